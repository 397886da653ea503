"""The rollout driver end to end: per-group streaming against one request per engine (the batch split).

    python bench/rollout.py            # 2 engine servers (subprocesses), a ~4M-parameter Qwen2
    python bench/rollout.py --quick    # fewer groups and tokens, for a smoke run

Two shapes, each 32 prompts x 8 samples, sampled with log-probs, through real HTTP servers:
- grpo: every response 64 tokens;
- long-tail: 10% of the prompts (3 of 32) answer 8x longer (256 tokens, the others 32).
Schedules: "batch split" sends all groups at once as one request per engine (the wave schedule a
deterministic run uses); "streaming" sends each group as its own request, at most
max_concurrent_groups in flight, routed to the engine with the least outstanding work as groups finish.
Prints rollout seconds (median of 3) and generated tokens/s of each, and the ratio to the batch split.

A second table runs 4 rollouts in a row on a stream of long-tail prompts (10% answer 8x longer), as a
run would: the batch split against streaming that starts 4 extra groups, keeps the first 32 to
finish (`rollout.keep_order: finish`) and carries the rest into the next rollout
(`rollout.partial_rollout`). Its figure is trained tokens per second over the 4 rollouts: work left
unfinished in the buffer at the end counts as time spent, not as tokens.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tether.engine.sampling import SamplingParams  # noqa: E402
from tether.rollout.driver import GroupDriver, Schedule  # noqa: E402
from tether.rollout.filters import keep_all  # noqa: E402
from tether.rollout.fleet import EngineFleet  # noqa: E402
from tether.sample import Sample  # noqa: E402

MODEL = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768)


class LengthFleet(EngineFleet):
    """Each sample's length comes from its metadata: a long tail without a trained model."""

    def payload(self, samples, params, seeds, rids):
        payload = super().payload(samples, params, seeds, rids)
        for sp, s in zip(payload["sampling_params"], samples):
            sp["max_new_tokens"] = s.metadata["tokens"] - s.response_length  # a continued one has some
        return payload


def serve(path: str, port: int) -> None:
    import torch

    from tether.engine.core import start_engine_core
    from tether.engine.embedded import EmbeddedEngine
    from tether.engine.server import EngineServer
    from tether.models.hf import load_tokenizer

    torch.set_num_threads(1)  # two engines on two cores, as colocated engines would share them
    core = start_engine_core(lambda: EmbeddedEngine(path), max_batch=512, max_batch_tokens=1 << 20)
    EngineServer(core, port=port).start()
    load_tokenizer(path)
    while True:
        time.sleep(3600)


def start_engines(path: Path, count: int) -> tuple[list[subprocess.Popen], list[str]]:
    from tether.http.server import free_port

    procs, urls = [], []
    for _ in range(count):
        port = free_port()
        procs.append(subprocess.Popen([sys.executable, __file__, "--serve", str(path), "--port", str(port)]))
        urls.append(f"http://127.0.0.1:{port}")
    deadline = time.time() + 120
    for url in urls:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"engine {url} did not start")
            time.sleep(0.2)
    return procs, urls


def groups(lengths, n: int, seed: int = 0):
    rng = random.Random(seed)
    for k, tokens in enumerate(lengths):
        prompt = [rng.randrange(3, 90) for _ in range(16)]
        yield [Sample(prompt_index=k, sample_index=j, prompt="", label=None, metadata={"tokens": tokens},
                      prompt_ids=prompt) for j in range(n)]


async def score(samples):
    for s in samples:
        s.reward = float(s.response_length)


def measure(urls, lengths, n, schedule) -> tuple[float, float]:
    driver = GroupDriver(LengthFleet(urls, timeout_s=600), timeout_s=600)
    params = SamplingParams(temperature=1.0, max_new_tokens=max(lengths), ignore_eos=True)
    start = time.perf_counter()
    result = driver.run(groups(lengths, n), schedule, params, 0, score, keep_all, "bench")
    elapsed = time.perf_counter() - start
    tokens = sum(s.response_length for g in result.kept for s in g)
    assert tokens == n * sum(lengths)
    return elapsed, tokens / elapsed


def long_tail_stream(base: int, seed: int = 2):
    rng = random.Random(seed)
    while True:
        yield 8 * base if rng.random() < 0.1 else base


def measure_rollouts(urls, base: int, prompts: int, n: int, schedule: Schedule, rollouts: int) -> tuple[float, float]:
    """Seconds per rollout and trained tokens/s over ``rollouts`` rollouts, carrying left-over groups."""
    driver = GroupDriver(LengthFleet(urls, timeout_s=600), timeout_s=600)
    params = SamplingParams(temperature=1.0, max_new_tokens=8 * base, ignore_eos=True)
    fresh, carried, trained = groups(long_tail_stream(base), n), [], 0
    start = time.perf_counter()
    for k in range(rollouts):
        result = driver.run(itertools.chain(carried, fresh), schedule, params, k, score, keep_all, f"bench rollout {k}")
        assert len(result.kept) == prompts
        carried = carried[result.started:] + result.leftover  # not reached or cut short: first next time
        trained += sum(s.response_length for g in result.kept for s in g)
    elapsed = time.perf_counter() - start
    return elapsed / rollouts, trained / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--serve")
    parser.add_argument("--port", type=int)
    parser.add_argument("--engines", type=int, default=2)
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve, args.port)
    from tether.models.tiny import build_char_tokenizer, build_tiny_model

    prompts, n = (16, 4) if args.quick else (32, 8)
    base, repeats = (16, 1) if args.quick else (32, 3)
    rng = random.Random(1)
    long = set(rng.sample(range(prompts), max(1, prompts // 10)))
    shapes = {"grpo": [2 * base] * prompts,
              "long-tail": [8 * base if k in long else base for k in range(prompts)]}
    schedules = {"batch split": Schedule(prompts, prompts, None, waves=True),
                 "streaming, all groups": Schedule(prompts, prompts, None, waves=False),
                 "streaming, 8 at a time": Schedule(prompts, prompts, 8, waves=False)}
    path = build_tiny_model(Path(tempfile.mkdtemp()), build_char_tokenizer(), max_positions=512, **MODEL)
    procs, urls = start_engines(path, args.engines)
    try:
        measure(urls, [8] * 4, 2, schedules["batch split"])  # warm-up
        print(f"{args.engines} engines, {prompts} prompts x {n} samples, cores: {os.cpu_count()}\n")
        print(f"{'shape':<10} {'schedule':<24} {'rollout s':>10} {'tokens/s':>9} {'vs batch split':>15}")
        for shape, lengths in shapes.items():
            base_s = None
            for name, schedule in schedules.items():
                runs = [measure(urls, lengths, n, schedule) for _ in range(repeats)]
                secs = statistics.median(r[0] for r in runs)
                tps = statistics.median(r[1] for r in runs)
                base_s = base_s or secs
                print(f"{shape:<10} {name:<24} {secs:>10.2f} {tps:>9.0f} {base_s / secs:>14.2f}x")
        rollouts, extra = 4, max(1, prompts // 8)
        runs = {"batch split": Schedule(prompts, prompts, None, waves=True),
                "streaming, start order, partial rollout": Schedule(prompts, prompts + extra, None, waves=False),
                f"streaming, first {prompts} of {prompts + extra} to finish, partial rollout":
                    Schedule(prompts, prompts + extra, None, waves=False, keep_first_finished=True)}
        print(f"\n{rollouts} rollouts in a row, long-tail stream (10% of prompts {8 * base} tokens, others {base})")
        print(f"{'schedule':<58} {'s/rollout':>10} {'trained tok/s':>14} {'vs batch split':>15}")
        base_tps = None
        for name, schedule in runs.items():
            measured = [measure_rollouts(urls, base, prompts, n, schedule, rollouts) for _ in range(repeats)]
            secs = statistics.median(r[0] for r in measured)
            tps = statistics.median(r[1] for r in measured)
            base_tps = base_tps or tps
            print(f"{name:<58} {secs:>10.2f} {tps:>14.0f} {tps / base_tps:>14.2f}x")
    finally:
        for proc in procs:
            proc.terminate()


if __name__ == "__main__":
    main()
