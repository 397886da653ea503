"""Log-probs from the LM head in chunks of tokens at response positions only (trainer/head.py): the same
values and gradients as the model's whole logits, for Llama/Qwen-style heads and Gemma's soft-capped one."""

from __future__ import annotations

import pytest
import torch

from tether.algorithms.logprobs import entropy_from_logits, head_logprobs, token_logprobs
from tether.trainer.batch import TrainBatch, collate, collate_packed
from tether.trainer.head import chunk_tokens, chunked_forward, chunked_head_agrees, plain_forward


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("softcap, scale", [(None, 1.0), (5.0, 1.0), (None, 0.25)])
def test_head_logprobs_equal_whole_logits_values_and_gradients(chunk, softcap, scale):
    torch.manual_seed(0)
    hidden = torch.randn(11, 16, requires_grad=True)
    weight = torch.randn(300, 16, requires_grad=True)
    bias = torch.randn(300, requires_grad=True)
    targets = torch.randint(0, 300, (11,))
    lp, ent = head_logprobs(hidden, weight, targets, 0.7, bias=bias, chunk_tokens=chunk, entropy="grad",
                            softcap=softcap, scale=scale)
    (lp.sum() + 0.3 * ent.sum()).backward()
    got = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    logits = torch.nn.functional.linear(hidden, weight, bias) * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    want_lp, want_ent = token_logprobs(logits, targets, 0.7), entropy_from_logits(logits, 0.7)
    (want_lp.sum() + 0.3 * want_ent.sum()).backward()
    assert torch.allclose(lp, want_lp, atol=1e-6) and torch.allclose(ent, want_ent, atol=1e-5)
    for g, t in zip(got, (hidden, weight, bias)):
        assert torch.allclose(g, t.grad, atol=1e-5, rtol=1e-4)


def test_metric_entropy_has_no_graph_and_no_grad_mode_keeps_no_graph():
    hidden, weight = torch.randn(5, 8, requires_grad=True), torch.randn(40, 8, requires_grad=True)
    lp, ent = head_logprobs(hidden, weight, torch.zeros(5, dtype=torch.long), entropy="metric", chunk_tokens=2)
    assert lp.requires_grad and not ent.requires_grad
    with torch.no_grad():
        lp, ent = head_logprobs(hidden, weight, torch.zeros(5, dtype=torch.long), chunk_tokens=2)
    assert not lp.requires_grad and ent is None


def _batch() -> TrainBatch:
    rows = [([5, 6, 7, 8], [9, 10, 11]), ([12, 13], [14, 15, 16, 17, 18]), ([19, 20, 21], [22])]
    return TrainBatch(tokens=[p + r for p, r in rows], prompt_lengths=[len(p) for p, _ in rows],
                      response_lengths=[len(r) for _, r in rows], loss_masks=[[1, 0, 1], [1] * 5, [1]])


@pytest.mark.parametrize("packed", [False, True])
def test_chunked_forward_equals_the_models_logits(small_model, packed):
    batch = _batch()
    mb = collate_packed(batch, [0, 1, 2], 0) if packed else collate(batch, [0, 1, 2], 0)
    assert int(mb.scored.sum()) == sum(batch.response_lengths)  # loss-masked tokens are scored too
    assert bool((mb.scored >= (mb.response_mask > 0)).all())

    def run(fn, *args):
        small_model.zero_grad()
        lp, ent = fn(small_model, mb, 0.8, "grad", *args)
        ((lp * mb.response_mask).sum() + 0.1 * (ent * mb.response_mask).sum()).backward()
        grads = {n: p.grad.clone() for n, p in small_model.named_parameters()}
        return lp.detach(), ent.detach(), grads

    lp, ent, grads = run(chunked_forward, 2)
    want_lp, want_ent, want_grads = run(plain_forward)
    assert torch.allclose(lp[mb.scored], want_lp[mb.scored], atol=1e-6)
    assert torch.allclose(ent[mb.scored], want_ent[mb.scored], atol=1e-5)
    assert bool((lp[~mb.scored] == 0).all())  # prompt positions: not computed
    for name, g in grads.items():
        assert torch.allclose(g, want_grads[name], atol=1e-6, rtol=1e-4), name


def _tiny(family: str):
    import transformers

    common = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, head_dim=8)
    if family == "gemma2":
        config = transformers.Gemma2Config(**common, final_logit_softcapping=3.0, attn_logit_softcapping=50.0)
        return transformers.Gemma2ForCausalLM(config)
    config = transformers.GraniteConfig(**{k: v for k, v in common.items() if k != "head_dim"}, logits_scaling=4.0)
    return transformers.GraniteForCausalLM(config)


@pytest.mark.parametrize("family", ["gemma2", "granite"])
def test_post_head_transforms_are_applied_in_the_chunks(family):
    torch.manual_seed(0)
    model = _tiny(family).float().eval()
    assert chunked_head_agrees(model)
    mb = collate(_batch(), [0, 1, 2], 0)
    with torch.no_grad():
        lp, _ = chunked_forward(model, mb, 1.0, "none", 3)
        want, _ = plain_forward(model, mb, 1.0, "none")
    assert torch.allclose(lp[mb.scored], want[mb.scored], atol=1e-5)
    if family == "gemma2":
        assert model.config.final_logit_softcapping == 3.0  # restored after the forward


def test_an_unknown_transform_falls_back_to_whole_logits(small_model):
    class Doubled(type(small_model)):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    model = Doubled(small_model.config)
    with pytest.warns(UserWarning, match="disagrees"):
        assert not chunked_head_agrees(model)
    from tether.trainer.step import forward_logprobs

    mb = collate(_batch(), [0, 1, 2], 0)
    with torch.no_grad():
        lp, _ = forward_logprobs(model, mb, 1.0, chunk_mb=1.0)
        want, _ = plain_forward(model, mb, 1.0, "none")
    assert torch.equal(lp, want)


def test_chunk_size_follows_the_vocabulary(small_model):
    vocab = small_model.get_output_embeddings().weight.shape[0]
    assert chunk_tokens(small_model, 1.0) == 2**20 // (4 * vocab)
    assert chunk_tokens(small_model, 1e-9) == 1


def test_a_rank_with_no_samples_still_runs_forward_and_backward(small_model):
    # collate_packed([]) is the no-op micro-batch of a rank with fewer samples than micro-batches: it must
    # still run the forward and backward (FSDP's collectives) and give a zero loss
    mb = collate_packed(_batch(), [], 0)
    small_model.zero_grad()
    lp, ent = chunked_forward(small_model, mb, 1.0, "grad", 4)
    assert lp.shape == mb.targets.shape and bool((lp == 0).all())
    ((lp * mb.response_mask).sum() + (ent * mb.response_mask).sum()).backward()
    assert all(p.grad is None or bool((p.grad == 0).all()) for p in small_model.parameters())
