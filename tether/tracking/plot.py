"""Training-curve plots from a run's ``metrics.jsonl``.

Matplotlib is imported lazily and only its object-oriented API with the Agg canvas is
used, so plotting works on headless machines and never changes the global pyplot
backend of the process that calls it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

Row = dict[str, Any]

_REWARD, _REWARD_STD = "rollout/reward_mean", "rollout/reward_std"
_LEN_MEAN, _LEN_MAX = "rollout/response_len_mean", "rollout/response_len_max"
_LOSS, _KL = "train/loss", "train/kl"


def read_metrics(metrics_jsonl: str | Path) -> list[Row]:
    """Read a metrics JSONL file into one dict per step, sorted by step.

    Rows sharing a step are merged, later values winning. That covers both a step
    logged in several calls (train metrics, then eval) and a resumed run re-logging
    steps already written before its last checkpoint. Blank or truncated lines (a
    crash mid-write) are skipped rather than failing the whole read.
    """
    by_step: dict[int, Row] = {}
    unstepped: list[Row] = []
    with open(metrics_jsonl, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(row, dict):
                continue
            step = row.get("step")
            if isinstance(step, int):
                by_step.setdefault(step, {}).update(row)
            else:
                unstepped.append(row)
    return [by_step[s] for s in sorted(by_step)] + unstepped


def _series(rows: Iterable[Row], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) for rows where ``key`` has a finite value; other rows are skipped."""
    xs: list[float] = []
    ys: list[float] = []
    for row in rows:
        value, step = row.get(key), row.get("step")
        if isinstance(value, (int, float)) and math.isfinite(value) and step is not None:
            xs.append(step)
            ys.append(float(value))
    return xs, ys


def _eval_score_keys(rows: Iterable[Row]) -> list[str]:
    """All ``eval/<dataset>/score`` keys present in any row, sorted."""
    keys = {k for row in rows for k in row if k.startswith("eval/") and k.endswith("/score")}
    return sorted(k for k in keys if k.count("/") == 2)


def _marker(xs: list[float]) -> str | None:
    """Markers only for very short series, where a bare line would be invisible."""
    return "o" if len(xs) <= 2 else None


def _panel_reward(ax: Any, rows: list[Row]) -> None:
    xs, ys = _series(rows, _REWARD)
    ax.plot(xs, ys, marker=_marker(xs), label="reward mean")
    # The spread as its own line: a mean +- std band of a 0/1 reward runs below 0 and above 1 and
    # hides the mean it surrounds.
    sx, sy = _series(rows, _REWARD_STD)
    if sx:
        ax.plot(sx, sy, marker=_marker(sx), linestyle="--", alpha=0.7, label="reward std")
    ax.set_title("Rollout reward")
    ax.set_ylabel("reward")


def _panel_eval(ax: Any, rows: list[Row]) -> None:
    # Eval runs only every k rollouts, so markers make the sparse points visible.
    for key in _eval_score_keys(rows):
        name = key.split("/")[1]
        xs, ys = _series(rows, key)
        line = ax.plot(xs, ys, marker="o", label=name)[0]
        # The best score of always giving one answer: a score above it is skill, not a collapse.
        cx, cy = _series(rows, f"eval/{name}/constant_answer_score")
        if cx:
            ax.plot(cx, cy, linestyle=":", color=line.get_color(), label=f"{name}: one constant answer")
    ax.set_title("Eval score")
    ax.set_ylabel("score")


def _panel_length(ax: Any, rows: list[Row]) -> None:
    xs, ys = _series(rows, _LEN_MEAN)
    if xs:
        ax.plot(xs, ys, marker=_marker(xs), label="mean")
    mx, my = _series(rows, _LEN_MAX)
    if mx:
        ax.plot(mx, my, marker=_marker(mx), linestyle="--", alpha=0.7, label="max")
    ax.set_title("Response length")
    ax.set_ylabel("tokens")


def _panel_loss_kl(ax: Any, rows: list[Row]) -> None:
    lx, ly = _series(rows, _LOSS)
    kx, ky = _series(rows, _KL)
    if lx:
        ax.plot(lx, ly, marker=_marker(lx), color="tab:blue", label="loss")
        ax.set_ylabel("loss")
    if kx:
        # KL lives on a very different scale from the loss, hence its own y axis.
        kl_ax = ax.twinx() if lx else ax
        kl_ax.plot(kx, ky, marker=_marker(kx), color="tab:red", label="kl")
        kl_ax.set_ylabel("kl")
        if kl_ax is not ax:
            kl_ax.legend(loc="upper right", fontsize="small")
    ax.set_title("Train loss / KL" if lx and kx else ("Train loss" if lx else "KL"))


def _panels(rows: list[Row]) -> list[Any]:
    """The panel painters whose metrics are present, in display order."""
    present = {k for row in rows for k, v in row.items() if v is not None}
    panels = []
    if _REWARD in present:
        panels.append(_panel_reward)
    if any(k in present for k in _eval_score_keys(rows)):
        panels.append(_panel_eval)
    if _LEN_MEAN in present or _LEN_MAX in present:
        panels.append(_panel_length)
    if _LOSS in present or _KL in present:
        panels.append(_panel_loss_kl)
    return panels


def plot_rows(rows: list[Row], out_png: str | Path, *, title: str | None = None, step_label: str = "rollout") -> Path:
    """Plot already-loaded metric rows (see ``read_metrics``) to a PNG file; ``step_label`` names the x
    axis ("rollout", "sft step")."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = _panels(rows)
    ncols = 2 if len(panels) > 1 else 1
    nrows = max(1, math.ceil(len(panels) / ncols))
    fig = Figure(figsize=(6 * ncols, 3.6 * nrows), dpi=100)
    FigureCanvasAgg(fig)  # attaches the Agg canvas to the figure
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, paint in zip(axes, panels):
        paint(ax, rows)
        # Rows are logged at train steps done (rollout N is step N + 1): say so on the axis.
        ax.set_xlabel("train step (rollout + 1)" if step_label == "rollout" else step_label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize="small")
    for ax in axes[len(panels):]:
        ax.set_axis_off()
    if not panels:
        # Still produce an image so callers can rely on the file existing.
        axes[0].text(0.5, 0.5, "no metrics to plot", ha="center", va="center")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def plot_curves(metrics_jsonl: str | Path, out_png: str | Path) -> Path:
    """Plot reward, eval score, response length and loss/KL curves from a metrics JSONL.

    Panels whose metrics never appear are left out. Returns the path of the PNG.
    """
    return plot_rows(read_metrics(metrics_jsonl), out_png)
