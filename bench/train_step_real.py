"""One GRPO train step (train_on_batch) on a real model, in-process, several ways: without FSDP (LM head in
chunks, and whole), under one-rank FSDP2 in float32 and with bfloat16 compute (eager attention, as the
trainer runs it on CPU, and PyTorch's SDPA); and a bare HF forward + backward of the same micro-batches for
reference. Isolates the trainer's own cost from the actors'.

    python bench/train_step_real.py [MODEL_DIR] [--rollout FILE]
        MODEL_DIR  default: SmolLM2-135M-Instruct as imported by tether
        --rollout  a run's rollouts/rollout_<id>.jsonl: train on its samples (real lengths, padding)

Without --rollout: 64 samples of 50 prompt + 35 response tokens (random ids), groups of 8; micro-batches
of 16 either way (the shape of recipes/reasoning_gym's steps). Prints the seconds of three steps of each
(the first warms up).
"""
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tether.algorithms.losses import LossParams  # noqa: E402
from tether.trainer.batch import TrainBatch  # noqa: E402
from tether.models.hf import load_model  # noqa: E402
from tether.trainer.model import apply_fsdp  # noqa: E402
from tether.trainer.step import StepSettings, train_on_batch  # noqa: E402

torch.set_num_threads(2)
args = sys.argv[1:]
rollout_file = None
if "--rollout" in args:
    k = args.index("--rollout")
    rollout_file, args = args[k + 1], args[:k] + args[k + 2:]
if args:
    M = args[0]
else:
    from tether.models.gguf import cached_import, smollm2_gguf

    M = str(cached_import(smollm2_gguf(), "SmolLM2-135M-Instruct"))
P, R, N = 50, 35, 64
if rollout_file:
    import json

    from tether.rollout.results import to_train_batch
    from tether.sample import sample_from_dict

    saved = [sample_from_dict(json.loads(line)) for line in Path(rollout_file).read_text().splitlines() if line]
    batch = to_train_batch(saved[:N], 8, 0.8)
    print(f"{rollout_file}: {len(batch)} samples of {min(map(len, batch.tokens))}-{max(map(len, batch.tokens))} "
          "tokens", flush=True)
else:
    _g = torch.Generator().manual_seed(0)
    batch = TrainBatch(tokens=[torch.randint(3, 40000, (P + R,), generator=_g).tolist() for _ in range(N)],
                       prompt_lengths=[P] * N, response_lengths=[R] * N, group_size=8,
                       rewards=[float(i % 3 == 0) for i in range(N)], rollout_logprobs=[[-1.0] * R] * N,
                       temperature=0.8)
dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/rendezvous", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))


def settings(**kw) -> StepSettings:
    return StepSettings(**{"micro_batch_size": 16, "global_batch_size": 64, "pad_id": 0, "grad_clip": 1.0,
                           "policy_loss": "ppo_clip", "loss_params": LossParams(), "advantage_estimator": "grpo",
                           "max_response_len": 48, **kw})


def run(name: str, fsdp: bool, dtype: torch.dtype | None = None, attention: str = "sdpa", **kw) -> None:
    model = load_model(M, "float32")
    model.set_attn_implementation(attention)
    if fsdp:
        model = apply_fsdp(model, mesh, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    seconds, metrics = [], {}
    for _ in range(3):
        start = time.perf_counter()
        metrics = train_on_batch(model, opt, sch, batch, settings(**kw), 0, 1)
        seconds.append(time.perf_counter() - start)
    phases = {k: round(v, 2) for k, v in metrics.items() if k.startswith("timing/")}
    print(f"{name}: {[round(x, 1) for x in seconds]} s; last step {phases}", flush=True)


def bare() -> None:
    model = load_model(M, "float32")
    x = torch.randint(0, 40000, (16, P + R))
    for _ in range(2):
        start = time.perf_counter()
        for _ in range(4):  # the four micro-batches, whole logits at the response positions
            model(input_ids=x).logits[:, P:].float().logsumexp(-1).mean().backward()
        print(f"bare HF, 4 x forward + backward: {time.perf_counter() - start:.1f} s", flush=True)


bare()
run("no FSDP, head in chunks", False)
run("no FSDP, whole logits", False, logits_chunk_mb=0)
run("FSDP2 one rank, float32", True)
run("FSDP2 one rank, bfloat16 compute, eager attention (the trainer's choice on CPU)", True, torch.bfloat16, "eager")
run("FSDP2 one rank, bfloat16 compute, SDPA attention", True, torch.bfloat16)
