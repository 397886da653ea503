"""The rollout manager: a Ray actor owning prompt data, engines, rewards and eval.

``generate(rollout_id)`` draws the next prompts, samples n responses for each on the engines, scores
them, and returns the TrainBatch (which stays in the object store: the driver passes the reference
on to the trainer) together with a small dict of metrics.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import ray

from tether.config import ConfigError, TetherConfig, config_from_dict
from tether.rollout.config import generate_fn_spec
from tether.engine.backends import request_fields
from tether.engine.sampling import SamplingParams
from tether.models.hf import load_tokenizer
from tether.rewards.shaping import overlong_penalty
from tether.rollout.buffer import BUFFER_STATE, PartialBuffer
from tether.rollout.builtin import builtin_rollout
from tether.rollout.data_checks import load_eval_rows, load_train_rows, model_positions
from tether.rollout.data_source import DataSource
from tether.rollout.difficulty import AdaptiveSource
from tether.rollout.probe import DIFFICULTY_DIR, SUMMARY, Probe, write_summary
from tether.rollout.driver import GroupDriver, Schedule
from tether.rollout.dumps import Dumps
from tether.rollout.engine_watch import EngineWatch
from tether.rollout import served
from tether.rollout.eval_set import EvalSet
from tether.rollout.failures import FailurePolicy, check_trained
from tether.rollout.filters import load_filter
from tether.rollout.fleet import EngineFleet, prefix_cache_metrics
from tether.rollout.generate_fn import CustomGenerate, takes_evaluation
from tether.rollout.health import RolloutHealth
from tether.rollout.modes import StreamMode, make_mode
from tether.rollout.prompt_format import ROUND_TRIP_ROWS, round_trip_problems
from tether.rollout.results import rollout_metrics, to_train_batch, trajectory_layout
from tether.rollout.rollout_fn import (EvalDataSource, RolloutContext, RolloutDataSource, RolloutFnError,
                                       RolloutOutput, call_rollout_fn, load_rollout_fn)
from tether.rollout.stream import STREAM_STATE, StreamSettings
from tether.rollout.user_functions import check_user_functions, make_scorer, score_shaped, score_unscored
from tether.errors import RolloutFailed
from tether.sample import Sample, counted
from tether.trainer.batch import TrainBatch

__all__ = ["RolloutManager", "check_user_functions", "DATA_STATE"]

DATA_STATE = "data_source.json"
"""The manager's checkpoint state, one dict: the data position ("data"), the partial-rollout buffer
("buffer") and the rollout stream ("stream"), each present when the run has it."""


MANAGER_SECONDS = "timing/rollout_manager_s"
"""The manager's own time for a rollout; the handle turns it into the Ray call's overhead."""

FAULTS = "faults"
"""The manager's concurrency group for lost engines: the driver asks about them and hands in their
replacements while a rollout runs (the default group runs one call at a time)."""


class RolloutManager:
    def __init__(self, cfg_dict: dict, engine_urls: list[str] | None = None):
        """Loads the data, tokenizer and user functions. Without ``engine_urls`` the engines are given
        later (``connect_engines``): the manager starts while they load their models."""
        self.cfg: TetherConfig = config_from_dict(cfg_dict, "rollout manager")
        d, r = self.cfg.data, self.cfg.rollout
        self.tokenizer = load_tokenizer(self.cfg.model.path)
        positions = model_positions(self.cfg.model.path)
        # Without prompt data the manager only evaluates (`tether eval`, the eval at the end of `tether sft`).
        self.data: DataSource | None = None
        self.filtered, self.skipped_rows = 0, list[str]()
        if d.path is not None or d.reasoning_gym is not None:  # the latter raises: check_inputs writes its files
            rows, self.filtered, self.skipped_rows = load_train_rows(self.cfg, self.tokenizer, positions)
            source: dict[str, Any] = dict(prompts_per_rollout=r.prompts_per_rollout,
                                          n_samples_per_prompt=r.n_samples_per_prompt, shuffle=d.shuffle,
                                          seed=self.cfg.seed)
            self.data = DataSource(rows, **source) if d.difficulty is None else AdaptiveSource(rows, d.difficulty,
                                                                                               **source)
        self._preparing: Iterator[None] | None = None
        # Every user function is loaded here, once: a bad spec fails the start, naming its field.
        self.scorer = make_scorer(self.cfg)
        self.keep = load_filter(r.dynamic_filter, args=self.cfg.args)
        self.params = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                     max_new_tokens=r.max_response_len, stop_token_ids=tuple(r.stop_token_ids))
        eval_loaded = load_eval_rows(self.cfg, self.tokenizer, positions)
        self.skipped_rows += [line for loaded in eval_loaded for line in loaded.skipped]
        eval_rows = [(e, loaded.rows) for e, loaded in zip(self.cfg.eval.datasets, eval_loaded)]
        row_fns = CustomGenerate.resolve_rows(self.data.rows, d.path or "data") if self.data is not None else []
        row_fns += [f for e, rows in eval_rows for f in CustomGenerate.resolve_rows(rows, e.path or f"eval {e.name}")]
        self.policy = FailurePolicy.from_config(r.failures)
        spec = generate_fn_spec(r)  # the user's generate function, or the environment's
        self.custom = (CustomGenerate(spec, row_fns, self.tokenizer, self.cfg, self.policy,
                                      "rollout.environment" if r.environment else "rollout.custom_generate_fn")
                       if spec or row_fns else None)
        self.fleet: EngineFleet | None = None
        self.mode = make_mode(r.schedule, self._stream_settings)
        self.driver: GroupDriver | None = None
        self.rollout_fn = load_rollout_fn(r.custom_rollout_fn) if r.custom_rollout_fn else None
        self.schedule = Schedule(need=r.prompts_per_rollout, over_sampling_groups=r.groups_to_start,
                                 max_concurrent_groups=r.max_concurrent_groups, waves=self.cfg.deterministic,
                                 keep_first_finished=r.keep_order == "finish", groups_per_request=r.groups_per_request)
        self.eval_sets = [EvalSet(e, rows, make_scorer(self.cfg, e.reward, f"eval.datasets[{i}].reward"))
                          for i, (e, rows) in enumerate(eval_rows)]
        self.dumps = Dumps(Path(self.cfg.debug.save_rollouts or Path(self.cfg.output_dir) / "rollouts"),
                           self.cfg.debug.keep_rollout_dumps)
        self.health = RolloutHealth(r.n_samples_per_prompt)
        self.buffer = PartialBuffer()
        if engine_urls is not None:
            self.connect_engines(engine_urls)

    def connect_engines(self, urls: list[str], reissue: bool = False,
                        served_urls: dict[str, list[str]] | None = None) -> None:
        """``reissue``: the driver replaces lost engines, so a lost engine's requests go to the others
        (or wait for its replacement) instead of failing the rollout. ``served_urls``: the served models'
        engine URLs by name (what reward and generate functions reach as ``models``)."""
        c = self.cfg.cluster
        served.connect(served_urls or {}, c.call_timeout_s)
        log_dir = Path(self.cfg.output_dir) / "engine_logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.fleet = EngineFleet(urls, c.call_timeout_s, c.router, str(log_dir), reissue, request_fields(self.cfg))
        self.watch = EngineWatch(self.fleet.router, c.engine_health_interval_s, c.engine_health_timeout_s,
                                 others=served.routers())
        self.driver = GroupDriver(self.fleet, self.cfg.cluster.call_timeout_s, self.custom, self.policy)
        self.mode.connect(fleet=self.fleet, data=self.data, params=self.params, keep=self.keep, custom=self.custom,
                          score=partial(score_shaped, self.scorer, self.cfg))

    def _stream_settings(self, schedule) -> StreamSettings:
        r = self.cfg.rollout
        return StreamSettings(need=r.prompts_per_rollout, max_staleness=schedule.max_staleness,
                              start_per_take=r.groups_to_start, max_in_flight=r.max_concurrent_groups,
                              stale_groups=schedule.stale_groups, groups_per_request=r.groups_per_request,
                              pause_mode=schedule.pause_mode, seed=self.cfg.seed,
                              timeout_s=self.cfg.cluster.call_timeout_s, policy=self.policy)

    def num_rollout_per_epoch(self) -> int:
        return self._require_data().num_rollout_per_epoch

    def _require_fleet(self) -> EngineFleet:
        if self.fleet is None:
            raise RuntimeError("the rollout manager has no engines yet (connect_engines first)")
        return self.fleet

    def _require_driver(self) -> GroupDriver:
        if self.driver is None:
            raise RuntimeError("the rollout manager has no engines yet (connect_engines first)")
        return self.driver

    def _require_data(self) -> DataSource:
        if self.data is None:
            raise ValueError("data.path is required for RL training (a JSONL file of prompts)")
        return self.data

    def data_info(self) -> dict:
        return {"train_rows": len(self.data.rows) if self.data else 0, "filtered_long_prompts": self.filtered,
                "skipped_bad_rows": self.skipped_rows,
                "eval_rows": {e.cfg.name: len(e.rows) for e in self.eval_sets}, "warnings": self._check_text()}

    def _check_text(self) -> list[str]:
        """Warnings for prompts and labels that the tokenizer does not give back as they are."""
        sets = [(e.cfg.path, e.rows) for e in self.eval_sets]
        if self.data is not None:
            sets.insert(0, (self.cfg.data.path, self.data.rows))
        items = [(f"{path}:{row.line}", what, text) for path, rows in sets
                 for row in rows[:ROUND_TRIP_ROWS]
                 for what, text in (("prompt", row.text), ("label", row.label)) if isinstance(text, str)]
        return round_trip_problems(self.tokenizer, items) + self._dict_labels(sets)

    def _dict_labels(self, sets) -> list[str]:
        """A label that is a dict holding a ground_truth (verl's reward_model field named whole): the
        reward would be handed the dict, not the answer."""
        key = self.cfg.data.label_key
        for path, rows in sets:
            for row in rows[:ROUND_TRIP_ROWS]:
                if isinstance(row.label, dict) and "ground_truth" in row.label:
                    return [f"{path}:{row.line}: data.label_key '{key}' gives a dict with a ground_truth field "
                            f"({sorted(row.label)}); rewards get the whole dict as the label. To compare against "
                            f"the answer, set data.label_key={key}.ground_truth"]
        return []

    def generate(self, rollout_id: int) -> tuple[TrainBatch, dict[str, float]]:
        """Samples for one rollout, scored. Called with num_returns=2: the batch stays in the object store."""
        data = self._require_data()
        epoch = data.epoch
        ctx = self._context(rollout_id, False, self.params, self._seed(rollout_id, 0),
                            partial(score_shaped, self.scorer, self.cfg), f"rollout {rollout_id}")
        start = time.perf_counter()
        driver = self._require_driver()
        driver.take_failures()  # from a rollout function's earlier calls, if any
        try:
            out = self._call(ctx, RolloutDataSource(data, self.buffer, rollout_id), False, "rollout")
        except RolloutFailed as err:  # a storm of failures: the samples that failed, for the record
            raise RolloutFailed(f"{err}\n{self._dump_failures(rollout_id, driver.take_failures().rows)}") from None
        failed = driver.take_failures().rows
        return self._finish(rollout_id, out.groups, dict(out.metrics), out.warnings, epoch, start, failed=failed)

    def _dump_failures(self, rollout_id: int, rows: list[dict]) -> str:
        name = f"rollout_{rollout_id:06d}_failures.jsonl"
        self.dumps.rows(rows, name)
        return f"(every failed sample, with its error: {self.dumps.dir / name})"

    def _finish(self, rollout_id: int, groups: list[list[Sample]], metrics: dict, warnings: list[str], epoch: int,
                start: float, dump_extra: list[dict] | None = None,
                failed: list[dict] | None = None) -> tuple[TrainBatch, dict[str, float]]:
        """A rollout's groups to its TrainBatch: post-process, metrics, health checks, the dump
        (``dump_extra``: more fields for each group's rows; ``failed``: the rows of the samples that
        failed, dumped on their own as well)."""
        r = self.cfg.rollout
        post_start = time.perf_counter()
        samples = [s for group in groups for s in group]
        scored = counted(samples)  # failed samples have no reward (tether/rollout/failures.py)
        self.scorer.post_process(scored)
        if r.overlong_buffer_len is not None and scored:
            metrics["rollout/overlong_penalty_mean"] = statistics.fmean(
                overlong_penalty(s.response_length, r.max_response_len, r.overlong_buffer_len,
                                 r.overlong_penalty_factor) for s in scored)
        metrics.update(rollout_metrics(samples))
        health, metrics["warnings"] = self.health.after_rollout(rollout_id, samples)
        metrics["warnings"] = warnings + metrics["warnings"]
        metrics.update(health)
        metrics["rollout/epoch"] = float(epoch)
        extra = dump_extra or [{}] * len(groups)
        self.dumps.rows([{**s.to_dict(), **more} for group, more in zip(groups, extra) for s in group],
                        f"rollout_{rollout_id:06d}.jsonl")
        where = self._dump_failures(rollout_id, failed) if failed else ""
        self.dumps.prune_old("rollout_")
        try:
            metrics["rollout/trained_frac"] = check_trained(samples, self.policy, f"rollout {rollout_id}")
        except RolloutFailed as err:
            raise RolloutFailed(f"{err}\n{where}") from None
        if isinstance(self.data, AdaptiveSource):  # pass rates and levels move with what was trained
            self.data.observe(groups, [[self.data.cfg.passed(s.scored_reward()) for s in counted(g)]
                                       for g in groups])
            data_metrics, changes = self.data.metrics()
            metrics.update(data_metrics)
            metrics["warnings"] += [f"rollout {rollout_id}: {c}" for c in changes]
        size, trajectories = self._layout(groups)
        batch = to_train_batch(samples, size, r.temperature, trajectories)
        end = time.perf_counter()
        metrics["timing/rollout_postprocess_s"] = end - post_start  # post-process, metrics, dump, batch
        # The rollout function's time outside the driver's generate: its event loop and HTTP client,
        # the engines' prefill counters (and, for a custom function, whatever it does besides).
        if "timing/generate_s" in metrics:
            metrics["timing/rollout_fn_overhead_s"] = post_start - start - metrics["timing/generate_s"]
        metrics[MANAGER_SECONDS] = end - start
        return batch, metrics

    # ------------------------------------------------------------ data.difficulty, before the first rollout
    def prepare_data(self) -> dict:
        """One step of what data.difficulty measures before the first rollout (a chunk of problems a
        call, so that every call stays within the call timeout): {"done": False} until the last, then
        {"done": True} with the probe's metrics. Nothing to do without data.difficulty."""
        if not isinstance(self.data, AdaptiveSource):
            return {"done": True}
        if self._preparing is None:
            self._probe = Probe(self.data, self._probe_groups, Path(self.cfg.output_dir) / DIFFICULTY_DIR)
            self._preparing = self._prepare_steps(self.data, self._probe)
        try:
            next(self._preparing)
            return {"done": False}
        except StopIteration:
            self._preparing = None
        data, probe = self.data, self._probe
        summary = data.summary()
        write_summary(Path(self.cfg.output_dir) / DIFFICULTY_DIR, summary)
        measured = [row for row in summary if row["measured"]]
        metrics: dict = {"done": True, "difficulty/probe_problems": float(probe.measured),
                         "timing/probe_s": probe.seconds, **data.metrics()[0]}
        if measured:
            metrics["difficulty/probe_pass_rate"] = (sum(r["pass_rate"] * r["measured"] for r in measured)
                                                     / sum(r["measured"] for r in measured))
        metrics["warnings"] = data.metrics()[1]
        return metrics

    def _prepare_steps(self, data: AdaptiveSource, probe: Probe) -> Iterator[None]:
        c = data.cfg.curriculum
        if c is not None and c.start == "probe":
            yield from probe.start_levels()
            data.start_at(probe.levels)
        elif c is not None:
            assert isinstance(c.start, int)  # "probe" is the other value
            data.start_at({task: min(c.start, data.top[task]) for task in data.tasks})
        count = len(data.rows) if data.cfg.probe_problems is None else data.cfg.probe_problems
        if count:
            yield from probe.measure(data.upcoming(count), "the problems training draws first")

    def _probe_groups(self, groups: list[list[Sample]], chunk: int) -> list[list[Sample]]:
        """The probe's groups, generated and scored (the raw reward, as an eval scores) on the run's engines."""
        ctx = self._context(0, True, self.params, self._seed(0, 1000 + chunk), partial(score_unscored, self.scorer,
                                                                                       self.cfg), f"probe chunk {chunk}")
        return self._call(ctx, EvalDataSource("probe", groups, 0), True, "probe").groups

    # ------------------------------------------------------------ fully asynchronous rollout
    def stream_start(self, version: int, next_take: int) -> None:
        self._stream_mode().require().start(version, next_take)
        self.watch.set_active(True)

    def stream_take(self, rollout_id: int) -> tuple[TrainBatch, dict[str, float]]:
        """The next rollout from the stream (called with num_returns=2, like generate)."""
        start = time.perf_counter()
        mode = self._stream_mode()
        try:
            flights, metrics, dropped, failed = mode.take(rollout_id)
        except RolloutFailed as err:  # over the failure budget: the samples that failed, for the record
            rows = mode.require().runner.failures.rows
            raise RolloutFailed(f"{err}\n{self._dump_failures(rollout_id, rows)}") from None
        if dropped:  # which prompts went untrained, for the record
            self.dumps.rows([{**s.to_dict(), "epoch": f.epoch, "draw": f.seq} for f in dropped for s in f.samples],
                            f"rollout_{rollout_id:06d}_dropped_stale.jsonl")
        return self._finish(rollout_id, [f.samples for f in flights], metrics, [], max(f.epoch for f in flights),
                            start, [{"epoch": f.epoch, "draw": f.seq} for f in flights], failed)

    def stream_pause(self) -> None:
        self.watch.set_active(False)  # a paused engine does not generate: its heartbeat would fail
        self._stream_mode().require().pause()

    def stream_resume(self, version: int) -> None:
        self._stream_mode().require().resume(version)
        self.watch.set_active(True)

    def _stream_mode(self) -> StreamMode:
        if not isinstance(self.mode, StreamMode):
            raise RuntimeError("the rollout stream runs with rollout.schedule.mode: fully_async")
        return self.mode

    def _context(self, rollout_id: int, evaluation: bool, params: SamplingParams, seed: int, score,
                 what: str) -> RolloutContext:
        if self.driver is None:
            raise RuntimeError(f"{what}: the rollout manager has no engines (connect_engines first)")
        return RolloutContext(cfg=self.cfg, tokenizer=self.tokenizer, rollout_id=rollout_id, evaluation=evaluation,
                              driver=self.driver, params=params, seed=seed, score=score, schedule=self.schedule,
                              keep=self.keep, buffer=self.buffer, what=what)

    def _call(self, ctx: RolloutContext, data_source, evaluation: bool, metric_prefix: str) -> RolloutOutput:
        """The rollout function (the config's; the built-in one when there is none, or for an eval the
        config's does not take)."""
        (out,), engines = self._call_all([(ctx, data_source)], evaluation, metric_prefix)
        out.metrics.update(engines)
        return out

    def _call_all(self, calls: list[tuple[RolloutContext, Any]], evaluation: bool,
                  metric_prefix: str) -> tuple[list[RolloutOutput], dict[str, float]]:
        """The rollout function on each (context, data source) at once, in one event loop: the engines
        batch them together (every eval set in one go). Returns the outputs and the engines' metrics
        over all the calls (prefix cache, reissued samples)."""
        fn, spec = self.rollout_fn, self.cfg.rollout.custom_rollout_fn or "built-in"
        if fn is None or (evaluation and not takes_evaluation(fn)):
            fn, spec = builtin_rollout, "built-in"
        fleet = self._require_fleet()
        before, reissued = fleet.prefill_counters(), fleet.reissued_samples

        async def run_all() -> list[RolloutOutput]:
            return list(await asyncio.gather(*(call_rollout_fn(fn, spec, ctx, source, evaluation,
                                                               user_fn=fn is not builtin_rollout)
                                               for ctx, source in calls)))

        with self.watch.watching():
            outs = asyncio.run(run_all())
        engines = prefix_cache_metrics(before, fleet.prefill_counters(), metric_prefix)
        if not evaluation:
            engines["faults/samples_reissued"] = float(fleet.reissued_samples - reissued)
        return outs, engines

    def _layout(self, groups: list[list[Sample]]) -> tuple[int, list[int] | None]:
        """(trajectories per group, each sample's trajectory or None): tether/rollout/results.py."""
        size, trajectories = trajectory_layout(groups, self.cfg)
        total, batch = size * len(groups), self.cfg.global_batch_size  # trajectories (samples, without segments)
        if self.rollout_fn is not None and total % batch:
            raise RolloutFnError(f"rollout.custom_rollout_fn '{self.cfg.rollout.custom_rollout_fn}' returned {total} "
                                 f"{'trajectories' if trajectories else 'samples'} ({len(groups)} groups of {size}); "
                                 "training takes a multiple of "
                                 f"train.global_batch_size={batch}")
        return size, trajectories

    def eval(self, rollout_id: int) -> dict:
        """Scores of every eval set (and "warnings", a list of texts, when one looks collapsed). The sets
        are generated together: one set of 50 problems alone would leave most of an engine's batch empty."""
        metrics: dict = {"warnings": []}
        start = time.perf_counter()
        calls = []
        for k, eval_set in enumerate(self.eval_sets):
            name = eval_set.name
            ctx = self._context(rollout_id, True, eval_set.params, self._seed(rollout_id, k + 1),
                                # a set's own reward scores it; else rewards its environment set are kept
                                eval_set.scorer.score_group if eval_set.cfg.reward else
                                partial(score_unscored, eval_set.scorer, self.cfg), f"eval {name} at rollout {rollout_id}")
            calls.append((ctx, EvalDataSource(name, eval_set.groups(), rollout_id)))
        outs, engines = self._call_all(calls, True, "eval") if calls else ([], {})
        self._require_driver().take_failures()  # an eval's failed samples are in its own dump
        for eval_set, out in zip(self.eval_sets, outs):
            name = eval_set.name
            scores, samples, prompts, answers = eval_set.summarize(out.groups, out.metrics)
            metrics.update(scores)
            health, warnings = self.health.after_eval(
                name, counted(samples), scores[f"eval/{name}/score"], scores[f"eval/{name}/constant_answer_score"],
                eval_set.cfg.reward or self.cfg.rollout.reward, rollout_id)
            metrics.update(health)
            metrics["warnings"] += warnings
            self.dumps.samples(samples, f"eval_{name}_{rollout_id:06d}.jsonl")
            self.dumps.answers(counted(samples), answers, f"eval_{name}_{rollout_id:06d}_answers.json")
            self.dumps.rows(prompts, f"eval_{name}_{rollout_id:06d}_prompts.jsonl")
            self.dumps.prune_old(f"eval_{name}_")
        metrics.update(engines)  # the engines' prefix-cache counters, over every set
        metrics["timing/eval_s"] = time.perf_counter() - start
        return metrics

    def _seed(self, rollout_id: int, stream: int) -> int:
        # Independent of call order: a resumed run samples rollout k exactly as an uninterrupted one.
        return (self.cfg.seed * 1_000_003 + rollout_id) * 17 + stream

    def keep_all_dumps(self) -> None:
        self.dumps.prune = False

    # ------------------------------------------------------------ state and memory
    def state_dict(self) -> dict:
        """Where the rollout stands: the data position, the groups handed back to the buffer, the stream."""
        state = {"data": self._require_data().state_dict()}
        if self.cfg.rollout.partial_rollout or self.rollout_fn is not None:  # groups handed back wait there
            state["buffer"] = self.buffer.state_dict()
        stream = self.mode.state_dict()
        if stream is not None:  # its position, and the groups drawn and not yet trained on
            state["stream"] = stream
        return state

    def load_state_dict(self, state: dict) -> dict:
        self._require_data().load_state_dict(state["data"])
        self.mode.load_state_dict(state.get("stream"), state["data"])
        if "buffer" in state:
            self.buffer.load_state_dict(state["buffer"])
        return state["data"]

    def save_state(self, ckpt_dir: str) -> None:
        (Path(ckpt_dir) / DATA_STATE).write_text(json.dumps(self.state_dict()))
        if isinstance(self.data, AdaptiveSource):  # what was kept so far, per task and level
            summary = Path(self.cfg.output_dir) / DIFFICULTY_DIR / SUMMARY
            summary.parent.mkdir(parents=True, exist_ok=True)
            summary.write_text(json.dumps(self.data.summary(), indent=1))

    def load_state(self, ckpt_dir: str) -> dict:
        """The data position of the checkpoint (older checkpoints kept the buffer and the stream in files
        of their own beside the data position: read as one state)."""
        state = json.loads((Path(ckpt_dir) / DATA_STATE).read_text())
        if "data" not in state:
            state = {"data": state}
            for key, name in (("stream", STREAM_STATE), ("buffer", BUFFER_STATE)):
                if (Path(ckpt_dir) / name).is_file():
                    state[key] = json.loads((Path(ckpt_dir) / name).read_text())
        try:
            return self.load_state_dict(state)
        except ConfigError as err:
            raise ConfigError(f"{ckpt_dir}: {err}") from None

    def release_memory(self, tags: list[str]) -> None:
        self._require_fleet().release_memory(tags)

    def resume_memory(self, tags: list[str]) -> None:
        self._require_fleet().resume_memory(tags)

    def engine_health(self) -> dict[str, bool]:
        return self._require_fleet().health()

    # ------------------------------------------------------------ lost engines (while a rollout runs)
    @ray.method(concurrency_group=FAULTS)
    def lost_engines(self) -> dict[str, str]:
        """URL -> why, of the engines lost and not yet replaced (the served models' too)."""
        lost = self.fleet.router.lost() if self.fleet is not None else {}
        for router in served.routers():
            lost.update(router.lost())
        return lost

    @ray.method(concurrency_group=FAULTS)
    def replace_engine(self, lost_url: str, new_url: str) -> None:
        name = served.find(lost_url)
        if name is None:
            self._require_fleet().replace(lost_url, new_url)
            return
        router = served.MODELS[name].router
        router.remove_worker(lost_url)
        router.add_worker(new_url)
