"""The scale ladder: one RL step (generate, train, push weights) of the real `tether train` on random
Qwen2-shaped models from ~4M to ~0.5B parameters: the time of each phase and the memory of each process.

    python bench/scale.py --sizes 4m,20m                    # quick: two small rungs, ~1 min on 2 cores
    python bench/scale.py                                   # the ladder in float32, ~4 min
    python bench/scale.py --dtypes float32,bfloat16         # and in bfloat16: the README's table, ~6 min
    python bench/scale.py --sizes 0.5b --set cluster.offload=true   # config overrides, for every run
    python bench/scale.py --sizes 0.5b --vocab 151936       # Qwen2.5's vocabulary size (494M), ~3.5 min
    python bench/scale.py --model-dir ~/.cache/tether/models/SmolLM2-135M-Instruct --sizes none \
        --ab train.logits_chunk_mb=0,256                    # any HF folder; each run once per value of a field
    python bench/scale.py --sizes 0.5b --vocab 151936 --lora 16 # full fine-tuning against LoRA, side by side

The times include building the models; later runs with the same --work reuse them.

Rungs (hidden / layers / heads / KV heads / MLP; head size 64 as in Qwen2.5; tied embeddings):
4m 256/4/4/2/1024, 20m 512/6/8/2/1792, 100m 768/12/12/2/3072, and 0.5b 896/24/14/2/4864, which is
Qwen2.5-0.5B's shape. The vocabulary is the character tokenizer's (tether.models.tiny.build_char_tokenizer,
99 tokens), so the 0.5b rung has 358M parameters: Qwen2.5-0.5B's 494M less its 151936 x 896 = 136M
embedding. --vocab N pads the embedding (and so the LM head) to N rows. The random model also samples
the ids past the tokenizer's, and they decode to nothing.

Each run is `tether train --config recipes/scale/qwen05b.yaml` in a subprocess. model.path,
data.path and output_dir point at what this script builds: models cached under --work, and 256
"a+b=" prompts rewarded by the fraction of digits in the response. rollout.num_rollout is --rollouts,
and --set adds overrides. The recipe's workload: 8 prompts x 4 samples, 4-6 prompt tokens and up to
32 response tokens. It makes one optimizer step of 4 micro-batches of 8, in float32 by default, with no
gradient checkpointing and no offload. The trainer and the embedded engine are colocated, with torch
threads = the cores. While a run goes, a thread reads /proc every 0.5 s for the run's process tree:
the driver, Ray's own processes, and the actors, named by their Ray process titles.

Prints one table with a column per run. The timings come from the last rollout's row of the run's
metrics.jsonl. Every `timing/*` key found there gets a row: generate, reward, train and its phases,
weight sync, the call overheads, save. Then come the step (timing/rollout_s less save and eval; the
loop checkpoints at the last rollout), what the phases leave over, and the first rollout's step,
which pays one-time costs. Memory rows:

- each role's peak resident set (VmHWM), summed over its processes. Shared pages count in every
  process that maps them, for example the object store's weight buckets.
- the largest total proportional set size (PSS) of the whole tree at one moment, and the trainer's
  and the engine's share of it then. PSS splits shared pages between their users, so it is what
  the run costs the machine. It is read every 2 s only: smaps_rollup takes tens of ms on a
  large process, and 0.1 s on the 0.5b trainer.
- the sampling's own CPU time, and the machine's load average at the end.

The machine is shared, so read the load row: another busy process slows every phase.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "scale" / "qwen05b.yaml"

SHAPES = {  # hidden, layers, attention heads, KV heads, MLP intermediate size
    "4m": (256, 4, 4, 2, 1024),
    "20m": (512, 6, 8, 2, 1792),
    "100m": (768, 12, 12, 2, 3072),
    "0.5b": (896, 24, 14, 2, 4864),
}
# Where each timing/<name>_s row goes (its own name, else the first pattern it matches), and which are
# parts of the phase above them (indented). A call overhead is timed around a phase's remote call, outside
# the phase: it goes with the other keys ("*"), which explain the step's "other" seconds.
ORDER = ["generate", "reward", "train", "train_*", "weight_sync", "weight_sync_*", "*", "save", "eval", "rollout"]
PARTS = ("reward", "generate_*", "train_*", "weight_sync_*")  # reward: scored while generating
OUTSIDE = "*call_overhead"
MAIN = ("timing/generate_s", "timing/train_s", "timing/weight_sync_s")
SHORT = {"float32": "fp32", "bfloat16": "bf16"}
RAY_AGENTS = {"DashboardAgent", "RuntimeEnvAgent"}
RANK = {"": -1, "ray system": 0, "ray idle workers": 1}  # a process keeps its most specific role (actors: 2)


# ---------------------------------------------------------------- preparation (recipes/scale/prepare.py too)


def build_model(out: Path, size: str, vocab: int | None = None, seed: int = 0) -> Path:
    """A random Qwen2 of the rung's shape with the character tokenizer, saved as an HF directory
    (float32); reused when one of the same size, vocabulary and seed is already complete there."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tether.models.tiny import build_char_tokenizer

    done = out / "model.done"  # written last: {"size", "vocab", "seed", "params"}
    built = json.loads(done.read_text()) if done.is_file() else None
    if isinstance(built, dict) and {k: built.get(k) for k in ("size", "vocab", "seed")} == {
            "size": size, "vocab": vocab, "seed": seed}:
        return out
    done.unlink(missing_ok=True)  # an interrupted build must not pass for a complete one
    hidden, layers, heads, kv_heads, intermediate = SHAPES[size]
    tokenizer = build_char_tokenizer(chat_template=False)
    config = Qwen2Config(
        vocab_size=vocab or len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate,
        max_position_embeddings=1024, tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    done.write_text(json.dumps({"size": size, "vocab": vocab, "seed": seed, "params": params}) + "\n")
    return out


def count_params(model_dir: Path) -> int:
    if (model_dir / "model.done").is_file():
        return json.loads((model_dir / "model.done").read_text())["params"]
    from safetensors import safe_open

    total = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                total += _prod(f.get_slice(key).get_shape())
    return total


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_prompts(path: Path, num: int = 256, seed: int = 0) -> Path:
    """``num`` prompts "a+b=" (labels the sums): more than the rollouts use, so no epoch ends mid-run
    (an epoch's end is a checkpoint)."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for _ in range(num):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append(json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}))
    path.write_text("\n".join(rows) + "\n")
    return path


# ---------------------------------------------------------------- memory of a process tree


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # the process is gone
        return ""


def _kb(status: str, key: str) -> int:
    for line in status.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def process_tree(root: int) -> list[int]:
    children = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _read(f"/proc/{entry}/stat")
            if stat:
                children[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def role(pid: int, root: int, cmdline: str) -> str:
    """driver, a Ray actor's class name (from its process title "ray::Class.method"), or Ray's own."""
    if pid == root:
        return "driver"
    if cmdline.startswith("ray::"):
        name = cmdline[5:].split()[0].split(".")[0] if cmdline[5:].strip() else "IDLE"
        if name == "IDLE":
            return "ray idle workers"
        return "ray system" if name in RAY_AGENTS else name
    return "ray system"  # gcs_server, raylet, monitors; also a worker before it takes its title


class MemorySampler(threading.Thread):
    """Samples the tree under ``root`` every ``interval`` s: each process's peak RSS (VmHWM) and role;
    every ``pss_every``-th sample also the tree's total PSS (smaps_rollup walks a process's memory map:
    tens of ms for a large trainer, so not every time). ``cpu_s``: what the sampling itself cost."""

    def __init__(self, root: int, interval: float = 0.5, pss_every: int = 4):
        super().__init__(daemon=True)
        self.root, self.interval, self.pss_every = root, interval, pss_every
        self.samples, self.cpu_s = 0, 0.0
        self.peak_kb: dict[int, int] = {}
        self.roles: dict[int, str] = {}
        self.peak_pss_kb = 0
        self.peak_parts_kb: dict[str, int] = {}  # role -> PSS at the moment of the peak
        self._done = threading.Event()

    def run(self) -> None:
        start = time.thread_time()
        while not self._done.is_set():
            self.sample(pss=self.samples % self.pss_every == 0)
            self.samples += 1
            self.cpu_s = time.thread_time() - start
            self._done.wait(self.interval)

    def sample(self, pss: bool = True) -> None:
        total, parts = 0, defaultdict(int)
        for pid in process_tree(self.root):
            status = _read(f"/proc/{pid}/status")
            if not status:
                continue
            self.peak_kb[pid] = max(self.peak_kb.get(pid, 0), _kb(status, "VmHWM"))
            name = role(pid, self.root, _read(f"/proc/{pid}/cmdline").replace("\0", " ").strip())
            if RANK.get(name, 2) >= RANK.get(self.roles.get(pid, ""), 2):  # a worker becomes an actor later
                self.roles[pid] = name
            if pss:
                kb = _kb(_read(f"/proc/{pid}/smaps_rollup"), "Pss")
                total += kb
                parts[self.roles[pid]] += kb
        if total > self.peak_pss_kb:
            self.peak_pss_kb, self.peak_parts_kb = total, dict(parts)

    def stop(self) -> None:
        self._done.set()
        self.join()

    def by_role(self) -> dict[str, tuple[int, int]]:
        """role -> (sum of its processes' peak RSS in kB, number of processes)."""
        out: dict[str, tuple[int, int]] = {}
        for pid, kb in self.peak_kb.items():
            peak, count = out.get(self.roles[pid], (0, 0))
            out[self.roles[pid]] = (peak + kb, count + 1)
        return out


# ---------------------------------------------------------------- one run


def run_one(size: str, dtype: str, model_dir: Path, data: Path, work: Path, args: argparse.Namespace,
            variant: str | None = None) -> dict:
    label = variant and ("lora " + variant.rpartition("=")[2] if variant.startswith("model.lora.rank=")
                         else variant.rpartition(".")[2])
    name = f"{size} {SHORT[dtype]}" + (f" {label}" if label else "")
    slug = name.replace(" ", "-").replace("=", "")
    out = work / "runs" / slug
    log = work / "logs" / f"{slug}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "tether.cli", "train", "--config", str(RECIPE), "--overwrite",
           f"model.path={model_dir}", f"model.dtype={dtype}", f"data.path={data}", f"output_dir={out}",
           f"rollout.num_rollout={args.rollouts}", *args.set, *([variant] if variant else [])]
    print(f"[scale] {name}: {' '.join(cmd[2:])}  (log: {log})", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    sampler = MemorySampler(proc.pid)
    sampler.start()
    try:
        code = proc.wait()
    except BaseException:
        os.killpg(proc.pid, signal.SIGTERM)  # the run's own process group: the driver and Ray under it
        raise
    finally:
        sampler.stop()
    wall = time.perf_counter() - start
    load = os.getloadavg()[0]
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-25:])
        raise SystemExit(f"[scale] {name} failed (exit {code}); the end of {log}:\n{tail}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    by_step = {row["step"]: row for row in rows}
    print(f"[scale] {name}: {wall:.0f} s", file=sys.stderr, flush=True)
    return {"name": name, "params": count_params(model_dir), "wall": wall, "last": by_step[args.rollouts],
            "first": by_step[1], "memory": sampler.by_role(), "pss_kb": sampler.peak_pss_kb,
            "pss_parts_kb": sampler.peak_parts_kb, "sampler_cpu_s": sampler.cpu_s, "load": load}


# ---------------------------------------------------------------- the table


def step_seconds(row: dict) -> float:
    return row["timing/rollout_s"] - row.get("timing/save_s", 0.0) - row.get("timing/eval_s", 0.0)


def timing_rows(results: list[dict]) -> list[tuple[str, str]]:
    """(key, label) of every timing/<name>_s key of the measured rows, in ORDER; parts indented."""
    names = {k[7:-2] for r in results for k in r["last"] if k.startswith("timing/") and k.endswith("_s")}

    def place(n: str) -> int:
        if n in ORDER:
            return ORDER.index(n)
        return ORDER.index("*") if fnmatch(n, OUTSIDE) else next(i for i, p in enumerate(ORDER) if fnmatch(n, p))

    def part(n: str) -> bool:
        return any(fnmatch(n, p) for p in PARTS) and not fnmatch(n, OUTSIDE)

    return [(f"timing/{n}_s", ("  " if part(n) else "") + f"{n} s") for n in sorted(names, key=lambda n: (place(n), n))]


def table(results: list[dict]) -> list[tuple[str, list[str]]]:
    rows: list[tuple[str, list[str]]] = [
        ("parameters", [f"{r['params'] / 1e6:.1f}M" for r in results]),
        ("response tokens (mean of 32)", [f"{r['last'].get('rollout/response_len_mean', 0):.1f}" for r in results]),
    ]
    for key, label in timing_rows(results):
        rows.append((label, [f"{r['last'].get(key, float('nan')):.2f}" for r in results]))
    rows.append(("step s (rollout - save - eval)", [f"{step_seconds(r['last']):.2f}" for r in results]))
    rows.append(("  other s (step - generate - train - sync)",
                 [f"{step_seconds(r['last']) - sum(r['last'].get(k, 0.0) for k in MAIN):.2f}" for r in results]))
    rows.append(("first rollout's step s", [f"{step_seconds(r['first']):.2f}" for r in results]))
    rows.append(("logprob mismatch engine/trainer",
                 [f"{r['last'].get('mismatch/logprob_abs_diff_mean', float('nan')):.1e}" for r in results]))
    roles = sorted({k for r in results for k in r["memory"]},
                   key=lambda k: (["driver", "TrainActor", "EngineActor", "RolloutManager"] + [k]).index(k))
    for name in roles:
        cells = []
        for r in results:
            peak, count = r["memory"].get(name, (0, 0))
            cells.append(f"{peak / 2**20:.2f}" + (f" ({count} proc)" if count > 1 else ""))
        rows.append((f"peak RSS GiB {name}", cells))
    rows.append(("peak PSS GiB, all processes", [f"{r['pss_kb'] / 2**20:.2f}" for r in results]))
    rows.append(("  of which trainer + engine", [f"{r['pss_parts_kb'].get('TrainActor', 0) / 2**20:.2f} + "
                                                 f"{r['pss_parts_kb'].get('EngineActor', 0) / 2**20:.2f}"
                                                 for r in results]))
    rows.append(("wall s (whole run: start-up to exit)", [f"{r['wall']:.0f}" for r in results]))
    rows.append(("  this bench's memory sampling, CPU s", [f"{r['sampler_cpu_s']:.1f}" for r in results]))
    rows.append(("load average at the end (1 min)", [f"{r['load']:.1f}" for r in results]))
    return rows


def print_table(results: list[dict], args: argparse.Namespace) -> None:
    rows = table(results)
    width = max(len(label) for label, _ in rows)
    cols = [max(len(r["name"]), *(len(cells[i]) for _, cells in rows)) for i, r in enumerate(results)]
    print(f"one RL step of `tether train --config recipes/scale/qwen05b.yaml` {' '.join(args.set)}".rstrip()
          + f": rollout {args.rollouts} of {args.rollouts}, {os.cpu_count()} cores")
    print(" " * width + "".join(f"  {r['name']:>{c}}" for r, c in zip(results, cols)))
    for label, cells in rows:
        print(f"{label:<{width}}" + "".join(f"  {cell:>{c}}" for cell, c in zip(cells, cols)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4m,20m,100m,0.5b", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--dtypes", default="float32", help="comma-separated: float32, bfloat16")
    parser.add_argument("--rollouts", type=int, default=2, help="rollouts per run; the last one is reported")
    parser.add_argument("--vocab", type=int, default=None, help="pad the models' vocabulary to this size "
                        "(151936: Qwen2.5's); default: the character tokenizer's 99 tokens")
    parser.add_argument("--set", action="append", default=[], metavar="section.field=value",
                        help="a config override for every run (repeatable)")
    parser.add_argument("--work", default=None, help="models (kept, reused) and runs; default: a fresh temp dir")
    parser.add_argument("--model-dir", action="append", default=[], metavar="DIR",
                        help="also run this HF model folder (repeatable; --sizes none for these alone)")
    parser.add_argument("--ab", metavar="section.field=V1,V2", help="run each model once per value of one field, "
                        "side by side (e.g. train.logits_chunk_mb=0,256: before/after)")
    parser.add_argument("--lora", type=int, metavar="RANK", help="run each model twice, side by side: full "
                        "fine-tuning, and LoRA of this rank on every linear layer (model.lora.rank=RANK)")
    args = parser.parse_args()
    sizes, dtypes = [s for s in args.sizes.split(",") if s != "none"], args.dtypes.split(",")
    variants: list[str | None] = [None]
    if args.ab:
        field, _, values = args.ab.partition("=")
        variants = [f"{field}={v}" for v in values.split(",")]
    if args.lora:
        variants = [None, f"model.lora.rank={args.lora}"]
    for size in sizes:
        if size not in SHAPES:
            parser.error(f"--sizes: {size!r} is not one of {', '.join(SHAPES)}")
    for dtype in dtypes:
        if dtype not in SHORT:
            parser.error(f"--dtypes: {dtype!r} is not one of {', '.join(SHORT)}")
    if args.rollouts < 1:
        parser.error("--rollouts must be at least 1")
    work = Path(args.work or tempfile.mkdtemp(prefix="tether-scale-")).resolve()
    data = write_prompts(work / "data" / "train.jsonl")
    results = []
    models = [(size, lambda size=size: build_model(
        work / "models" / (size if args.vocab is None else f"{size}-v{args.vocab}"), size, args.vocab))
        for size in sizes]
    models += [(Path(d).name, lambda d=d: Path(d).expanduser().resolve()) for d in args.model_dir]
    for size, locate in models:
        model_dir = locate()
        for dtype in dtypes:
            for variant in variants:
                results.append(run_one(size, dtype, model_dir, data, work, args, variant))
    print_table(results, args)


if __name__ == "__main__":
    main()
