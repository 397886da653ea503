"""A reward model behind HTTP: ``rollout.reward: http://host:port/path``.

One POST per group, JSON both ways:

    request   {"samples": [{"prompt", "response", "label", "metadata", "prompt_index",
                            "sample_index", "group_index", "rollout_id", "finish_reason",
                            "response_length"}, ...]}
    response  {"rewards": [<number> | {<name>: <number>, ...}, ...]}    one per sample, in order

A connection error, a timeout, a 429 or a 5xx is retried (``rollout.reward_retries`` times, waiting
0.5 s, 1 s, 2 s, ...); any other 4xx, or a reply of the wrong shape, fails at once. Every error names
the URL, the group and what was tried.
"""

from __future__ import annotations

import asyncio

import httpx

from tether.http.client import async_client
from tether.rewards.loader import RewardError
from tether.sample import Sample

RETRY_STATUS = {429, 500, 502, 503, 504}


def is_remote(spec: str) -> bool:
    return spec.strip().startswith(("http://", "https://"))


def request_body(samples: list[Sample]) -> dict:
    return {"samples": [{"prompt": s.prompt, "response": s.response_text, "label": s.label, "metadata": s.metadata,
                         "prompt_index": s.prompt_index, "sample_index": s.sample_index,
                         "group_index": s.group_index, "rollout_id": s.rollout_id,
                         "finish_reason": s.finish_reason, "response_length": s.response_length}
                        for s in samples]}


class RemoteReward:
    def __init__(self, url: str, timeout_s: float, retries: int):
        self.url = url.strip()
        self.timeout_s = timeout_s
        self.retries = retries

    async def score(self, samples: list[Sample]) -> list:
        what = f"reward server {self.url}, group of prompt_index={samples[0].prompt_index} (rollout {samples[0].rollout_id})"
        body = request_body(samples)
        problems = []
        async with async_client(self.timeout_s) as client:
            for attempt in range(self.retries + 1):
                if attempt:
                    await asyncio.sleep(0.5 * 2 ** (attempt - 1))
                try:
                    reply = await client.post(self.url, json=body)
                except httpx.TimeoutException:
                    problems.append(f"no answer within {self.timeout_s:.0f}s")
                    continue
                except httpx.TransportError as err:
                    problems.append(f"{type(err).__name__}: {err}")
                    continue
                if reply.status_code in RETRY_STATUS:
                    problems.append(f"HTTP {reply.status_code}")
                    continue
                if reply.status_code != 200:
                    raise RewardError(f"{what}: HTTP {reply.status_code}: {reply.text[:300]}")
                return self._rewards(reply, len(samples), what)
        raise RewardError(f"{what}: failed {self.retries + 1} time(s): " + "; ".join(problems))

    @staticmethod
    def _rewards(reply: httpx.Response, n: int, what: str) -> list:
        try:
            rewards = reply.json()["rewards"]
        except (ValueError, KeyError, TypeError):
            raise RewardError(f"{what}: expected JSON {{\"rewards\": [...]}}, got {reply.text[:300]!r}") from None
        if not isinstance(rewards, list) or len(rewards) != n:
            raise RewardError(f"{what}: sent {n} samples, got {rewards!r:.300} back as rewards")
        return rewards
