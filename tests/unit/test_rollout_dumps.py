"""debug.keep_rollout_dumps bounds the rollouts directory of a long run."""

from __future__ import annotations

from tether.rollout.dumps import Dumps


def manager(tmp_path, keep):
    return Dumps(tmp_path, keep)


def test_only_the_newest_rollouts_and_evals_stay(tmp_path):
    fake = manager(tmp_path, keep=2)
    for k in range(5):
        for name in (f"rollout_{k:06d}.jsonl", f"eval_math_{k:06d}.jsonl", f"eval_math_{k:06d}_answers.json",
                     f"eval_math_{k:06d}_prompts.jsonl", f"eval_other_{k:06d}.jsonl"):
            (tmp_path / name).write_text("{}\n")
        (tmp_path / f"rollout_{k:06d}_dropped_stale.jsonl").write_text("{}\n")
        fake.prune_old("rollout_")
        fake.prune_old("eval_math_")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [n for n in names if n.startswith("rollout_")] == [
        "rollout_000003.jsonl", "rollout_000003_dropped_stale.jsonl", "rollout_000004.jsonl",
        "rollout_000004_dropped_stale.jsonl"]
    assert len([n for n in names if n.startswith("eval_math_")]) == 6  # 2 evals x 3 files
    assert len([n for n in names if n.startswith("eval_other_")]) == 5  # another eval set: its own count


def test_none_or_tether_rollout_keeps_everything(tmp_path):
    for keep, prune in ((None, True), (1, False)):
        fake = manager(tmp_path, keep)
        fake.prune = prune
        for k in range(3):
            (tmp_path / f"rollout_{k:06d}.jsonl").write_text("{}\n")
            fake.prune_old("rollout_")
        assert len(list(tmp_path.glob("rollout_*"))) == 3
