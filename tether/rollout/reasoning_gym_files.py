"""Generated prompts as files: data.reasoning_gym and the eval sets with reasoning_gym become ordinary
prompt JSONL in <output_dir>/data/, and the config names those files instead, before anything reads it.

``materialise`` runs once, from tether.run.preflight.check_inputs, which every command runs before anything
starts; from then on the run is one over files (the loader, the row checks, shuffling, the resumable
position, the rollout manager's copy of the config), and the config written with checkpoints names the
files. A row: {prompt: the question, label: the answer, metadata: {task, settings, entry}} (under the
data section's keys), which the reasoning_gym reward scores (tether/rewards/reasoning_gym.py).

A file's name ends in a hash of its bytes. The same config gives the same bytes, so a resumed run
regenerates the name of the file it trained on and finds it there (an identical file is not written
again); a change that would give other problems (settings, seeds, the package's version) gives another
name, and the resume then refuses the changed data.path instead of training on other problems.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections import Counter
from pathlib import Path

from tether.config import DataConfig, EvalDatasetConfig, TetherConfig
from tether.rollout.reasoning_gym_config import ReasoningGymData, ReasoningGymEval
from tether.rollout.reasoning_gym_data import Problem, TaskMix, generate, json_safe


def materialise(cfg: TetherConfig) -> None:
    """Write the generated problems of ``cfg`` and point its data.path and eval sets at them (in place;
    per_task eval sets are expanded into one set per task). A config without reasoning_gym is left as is."""
    rg = cfg.data.reasoning_gym
    if rg is None and not any(d.reasoning_gym for d in cfg.eval.datasets):
        return
    train = generate(data_mix(rg)) if rg is not None else []
    held_out = frozenset(p.entry["question"] for p in train)
    if rg is not None:
        train_path = write_rows(Path(cfg.output_dir) / "data", "train", rows(train, cfg.data))
        _report("data.reasoning_gym", train, train_path)
    datasets = []
    for i, d in enumerate(cfg.eval.datasets):
        datasets += [d] if d.reasoning_gym is None else _eval_sets(cfg, i, held_out)
    cfg.eval = cfg.eval.model_copy(update={"datasets": datasets})  # first: the data's tasks are their default
    if rg is not None:
        cfg.data = DataConfig.model_validate({**cfg.data.model_dump(), "path": str(train_path), "reasoning_gym": None})


def _eval_sets(cfg: TetherConfig, index: int, held_out: frozenset[str]) -> list[EvalDatasetConfig]:
    """The file-backed eval sets that eval.datasets[index] becomes (one, or one per task)."""
    d, rg = cfg.eval.datasets[index], cfg.data.reasoning_gym
    assert d.reasoning_gym is not None  # the caller passes only the generated sets
    sets = []
    for name, problems in _split(d, rg, generate(eval_mix(d.reasoning_gym, rg, index), held_out)):
        path = write_rows(Path(cfg.output_dir) / "data", f"eval_{name}", rows(problems, cfg.data))
        _report(f"eval.datasets[{index}] {name}", problems, path)
        sets.append(EvalDatasetConfig.model_validate({**d.model_dump(), "name": name, "path": str(path),
                                                      "reasoning_gym": None}))
    return sets


def data_mix(rg: ReasoningGymData) -> TaskMix:
    return TaskMix(tuple(rg.tasks), rg.size, rg.seed, "data.reasoning_gym", dict(rg.settings), dict(rg.weights),
                   rg.levels)


def eval_mix(e: ReasoningGymEval, data: ReasoningGymData | None, index: int) -> TaskMix:
    """An eval set's mix: its own fields over the data section's (tasks, each task's settings and weight)."""
    if e.tasks is not None:
        tasks = e.tasks
    else:
        assert data is not None  # config.py refuses neither being set
        tasks = data.tasks
    base_seed = data.seed if data is not None else 0
    seed = e.seed if e.seed is not None else base_seed + 1 + index
    settings = {**(data.settings if data else {}), **e.settings}
    weights = {**(data.weights if data else {}), **e.weights}
    return TaskMix(tuple(tasks), e.size, seed, f"eval.datasets[{index}].reasoning_gym", settings, weights)


def _split(d: EvalDatasetConfig, data: ReasoningGymData | None,
           problems: list[Problem]) -> list[tuple[str, list[Problem]]]:
    """(name, problems) of each set ``d`` becomes: itself, or with per_task one per task, in task order."""
    rg = d.reasoning_gym
    assert rg is not None  # only a generated set is split
    if not rg.per_task:
        assert d.name is not None  # config.py requires it unless per_task
        return [(d.name, problems)]
    if rg.tasks is not None:
        tasks = rg.tasks
    else:
        assert data is not None  # config.py refuses neither being set
        tasks = data.tasks
    return [(name, [p for p in problems if p.task == task]) for name, task in zip(rg.set_names(d.name, data), tasks)]


def rows(problems: list[Problem], data: DataConfig) -> list[dict]:
    """Prompt rows under the data section's keys, so the loader reads them like the user's own files."""
    return [{data.prompt_key: p.entry["question"], data.label_key: p.entry["answer"],
             data.metadata_key: {"task": p.task, "settings": json_safe(p.settings), "entry": p.entry,
                                 **({"level": p.level} if p.level is not None else {})}}
            for p in problems]


def write_rows(folder: Path, stem: str, rows: list[dict]) -> Path:
    """Write ``rows`` as <folder>/reasoning_gym_<stem>_<hash>.jsonl (atomically; an identical file is kept)."""
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()
    safe_stem = re.sub(r"[^A-Za-z0-9_.-]", "_", stem)
    path = folder / f"reasoning_gym_{safe_stem}_{hashlib.sha256(text).hexdigest()[:10]}.jsonl"
    if path.is_file() and path.read_bytes() == text:
        return path
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(text)
    os.replace(tmp, path)
    return path


def _report(what: str, problems: list[Problem], path: Path) -> None:
    counts = ", ".join(f"{task} {n}" for task, n in sorted(Counter(p.task for p in problems).items()))
    levels = Counter((p.task, p.level) for p in problems if p.level is not None)
    if levels:
        counts += "; levels: " + ", ".join(f"{task} {max(lv for t, lv in levels if t == task) + 1}"
                                           for task in sorted({t for t, _ in levels}))
    print(f"[tether] {what}: {len(problems)} problems ({counts}) in {path}", file=sys.stderr)
