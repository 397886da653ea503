"""Peak memory and time of one training forward + backward at a real vocabulary, whole logits against the
chunked LM head (train.logits_chunk_mb): 8 samples of 512 tokens (64 prompt + 448 response), one process
per measurement (run it once per value), peak RSS from getrusage.

    python bench/head_memory.py MODEL_DIR 0      # whole [8, 512, V] logits
    python bench/head_memory.py MODEL_DIR 256    # chunks of about 256 MB of float32 logits
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tether.trainer.batch import TrainBatch, collate  # noqa: E402
from tether.models.hf import load_model  # noqa: E402
from tether.trainer.step import forward_logprobs  # noqa: E402


def main(model_dir: str, chunk_mb: float) -> None:
    model = load_model(model_dir, "float32")
    torch.manual_seed(0)
    vocab = model.config.vocab_size
    batch = TrainBatch(tokens=[torch.randint(3, min(vocab, 49152), (512,)).tolist() for _ in range(8)],
                       prompt_lengths=[64] * 8, response_lengths=[448] * 8)
    mb = collate(batch, list(range(8)), 0)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    logprobs, _ = forward_logprobs(model, mb, 1.0, "metric", chunk_mb)
    (logprobs * mb.response_mask).sum().backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"chunk_mb={chunk_mb:g}: forward+backward {seconds:.1f} s, peak RSS {peak / 2**20:.2f} GiB "
          f"(+{(peak - base) / 2**20:.2f} over the loaded model)")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], float(sys.argv[2]))
