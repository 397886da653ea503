"""A group's prompt computed once (trainer/shared_prefix.py) on a GPU, with the attention the trainer
would use there: SDPA (a boolean mask) and flex attention (a BlockMask that skips masked blocks).
Log-probs and one step's update equal the unshared layout's, in float32 on CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_shared_prompts import assert_same_logprobs, assert_same_step, grouped_batch, tiny

pytestmark = [pytest.mark.gpu]


@pytest.mark.parametrize("attention", ["sdpa", "flex_attention"])
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_shared_prompts_on_cuda(family, attention):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 as on CPU: the comparison is to rounding
    torch.backends.cudnn.allow_tf32 = False
    model = tiny(family, attention).cuda()
    batch = grouped_batch(prompts=(17, 9, 33), responses=(21, 0, 40, 6))
    assert_same_logprobs(model, batch, atol=2e-5, device="cuda")
    assert_same_step(model, batch, device="cuda")
