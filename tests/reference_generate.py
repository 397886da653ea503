"""A static-batch reference generator and sampler, for the tests: the straightforward computation the
engine's continuous batcher and row sampler (tether/engine/batcher.py, row_sampling.py) are checked
against. Not part of the package: the engine never runs it.

One batch may mix requests with different settings: `sample_next` takes one SamplingParams per row
(or one for all) and one generator per row (or one for all).

- Uniform settings and one generator: `filter_logits`, then one `torch.multinomial` over the batch.
- Mixed settings: temperature scaling per distinct temperature (the same scalar division a row gets
  when sampled alone) and top-k/top-p/min-p with per-row tensors (`filter_logits_rows`), which equals
  `filter_logits` on each row bit for bit.
- A list of generators: each sampling row draws `torch.multinomial` on its own [1, V] row with its own
  generator, the same call a one-row batch makes.

`generate_batch` samples one response per prompt with a KV cache; a finished row keeps decoding a
pad token (a static batch) until every row is finished.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn
from transformers import DynamicCache

from tether.algorithms.logprobs import token_logprobs
from tether.engine.generate import GenerateOutput, Sequence as EngineSequence, cache_kwarg, left_pad
from tether.engine.sampling import SamplingParams

Generators = torch.Generator | None | Sequence[torch.Generator | None]


def make_generators(params_list: Sequence[SamplingParams], default_generator: torch.Generator | None = None,
                    device: torch.device | str | None = None) -> torch.Generator | None | list[torch.Generator | None]:
    """The generator(s) a batch draws from, honouring per-request seeds.

    No request has a seed: ``default_generator`` itself (the whole batch draws from it in one call,
    exactly as before seeds existed). Otherwise one entry per row: a fresh generator on ``device``
    seeded with the row's params.seed (rows with equal seeds get separate generators, so they draw
    the same tokens as each would alone), or ``default_generator`` (shared, possibly None: the global
    RNG) for rows without a seed. ``device`` defaults to the default generator's device, else CPU.
    """
    if all(p.seed is None for p in params_list):
        return default_generator
    if device is None:
        device = default_generator.device if default_generator is not None else "cpu"
    return [default_generator if p.seed is None else torch.Generator(device=device).manual_seed(p.seed)
            for p in params_list]



def filter_logits(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus to -inf (always keeping the most likely token)."""
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p.
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def filter_min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf the logits whose probability is below min_p * the row's largest probability.

    ``min_p`` is ``[B]`` (0 leaves a row as it is). The ratio to the largest probability does not
    change when filtered-out tokens are removed, so applying it after top-k/top-p is the same as
    applying it to the temperature-scaled distribution.
    """
    on = min_p > 0
    if not bool(on.any()):
        return scaled
    probs = torch.softmax(scaled, dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.to(probs.dtype)[:, None]
    return scaled.masked_fill((probs < threshold) & on[:, None], float("-inf"))


def filter_logits_rows(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       min_p: torch.Tensor | None = None) -> torch.Tensor:
    """`filter_logits` (then `filter_min_p`) with per-row settings: scaled [B, V]; top_k, top_p, min_p [B].

    A row with top_k -1 (or >= V), top_p 1 and min_p 0 is left as it is. Each row's result equals
    `filter_logits` on that row alone with its own scalars, bit for bit.
    """
    vocab = scaled.shape[-1]
    top_k = top_k.to(device=scaled.device, dtype=torch.long)
    top_p = top_p.to(device=scaled.device, dtype=scaled.dtype)
    k_on = (top_k > 0) & (top_k < vocab)
    if bool(k_on.any()):
        # The k-th largest value of each row (the smallest value where top-k is off: nothing is below it).
        k = torch.where(k_on, top_k, torch.full_like(top_k, vocab))
        kth = torch.sort(scaled, dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
        scaled = scaled.masked_fill((scaled < kth) & k_on[:, None], float("-inf"))
    p_on = top_p < 1.0
    if bool(p_on.any()):
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Rows with top_p == 1 are masked out explicitly: rounding can push their cumsum to 1 early.
        drop_sorted = ((probs.cumsum(-1) - probs) >= top_p[:, None]) & p_on[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    if min_p is not None:
        scaled = filter_min_p(scaled, min_p.to(scaled.device))
    return scaled


def _per_row(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name}: got {len(value)} entries for a batch of {n} rows")
        return list(value)
    return [value] * n


def _rows_by_value(values: list) -> dict:
    groups: dict = {}
    for row, value in enumerate(values):
        groups.setdefault(value, []).append(row)
    return groups


def sample_next(logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams],
                generators: torch.Generator | None | Sequence[torch.Generator | None] = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B], log-probs [B]).

    params: one SamplingParams for every row, or one per row. generators: one generator (or None,
    the global RNG) that draws the whole batch in one `torch.multinomial` call, or one per row (an
    entry may be None, and rows may share one object) used by that row alone. Greedy rows draw nothing.
    """
    logits = logits.float()
    n = logits.shape[0]
    rows_params = _per_row(params, n, "params")
    per_row_generators = isinstance(generators, (list, tuple))
    if per_row_generators and len(generators) != n:
        raise ValueError(f"generators: got {len(generators)} entries for a batch of {n} rows")
    if n == 0:
        return (torch.empty(0, dtype=torch.long, device=logits.device),
                torch.empty(0, dtype=torch.float32, device=logits.device))

    if len(set(rows_params)) <= 1 and not per_row_generators:
        return _sample_uniform(logits, rows_params[0] if rows_params else SamplingParams(), generators)

    greedy_rows = [i for i, p in enumerate(rows_params) if p.greedy]
    sample_rows = [i for i, p in enumerate(rows_params) if not p.greedy]
    tokens = torch.empty(n, dtype=torch.long, device=logits.device)
    if greedy_rows:
        idx = torch.tensor(greedy_rows, device=logits.device)
        tokens[idx] = logits[idx].argmax(-1)
    if sample_rows:
        idx = torch.tensor(sample_rows, device=logits.device)
        sub_params = [rows_params[i] for i in sample_rows]
        scaled = torch.empty_like(logits[idx])
        # Scale per distinct temperature with the scalar division a row alone gets (same bits).
        for temperature, rows in _rows_by_value([p.temperature for p in sub_params]).items():
            rows_t = torch.tensor(rows, device=logits.device)
            scaled[rows_t] = logits[idx[rows_t]] / temperature
        filters = {(p.top_k, p.top_p, p.min_p) for p in sub_params}
        if len(filters) == 1:
            top_k, top_p, min_p = filters.pop()
            filtered = filter_logits(scaled, top_k, top_p)
            if min_p > 0:
                filtered = filter_min_p(filtered, torch.full((len(sample_rows),), min_p, device=logits.device))
        else:
            filtered = filter_logits_rows(
                scaled,
                torch.tensor([p.top_k for p in sub_params], device=logits.device),
                torch.tensor([p.top_p for p in sub_params], dtype=scaled.dtype, device=logits.device),
                torch.tensor([p.min_p for p in sub_params], dtype=scaled.dtype, device=logits.device))
        probs = torch.softmax(filtered, dim=-1)
        if per_row_generators:
            drawn = torch.cat([torch.multinomial(probs[j : j + 1], 1, generator=generators[row]).squeeze(-1)
                               for j, row in enumerate(sample_rows)])
        else:
            drawn = torch.multinomial(probs, 1, generator=generators).squeeze(-1)
        tokens[idx] = drawn

    logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
    temperatures = [p.temperature if not p.greedy else 1.0 for p in rows_params]
    for temperature, rows in _rows_by_value(temperatures).items():
        idx = torch.tensor(rows, device=logits.device)
        logprobs[idx] = token_logprobs(logits[idx][:, None, :], tokens[idx][:, None], temperature)[:, 0]
    return tokens, logprobs


def _sample_uniform(logits: torch.Tensor, params: SamplingParams,
                    generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row shares params and one generator: the historical path, kept bit for bit."""
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        temperature = 1.0
    else:
        temperature = params.temperature
        filtered = filter_logits(logits / temperature, params.top_k, params.top_p)
        if params.min_p > 0:
            filtered = filter_min_p(filtered, torch.full((logits.shape[0],), params.min_p, device=logits.device))
        probs = torch.softmax(filtered, dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    logprobs = token_logprobs(logits[:, None, :], tokens[:, None], temperature)[:, 0]
    return tokens, logprobs


@torch.no_grad()
def generate_batch(model: nn.Module, prompts: list[list[int]], params: SamplingParams | Sequence[SamplingParams],
                   eos_ids: Iterable[int], pad_id: int, generator: Generators = None, *,
                   should_abort: Callable[[], Iterable[int]] | None = None,
                   decode: Callable[[list[int]], str] | None = None) -> list[GenerateOutput]:
    """Sample one response per prompt (see the module docstring for when a row finishes).

    params: one SamplingParams for all prompts or one per prompt. generator: a generator (or None,
    the global RNG) passed through `make_generators` with the params' seeds, or an explicit list with
    one generator (or None) per prompt, used as given (seeds are then not consulted).
    should_abort: called once per decode step, after that step's tokens are recorded and the
    stop/length checks are done, and only while some row is still running; it returns the row
    indices to abort now. Such a row finishes "abort" and keeps its tokens: a row named at the call
    of step k (0-based) holds k + 1 tokens. Rows already finished are left as they are.
    decode: token ids -> text; required when any params.stop is set; when given, every output's
    `text` is filled.
    """
    n = len(prompts)
    if isinstance(params, SamplingParams):
        rows_params = [params] * n
    else:
        rows_params = list(params)
        if len(rows_params) != n:
            raise ValueError(f"params: got {len(rows_params)} SamplingParams for {n} prompts")
    explicit_generators = isinstance(generator, (list, tuple))
    if explicit_generators and len(generator) != n:
        raise ValueError(f"generator: got {len(generator)} generators for {n} prompts")
    if decode is None and any(p.stop for p in rows_params):
        raise ValueError("params.stop (stop strings) needs a decode function to detokenize the outputs")
    if n == 0:
        return []
    # One object when every row shares params: sample_next then takes the historical path.
    sample_params = rows_params[0] if len(set(rows_params)) == 1 else rows_params

    eos = frozenset(eos_ids)
    seqs = [EngineSequence(row, list(prompt), p, p.seed or 0, frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else eos))
            for row, (prompt, p) in enumerate(zip(prompts, rows_params))]

    ids, mask = left_pad(prompts, pad_id)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    kv = {cache_kwarg(model): DynamicCache()}
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **kv).logits[:, -1]
    generators = list(generator) if explicit_generators else make_generators(rows_params, generator, logits.device)

    next_pos = positions[:, -1] + 1
    for _step in range(max(p.max_new_tokens for p in rows_params)):
        tokens, logprobs = sample_next(logits, sample_params, generators)
        for seq, token, logprob in zip(seqs, tokens.tolist(), logprobs.tolist()):
            if seq.finish_reason is None:
                seq.record(token, logprob, decode)
        if should_abort is not None and any(s.finish_reason is None for s in seqs):
            for row in should_abort():
                if not 0 <= row < n:
                    raise ValueError(f"should_abort returned row {row}, outside a batch of {n} rows")
                if seqs[row].finish_reason is None:
                    seqs[row].finish_reason = "abort"
        if all(s.finish_reason is not None for s in seqs):
            break
        # Finished rows keep decoding a pad token (their outputs are no longer recorded): a static batch.
        done = torch.tensor([s.finish_reason is not None for s in seqs], device=tokens.device)
        step_tokens = tokens.masked_fill(done, pad_id)[:, None]
        mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype)], dim=1)
        logits = model(input_ids=step_tokens, attention_mask=mask, position_ids=next_pos[:, None],
                       use_cache=True, **kv).logits[:, -1]
        next_pos = next_pos + 1
    return [seq.output(decode) for seq in seqs]
