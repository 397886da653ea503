"""OpenEnv environment servers as tether rollouts (``rollout.environment: {type: openenv, url: http://host:8000}``).

An OpenEnv environment (``openenv-core``: an ``Environment`` with ``reset`` / ``step`` / ``state``,
served by ``create_app``) runs as its own server, in its own Python environment, container or
machine. Its stateful sessions are WebSockets (``/ws``; its HTTP ``/reset`` and ``/step`` make a
fresh environment per request): one connection is one episode, and tether speaks that protocol
itself, so the trainer's environment needs none of OpenEnv's dependencies:

    -> {"type": "reset", "data": {...}}          <- {"type": "observation", "data": {"observation", "reward", "done"}}
    -> {"type": "step", "data": {<action>}}      <- the same
    -> {"type": "close"}                         an error: {"type": "error", "data": {"message", "code"}}

Per sample: a connection is opened (retried while the server refuses it, up to ``connect_timeout_s``),
the environment reset with the row's ``reset`` field (and a seed, the same for every sample of a
prompt: a group plays one episode's start), its first observation appended to
the prompt; each assistant turn becomes an action (``action``: a function of the turn's text, or
``{action_key: text}``), its observation the next user message (``observation_key``'s field, or the
whole observation as JSON); the episode ends when the environment says done, at ``max_turns``, or
when the response budget is spent; the reward is the steps' rewards summed (or the last).

Each request waits for its own answer on its connection (one at a time), at most
``message_timeout_s``. A server that is gone, a connection that drops, an error answer or a timeout
is an EnvironmentFailure naming the server and the request: the sample is tried again from its prompt
on a new connection (the environment's state lived in the one that broke), then masked.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import zlib
from typing import Any, Callable

from tether.envs.config import OpenEnvConfig
from tether.envs.episode import episode_reward, load_factory, run_episode
from tether.errors import EnvironmentFailure
from tether.rollout.generate_fn import GenerateContext
from tether.run.faults import inject_fault
from tether.sample import Sample

RESET_FIELD = "reset"
"""The row field (in its metadata) holding the keyword arguments of the environment's reset."""


def ws_url(url: str) -> str:
    base = url.rstrip("/")
    for http, ws in (("https://", "wss://"), ("http://", "ws://")):
        if base.startswith(http):
            base = ws + base[len(http):]
    return base if base.endswith("/ws") else base + "/ws"


class OpenEnvSession:
    """One WebSocket session with an OpenEnv server: one environment instance, one episode."""

    def __init__(self, url: str, connect_timeout_s: float, message_timeout_s: float):
        self.url, self.ws_url = url, ws_url(url)
        self.connect_timeout_s, self.message_timeout_s = connect_timeout_s, message_timeout_s
        self.ws: Any = None
        self._lock = asyncio.Lock()

    async def connect(self) -> None:
        import websockets

        deadline, wait, last = time.monotonic() + self.connect_timeout_s, 0.1, None
        while True:
            try:
                self.ws = await websockets.connect(self.ws_url, open_timeout=max(1.0, self.connect_timeout_s),
                                                   max_size=None, ping_interval=None)
                return
            except (OSError, asyncio.TimeoutError, websockets.InvalidHandshake) as err:
                last = err
            if time.monotonic() + wait > deadline:
                raise EnvironmentFailure(f"OpenEnv server {self.url}: no connection to {self.ws_url} within "
                                         f"{self.connect_timeout_s:g}s ({type(last).__name__}: {last}); is it running?")
            await asyncio.sleep(wait)
            wait = min(2 * wait, 2.0)

    async def request(self, kind: str, data: dict | None = None) -> dict:
        """Send one message and wait for its answer (the next message on this connection)."""
        import websockets

        if inject_fault("environment"):
            raise EnvironmentFailure(f"OpenEnv server {self.url}: {kind}: injected fault (TETHER_INJECT_FAULTS)")
        message = {"type": kind, **({"data": data} if data is not None else {})}
        async with self._lock:  # one request in flight: the next message is its answer
            try:
                await self.ws.send(json.dumps(message))
                raw = await asyncio.wait_for(self.ws.recv(), self.message_timeout_s)
            except asyncio.TimeoutError:
                raise EnvironmentFailure(f"OpenEnv server {self.url}: no answer to {kind} within "
                                         f"{self.message_timeout_s:g}s") from None
            except websockets.ConnectionClosed as err:
                raise EnvironmentFailure(f"OpenEnv server {self.url}: the connection closed during {kind} "
                                         f"({err}); the episode's state went with it") from None
        reply = json.loads(raw)
        if reply.get("type") == "error":
            problem = reply.get("data") or {}
            raise EnvironmentFailure(f"OpenEnv server {self.url}: {kind} failed: {problem.get('message')} "
                                     f"(code {problem.get('code')}) {problem.get('errors') or ''}".rstrip())
        expected = "state" if kind == "state" else "observation"
        if reply.get("type") != expected:
            raise EnvironmentFailure(f"OpenEnv server {self.url}: answered {kind} with a {reply.get('type')!r} "
                                     f"message, expected {expected!r}")
        return reply.get("data") or {}

    async def close(self) -> None:
        if self.ws is None:
            return
        try:
            await self.ws.send(json.dumps({"type": "close"}))
        except Exception:  # noqa: BLE001 - closing a connection that may be gone already
            pass
        await self.ws.close()
        self.ws = None


@functools.cache
def _action_fn(spec: str) -> Callable[[str], dict]:
    return load_factory(spec, "action function")


class OpenEnvEpisode:
    def __init__(self, c: OpenEnvConfig, sample: Sample, seed: int):
        urls = [c.url] if isinstance(c.url, str) else c.url
        # Samples spread over the servers by their prompt and index (the same server on every run).
        self.url = urls[zlib.crc32(f"{sample.prompt_index}:{sample.sample_index}".encode()) % len(urls)]
        self.c, self.sample, self.seed = c, sample, seed
        self.name = f"OpenEnv server {self.url}"
        self.session = OpenEnvSession(self.url, c.connect_timeout_s, c.message_timeout_s)
        self.rewards: list[float] = []

    def _text(self, observation: dict) -> str:
        if self.c.observation_key is not None:
            if self.c.observation_key not in observation:
                raise EnvironmentFailure(f"{self.name}: the observation has no field '{self.c.observation_key}' "
                                         f"(rollout.environment.observation_key); it has {sorted(observation)}")
            return str(observation[self.c.observation_key])
        return json.dumps(observation)

    async def start(self, sample: Sample) -> tuple[list[dict], list[dict] | None]:
        await self.session.connect()
        meta = sample.metadata if isinstance(sample.metadata, dict) else {}
        reset = dict(meta.get(RESET_FIELD) or {})
        reset.setdefault("seed", self.seed)
        first = await self.session.request("reset", reset)
        prompt = sample.prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        text = self._text(first.get("observation") or {})
        if text:
            messages[-1]["content"] = (messages[-1].get("content") or "") + self.c.observation_separator + text
        return messages, None

    def _action(self, text: str) -> dict:
        if self.c.action is None:
            return {self.c.action_key: text}
        action = _action_fn(self.c.action)(text)
        if not isinstance(action, dict):
            raise ValueError(f"rollout.environment.action '{self.c.action}' returned {action!r:.100}; expected a dict")
        return action

    async def respond(self, message: dict, last: bool) -> tuple[list[dict], bool]:
        out = await self.session.request("step", self._action(message.get("content") or ""))
        self.rewards.append(float(out.get("reward") or 0.0))
        done = bool(out.get("done"))
        text = self._text(out.get("observation") or {})
        return ([{"role": "user", "content": text}] if text and not done else []), done

    async def reward(self) -> float | None:
        return episode_reward(self.rewards, self.c.reward)

    async def close(self) -> None:
        await self.session.close()


async def generate(ctx: GenerateContext, sample: Sample, sampling_params: dict, evaluation: bool = False) -> Sample:
    """The generate function of ``rollout.environment: {type: openenv}``."""
    assert ctx.cfg is not None and isinstance(ctx.cfg.rollout.environment, OpenEnvConfig)
    c = ctx.cfg.rollout.environment
    # One seed per prompt: the samples of a group play the same episode (group-relative advantages
    # compare answers to the same environment); a row's reset.seed wins.
    seed = zlib.crc32(f"{ctx.cfg.seed}:{sample.prompt_index}".encode())
    episode = OpenEnvEpisode(c, sample, seed)
    await run_episode(ctx, sample, sampling_params, episode, max_turns=c.max_turns, tool_parser=None,
                      chat_template=c.chat_template, turn_tokens=c.max_turn_tokens)
    sample.metrics["env_steps"] = float(len(episode.rewards))
    return sample


def check(c: OpenEnvConfig) -> None:
    """The action function loads (the servers are reached when the first episode starts)."""
    import websockets  # noqa: F401 - the client's one dependency

    if c.action is not None:
        _action_fn(c.action)
