"""What every tether HTTP server checks before a handler runs (engines, the vLLM adapter, chat sessions).

- A bearer token (``cluster.api_key`` / TETHER_API_KEY): control routes (weight updates, memory,
  pause/abort, flush, joining a weight-update group: every route not listed as open below) need it
  whenever a key is set; generation and read-only routes need it too with ``server.require_key_for_generate``.
  /health never does, so that load balancers and health checks keep working.
- A bound on request bodies (413), read before any JSON is parsed, so a huge body costs nothing.
- A bound on generation requests in flight (429 past it), instead of an unbounded queue.
- Validation errors (422) that name the field and never echo the value: FastAPI's default reply
  includes the input, which a NaN makes unserialisable (a bare 500) and a large body makes large.

The guard is plain ASGI (no per-request task or thread), wrapped around the FastAPI app.
"""

from __future__ import annotations

import hmac
import json
import os
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

API_KEY_ENV = "TETHER_API_KEY"
# Routes that generate (bounded in flight) and routes that only read; both open unless
# require_key_for_generate. Everything else is a control route.
GENERATION_ROUTES = frozenset({"/generate", "/v1/completions", "/v1/chat/completions", "/health_generate"})
READ_ROUTES = frozenset({"/get_model_info", "/get_server_info", "/get_load", "/v1/models", "/get_weight_version"})
ALWAYS_OPEN = frozenset({"/health"})
WEIGHT_ROUTES = frozenset({"/update_weights_from_tensor"})  # bodies are whole weight buckets


@dataclass(frozen=True)
class ServerLimits:
    api_key: str | None = None
    require_key_for_generate: bool = False
    max_body_bytes: int = 16 << 20
    max_weight_body_bytes: int = 4 << 30
    max_in_flight: int = 4096
    join_timeout_s: float = 60.0  # /init_weights_update_group (not a guard matter: read by its handler)

    def body_limit(self, path: str) -> int:
        return self.max_weight_body_bytes if path in WEIGHT_ROUTES else self.max_body_bytes

    def needs_key(self, path: str) -> bool:
        if not self.api_key or path in ALWAYS_OPEN:
            return False
        return self.require_key_for_generate or path not in GENERATION_ROUTES | READ_ROUTES


DEFAULT_LIMITS = ServerLimits()


def api_key_from_env() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


class Guard:
    """ASGI middleware enforcing ``limits`` (see the module docstring)."""

    def __init__(self, app, limits: ServerLimits):
        self.app, self.limits = app, limits
        self.in_flight = 0  # one event loop: no lock needed

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, headers = scope["path"], dict(scope["headers"])
        if self.limits.needs_key(path) and not self._authorized(headers):
            return await _reply(send, 401, f"{path} needs the API key: send 'Authorization: Bearer <key>'")
        limit = self.limits.body_limit(path)
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await _reply(send, 413, f"request body of {declared.decode(errors='replace')} bytes; "
                                           f"{path} takes at most {limit}")
        body = await _read_body(receive, limit)
        if body is None:
            return await _reply(send, 413, f"request body over {limit} bytes; {path} takes at most {limit}")
        generating = path in GENERATION_ROUTES
        if generating and self.in_flight >= self.limits.max_in_flight:
            return await _reply(send, 429, f"{self.in_flight} requests in flight, the server's limit "
                                           f"(server.max_queued_requests); retry later")
        self.in_flight += generating
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.in_flight -= generating

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        given = headers.get(b"authorization", b"")
        expected = f"Bearer {self.limits.api_key}".encode()
        return hmac.compare_digest(given, expected)


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole body, or None once it passes ``limit`` (the rest is never buffered)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the client's disconnect, as the app expects
    return replay


async def _reply(send, status: int, detail: str) -> None:
    payload = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def describe_validation_error(err: RequestValidationError) -> list[dict]:
    """Each problem as {field, message}: the field's dotted path in the body, never its value."""
    out = []
    for e in err.errors():
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        out.append({"field": ".".join(loc) or "body", "message": e.get("msg", "invalid")})
    return out


def guard(app: FastAPI, limits: ServerLimits) -> FastAPI:
    """Install the guard and the value-free 422 handler on ``app``."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        problems = describe_validation_error(err)
        summary = "; ".join(f"{p['field']}: {p['message']}" for p in problems)
        return JSONResponse(status_code=422, content={"detail": summary, "errors": problems})

    app.add_middleware(Guard, limits=limits)
    return app
