"""Generation for rollout and eval over the engines' HTTP API, through the router.

Samples of one prompt stay together (the engine prefills their shared prompt once); the batch is
cut into one /generate request per engine, sent concurrently, each sample with its own sampling
seed. A sample's tokens therefore depend on its seed, not on which engine or batch served it.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tether.engine.sampling import SamplingParams
from tether.router import Router
from tether.sample import STATUS_OF_FINISH, Sample


def split_groups(num_samples: int, group_size: int, parts: int) -> list[range]:
    """Contiguous sample ranges, whole groups each, as even as possible (some may be empty)."""
    groups = num_samples // group_size
    bounds = [round(k * groups / parts) * group_size for k in range(parts + 1)]
    return [range(bounds[k], bounds[k + 1]) for k in range(parts)]


def sampling_payload(params: SamplingParams, seed: int) -> dict:
    return {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
            "min_p": params.min_p, "max_new_tokens": params.max_new_tokens,
            "stop_token_ids": list(params.stop_token_ids), "stop": list(params.stop),
            "ignore_eos": params.ignore_eos, "sampling_seed": seed}


class GenerationError(RuntimeError):
    pass


def _url(err: httpx.TransportError) -> str:
    try:
        return str(err.request.url)
    except RuntimeError:  # httpx raises when the error carries no request
        return "an engine"


class EngineFleet:
    def __init__(self, urls: list[str], timeout_s: float):
        if not urls:
            raise ValueError("EngineFleet needs at least one engine URL")
        self.router = Router(urls, timeout_s=timeout_s)
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(urls)), thread_name_prefix="fleet")

    def generate(self, samples: list[Sample], params: SamplingParams, group_size: int, seed: int,
                 what: str) -> dict[str, float]:
        """Fill response_ids / logprobs / text / finish_reason of every sample, in place."""
        start = time.perf_counter()
        parts = [p for p in split_groups(len(samples), group_size, len(self.router.workers)) if p]
        payloads = [{"input_ids": [samples[i].prompt_ids for i in part],
                     "sampling_params": [sampling_payload(params, seed * 1_000_003 + i) for i in part],
                     "return_logprob": True} for part in parts]
        futures = [self._pool.submit(self.router.generate, payload) for payload in payloads]
        for part, future in zip(parts, futures):
            try:
                outputs = future.result(timeout=self.timeout_s)
            except httpx.HTTPStatusError as err:
                raise GenerationError(f"{what}: engine answered {err.response.status_code}: {err.response.text}") from None
            except (httpx.TimeoutException, TimeoutError) as err:
                raise GenerationError(f"{what}: no answer from an engine within {self.timeout_s:.0f}s ({err!r})") from None
            except httpx.TransportError as err:
                raise GenerationError(f"{what}: lost the connection to {_url(err)} after {time.perf_counter() - start:.1f}s "
                                      f"({err!r})") from None
            for i, out in zip(part, outputs):
                s = samples[i]
                s.response_ids = out["output_ids"]
                s.response_logprobs = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
                s.finish_reason = out["meta_info"]["finish_reason"]["type"]
                s.status = STATUS_OF_FINISH.get(s.finish_reason, "failed")
                s.weight_versions = [int(out["meta_info"]["weight_version"])]
                s.response_text = out["text"]
        return {"timing/generate_s": time.perf_counter() - start}

    def release_memory(self, tags: list[str]) -> None:
        self.router.broadcast("/release_memory_occupation", {"tags": tags})

    def resume_memory(self, tags: list[str]) -> None:
        self.router.broadcast("/resume_memory_occupation", {"tags": tags})

    def health(self) -> dict[str, bool]:
        return self.router.check_health()
