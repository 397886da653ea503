"""The trainer's step on one rank: where its time goes, with and without the separate old-log-prob pass.

    python bench/train_step.py                   # the recipes' shape: 32 prompts x 8 samples, 8 + 14 tokens
    python bench/train_step.py --hidden 256 --layers 4

One rollout's batch, one optimizer step (global_batch_size = the batch), float32, torch threads = the
cores. Prints the median milliseconds (of 6, after 2 warm-ups) of: the step as it runs now (old
log-probs taken from the training forward), a separate no-grad old-log-prob pass (what the step cost
on top before), and their ratio; then the same step with the model wrapped by FSDP2 on a one-rank
gloo group, as a single train actor runs it, against the plain model (the cost of the wrapping).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tether.algorithms.losses import LossParams
from tether.trainer.batch import TrainBatch
from tether.models.tiny import build_char_tokenizer, build_tiny_model
from tether.models.hf import load_model
from tether.trainer.model import apply_fsdp
from tether.trainer.step import StepSettings, response_logprobs, train_on_batch


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1000


def timed_step(model: torch.nn.Module, batch: TrainBatch, s: StepSettings, repeats: int) -> float:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return timed(lambda: train_on_batch(model, optimizer, scheduler, batch, s, 0, 1), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--response-len", type=int, default=14)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    model_dir = build_tiny_model(tempfile.mkdtemp(), build_char_tokenizer(), hidden_size=args.hidden,
                                 num_layers=args.layers, num_heads=4, num_kv_heads=2, intermediate_size=3 * args.hidden,
                                 max_positions=args.prompt_len + args.response_len + 8)
    g = torch.Generator().manual_seed(0)
    n, p, r = args.samples, args.prompt_len, args.response_len
    batch = TrainBatch(tokens=[torch.randint(3, 60, (p + r,), generator=g).tolist() for _ in range(n)],
                       prompt_lengths=[p] * n, response_lengths=[r] * n, group_size=8,
                       rewards=torch.rand(n, generator=g).tolist(),
                       rollout_logprobs=[(-torch.rand(r, generator=g)).tolist() for _ in range(n)], temperature=1.0)
    s = StepSettings(micro_batch_size=n, global_batch_size=n, pad_id=0, grad_clip=1.0, policy_loss="ppo_clip",
                     loss_params=LossParams(), advantage_estimator="grpo", max_response_len=r)
    model = load_model(str(model_dir), "float32")
    step = timed_step(model, batch, s, args.repeats)
    old = timed(lambda: response_logprobs(model, batch, [list(range(n))], s), args.repeats)
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/rendezvous", rank=0, world_size=1)
    sharded = apply_fsdp(load_model(str(model_dir), "float32"), init_device_mesh("cpu", (1,)))
    fsdp_step = timed_step(sharded, batch, s, args.repeats)
    dist.destroy_process_group()
    params = sum(t.numel() for t in model.parameters())
    print(f"{n} samples x {p}+{r} tokens, {params / 1e6:.2f}M parameters, {torch.get_num_threads()} threads")
    print(f"{'step (old log-probs from the training forward)':<50} {step:>8.0f} ms")
    print(f"{'separate old-log-prob pass (skipped now)':<50} {old:>8.0f} ms")
    print(f"{'step with the separate pass':<50} {step + old:>8.0f} ms")
    print(f"{'saved':<50} {old / (step + old) * 100:>7.0f} %")
    print(f"{'step with FSDP2 on one rank':<50} {fsdp_step:>8.0f} ms ({fsdp_step / step:.2f}x the plain model)")


if __name__ == "__main__":
    main()
