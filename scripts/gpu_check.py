"""The GPU check: tether's engine, trainer, weight push and checkpoints on one GPU, without Ray.

    bash scripts/gpu_check.sh OUT_DIR          # on a GPU machine (pure-Python wheels from scripts/gpu_wheels.sh)
    bash scripts/gpu_check.sh --cpu OUT_DIR    # the same checks on CPU at a small size (CI runs this)

Made for a bare, offline single-GPU machine with PyTorch, transformers, safetensors, numpy, httpx and
pytest, and a few minutes: no Ray (its wheel alone is larger than what can be brought), so every part
runs in this process or in an engine server it starts, as `tether serve` runs one. In order:

    model       a random Qwen2 of Qwen2.5-0.5B's shape (896 hidden, 24 layers) with Qwen2.5's 151,936-token
                vocabulary (the character tokenizer; the ids past it decode to nothing); --cpu: 64 hidden, 2 layers
    engine      the embedded engine serving it over HTTP (`tether serve --device cuda`), float32 and bfloat16
    logprobs    each engine's log-probs of its own sampled replies against the trainer's forward of the
                same weights (FSDP2, float32; then bfloat16 compute over float32 master weights)
    throughput  the GRPO shape (32 prompts x 8 samples, 128 new tokens, sampled; --cpu: 4 x 4 x 16) through
                the bfloat16 engine's /generate against HF generate of the same model on the same device
    train       one GRPO step on the engine's samples: one FSDP2 rank over NCCL (gloo on CPU), bfloat16
                mixed precision
    push        the trained weights into the float32 engine (a run's engines serve model.dtype, the master
                weights' dtype) over the weight-update group (gloo: NCCL takes
                one rank per GPU, and engine and trainer share this one); its replies change, and its
                log-probs of a reply are the trainer's
    resume      a checkpoint after the step; the next step run twice, once straight on and once after
                loading it: the same weights bit for bit, and the same draw from the CUDA generator after
    pytest      tests/gpu (what needs vLLM or SGLang skips, saying so)

Writes OUT_DIR/gpu_check.md (the table, also printed), gpu_check.json and the engines' logs; exits 1
when a check failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import torch  # noqa: E402

VOCAB = 151_936  # Qwen2.5's
SHAPES = {"cuda": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       intermediate_size=4864),  # Qwen2.5-0.5B
          "cpu": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128)}
WORKLOAD = {"cuda": dict(prompts=32, samples=8, new_tokens=128), "cpu": dict(prompts=4, samples=4, new_tokens=16)}
SERVER_START_S = 300.0


@dataclass
class Row:
    check: str
    status: str  # passed, failed, skipped
    figures: str
    seconds: float


class Report:
    """Each check runs once; one that raises is a failed row with its error, and the next ones go on."""

    def __init__(self, out: Path):
        self.out, self.rows = out, []

    def run(self, name: str, fn: Callable[[], str | tuple[str, str]]) -> None:
        start = time.perf_counter()
        try:
            result = fn()
            status, figures = result if isinstance(result, tuple) else ("passed", result)
        except Exception as err:  # noqa: BLE001 - a failed check is a row, the rest still run
            status, figures = "failed", f"{type(err).__name__}: {str(err)[:400]}"
            with open(self.out / "gpu_check_errors.log", "a") as f:
                f.write(f"--- {name}\n{traceback.format_exc()}\n")
        row = Row(name, status, figures.replace("|", "/").replace("\n", " "), time.perf_counter() - start)
        self.rows.append(row)
        print(f"[gpu_check] {row.check}: {row.status} ({row.seconds:.1f} s) {row.figures}", flush=True)

    def write(self, header: str) -> str:
        lines = [header, "", "| check | result | figures | seconds |", "|---|---|---|---|"]
        lines += [f"| {r.check} | {r.status} | {r.figures} | {r.seconds:.1f} |" for r in self.rows]
        table = "\n".join(lines) + "\n"
        (self.out / "gpu_check.md").write_text(table)
        (self.out / "gpu_check.json").write_text(json.dumps([r.__dict__ for r in self.rows], indent=1) + "\n")
        return table

    @property
    def failed(self) -> bool:
        return any(r.status == "failed" for r in self.rows)


# ------------------------------------------------------------ the model and the engine servers
def build_model(out: Path, device: str) -> tuple[Path, int]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tether.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer(chat_template=True)
    config = Qwen2Config(vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=True,
                         rope_theta=1_000_000.0, rms_norm_eps=1e-6, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **SHAPES[device])
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: minutes on CPU at this size, seconds on a GPU
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out, sum(p.numel() for p in model.parameters())


class EngineServer:
    """`tether serve` in a child process: the embedded engine on ``device`` behind its HTTP server."""

    def __init__(self, model: Path, dtype: str, device: str, log: Path):
        from tether.http.server import free_port

        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = open(log, "w")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, "-m", "tether.cli", "serve", "--model", str(model),
                                      "--port", self.url.rpartition(":")[2], "--dtype", dtype, "--device", device],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine server exited ({self.proc.returncode}); see {log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"the engine server at {self.url} did not answer /health within {SERVER_START_S:.0f} s")

    def generate(self, body: dict) -> Any:
        reply = httpx.post(f"{self.url}/generate", json=body, timeout=600)
        if reply.status_code != 200:
            raise RuntimeError(f"{self.url}/generate answered {reply.status_code}: {reply.text[:300]}")
        return reply.json()

    def version(self) -> int:
        return int(httpx.get(f"{self.url}/get_model_info", timeout=30).json()["weight_version"])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# ------------------------------------------------------------ samples and the trainer
@dataclass
class Samples:
    prompts: list[list[int]]
    responses: list[list[int]]
    logprobs: list[list[float]]
    group: int


def prompts_of(tokenizer, count: int) -> list[list[int]]:
    return [tokenizer.encode(f"{7 * i % 50}+{(13 * i + 5) % 50}=", add_special_tokens=False) for i in range(count)]


def sample(server: EngineServer, prompts: list[list[int]], group: int, new_tokens: int, seed: int = 1) -> Samples:
    """``group`` sampled replies to each prompt, each its own seed, with the engine's log-probs."""
    ids = [p for p in prompts for _ in range(group)]
    params = [{"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True, "sampling_seed": seed + i}
              for i in range(len(ids))]
    outs = server.generate({"input_ids": ids, "sampling_params": params, "return_logprob": True})
    return Samples(ids, [list(o["output_ids"]) for o in outs],
                   [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs], group)


def train_batch(samples: Samples):
    """The samples as a GRPO batch. Reward: the share of a reply's token ids that are even (a random
    model's replies differ in it, so the group advantages are not all zero)."""
    from tether.trainer.batch import TrainBatch

    rewards = [sum(t % 2 == 0 for t in r) / max(len(r), 1) for r in samples.responses]
    return TrainBatch(tokens=[p + r for p, r in zip(samples.prompts, samples.responses)],
                      prompt_lengths=[len(p) for p in samples.prompts],
                      response_lengths=[len(r) for r in samples.responses], group_size=samples.group,
                      rewards=rewards, rollout_logprobs=samples.logprobs, temperature=1.0,
                      sample_ids=[(i // samples.group, i % samples.group) for i in range(len(samples.prompts))])


class Trainers:
    """TrainActor (the trainer as a run drives it) in this process: rank 0 of a one-rank process group,
    NCCL for CUDA tensors beside gloo on a GPU."""

    def __init__(self, model: Path, device: str, out: Path):
        self.model, self.device, self.out = model, device, out
        self.mesh = None

    def config(self, compute_dtype: str | None, batch: int) -> dict:
        return {"model": {"path": str(self.model), "dtype": "float32", "gradient_checkpointing": False},
                "cluster": {"gpus_per_bundle": 1 if self.device == "cuda" else 0, "num_engines": 1,
                            "weight_sync": "distributed"},
                "train": {"compute_dtype": compute_dtype, "lr": 1e-3, "micro_batch_size": min(batch, 32),
                          "global_batch_size": batch, "grad_clip": 1.0},
                "rollout": {"max_response_len": 4096},
                "output_dir": str(self.out / "trainer"), "seed": 0}

    def make(self, compute_dtype: str | None, batch: int, load_dir: str | None = None):
        from tether.trainer.actor import TrainActor, free_port

        actor = TrainActor(self.config(compute_dtype, batch), 0, 1)
        if self.mesh is None:
            actor.setup_distributed("127.0.0.1", free_port())
            self.mesh = actor.mesh
        actor.mesh = self.mesh
        actor.init(total_steps=100, with_ref=False, load_dir=load_dir)
        return actor


def diffs(engine: list[list[float]], trainer: list[list[float]]) -> tuple[float, float]:
    flat = [abs(a - b) for e, t in zip(engine, trainer) for a, b in zip(e, t)]
    return sum(flat) / len(flat), max(flat)


def weights_digest(actor) -> str:
    from tether.models.lora import merged_tensors

    h = hashlib.sha256()
    for name, tensor in merged_tensors(actor.model):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


# ------------------------------------------------------------ the checks
class Check:
    def __init__(self, device: str, out: Path):
        from tether.models.hf import load_tokenizer

        self.device, self.out = device, out
        self.work = dict(WORKLOAD[device])
        self.model, self.params = build_model(out / "model", device)
        self.tokenizer = load_tokenizer(str(self.model))
        self.trainers = Trainers(self.model, device, out)
        self.engines: dict[str, EngineServer] = {}
        self.batch = None
        self.trainer = None

    def engine(self, dtype: str) -> EngineServer:
        if dtype not in self.engines:
            self.engines[dtype] = EngineServer(self.model, dtype, self.device, self.out / f"engine_{dtype}.log")
        return self.engines[dtype]

    def close(self) -> None:
        for server in self.engines.values():
            server.stop()

    def logprobs(self, dtype: str, compute_dtype: str | None, mean_limit: float, max_limit: float) -> str:
        start = time.perf_counter()
        server = self.engine(dtype)
        started = time.perf_counter() - start
        samples = sample(server, prompts_of(self.tokenizer, 8), 2, 32)
        batch = train_batch(samples)
        trainer = self.trainers.make(compute_dtype, len(batch))
        mean, worst = diffs(samples.logprobs, trainer.score(batch))
        figures = (f"engine ({dtype}) vs trainer ({compute_dtype or 'float32'} compute): mean abs diff {mean:.2e}, "
                   f"max {worst:.2e} over {sum(map(len, samples.responses))} tokens; server up in {started:.1f} s")
        if mean > mean_limit or worst > max_limit:
            raise AssertionError(f"{figures} (limits: mean {mean_limit:g}, max {max_limit:g})")
        return figures

    def throughput(self) -> str:
        from transformers import AutoModelForCausalLM

        w = self.work
        prompts = prompts_of(self.tokenizer, w["prompts"])
        server = self.engine("bfloat16")
        sample(server, prompts[:2], 1, 4)  # warm-up
        start = time.perf_counter()
        samples = sample(server, prompts, w["samples"], w["new_tokens"])
        engine_s = time.perf_counter() - start
        tokens = sum(map(len, samples.responses))
        self.batch = train_batch(samples)  # the GRPO step trains on these
        hf = AutoModelForCausalLM.from_pretrained(self.model, dtype=torch.bfloat16).to(self.device).eval()
        width = max(map(len, prompts))
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        ids = ids.repeat_interleave(w["samples"], 0)
        mask = (ids != pad).long()
        with torch.no_grad():
            hf.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, do_sample=True, pad_token_id=pad)  # warm-up
            self.sync()
            start = time.perf_counter()
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=w["new_tokens"], min_new_tokens=w["new_tokens"],
                              do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad)
            self.sync()
        hf_s = time.perf_counter() - start
        hf_tokens = (out.shape[1] - ids.shape[1]) * out.shape[0]
        del hf
        return (f"{w['prompts']} prompts x {w['samples']} samples x {w['new_tokens']} tokens, bfloat16: engine "
                f"{tokens / engine_s:,.0f} tok/s ({engine_s:.2f} s, over HTTP) vs HF generate "
                f"{hf_tokens / hf_s:,.0f} tok/s ({hf_s:.2f} s): {hf_s / engine_s:.1f}x")

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def train(self) -> str:
        if self.batch is None:
            raise RuntimeError("no samples: the throughput check did not run")
        self.trainer = self.trainers.make("bfloat16", len(self.batch))
        start = time.perf_counter()
        metrics = self.trainer.train(0, self.batch)
        self.sync()
        seconds = time.perf_counter() - start
        bad = {k: v for k, v in metrics.items() if isinstance(v, float) and v != v}
        if bad:
            raise AssertionError(f"non-finite metrics: {sorted(bad)}")
        if not metrics.get("train/grad_norm", 0.0) > 0:
            raise AssertionError(f"no gradient: {metrics}")
        tokens = sum(self.batch.response_lengths)
        keys = ("train/pg_loss", "train/grad_norm", "train/entropy")
        shown = ", ".join(f"{k.split('/')[1]} {metrics[k]:.4g}" for k in keys if k in metrics)
        memory = f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if self.device == "cuda" else ""
        return f"{len(self.batch)} samples, {tokens} response tokens in {seconds:.2f} s; {shown}{memory}"

    def push(self) -> str:
        from tether.weight_sync.distributed import DistributedSender

        if self.trainer is None:
            raise RuntimeError("no trained model: the train check did not run")
        server = self.engine("float32")  # model.dtype: bfloat16 compute keeps float32 master weights, as pushed
        probe = prompts_of(self.tokenizer, 4)
        before = sample(server, probe, 1, 16, seed=7)
        version = server.version() + 1
        sender = DistributedSender([server.url], "127.0.0.1", backend="gloo", device="cpu", timeout_s=300)
        self.trainer.sender, self.trainer.engine_urls = sender, [server.url]
        try:
            stats = self.trainer.push_weights(version)
        finally:
            sender.close()
            self.trainer.sender = None
        after = sample(server, probe, 1, 16, seed=7)
        if server.version() != version:
            raise AssertionError(f"the engine reports version {server.version()}, not {version}")
        same_tokens = before.responses == after.responses
        moved = max(abs(a - b) for x, y in zip(before.logprobs, after.logprobs) for a, b in zip(x, y))
        if same_tokens and moved < 1e-3:
            raise AssertionError("the engine's replies did not change after the push")
        mean, worst = diffs(after.logprobs, self.trainer.score(train_batch(after)))
        if mean > 0.05:
            raise AssertionError(f"after the push the engine's log-probs are {mean:.3f} (mean) from the trainer's")
        return (f"{stats['weight_sync/megabytes']:.0f} MB in {stats['weight_sync/seconds']:.2f} s; replies "
                f"{'changed' if not same_tokens else 'kept their tokens, log-probs moved'}; engine vs trainer after: "
                f"mean abs diff {mean:.2e}, max {worst:.2e}")

    def resume(self) -> str:
        from tether.run.checkpoint import commit, staging_dir

        if self.trainer is None or self.batch is None:
            raise RuntimeError("no trained model: the train check did not run")
        root = self.out / "checkpoints"
        staged = staging_dir(root, 1)
        start = time.perf_counter()
        self.trainer.save(str(staged))
        saved = commit(root, 1, self.trainer.cfg.model_dump(mode="json"), {"train_world_size": 1})
        save_s = time.perf_counter() - start
        self.trainer.train(1, self.batch)
        straight, draw = weights_digest(self.trainer), self.draw()
        again = self.trainers.make("bfloat16", len(self.batch), load_dir=str(saved))
        again.train(1, self.batch)
        resumed, redraw = weights_digest(again), self.draw()
        if resumed != straight:
            raise AssertionError(f"the resumed step's weights differ: {resumed} vs {straight}")
        if redraw != draw:
            raise AssertionError("the generator's draw after the resumed step differs: its state was not restored")
        where = "CUDA" if self.device == "cuda" else "CPU"
        return f"saved in {save_s:.2f} s; step 2 straight on == after loading (sha256 {straight}); {where} generator draw equal"

    def draw(self) -> list[float]:
        return torch.rand(4, device=self.device).tolist()


def pytest_gpu(out: Path) -> tuple[str, str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rs", "-p", "no:cacheprovider",
                           "--junitxml", str(out / "pytest_gpu.xml")], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    (out / "pytest_gpu.log").write_text(proc.stdout + proc.stderr)
    summary = (proc.stdout.strip().splitlines() or ["no output"])[-1].strip("= ")
    if proc.returncode not in (0, 5):
        raise AssertionError(f"pytest tests/gpu: {summary}")
    status = "passed" if " passed" in summary else "skipped"
    return status, f"pytest tests/gpu: {summary}"


def environment(device: str) -> str:
    import transformers

    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "none (--cpu)"
    return (f"Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
            f"GPU {gpu}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the folder the table, the JSON and the logs go to")
    parser.add_argument("--cpu", action="store_true", help="run the checks on CPU at a small size")
    args = parser.parse_args()
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --cpu for the CPU mode)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out)
    started = time.perf_counter()
    report.run("environment", lambda: environment(device))
    check: Check | None = None

    def build() -> str:
        nonlocal check
        check = Check(device, args.out)
        shape = SHAPES[device]
        return (f"random Qwen2, {shape['hidden_size']} hidden x {shape['num_hidden_layers']} layers, vocabulary "
                f"{VOCAB:,}: {check.params / 1e6:.0f}M parameters")

    report.run("model", build)
    if check is not None:
        c = check
        try:
            report.run("engine + logprobs, float32", lambda: c.logprobs("float32", None, 1e-3, 2e-2))
            report.run("engine + logprobs, bfloat16", lambda: c.logprobs("bfloat16", "bfloat16", 0.05, 1.0))
            report.run("throughput (GRPO shape)", c.throughput)
            report.run("train: GRPO step, FSDP2, bf16 mixed precision", c.train)
            report.run("push into the engine", c.push)
            report.run("checkpoint + exact resume", c.resume)
        finally:
            c.close()
    report.run("pytest tests/gpu", lambda: pytest_gpu(args.out))
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    table = report.write(f"tether GPU check ({'CPU mode' if args.cpu else 'GPU'}), {when}, "
                         f"{time.perf_counter() - started:.0f} s")
    print("\n" + table)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
