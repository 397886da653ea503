"""HTTP clients for engines, reward servers and tools, sharing one TLS context per process.

httpx builds a new TLS context for every client it creates (loading the CA bundle: about 20 ms on
a small CPU), even when every URL is plain http. The rollout makes clients per rollout and the
remote reward per group, so that cost was paid on every step; one context, made on first use with
httpx's own defaults (SSL_CERT_FILE / SSL_CERT_DIR, else certifi), serves them all.

Idle keep-alive connections are dropped after KEEPALIVE_EXPIRY_S, below the 5 s after which uvicorn
(SGLang's and vLLM's servers) closes them: with equal timeouts a long-lived client (the router, the
fully async rollout stream) can send a request on a connection the server is closing that instant,
and gets a ReadError for a request the engine never saw.
"""

from __future__ import annotations

import functools
import os
import ssl
from typing import Any

import httpx


@functools.cache
def tls_context() -> ssl.SSLContext:
    return httpx.create_ssl_context()


KEEPALIVE_EXPIRY_S = 2.0


def pool_limits(max_connections: int | None = 100, max_keepalive: int = 20) -> httpx.Limits:
    return httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_keepalive,
                        keepalive_expiry=KEEPALIVE_EXPIRY_S)


def async_client(timeout_s: float, limits: httpx.Limits | None = None, **kwargs: Any) -> httpx.AsyncClient:
    """``httpx.AsyncClient(timeout=timeout_s, **kwargs)`` with the shared TLS context and pool_limits()."""
    return httpx.AsyncClient(timeout=timeout_s, verify=tls_context(), limits=limits or pool_limits(), **kwargs)


def sync_client(timeout_s: float, headers: dict[str, str] | None = None) -> httpx.Client:
    """``httpx.Client(timeout=timeout_s)`` with the shared TLS context and pool_limits()."""
    return httpx.Client(timeout=timeout_s, verify=tls_context(), limits=pool_limits(), headers=headers)


def engine_headers() -> dict[str, str]:
    """Headers for requests to engines: the API key of this process (TETHER_API_KEY), if any. Only
    engine clients send it; reward servers and tools are other people's servers."""
    key = os.environ.get("TETHER_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}
