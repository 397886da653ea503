"""The engines as the rollout sees them: /generate over HTTP through the router, and their memory and health.

One call sends some samples as one /generate request (SGLang's batch form: a list of prompts, one
sampling-parameter dict each, one rid each). Samples of one group travel together, so the engine
prefills their shared prompt once. Every sample carries its own sampling seed: its tokens depend on
that seed, not on the engine or the request that served it.

That is what makes a lost engine cheap: a request whose engine dies or freezes (the router marks it
lost, see EngineWatch) is sent again, unchanged, to another engine, and gives the samples the lost
one would have given. Nothing of the first try was kept (a sample is filled only from a reply).
"""

from __future__ import annotations

import time
from typing import cast

import httpx

from tether.engine.sampling import SamplingParams
from tether.rollout.router import EngineLost, NoHealthyWorker, Router
from tether.sample import Sample


def split_groups(num_samples: int, group_size: int, parts: int) -> list[range]:
    """Contiguous sample ranges, whole groups each, as even as possible (some may be empty)."""
    groups = num_samples // group_size
    bounds = [round(k * groups / parts) * group_size for k in range(parts + 1)]
    return [range(bounds[k], bounds[k + 1]) for k in range(parts)]


def sampling_payload(params: SamplingParams, seed: int, max_new_tokens: int | None = None) -> dict:
    return {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
            "min_p": params.min_p, "max_new_tokens": params.max_new_tokens if max_new_tokens is None else max_new_tokens,
            "stop_token_ids": list(params.stop_token_ids), "stop": list(params.stop),
            "ignore_eos": params.ignore_eos, "sampling_seed": seed}


class GenerationError(RuntimeError):
    pass


def _url(err: httpx.HTTPError) -> str:
    """The engine a failed request went to (its /generate URL)."""
    try:
        return str(err.request.url)
    except RuntimeError:  # httpx raises when the error carries no request
        return "an engine"


def fill_response(sample: Sample, out: dict) -> None:
    """Append one /generate reply to the sample's response (a continued sample already has a part)."""
    meta = out["meta_info"]
    sample.add_reply(list(out["output_ids"]), [lp for lp, _, _ in meta["output_token_logprobs"]], out["text"],
                     meta["finish_reason"]["type"], int(meta["weight_version"]), meta.get("weight_version_spans"))


class EngineFleet:
    def __init__(self, urls: list[str], timeout_s: float, router: str = "builtin", log_dir: str | None = None,
                 reissue: bool = False, fields: dict | None = None):
        """``reissue``: send a request whose engine is lost to another engine (engine fault tolerance)
        instead of failing the rollout. ``fields``: added to every /generate (engine/backends.py's
        request_fields: the adapter an SGLang engine serves the policy as)."""
        self.reissue = reissue
        self.fields = dict(fields or {})
        self.reissued_samples = 0
        if not urls:
            raise ValueError("EngineFleet needs at least one engine URL")
        if router == "sglang_router":
            from tether.rollout.router_sglang import SglangRouterFront

            self.router: Router = SglangRouterFront(urls, timeout_s=timeout_s, log_dir=log_dir)
        else:
            self.router = Router(urls, timeout_s=timeout_s)
        self.timeout_s = timeout_s

    @property
    def num_engines(self) -> int:
        """Engines serving now (at least 1: requests wait for a replacement when every one is lost)."""
        return max(1, len(self.router.serving))

    async def generate(self, client: httpx.AsyncClient, samples: list[Sample], params: SamplingParams,
                       seeds: list[int], rids: list[str], what: str) -> None:
        """Generate (or continue) the response of every sample in one request; fills them in place.

        A sample that already has response tokens continues from them (its prompt is prompt + response
        so far) with the tokens left of ``params.max_new_tokens``; a finished one is left as it is.
        """
        todo = [k for k, s in enumerate(samples) if s.status in ("pending", "aborted")]
        if not todo:  # a group carried over complete (partial rollout): nothing to generate
            return
        samples, seeds, rids = [samples[k] for k in todo], [seeds[k] for k in todo], [rids[k] for k in todo]
        outputs = await self.send(client, self.payload(samples, params, seeds, rids), what)
        for sample, out in zip(samples, outputs):
            fill_response(sample, out)

    async def send(self, client: httpx.AsyncClient, payload: dict, what: str) -> list[dict]:
        """POST /generate through the router; with ``reissue``, again to another engine each time the
        engine holding it is lost, until the router has none left to wait for."""
        start = time.perf_counter()
        while True:
            try:
                # A batch payload (one entry per sample): /generate answers with a list.
                return cast("list[dict]", await self.router.generate_async(client, payload))
            except httpx.HTTPStatusError as err:
                raise GenerationError(f"{what}: {_url(err)} answered {err.response.status_code}: "
                                      f"{err.response.text}") from None
            except httpx.TimeoutException as err:
                raise GenerationError(f"{what}: no answer from {_url(err)} within {self.timeout_s:.0f}s ({err!r})") from None
            except NoHealthyWorker as err:
                raise GenerationError(f"{what}: {err}") from None
            except (httpx.TransportError, EngineLost) as err:
                if not self.reissue:
                    where = err.url if isinstance(err, EngineLost) else _url(err)
                    raise GenerationError(f"{what}: lost the connection to {where} after "
                                          f"{time.perf_counter() - start:.1f}s ({err!r})") from None
                self.reissued_samples += len(payload["input_ids"])

    def payload(self, samples: list[Sample], params: SamplingParams, seeds: list[int], rids: list[str]) -> dict:
        return {"input_ids": [s.prompt_ids + s.response_ids for s in samples],
                "sampling_params": [sampling_payload(params, seed, params.max_new_tokens - s.response_length)
                                    for s, seed in zip(samples, seeds)],
                "rid": rids, "return_logprob": True, **self.fields}

    async def abort(self, client: httpx.AsyncClient, rids: list[str]) -> int:
        return await self.router.abort_async(client, rids)

    def release_memory(self, tags: list[str]) -> None:
        self.router.broadcast("/release_memory_occupation", {"tags": tags})

    def resume_memory(self, tags: list[str]) -> None:
        self.router.broadcast("/resume_memory_occupation", {"tags": tags})

    def health(self) -> dict[str, bool]:
        return self.router.check_health()

    def replace(self, lost_url: str, new_url: str) -> None:
        """A replacement engine takes a lost one's place."""
        self.router.remove_worker(lost_url)
        self.router.add_worker(new_url)

    def prefill_counters(self) -> dict[str, float]:
        """Prompt tokens the engines prefilled so far, summed: computed, taken from the cross-request prefix
        cache, and shared within a batch (from /get_load; an engine without that endpoint or those
        fields counts 0, and the rollout then logs no hit rate)."""
        totals = dict.fromkeys(PREFILL_COUNTERS, 0.0)
        for load in self.router.query("/get_load", missing_ok=True):
            for key in PREFILL_COUNTERS:
                totals[key] += float(load.get(key, 0))
        return totals


PREFILL_COUNTERS = ("prefill_tokens", "prefill_tokens_cached", "prefill_tokens_shared")


def prefix_cache_metrics(before: dict[str, float], after: dict[str, float], prefix: str) -> dict[str, float]:
    """The share of prompt tokens a rollout's requests found in the engines' prefix cache (a later turn
    reusing an earlier one's KV), and the share computed once for a whole group within a batch."""
    delta = {k: after[k] - before[k] for k in PREFILL_COUNTERS}
    total = sum(delta.values())
    if total <= 0:
        return {}
    return {f"{prefix}/prefix_cache_hit_rate": delta["prefill_tokens_cached"] / total,
            f"{prefix}/prefill_shared_frac": delta["prefill_tokens_shared"] / total,
            f"{prefix}/prefill_tokens": delta["prefill_tokens"]}
