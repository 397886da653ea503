"""An ASGI app served by uvicorn in a background thread: the engine's server and the chat-session server."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ThreadedServer:
    """``start()`` returns once the app listens (or raises naming ``what`` and the address); ``url`` is where."""

    def __init__(self, app, host: str, port: int, what: str):
        self.host, self.port, self.what = host, port or free_port(host), what
        # Idle connections stay open longer than clients keep them (http_client.KEEPALIVE_EXPIRY_S), so
        # the client, not the server, always closes one: no request is sent on a closing connection.
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, log_level="warning",
                                                     timeout_keep_alive=60))
        self._thread = threading.Thread(target=self._server.run, name=what.replace(" ", "-"), daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0):
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"{self.what} did not start on {self.url} within {timeout_s:.0f}s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
