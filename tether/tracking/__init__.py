"""Experiment tracking for tether: JSONL / TensorBoard / W&B metrics, console lines,
end-of-run summary and training-curve plots.

Importing this package is cheap: torch's TensorBoard writer, wandb and matplotlib are
only imported when a Tracker or a plot actually needs them.
"""

from tether.tracking.console import format_rollout_line, format_summary
from tether.tracking.plot import plot_curves, plot_rows, read_metrics
from tether.tracking.tracker import Tracker

__all__ = [
    "Tracker",
    "format_rollout_line",
    "format_summary",
    "plot_curves",
    "plot_rows",
    "read_metrics",
]
