"""Who owns an output directory: a fresh run never writes over the logs or checkpoints of another.

A run from rollout 0 (or an SFT run) starts only in a directory without an earlier run's files. If
it finds some it refuses, changes nothing, and says how to resume, overwrite on purpose
(``--overwrite``, which deletes them) or pick another ``output_dir``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tether.config import ConfigError

# What a run leaves in its output directory (checkpoints are looked for separately: they may live elsewhere).
RUN_FILES = ("metrics.jsonl", "trained_samples.jsonl", "summary.json", "rollouts", "tensorboard", "curves.png")


class RunDirError(ConfigError):
    """The output directory holds another run; the message says what and how to go on."""


def _nonempty(path: Path) -> bool:
    if path.is_dir():
        return any(path.iterdir())
    return path.is_file() and path.stat().st_size > 0


def checkpoints_in(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("rollout_*") if p.is_dir() and p.suffix != ".tmp") if root.is_dir() else []


def earlier_run(output_dir: Path, checkpoint_dir: Path | None) -> list[str]:
    """What an earlier run left behind, one phrase per thing (empty: the directory is free)."""
    found = [str(output_dir / name) for name in RUN_FILES if _nonempty(output_dir / name)]
    if checkpoint_dir is not None:
        ckpts = checkpoints_in(checkpoint_dir)
        if ckpts:
            found.append(f"{len(ckpts)} checkpoint(s) in {checkpoint_dir} (newest {ckpts[-1].name})")
    return found


def claim(output_dir: str | Path, checkpoint_dir: str | Path | None, *, overwrite: bool, command: str,
          config_path: str | None = None) -> list[str]:
    """Make sure a fresh run may write here; with ``overwrite`` delete the earlier run first.

    Returns what was deleted. Raises RunDirError naming what is there, when not overwriting.
    """
    out = Path(output_dir)
    ckpt = Path(checkpoint_dir) if checkpoint_dir is not None else None
    found = earlier_run(out, ckpt)
    if not found:
        return []
    if not overwrite:
        lines = [f"{out} holds an earlier run; nothing was changed:", *(f"  {item}" for item in found)]
        if ckpt is not None and checkpoints_in(ckpt):
            lines.append(f"to resume it:   {resume_command(command, config_path, ckpt)}")
        lines += ["to replace it:  add --overwrite (deletes the files above)",
                  f"to keep both:   give another output_dir, e.g. output_dir={out}-2"]
        raise RunDirError("\n".join(lines))
    removed = []
    for name in RUN_FILES:
        path = out / name
        if path.exists():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            removed.append(str(path))
    if ckpt is not None:
        for path in checkpoints_in(ckpt) + sorted(ckpt.glob("rollout_*.tmp")):
            shutil.rmtree(path)
            removed.append(str(path))
        if (ckpt / "latest").exists():
            (ckpt / "latest").unlink()
    return removed


def stopped_message(how: str, command: str, config_path: str | None, checkpoint_dir: Path) -> str:
    """What a run stopped from outside (Ctrl-C, SIGTERM) says: where it can go on from."""
    ckpts = checkpoints_in(checkpoint_dir)
    if not ckpts:
        return f"stopped by {how} before any checkpoint was complete; a new run starts from the beginning"
    return (f"stopped by {how}; the latest complete checkpoint is {ckpts[-1]}\n"
            f"to resume:  {resume_command(command, config_path, checkpoint_dir)}")


def resume_command(command: str, config_path: str | None, checkpoint_dir: Path) -> str:
    config = f"--config {config_path} " if config_path else ""
    return f"tether {command} {config}--load {checkpoint_dir}"
