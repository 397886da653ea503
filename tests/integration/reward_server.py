"""A reward model over HTTP for the tests (tether's documented JSON format), run in a thread."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class RewardServer:
    """A reward model over HTTP: scores 1 when the response is non-empty; can fail or stall on demand."""

    def __init__(self):
        self.requests: list[dict] = []
        self.fail_next = 0  # answer 503 to this many requests
        self.stall_s = 0.0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                time.sleep(server.stall_s)
                if self.path == "/bad":
                    status, reply = 400, {"error": "bad request"}
                elif server.fail_next:
                    server.fail_next -= 1
                    status, reply = 503, {"error": "busy"}
                else:
                    status = 200
                    reply = {"rewards": [{"score": float(bool(s["response"])), "length": s["response_length"]}
                                         for s in body["samples"]]}
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
