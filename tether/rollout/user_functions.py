"""The functions a run's config names (rewards, group reward, post-process, filter, generate and rollout
functions, data rows' own): the rollout's scorer, and a check that loads each of them once before
anything starts, so that a bad spec fails naming its config field (or its data file and line)."""

from __future__ import annotations

import functools
from pathlib import Path

from tether.config import ConfigError, TetherConfig
from tether.rewards.loader import RewardLoadError, set_reward
from tether.rewards.scorer import Scorer
from tether.rewards.shaping import apply_overlong_penalty
from tether.rollout.data_source import DatasetError, read_rows
from tether.rollout.distill import teacher_scores
from tether.rollout.filters import FilterError, load_filter
from tether.rollout.generate_fn import CustomGenerate, GenerateLoadError, row_spec
from tether.rollout.rollout_fn import RolloutFnLoadError, load_rollout_fn
from tether.rollout.served import unserved_names
from tether.sample import Sample, counted


def make_scorer(cfg: TetherConfig, reward: str | None = None, field: str = "rollout.reward") -> Scorer:
    """The rollout's scorer (or an eval set's, with its own reward) from the config."""
    r = cfg.rollout
    return Scorer(reward or r.reward, group_reward=None if reward else r.group_reward, reward_key=r.reward_key,
                  post_process=None if reward else r.reward_post_process, timeout_s=r.reward_timeout_s,
                  retries=r.reward_retries, field=field if reward else "rollout.reward", args=cfg.args,
                  attempts=r.failures.max_attempts if "reward" in r.failures.retry else 1,
                  label_key=cfg.data.label_key)


async def score_shaped(scorer: Scorer, cfg: TetherConfig, group: list[Sample]) -> None:
    """The group's rewards as trained on (after overlong shaping): what the dynamic filter sees. A
    group whose generate function set every sample's reward keeps those (checked like any reward).
    (Not a method: Ray makes an actor with any async method an asyncio actor.)"""
    r = cfg.rollout
    await score_unscored(scorer, cfg, group)
    if r.overlong_buffer_len is not None:
        apply_overlong_penalty(counted(group), r.max_response_len, r.overlong_buffer_len, r.overlong_penalty_factor)
    await teacher_scores(cfg, group)


async def score_unscored(scorer: Scorer, cfg: TetherConfig, group: list[Sample]) -> None:
    """The group's rewards: those its generate function (or environment) set, checked as any reward,
    when it set every one; else the scorer's. Failed samples get none (tether/rollout/failures.py)."""
    r = cfg.rollout
    live = counted(group)
    if live and all(s.reward is not None for s in live):
        who = r.custom_generate_fn or (f"rollout.environment ({r.environment.type})" if r.environment else
                                       "generate function")
        for s in live:
            set_reward(s, s.reward_info if s.reward_info is not None else s.reward, who, r.reward_key)
    else:
        await scorer.score_group(group)


def check_user_functions(cfg: TetherConfig) -> None:
    """Load every user function the rollout will call (rewards, group reward, post-process, filter,
    generate functions, data rows' own included) once in the launching process, so that a bad spec
    fails before Ray starts, naming its config field (or its data file and line)."""
    problems = []
    checks = [lambda: make_scorer(cfg), lambda: load_filter(cfg.rollout.dynamic_filter, args=cfg.args),
              lambda: CustomGenerate(cfg.rollout.custom_generate_fn), lambda: CustomGenerate(None, _row_generate_fns(cfg)),
              lambda: cfg.rollout.custom_rollout_fn and load_rollout_fn(cfg.rollout.custom_rollout_fn)]
    checks += [functools.partial(make_scorer, cfg, e.reward, f"eval.datasets[{i}].reward")
               for i, e in enumerate(cfg.eval.datasets) if e.reward]
    for load in checks:
        try:
            load()
        except (RewardLoadError, FilterError, GenerateLoadError, RolloutFnLoadError, DatasetError) as err:
            problems.append(f"  {err}")
    if cfg.rollout.environment is not None:
        try:
            check_environment(cfg.rollout.environment)
        except (ValueError, ImportError) as err:
            problems.append(f"  rollout.environment: {err}")
    if ":" in cfg.algorithm.policy_loss:
        from tether.algorithms.losses import get_policy_loss

        try:
            get_policy_loss(cfg.algorithm.policy_loss)
        except ValueError as err:
            problems.append(f"  algorithm.policy_loss: {err}")
    r = cfg.rollout
    specs = {"rollout.reward": r.reward, "rollout.group_reward": r.group_reward,
             "rollout.reward_post_process": r.reward_post_process, "rollout.dynamic_filter": r.dynamic_filter,
             "rollout.custom_generate_fn": r.custom_generate_fn, "rollout.custom_rollout_fn": r.custom_rollout_fn,
             **{f"eval.datasets[{i}].reward": e.reward for i, e in enumerate(cfg.eval.datasets)}}
    problems += [f"  {p}" for p in unserved_names({k: v for k, v in specs.items() if isinstance(v, str) and ":" in v},
                                                  list(cfg.served_models))]
    if problems:
        raise ConfigError("cannot load a function the config names:\n" + "\n".join(problems))


def check_environment(environment) -> None:
    """The environment's library is there and its factory or registered name resolves."""
    import importlib

    from tether.envs.config import GENERATE_FN

    module = importlib.import_module(GENERATE_FN[environment.type].split(":")[0])
    module.check(environment)


def _row_generate_fns(cfg: TetherConfig) -> list[tuple[str, str]]:
    """(spec, where) of every prompt and eval row that names its own generate function."""
    found = []
    for path in [cfg.data.path] + [e.path for e in cfg.eval.datasets]:
        if path and Path(path).exists():  # (a Hub dataset's rows are checked when the manager loads them)
            found += [(spec, where) for _, where, obj in read_rows(Path(path))
                      if (spec := row_spec(obj.get(cfg.data.metadata_key), path))]
    return found
