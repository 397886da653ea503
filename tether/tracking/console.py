"""Human-readable console output: one compact line per rollout and an end-of-run box.

Everything here is pure string formatting (no I/O), so the trainer, the tracker and
tests can all use it without side effects.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

# (metric key, label, formatter name) in display order. The order is fixed so that
# consecutive lines line up visually and are easy to scan by eye.
_TRAIN_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("rollout/response_len_mean", "len", "num"),
    ("rollout/truncated_frac", "trunc", "num"),
    ("train/loss", "loss", "num"),
    ("train/pg_loss", "pg", "num"),
    ("train/sft_loss", "sft", "num"),
    ("train/kl", "kl", "num"),
    ("train/ppo_kl", "pkl", "num"),
    ("train/clipfrac", "clip", "num"),
    ("train/entropy", "ent", "num"),
    ("train/grad_norm", "gn", "num"),
    ("train/lr", "lr", "sci1"),
    ("mismatch/logprob_abs_diff_mean", "mismatch", "sci0"),
)

_TIMING_FIELDS: tuple[tuple[str, str], ...] = (
    ("timing/generate_s", "gen"),
    ("timing/train_s", "train"),
    ("timing/weight_sync_s", "sync"),
    ("timing/save_s", "save"),
    ("timing/rollout_s", "total"),
)


def _as_float(value: Any) -> float | None:
    """Coerce a metric value to float; None (e.g. a NaN read back from JSON) stays None."""
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _num(value: float) -> str:
    """Compact general-purpose number: 3 significant digits, no exponent for big values."""
    if not math.isfinite(value):
        return str(value)
    value += 0.0  # turns -0.0 into 0.0 so a zero loss does not print as "-0"
    # Large values (token lengths, step counts) read better as integers than as 1.23e+03.
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}"


_FORMATTERS: dict[str, Callable[[float], str]] = {
    "num": _num,
    "sci0": lambda v: f"{v:.0e}",
    "sci1": lambda v: f"{v:.1e}",
}


def _reward_part(metrics: Mapping[str, Any]) -> str | None:
    """Reward mean with its std as ``0.734±0.21`` (std omitted if not logged)."""
    mean = _as_float(metrics.get("rollout/reward_mean"))
    if mean is None:
        return None
    std = _as_float(metrics.get("rollout/reward_std"))
    mean_s = "nan" if math.isnan(mean) else f"{mean:.3f}"
    return f"reward {mean_s}" + ("" if std is None else f"±{std:.2f}")


def _eval_part(metrics: Mapping[str, Any]) -> str | None:
    """``eval <ds> <score>`` for every ``eval/<ds>/score`` key, datasets sorted by name."""
    scores: list[str] = []
    for key in sorted(metrics):
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "eval" and parts[2] == "score":
            value = _as_float(metrics[key])
            if value is not None:
                scores.append(f"{parts[1]} {_num(value)}")
    return "eval " + " ".join(scores) if scores else None


def _timing_part(metrics: Mapping[str, Any]) -> str | None:
    """Wall-clock phases as ``gen 1.2s train 0.8s``."""
    items = []
    for key, label in _TIMING_FIELDS:
        value = _as_float(metrics.get(key))
        if value is not None:
            items.append(f"{label} {value:.1f}s")
    return " ".join(items) if items else None


def step_name(step: int, total: int | None, label: str = "rollout") -> str:
    """How a logged step reads on the console. A run's metrics are logged at its number of train steps
    (0: before training), so rollout N (0-based, as in checkpoints rollout_00000N and dumps) is step N+1;
    the line names both. Other labels ("sft step") print the step as it is."""
    count = f"{step}/{total}" if total is not None else str(step)
    if label != "rollout":
        return f"{label} {count}"
    return f"step {count}, before training" if step == 0 else f"rollout {step - 1}, step {count}"


def format_rollout_line(step: int, total: int | None, metrics: Mapping[str, Any], label: str = "rollout") -> str:
    """One compact line summarising a rollout step.

    Only metrics present in ``metrics`` are shown, always in the same order; eval
    scores and timings get their own ``|``-separated sections when present.
    Unknown keys are ignored (they still reach JSONL/TensorBoard/W&B).
    """
    head = f"[{step_name(step, total, label)}]"
    train_items: list[str] = []
    reward = _reward_part(metrics)
    if reward is not None:
        train_items.append(reward)
    for key, label, fmt in _TRAIN_FIELDS:
        value = _as_float(metrics.get(key))
        if value is not None:
            text = _FORMATTERS[fmt](value) if math.isfinite(value) else str(value)
            train_items.append(f"{label} {text}")
    sections = [" ".join(train_items)] if train_items else []
    sections += [s for s in (_eval_part(metrics), _timing_part(metrics)) if s is not None]
    return head + (" " + " | ".join(sections) if sections else "")


def _cell(value: Any) -> str:
    """Format one table cell: '-' for missing, integers verbatim, floats to 4 sig. digits."""
    if value is None:
        return "-"
    if isinstance(value, bool) or isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _delta(first: Any, last: Any) -> str:
    """Signed change between first and last values, '-' when either is missing."""
    a, b = _as_float(first), _as_float(last)
    if a is None or b is None:
        return "-"
    return f"{b - a:+.4g}"


def _table(rows: list[list[str]]) -> list[str]:
    """Left-align the first column, right-align the rest, two spaces between columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells))
    return lines


def _duration(seconds: float) -> str:
    """``1h02m03s`` / ``2m03s`` / ``4.2s``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def _summary_sections(summary: Mapping[str, Any]) -> list[list[str]]:
    """Split a summary dict into titled blocks of text lines."""
    title = f"tether run summary: {summary.get('run_name', '?')}"
    if summary.get("run_id"):
        title += f" (id {summary['run_id']})"
    sections: list[list[str]] = [[title]]

    metrics: Mapping[str, Mapping[str, Any]] = summary.get("metrics") or {}
    if metrics:
        rows = [["metric", "first", "last", "delta"]]
        for key, stats in metrics.items():
            first, last = stats.get("first"), stats.get("last")
            rows.append([key, _cell(first), _cell(last), _delta(first, last)])
        sections.append(_table(rows))

    best: Mapping[str, Mapping[str, Any]] = summary.get("best_eval") or {}
    if best:
        rows = [["best eval", "score", "step"]]
        rows += [[ds, _cell(b.get("score")), _cell(b.get("step"))] for ds, b in best.items()]
        sections.append(_table(rows))

    warnings: list[Mapping[str, Any]] = summary.get("warnings") or []
    if warnings:
        lines = [f"WARNINGS ({len(warnings)}); the full texts are in summary.json"]
        for w in warnings[:8]:
            first = str(w.get("message", "")).splitlines()[0]
            at = f"step {w['step']}: " if w.get("step") is not None else ""
            lines.append(_clip(f"  {at}{first}", 110))
        if len(warnings) > 8:
            lines.append(f"  ... and {len(warnings) - 8} more")
        sections.append(lines)

    footer = []
    if summary.get("first_step") is not None:
        footer.append(
            f"steps {summary['first_step']}..{summary.get('last_step')}"
            f" ({summary.get('num_steps', '?')} logged)"
        )
    if summary.get("elapsed_s") is not None:
        footer.append(f"elapsed {_duration(float(summary['elapsed_s']))}")
    if summary.get("output_dir"):
        footer.append(f"output {summary['output_dir']}")
    if summary.get("plot"):
        footer.append(f"curves {summary['plot']}")
    if footer:
        sections.append(footer)
    return sections


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def format_warning(step: int | None, message: str, label: str = "rollout") -> str:
    """A warning as a block that stands out between the per-rollout lines."""
    at = f" at {step_name(step, None, label)}" if step is not None else ""
    body = "\n".join(f"!!   {line}" for line in message.splitlines())
    return f"!! WARNING{at}:\n{body}"


def format_summary(summary: Mapping[str, Any]) -> str:
    """Render a run summary (as produced by ``Tracker.summary``) as an ASCII box.

    ASCII rather than box-drawing characters so it survives any terminal encoding
    and log collector. Missing parts of the summary are simply left out.
    """
    sections = _summary_sections(summary)
    width = max(len(line) for section in sections for line in section)
    rule = "+" + "-" * (width + 2) + "+"
    out = [rule]
    for section in sections:
        out += [f"| {line.ljust(width)} |" for line in section]
        out.append(rule)
    return "\n".join(out)
