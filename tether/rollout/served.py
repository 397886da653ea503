"""Served models: frozen engines beside the policy's (``served_models:``), reached by name from user code.

A reward function with a parameter named ``models``, and a generate function through ``ctx.models``,
get a mapping of name -> ServedModel. A ServedModel spreads its requests over that model's engines
through a router of its own (least loaded first; an engine found dead is taken out, and the driver
starts a replacement that loads the same model: no weights are ever pushed to it)::

    async def judge(prompt, response, models) -> float:
        verdict = await models["judge"].chat([{"role": "user", "content": f"{prompt}{response}\\nCorrect? yes/no"}],
                                             max_tokens=2, temperature=0)
        return float(verdict.strip().lower().startswith("yes"))

A sync reward (run in a thread) calls ``chat_sync`` / ``generate_sync`` instead. The rollout manager
fills the mapping (tether.served.MODELS) when it connects its engines (``connect``).
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
from pathlib import Path
from typing import Any, Mapping

import httpx

from tether.http.client import engine_headers, sync_client
from tether.rollout.router import Router
from tether.served import MODELS, ServedModelError


MAX_SCORED = 1024  # sequences in one scoring request


class ServedModel:
    """One served model's engines, behind a router (least-loaded first, lost engines taken out)."""

    def __init__(self, name: str, urls: list[str], timeout_s: float):
        self.name, self.timeout_s = name, timeout_s
        self.router = Router(urls, timeout_s=timeout_s)
        self._sync = sync_client(timeout_s, headers=engine_headers())
        self._async: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._score_queues: dict[asyncio.AbstractEventLoop, list] = {}  # score calls waiting to go out together

    @property
    def urls(self) -> list[str]:
        return [w.url for w in self.router.workers]

    def _client(self) -> httpx.AsyncClient:
        """An async client of the running event loop: the rollout manager runs each rollout in a loop of
        its own, and a client's connections belong to the loop that opened them."""
        loop = asyncio.get_running_loop()
        if self._async is None or self._loop is not loop:
            self._async, self._loop = httpx.AsyncClient(timeout=self.timeout_s, headers=engine_headers()), loop
        return self._async

    # ------------------------------------------------------------ SGLang's /generate
    @staticmethod
    def _payload(prompt: str | list[int], sampling_params: dict | None, return_logprob: bool) -> dict:
        key = "text" if isinstance(prompt, str) else "input_ids"
        return {key: prompt, "sampling_params": dict(sampling_params or {}), "return_logprob": return_logprob}

    async def generate(self, prompt: str | list[int], sampling_params: dict | None = None,
                       return_logprob: bool = False) -> dict:
        """One /generate call (text or token ids): the engine's reply, SGLang's shape ({"text",
        "output_ids", "meta_info"})."""
        try:
            return await self.router.generate_async(self._client(), self._payload(prompt, sampling_params, return_logprob))  # type: ignore[return-value]
        except httpx.HTTPStatusError as err:
            raise self._refused("/generate", err) from None

    def generate_sync(self, prompt: str | list[int], sampling_params: dict | None = None,
                      return_logprob: bool = False) -> dict:
        """``generate`` for a sync function (a sync reward runs in a thread of its own)."""
        try:
            return self.router.generate(self._payload(prompt, sampling_params, return_logprob))  # type: ignore[return-value]
        except httpx.HTTPStatusError as err:
            raise self._refused("/generate", err) from None

    async def score(self, sequences: list[list[int]], starts: list[int], temperature: float = 1.0) -> list[list[float]]:
        """Each sequence's token log-probs from position ``starts[i]`` on (each token after the ones
        before it, the logits divided by ``temperature``): SGLang's /generate with max_new_tokens 0 and
        logprob_start_len. Position 0 has no log-prob: a start of at least 1.

        Calls made in one turn of the event loop (a rollout's groups, scored as they finish together)
        go out as one request of up to MAX_SCORED sequences: one HTTP round trip and one forward on the
        engine instead of one per group."""
        if any(start < 1 for start in starts):
            raise ValueError("score: every start must be >= 1 (the first token has no log-prob)")
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        queue = self._score_queues.setdefault(loop, [])
        queue.append(([list(map(int, s)) for s in sequences], list(starts), temperature, future))
        if len(queue) == 1:
            loop.create_task(self._flush_scores(loop))
        return await future

    async def _flush_scores(self, loop: asyncio.AbstractEventLoop) -> None:
        for _ in range(3):  # let the other calls of this turn join
            await asyncio.sleep(0)
        calls = self._score_queues.pop(loop, [])
        chunks: list[list] = [[]]
        for call in calls:
            if chunks[-1] and sum(len(c[0]) for c in chunks[-1]) + len(call[0]) > MAX_SCORED:
                chunks.append([])
            chunks[-1].append(call)
        await asyncio.gather(*(self._score_chunk(chunk) for chunk in chunks))

    async def _score_chunk(self, calls: list) -> None:
        sequences = [seq for seqs, _, _, _ in calls for seq in seqs]
        starts = [start for _, sts, _, _ in calls for start in sts]
        temperatures = [t for seqs, _, t, _ in calls for _ in seqs]
        payload = {"input_ids": sequences, "return_logprob": True, "logprob_start_len": starts,
                   "sampling_params": [{"max_new_tokens": 0, "temperature": t} for t in temperatures]}
        try:
            try:
                replies = await self.router.generate_async(self._client(), payload)
            except httpx.HTTPStatusError as err:
                raise self._refused("/generate (scoring)", err) from None
            scores = [self._checked(seq, start, reply) for seq, start, reply in zip(sequences, starts, replies)]
        except Exception as err:  # noqa: BLE001 - every caller of the chunk gets the failure
            for *_, future in calls:
                if not future.done():
                    future.set_exception(err)
            return
        at = 0
        for seqs, _, _, future in calls:
            if not future.done():
                future.set_result(scores[at:at + len(seqs)])
            at += len(seqs)

    def _checked(self, seq: list[int], start: int, reply: dict) -> list[float]:
        entries = reply["meta_info"]["input_token_logprobs"]
        if [int(e[1]) for e in entries] != list(seq[start:]):
            raise ServedModelError(f"served model {self.name!r}: its scores are of other tokens than the ones "
                                   f"sent (from position {start})")
        return [float(e[0]) for e in entries]

    # ------------------------------------------------------------ OpenAI's chat completions
    @staticmethod
    def _chat_body(messages: list[dict] | str, params: dict[str, Any]) -> dict:
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return {"messages": messages, **params}

    async def chat(self, messages: list[dict] | str, **params: Any) -> str:
        """The reply's text to a conversation (a string is one user message), through the served model's
        chat template; ``params`` are OpenAI's (max_tokens, temperature, stop, seed, ...)."""
        return _text(await self.chat_completion(messages, **params))

    async def chat_completion(self, messages: list[dict] | str, **params: Any) -> dict:
        """The whole /v1/chat/completions reply (OpenAI's shape)."""
        async with self.router.lease_async(len(str(messages)) // 4) as url:
            reply = await self._client().post(f"{url}/v1/chat/completions", json=self._chat_body(messages, params),
                                              timeout=self.timeout_s)
        if reply.status_code != 200:
            raise self._refused("/v1/chat/completions", reply)
        return reply.json()

    def chat_sync(self, messages: list[dict] | str, **params: Any) -> str:
        """``chat`` for a sync function."""
        with self.router.lease(len(str(messages)) // 4) as url:
            reply = self._sync.post(f"{url}/v1/chat/completions", json=self._chat_body(messages, params))
        if reply.status_code != 200:
            raise self._refused("/v1/chat/completions", reply)
        return _text(reply.json())

    def _refused(self, route: str, err: httpx.HTTPStatusError | httpx.Response) -> ServedModelError:
        reply = err.response if isinstance(err, httpx.HTTPStatusError) else err
        return ServedModelError(f"served model {self.name!r}: {reply.request.url} answered {reply.status_code} "
                                f"to {route}: {reply.text[:300]}")

    def close(self) -> None:
        self.router.close()
        self._sync.close()


def _text(completion: dict) -> str:
    return completion["choices"][0]["message"]["content"] or ""


def connect(urls: Mapping[str, list[str]], timeout_s: float) -> None:
    """Point this process's served models (tether.served.MODELS) at their engines."""
    MODELS.set({name: ServedModel(name, list(u), timeout_s) for name, u in urls.items()})


def routers() -> list[Router]:
    return [m.router for m in MODELS.values()]


def find(url: str) -> str | None:
    """The served model an engine URL belongs to."""
    return next((name for name, m in MODELS.items() if url in m.urls), None)


def _source_file(spec: str) -> Path | None:
    """The file a ``file.py:function`` or ``module:function`` spec's function lives in."""
    target = spec.strip().rpartition(":")[0]
    if target.endswith(".py"):
        return Path(target)
    try:
        found = importlib.util.find_spec(target)
    except (ImportError, ValueError):
        return None
    return Path(found.origin) if found is not None and found.origin else None


def names_used(source: str, function: str | None = None) -> list[tuple[int, str]]:
    """(line, name) of every ``models["name"]`` / ``ctx.models["name"]`` / ``models.get("name")`` in
    Python source (in ``function``'s body when the module defines it), the name written as a string."""
    tree: ast.AST = ast.parse(source)
    defined = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function]
    found = []
    for node in ast.walk(defined[0] if defined else tree):
        target, key = None, None
        if isinstance(node, ast.Subscript):
            target, key = node.value, node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
            target, key = node.func.value, node.args[0]
        named = isinstance(target, ast.Name) and target.id == "models" or \
            isinstance(target, ast.Attribute) and target.attr == "models"
        if named and isinstance(key, ast.Constant) and isinstance(key.value, str):
            found.append((key.lineno, key.value))
    return sorted(found)


def unserved_names(specs: dict[str, str], served: list[str]) -> list[str]:
    """Problems, one per served model a user function names that the config does not serve: file and
    line, the name, the served ones. ``specs``: config field -> function spec."""
    problems = []
    for field, spec in specs.items():
        path = _source_file(spec)
        if path is None or not path.is_file():
            continue
        try:
            used = names_used(path.read_text(), spec.rpartition(":")[2].strip())
        except SyntaxError:  # loading the function reports it
            continue
        for line, name in used:
            if name not in served:
                problems.append(f"{field}: {path}:{line} uses the served model {name!r}, which the config does not "
                                f"serve (served_models: {', '.join(sorted(served)) or 'none'})")
    return problems
