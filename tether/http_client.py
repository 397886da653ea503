"""HTTP clients for engines, reward servers and tools, sharing one TLS context per process.

httpx builds a new TLS context for every client it creates (loading the CA bundle: about 20 ms on
a small CPU), even when every URL is plain http. The rollout makes clients per rollout and the
remote reward per group, so that cost was paid on every step; one context, made on first use with
httpx's own defaults (SSL_CERT_FILE / SSL_CERT_DIR, else certifi), serves them all.
"""

from __future__ import annotations

import functools
import ssl
from typing import Any

import httpx


@functools.cache
def tls_context() -> ssl.SSLContext:
    return httpx.create_ssl_context()


def async_client(timeout_s: float, **kwargs: Any) -> httpx.AsyncClient:
    """``httpx.AsyncClient(timeout=timeout_s, **kwargs)`` with the shared TLS context."""
    return httpx.AsyncClient(timeout=timeout_s, verify=tls_context(), **kwargs)
