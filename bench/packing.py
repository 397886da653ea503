"""Training throughput with sequence packing vs right padding, on a batch with mixed lengths.

    python bench/packing.py            # 64 samples of 16..384 tokens, a ~4M-parameter Qwen2
    python bench/packing.py --quick    # 16 samples, for a smoke run

One optimizer step (forward + backward over all micro-batches, the old-log-prob pass included, as
in a rollout) per layout, in one process on the same cores. Prints one table: real (non-padding)
tokens per second, the share of computed positions that were padding, and packing's speed-up.
Compare the ratio, not the absolute numbers, across machines.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tether.algorithms.losses import LossParams  # noqa: E402
from tether.trainer.batch import TrainBatch, collate, collate_packed, split_micro_batches  # noqa: E402
from tether.models.tiny import build_char_tokenizer, build_tiny_model  # noqa: E402
from tether.trainer.micro_batches import balance_by_tokens, count_by_budget  # noqa: E402
from tether.models.hf import load_model  # noqa: E402
from tether.trainer.step import StepSettings, train_on_batch  # noqa: E402


def mixed_batch(num: int, low: int, high: int, vocab: int) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    prompt_lengths = torch.randint(8, 33, (num,), generator=g).tolist()
    response_lengths = [int(x) for x in torch.randint(low, high + 1, (num,), generator=g)]
    tokens = [torch.randint(3, vocab, (p + r,), generator=g).tolist() for p, r in zip(prompt_lengths, response_lengths)]
    return TrainBatch(tokens=tokens, prompt_lengths=prompt_lengths, response_lengths=response_lengths, group_size=8,
                      rewards=torch.rand(num, generator=g).tolist(),
                      rollout_logprobs=[(-torch.rand(r, generator=g)).tolist() for r in response_lengths])


def padding_share(batch: TrainBatch, s: StepSettings) -> float:
    """Padded positions / computed positions of one pass over the batch."""
    indices = list(range(len(batch)))
    if s.max_tokens_per_micro_batch is None:
        mbs = [collate(batch, c, 0) for c in split_micro_batches(indices, s.micro_batch_size)]
    else:
        lengths = [len(t) for t in batch.tokens]
        count = count_by_budget(indices, lengths, s.max_tokens_per_micro_batch)
        mbs = [collate_packed(batch, c, 0) for c in balance_by_tokens(indices, lengths, count)]
    computed = sum(mb.input_ids.numel() for mb in mbs)
    return 1 - sum(len(t) for t in batch.tokens) / computed


def measure(model_dir: Path, batch: TrainBatch, s: StepSettings, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        model = load_model(str(model_dir), "float32")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        start = time.perf_counter()
        train_on_batch(model, optimizer, scheduler, batch, s, 0, 1)
        best = min(best, time.perf_counter() - start)
    return sum(len(t) for t in batch.tokens) / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--min-response", type=int, default=16)
    parser.add_argument("--max-response", type=int, default=384)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.max_response, args.repeats = 16, 128, 1
    tokenizer = build_char_tokenizer()
    batch = mixed_batch(args.samples, args.min_response, args.max_response, len(tokenizer))
    base = dict(global_batch_size=len(batch), pad_id=0, grad_clip=1.0, policy_loss="ppo_clip",
                loss_params=LossParams(), advantage_estimator="grpo", micro_batch_size=args.micro_batch_size)
    layouts = {
        f"padded, {args.micro_batch_size} samples per micro-batch": StepSettings(**base),
        f"packed, {args.token_budget} tokens per micro-batch": StepSettings(
            **base, max_tokens_per_micro_batch=args.token_budget),
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "m", tokenizer, hidden_size=256, num_layers=4, num_heads=4,
                                     num_kv_heads=2, intermediate_size=768, max_positions=512)
        rows = [(name, padding_share(batch, s), measure(model_dir, batch, s, args.repeats))
                for name, s in layouts.items()]
    lengths = [len(t) for t in batch.tokens]
    print(f"\ntraining throughput: one RL step on {len(batch)} samples of {min(lengths)}..{max(lengths)} tokens "
          f"({sum(lengths)} in all), qwen2-4M, float32, torch threads {torch.get_num_threads()}\n")
    print("| layout | padding share | real tokens/s | speed-up |")
    print("|---|---|---|---|")
    for name, pad, speed in rows:
        print(f"| {name} | {pad:.0%} | {speed:.0f} | {speed / rows[0][2]:.2f}x |")


if __name__ == "__main__":
    main()
