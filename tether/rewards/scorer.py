"""Scoring a rollout: everything the config says about rewards, loaded once and applied per group.

- ``rollout.reward``: a function of one sample (sync or async), or a reward server's URL;
- ``rollout.group_reward``: a function of a whole group (pairwise or ranking judges), used instead;
- ``rollout.reward_key``: the entry trained on when rewards are dicts;
- ``rollout.reward_post_process``: a function over all the kept samples of a rollout, after scoring.

Groups are scored as they finish (``score_group`` is a coroutine): async functions of the group's
samples are awaited together, a sync function runs in a worker thread so that the rollout's other
requests are served meanwhile. A group's functions get ``rollout.reward_timeout_s`` in all; the
worker threads are the scorer's own, so a function that never returns holds one of them, not the
end of the rollout's event loop (which waits for the default executor's threads).
"""

from __future__ import annotations

import asyncio
import inspect
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from tether.importing import load_function
from tether.rewards.loader import RewardError, RewardLoadError, load_reward_fn, reward_raised, set_reward
from tether.rewards.remote import RemoteReward, is_remote
from tether.rewards.signature import batched_reward, is_async, resolve
from tether.errors import TIMEOUTS
from tether.run.faults import inject_fault
from tether.sample import UNSCORED, Sample


class Scorer:
    def __init__(self, reward: str, *, group_reward: str | None = None, reward_key: str | None = None,
                 post_process: str | None = None, timeout_s: float = 60.0, retries: int = 2,
                 field: str = "rollout.reward", args: dict | None = None, attempts: int = 1,
                 label_key: str = "label"):
        """``args``: the config's ``args:``, given to a function with a parameter of that name;
        ``attempts``: tries at a sample's reward before it is failed (rollout.failures); ``label_key``:
        the keyword a TRL-style batched reward gets the labels under."""
        self.attempts = attempts
        self.key = reward_key
        self.timeout_s = timeout_s
        self.field = "rollout.group_reward" if group_reward else field
        self._threads = ThreadPoolExecutor(max_workers=min(32, (os.cpu_count() or 1) + 4), thread_name_prefix="reward")
        self.group_spec = group_reward
        self.spec = group_reward or reward
        self.remote = RemoteReward(reward, timeout_s, retries) if is_remote(reward) and not group_reward else None
        self.fn = None if self.remote or group_reward else _named(lambda s: load_reward_fn(s, args), reward, field)
        self.group_fn = _named(lambda s: load_function(s, "group reward", RewardLoadError, args), group_reward,
                               "rollout.group_reward") if group_reward else None
        if getattr(self.fn, "batched", False):  # TRL's batched form: a function of the group, called once
            assert self.fn is not None
            self.group_fn, self.fn = batched_reward(self.fn, label_key), None
        self.post_fn = _named(lambda s: load_function(s, "reward post-process", RewardLoadError, args), post_process,
                              "rollout.reward_post_process") if post_process else None
        self.post_spec = post_process

    async def score_group(self, samples: list[Sample]) -> None:
        """Set the reward of every sample of one group that has not failed already. A sample whose reward
        cannot be had (the function raised, timed out or returned something that is not a reward) is
        scored again, ``attempts`` times in all, then failed (kind "reward": masked, never scored 0);
        a reward of None marks it unscored (TRL's "not scored")."""
        todo = [s for s in samples if not s.failed]
        errors: dict[int, str] = {}
        for attempt in range(1, self.attempts + 1):
            if not todo:
                return
            errors = await self._score_once(todo, attempt)
            todo = [s for s in todo if id(s) in errors]
            if todo and attempt < self.attempts:
                for sample in todo:
                    sample.note_retry("reward")
        for sample in todo:
            sample.fail("reward", errors[id(sample)], self.attempts)

    async def _score_once(self, samples: list[Sample], attempt: int) -> dict[int, str]:
        """Score these samples once; the error of each that got no reward, by id."""
        whole = self.remote is not None or self.group_fn is not None  # one call for the group
        keys = [(s.rollout_id, s.prompt_index, -1 if whole else s.sample_index, attempt) for s in samples]
        errors = {id(s): "injected fault (TETHER_INJECT_FAULTS)" for s, key in zip(samples, keys)
                  if inject_fault("reward", key)}
        live = [s for s in samples if id(s) not in errors]
        if not live:
            return errors
        try:
            if self.remote is not None:  # bounded by its own timeout and retries
                values = await self.remote.score(live)
            else:
                values = await asyncio.wait_for(self._local(live), self.timeout_s)
        except TIMEOUTS:
            s = live[0]
            message = (f"{self.field} '{self.spec}' did not return within rollout.reward_timeout_s={self.timeout_s:g}s "
                       f"for the group of rollout {s.rollout_id}, prompt_index={s.prompt_index} ({len(live)} samples)")
            return {**errors, **{id(s): message for s in live}}
        except RewardError as err:
            return {**errors, **{id(s): str(err) for s in live}}
        for sample, value in zip(live, values):
            if isinstance(value, BaseException):
                errors[id(sample)] = str(value)
            elif value is None:
                sample.fail(UNSCORED, f"{self.field} '{self.spec}' returned None (not scored) for {sample.describe()}")
            else:
                try:
                    set_reward(sample, value, self.spec, self.key)
                except RewardError as err:
                    errors[id(sample)] = str(err)
        return errors

    async def _local(self, samples: list[Sample]) -> list:
        """Each sample's reward, or the RewardError its function raised (a group function's error is the
        whole group's)."""
        if self.group_fn is not None:
            return await self._group(self.group_fn, samples)
        fn = self.fn
        assert fn is not None  # loaded unless the reward is remote (not scored here) or a group reward
        if is_async(fn):
            return list(await asyncio.gather(*(self._one_async(fn, s) for s in samples)))
        return await asyncio.get_running_loop().run_in_executor(self._threads, self._each, fn, samples)

    def _each(self, fn: Callable[[Sample], Any], samples: list[Sample]) -> list:
        out: list = []
        for sample in samples:
            try:
                out.append(resolve(fn(sample)))
            except Exception as exc:  # noqa: BLE001 - this sample's failure, not the group's
                out.append(reward_raised(self.spec, sample, exc))
        return out

    def score(self, samples: list[Sample], group_size: int) -> list[float | None]:
        """``score_group`` for each group, outside an event loop (the eval's constant-answer check); None
        for a sample that got no reward."""
        async def run() -> None:
            for k in range(0, len(samples), group_size):
                await self.score_group(samples[k:k + group_size])
        asyncio.run(run())
        return [None if s.failed else s.scored_reward() for s in samples]

    async def _one_async(self, fn: Callable[[Sample], Any], sample: Sample) -> Any:
        try:
            return await fn(sample)
        except Exception as exc:  # noqa: BLE001 - this sample's failure, not the group's
            return reward_raised(self.spec, sample, exc)

    async def _group(self, group_fn: Callable[[list[Sample]], Any], samples: list[Sample]) -> list:
        try:
            if inspect.iscoroutinefunction(group_fn):
                values = await group_fn(samples)
            else:
                values = await asyncio.get_running_loop().run_in_executor(
                    self._threads, lambda: resolve(group_fn(samples)))
        except Exception as exc:
            raise RewardError(f"{self.field} '{self.spec}' raised {type(exc).__name__}: {exc} "
                              f"(group of rollout {samples[0].rollout_id}, prompt_index={samples[0].prompt_index})") from exc
        if not isinstance(values, (list, tuple)) or len(values) != len(samples):
            raise RewardError(f"{self.field} '{self.spec}' returned {values!r:.200} for a group of "
                              f"{len(samples)} samples; expected a list of {len(samples)} rewards")
        return list(values)

    def post_process(self, samples: list[Sample]) -> None:
        """Run the post-process hook over a rollout's samples: it changes rewards in place, or returns new ones."""
        if self.post_fn is None:
            return
        assert self.post_spec is not None  # post_fn was loaded from it
        try:
            values = resolve(self.post_fn(samples))
        except Exception as exc:
            raise RewardError(f"rollout.reward_post_process '{self.post_spec}' raised {type(exc).__name__}: {exc}") from exc
        if values is not None:
            if len(values) != len(samples):
                raise RewardError(f"rollout.reward_post_process '{self.post_spec}' returned {len(values)} rewards "
                                  f"for {len(samples)} samples")
            for sample, value in zip(samples, values):
                set_reward(sample, value, self.post_spec, self.key)
        for sample in samples:  # a hook that wrote sample.reward directly is checked too
            set_reward(sample, sample.reward, self.post_spec, self.key)


def _named(load: Callable[[str], Callable], spec: str, field: str) -> Callable:
    """``load(spec)``, with an error that names the config field."""
    try:
        return load(spec)
    except RewardLoadError as err:
        raise RewardLoadError(f"{field}: {err}") from None
