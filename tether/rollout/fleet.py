"""Spreading generation over the engine actors and filling Samples with the results.

Samples of one prompt stay on one engine (they share a prompt, which a prefix cache can reuse);
groups are dealt to engines in contiguous, nearly equal slices.
"""

from __future__ import annotations

import time
from typing import Any

from tether.cluster import wait
from tether.engine.base import GenerateRequest
from tether.engine.sampling import SamplingParams
from tether.rollout.sample import Sample


def split_groups(num_samples: int, group_size: int, parts: int) -> list[range]:
    """Contiguous sample ranges, whole groups each, as even as possible (some may be empty)."""
    groups = num_samples // group_size
    bounds = [round(k * groups / parts) * group_size for k in range(parts + 1)]
    return [range(bounds[k], bounds[k + 1]) for k in range(parts)]


class EngineFleet:
    def __init__(self, engines: list[Any], timeout_s: float):
        if not engines:
            raise ValueError("EngineFleet needs at least one engine")
        self.engines = engines
        self.timeout_s = timeout_s

    def generate(self, samples: list[Sample], params: SamplingParams, group_size: int, seed: int,
                 tokenizer, what: str) -> dict[str, float]:
        """Fill response_ids / logprobs / text / finish_reason of every sample, in place."""
        start = time.perf_counter()
        slices = split_groups(len(samples), group_size, len(self.engines))
        refs, used = [], []
        for k, (engine, part) in enumerate(zip(self.engines, slices)):
            if not part:
                continue
            requests = [GenerateRequest(samples[i].prompt_ids, params) for i in part]
            # A distinct, reproducible stream per engine slice.
            refs.append(engine.generate.remote(requests, seed * 1009 + k))
            used.append(part)
        results = wait(refs, self.timeout_s, f"{len(refs)} engine(s) generating {len(samples)} samples for {what}")
        for part, outputs in zip(used, results):
            for i, out in zip(part, outputs):
                s = samples[i]
                s.response_ids = out.output_ids
                s.response_logprobs = out.output_logprobs
                s.finish_reason = out.finish_reason
                s.response_text = tokenizer.decode(out.output_ids, skip_special_tokens=True)
        return {"timing/generate_s": time.perf_counter() - start}

    def call_all(self, method: str, *args: Any) -> list:
        refs = [getattr(e, method).remote(*args) for e in self.engines]
        return wait(refs, self.timeout_s, f"engines.{method}{args}")
