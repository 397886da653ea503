"""A group's prompt computed once (train.share_prompts) against the trainer without it and against a bare
Hugging Face forward + backward of the same samples, on a real model's GRPO batch, timed side by side.

    python bench/shared_prompt.py ROLLOUT [--model DIR] [--rounds 3] [--dtype float32|bfloat16]

ROLLOUT is a saved rollout of a run (``runs/<run>/rollouts/rollout_<id>.jsonl``, from ``tether rollout`` or
``debug.save_rollouts``): its samples, with their real prompt and response lengths, grouped as generated.
MODEL defaults to SmolLM2-135M-Instruct as tether imports it. One process, one-rank FSDP2 over gloo as
the train actor runs it, micro-batches of 16 samples (the reasoning-gym recipe's), rounds interleaved
so that the machine's drift hits every way alike:

- bare HF: ``model(input_ids, attention_mask).logits`` for each micro-batch of 16 right-padded samples,
  log-probs of the response tokens, their sum backward (no FSDP, no chunked head, no loss);
- tether, unshared: ``train_on_batch``'s forward + backward phase (train.share_prompts=false);
- tether, shared: the same with train.share_prompts=true.

Prints each way's seconds per round and tokens computed, and the ratios against bare HF.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tether.algorithms.losses import LossParams  # noqa: E402
from tether.models.hf import DTYPES, load_model  # noqa: E402
from tether.rollout.results import to_train_batch  # noqa: E402
from tether.sample import sample_from_dict  # noqa: E402
from tether.trainer.batch import TrainBatch, collate, split_micro_batches  # noqa: E402
from tether.trainer.model import apply_fsdp  # noqa: E402
from tether.trainer.shared_prefix import unit_token_limit  # noqa: E402
from tether.trainer.step import StepSettings, micro_batches, train_on_batch  # noqa: E402

MICRO = 16


def read_batch(path: str, group_size: int) -> TrainBatch:
    samples = [sample_from_dict(json.loads(line)) for line in Path(path).read_text().splitlines() if line.strip()]
    return to_train_batch(samples, group_size, 0.8)  # the recipe's temperature (the time does not depend on it)


def settings(batch: TrainBatch, **kw) -> StepSettings:
    return StepSettings(**{"micro_batch_size": MICRO, "global_batch_size": len(batch), "pad_id": 0, "grad_clip": 1.0,
                           "policy_loss": "ppo_clip", "loss_params": LossParams(), "advantage_estimator": "grpo",
                           "max_response_len": max(batch.response_lengths), **kw})


def bare(model, batch: TrainBatch) -> float:
    start = time.perf_counter()
    for chunk in split_micro_batches(list(range(len(batch))), MICRO):
        mb = collate(batch, chunk, 0)
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1].float()
        logprobs = logits.log_softmax(-1).gather(-1, mb.targets[..., None])[..., 0]
        (logprobs * mb.response_mask).sum().backward()
    return time.perf_counter() - start


def trainer(model, optimizer, batch: TrainBatch, s: StepSettings) -> float:
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    metrics = train_on_batch(model, optimizer, scheduler, batch, s, 0, 1)
    return metrics["timing/train_forward_backward_s"]


def computed_tokens(batch: TrainBatch, s: StepSettings) -> int:
    return sum(mb.input_ids.numel() for mb in micro_batches(batch, list(range(len(batch))), s))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rollout")
    parser.add_argument("--model")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="compute dtype of the trainer's passes (FSDP2 mixed precision) and of bare HF")
    args = parser.parse_args()
    if args.model is None:
        from tether.models.gguf import cached_import, smollm2_gguf

        args.model = str(cached_import(smollm2_gguf(), "SmolLM2-135M-Instruct"))
    torch.set_num_threads(2)
    batch = read_batch(args.rollout, args.group_size)
    print(f"{args.rollout}: {len(batch)} samples, prompts {min(batch.prompt_lengths)}-{max(batch.prompt_lengths)} "
          f"tokens, responses {min(batch.response_lengths)}-{max(batch.response_lengths)} "
          f"(mean {statistics.fmean(batch.response_lengths):.1f}), {sum(map(len, batch.tokens))} tokens", flush=True)
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/rendezvous", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    dtype = DTYPES[args.dtype]
    hf = load_model(args.model, args.dtype)
    hf.train()
    ours = apply_fsdp(load_model(args.model, "float32"), mesh, None if dtype == torch.float32 else dtype)
    if dtype == torch.bfloat16:
        ours.set_attn_implementation("eager")  # as the trainer runs bfloat16 on CPU (trainer/model.py)
    ours.train()
    optimizer = torch.optim.AdamW(ours.parameters(), lr=0.0)  # lr 0: every round trains the same weights
    ways = {"tether, unshared": settings(batch), "tether, shared": settings(
        batch, share_prompts=True, max_unit_tokens=unit_token_limit(ours))}
    tokens = {"bare HF": sum(collate(batch, c, 0).input_ids.numel()
                             for c in split_micro_batches(list(range(len(batch))), MICRO))}
    tokens.update({name: computed_tokens(batch, s) for name, s in ways.items()})
    seconds: dict[str, list[float]] = {name: [] for name in tokens}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        hf.zero_grad(set_to_none=True)
        times = {"bare HF": bare(hf, batch)}
        for name, s in ways.items():
            times[name] = trainer(ours, optimizer, batch, s)
        print(f"round {round_}: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()), flush=True)
        if round_:
            for k, v in times.items():
                seconds[k].append(v)
    base = statistics.median(seconds["bare HF"])
    print(f"\n{args.dtype}, forward + backward of the whole batch, median of {args.rounds} rounds:")
    print("| way | positions computed | seconds | bare HF / this |\n|---|---|---|---|")
    for name, values in seconds.items():
        median = statistics.median(values)
        print(f"| {name} | {tokens[name]} | {median:.1f} ({min(values):.1f}-{max(values):.1f}) | {base / median:.2f}x |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
