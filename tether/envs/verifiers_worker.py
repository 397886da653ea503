"""The verifiers side of rollout.environment type verifiers: a worker process in the Python environment
that has ``verifiers`` (and the environment module), run by tether/envs/verifiers.py as

    <that python> verifiers_worker.py

It imports nothing of tether (it runs where tether is not installed). JSON lines on stdin and
stdout, one request and one answer each, matched by ``id``; requests run concurrently:

    {"id", "op": "dataset", "env_id", "env_args", "split": "train" | "eval", "n": -1}
        -> {"id", "rows": [{"prompt", "answer", "info", "task", "example_id"}, ...]}
    {"id", "op": "rollout", "env_id", "env_args", "row", "base_url", "model", "sampling_args"}
        -> {"id", "reward", "metrics", "turns", "stop_condition", "error"}
    any failure -> {"id", "error": "<type>: <message>", "where": "<traceback tail>"}

A rollout plays the environment (``vf.load_environment(env_id, **env_args)``, loaded once per
process and arguments) against an OpenAI-compatible chat endpoint (``base_url``: the tether chat
session that records the sample's tokens), then scores it with the environment's rubric.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback
from typing import Any

_ENVS: dict[str, Any] = {}


def _env(env_id: str, env_args: dict) -> Any:
    import verifiers as vf

    key = json.dumps([env_id, env_args], sort_keys=True)
    if key not in _ENVS:
        _ENVS[key] = vf.load_environment(env_id, **env_args)
    return _ENVS[key]


def _plain(value: Any) -> Any:
    """JSON-safe: pydantic messages as dicts, the rest as it is or as text."""
    if hasattr(value, "model_dump"):
        return value.model_dump(exclude_none=True)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


async def _dataset(req: dict) -> dict:
    env = _env(req["env_id"], req.get("env_args") or {})
    data = env.get_eval_dataset(n=req.get("n", -1)) if req.get("split") == "eval" else env.get_dataset(n=req.get("n", -1))
    rows = []
    for row in data:
        rows.append({k: _plain(row.get(k)) for k in ("prompt", "answer", "info", "task", "example_id")})
    return {"rows": rows}


async def _rollout(req: dict) -> dict:
    import verifiers as vf

    env = _env(req["env_id"], req.get("env_args") or {})
    # No retries: a retried turn would be a second turn in the sample (tether retries whole samples).
    client = vf.ClientConfig(api_base_url=req["base_url"], api_key_var="TETHER_VERIFIERS_KEY",
                             client_type="openai_chat_completions", max_retries=0)
    state = await env.rollout(req["row"], client, req.get("model") or "policy", req.get("sampling_args") or {})
    await env.rubric.score_rollout(state)
    error = state.get("error")
    return {"reward": float(state.get("reward") or 0.0),
            "metrics": {k: float(v) for k, v in (state.get("metrics") or {}).items() if isinstance(v, (int, float))},
            "turns": len(state.get("trajectory") or []), "stop_condition": _plain(state.get("stop_condition")),
            "error": None if error is None else f"{type(error).__name__}: {error}"}


async def _answer(req: dict, out: asyncio.Lock) -> None:
    try:
        reply = await {"dataset": _dataset, "rollout": _rollout}[req["op"]](req)
    except Exception as err:  # noqa: BLE001 - every failure goes back to tether, which classifies it
        reply = {"error": f"{type(err).__name__}: {err}", "where": "".join(traceback.format_exc().splitlines(True)[-6:])}
    async with out:
        sys.stdout.write(json.dumps({"id": req.get("id"), **reply}) + "\n")
        sys.stdout.flush()


async def main() -> None:
    os.environ.setdefault("TETHER_VERIFIERS_KEY", "tether")
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 26)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out, tasks = asyncio.Lock(), set()
    sys.stdout.write(json.dumps({"id": None, "ready": True}) + "\n")
    sys.stdout.flush()
    while line := await reader.readline():
        task = asyncio.ensure_future(_answer(json.loads(line), out))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)


if __name__ == "__main__":
    # Run as a script, its own folder is first on sys.path, and tether/envs/verifiers.py would be
    # imported as the verifiers package.
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
    asyncio.run(main())
