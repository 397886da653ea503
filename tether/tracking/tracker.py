"""Experiment tracking: one ``Tracker`` fans metrics out to JSONL, TensorBoard, W&B and
the console, and writes a summary plus curves at the end of the run.

The JSONL file is the source of truth (always local, append-only, trivially parsed);
TensorBoard and W&B are optional views on the same numbers.
"""

from __future__ import annotations

import json
import math
import numbers
import secrets
import string
import sys
import time
from pathlib import Path
from typing import Any, Mapping

from tqdm import tqdm

from tether.tracking.console import format_rollout_line, format_summary, format_warning
from tether.tracking.plot import plot_rows, read_metrics

_RESERVED_KEYS = ("step", "time")
WARNINGS = "warnings"
"""A metrics key whose value is a list of warning texts: ``log`` passes them to ``warn`` instead of
the sinks, so any part that reports metrics can raise a warning the same way."""
_SUMMARY_KEYS = ("rollout/reward_mean", "rollout/response_len_mean")
_ID_ALPHABET = string.ascii_lowercase + string.digits


def _new_run_id() -> str:
    """8 random lowercase alphanumerics: valid as a W&B run id and as a directory name."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(8))


def _to_scalar(key: str, value: Any) -> int | float:
    """Convert a metric value (python number, numpy scalar, 0-d/1-element tensor) to a
    plain python int/float so every sink, JSON included, accepts it."""
    if hasattr(value, "item") and callable(value.item):
        try:
            value = value.item()
        except (ValueError, RuntimeError) as exc:  # numpy / torch with several elements
            raise TypeError(f"metric {key!r} must be a scalar, got a multi-element "
                            f"{type(value).__name__}") from exc
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}")


def _json_safe(value: int | float) -> int | float | None:
    """Strict JSON has no NaN/Infinity: write them as null rather than dropping the row."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _first_last(rows: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    """First and last non-null values of ``key`` with their steps, or None if never logged."""
    hits = [(r["step"], r[key]) for r in rows if r.get(key) is not None and "step" in r]
    if not hits:
        return None
    return {"first": hits[0][1], "last": hits[-1][1],
            "first_step": hits[0][0], "last_step": hits[-1][0]}


def _is_eval_score(key: str) -> bool:
    """True for ``eval/<dataset>/score`` keys."""
    parts = key.split("/")
    return len(parts) == 3 and parts[0] == "eval" and parts[2] == "score"


def _import_wandb() -> Any:
    """Import wandb on demand so it stays an optional dependency."""
    try:
        import wandb
    except ImportError as exc:
        raise ImportError(
            "Weights & Biases tracking was requested (wandb=True) but the 'wandb' package "
            "is not installed. Install it with: pip install 'wandb>=0.17'"
        ) from exc
    return wandb


class Tracker:
    """Log per-step metrics to JSONL, TensorBoard, W&B (offline by default) and the console.

    Files under ``output_dir``: ``config.json``, ``metrics.jsonl`` (appended to, so a
    resumed run continues it), ``tensorboard/``, ``wandb/``, and at ``finish()``
    ``summary.json`` and ``curves.png``. Use as a context manager to guarantee
    ``finish()`` runs, also when training raises.
    """

    def __init__(
        self,
        output_dir: str | Path,
        *,
        run_name: str,
        config: Mapping[str, Any],
        jsonl: bool = True,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_project: str = "tether",
        wandb_mode: str | None = None,
        console: bool = True,
        resume_run_id: str | None = None,
        step_label: str = "rollout",
    ) -> None:
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.run_name = run_name
        self.console = console
        self.step_label = step_label  # what a step is called on the console: "rollout", "sft step"
        self._run_id = resume_run_id or _new_run_id()
        self._start = time.time()
        self._rows: list[dict[str, Any]] = []  # this session's rows, used when jsonl=False
        self._total: int | None = None
        self._bars: list[tqdm] = []
        self._finished: dict[str, Any] | None = None
        self._warnings: list[dict[str, Any]] = []
        # Import wandb before opening any file so a missing extra fails fast and clean.
        wandb_module = _import_wandb() if wandb else None
        self._write_config(config)
        self._jsonl = self.metrics_path.open("a", encoding="utf-8") if jsonl else None
        self._tb = self._open_tensorboard() if tensorboard else None
        self._wandb_run = None
        if wandb_module is not None:
            try:
                self._wandb_run = self._open_wandb(wandb_module, wandb_project, wandb_mode, config)
            except BaseException:
                self._close_sinks(exit_code=1)  # don't leak the files opened above
                raise

    # ---------------------------------------------------------------- setup

    @property
    def run_id(self) -> str:
        """Stable id of this run; pass it as ``resume_run_id`` to continue the run."""
        return self._run_id

    @property
    def metrics_path(self) -> Path:
        return self.output_dir / "metrics.jsonl"

    def _write_config(self, config: Mapping[str, Any]) -> None:
        # default=str keeps non-JSON values (paths, dtypes, enums) readable instead of failing.
        text = json.dumps(dict(config), indent=2, default=str)
        (self.output_dir / "config.json").write_text(text + "\n", encoding="utf-8")

    def _open_tensorboard(self) -> Any:
        from torch.utils.tensorboard import SummaryWriter

        # A short flush interval so curves show up in a live TensorBoard during the run.
        return SummaryWriter(log_dir=str(self.output_dir / "tensorboard"), flush_secs=10)

    def _open_wandb(self, wandb: Any, project: str, mode: str | None, config: Mapping[str, Any]) -> Any:
        return wandb.init(
            project=project,
            name=self.run_name,
            config=dict(config),
            dir=str(self.output_dir),
            mode=mode,
            id=self._run_id,
            resume="allow",
        )

    # ---------------------------------------------------------------- logging

    def log(self, step: int, metrics: Mapping[str, Any], *, total: int | None = None) -> None:
        """Record ``metrics`` for ``step`` in every enabled sink.

        Values may be python numbers, numpy scalars or single-element tensors. NaN/inf
        are kept in TensorBoard/W&B and written as ``null`` in the JSONL.
        """
        if self._finished is not None:
            raise RuntimeError("Tracker.log() called after finish()")
        clash = [k for k in _RESERVED_KEYS if k in metrics]
        if clash:
            raise ValueError(f"metric names {clash} are reserved by the tracker")
        for message in metrics.get(WARNINGS) or ():
            self.warn(message, step)
        values = {k: _to_scalar(k, v) for k, v in metrics.items() if k != WARNINGS}
        row = {"step": int(step), "time": time.time(),
               **{k: _json_safe(v) for k, v in values.items()}}
        if self._jsonl is None:
            self._rows.append(row)  # the only record of the run when there is no file
        else:
            self._jsonl.write(json.dumps(row, allow_nan=False) + "\n")
            self._jsonl.flush()  # a crash must not lose already-finished steps
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, global_step=int(step))
        if self._wandb_run is not None:
            self._wandb_run.log(values, step=int(step))
        if self.console:
            total = total if total is not None else self._total
            self._echo(format_rollout_line(int(step), total, values, self.step_label))

    def warn(self, message: str, step: int | None = None) -> None:
        """Print ``message`` so that it stands out (also when the console lines are off) and keep it
        for the summary: a run that cannot learn must say so, not just print zeros."""
        self._warnings.append({"step": step, "message": message})
        tqdm.write(format_warning(step, message, self.step_label), file=sys.stderr)

    @property
    def warnings(self) -> list[dict[str, Any]]:
        return list(self._warnings)

    def _echo(self, line: str) -> None:
        # tqdm.write clears and redraws any live progress bar (ours or another
        # component's), so the line never gets spliced into a bar; without bars it
        # is a plain print.
        tqdm.write(line, file=sys.stdout)

    def progress(self, total: int, desc: str, initial: int = 0) -> tqdm:
        """A progress bar on stderr that the caller advances with ``bar.update()``.

        Its ``total`` also becomes the default denominator of the console lines.
        The tracker closes it at ``finish()`` if the caller has not.
        """
        self._total = total
        bar = tqdm(total=total, desc=desc, initial=initial, file=sys.stderr,
                   mininterval=1.0, dynamic_ncols=True)
        self._bars.append(bar)
        return bar

    # ---------------------------------------------------------------- end of run

    def _all_rows(self) -> list[dict[str, Any]]:
        """Every row of the run, including those written before a resume."""
        if self._jsonl is not None:
            self._jsonl.flush()
            return read_metrics(self.metrics_path)
        merged: dict[int, dict[str, Any]] = {}
        for row in self._rows:
            merged.setdefault(row["step"], {}).update(row)
        return [merged[s] for s in sorted(merged)]

    def summary(self) -> dict[str, Any]:
        """First/last values of the key metrics and the best score per eval dataset."""
        rows = self._all_rows()
        eval_keys = sorted({k for r in rows for k in r if _is_eval_score(k)})
        metrics = {}
        for key in (*_SUMMARY_KEYS, *eval_keys):
            stats = _first_last(rows, key)
            if stats is not None:
                metrics[key] = stats
        best_eval = {}
        for key in eval_keys:
            hits = [(r[key], r["step"]) for r in rows if r.get(key) is not None]
            if hits:
                # max() keeps the earliest step among ties, matching "first reached".
                score, step = max(hits, key=lambda h: (h[0], -h[1]))
                best_eval[key.split("/")[1]] = {"score": score, "step": step}
        steps = [r["step"] for r in rows if "step" in r]
        return {
            "run_name": self.run_name,
            "run_id": self._run_id,
            "output_dir": str(self.output_dir),
            "num_steps": len(steps),
            "first_step": steps[0] if steps else None,
            "last_step": steps[-1] if steps else None,
            "elapsed_s": time.time() - self._start,
            "metrics": metrics,
            "best_eval": best_eval,
            "warnings": list(self._warnings),
        }

    def finish(self, *, exit_code: int = 0) -> dict[str, Any]:
        """Write summary.json and curves.png, close all sinks and return the summary.

        Safe to call more than once; later calls return the first summary.
        """
        if self._finished is not None:
            return self._finished
        for bar in self._bars:
            bar.close()
        summary = self.summary()
        summary["plot"] = self._plot()
        (self.output_dir / "summary.json").write_text(
            json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        self._close_sinks(exit_code)
        self._finished = summary
        if self.console:
            self._echo(format_summary(summary))
        return summary

    def _plot(self) -> str | None:
        """Render curves.png; a plotting failure must not cost the run its summary."""
        try:
            return str(plot_rows(self._all_rows(), self.output_dir / "curves.png",
                                 title=self.run_name, step_label=self.step_label))
        except Exception as exc:  # noqa: BLE001 - reported, then the run finishes normally
            print(f"[tether.tracking] could not plot curves: {exc!r}", file=sys.stderr)
            return None

    def _close_sinks(self, exit_code: int) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb_run is not None:
            self._wandb_run.finish(exit_code=exit_code)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # Flush and close everything even when training crashed; W&B marks it failed.
        self.finish(exit_code=0 if exc_type is None else 1)
