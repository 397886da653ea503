"""Lost engines at the router: requests in flight on one go to another, or wait for a replacement.

The engines here are real HTTP servers on loopback: one answers /generate as an engine would, one
accepts the request and never answers (a frozen engine), one is shut down (a dead one).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tether.rollout.engine_watch import EngineWatch
from tether.rollout.fleet import EngineFleet, GenerationError
from tether.rollout.router import EngineLost, NoHealthyWorker, Router

PAYLOAD = {"input_ids": [[1, 2], [1, 3]], "sampling_params": [{"max_new_tokens": 2}] * 2}


class Answers(BaseHTTPRequestHandler):
    status = 200

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._reply([{"output_ids": [7], "text": "7", "meta_info": {
            "output_token_logprobs": [[-0.5, 7, None]], "finish_reason": {"type": "stop"}, "weight_version": 0}}
            for _ in body["input_ids"]])

    def do_GET(self):
        self._reply({"status": "ok"})

    def _reply(self, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


class Frozen(Answers):
    def do_POST(self):
        time.sleep(20)

    do_GET = do_POST


class Busy(Answers):
    status = 429


@pytest.fixture()
def servers():
    started = []

    def start(handler) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
        return f"http://127.0.0.1:{server.server_port}"

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


def dead_url() -> str:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    port = server.server_port
    server.server_close()  # nothing listens there any more: connections are refused
    return f"http://127.0.0.1:{port}"


async def send_then(fleet: EngineFleet, action, after_s: float = 0.3):
    """fleet.send while ``action`` runs ``after_s`` later; returns (replies, seconds)."""
    async with httpx.AsyncClient() as client:
        task = asyncio.create_task(fleet.send(client, PAYLOAD, "rollout 0"))
        await asyncio.sleep(after_s)
        start = time.perf_counter()
        action()
        return await task, time.perf_counter() - start


def test_a_request_on_a_lost_engine_goes_to_another_at_once(servers):
    frozen, good = servers(Frozen), servers(Answers)
    fleet = EngineFleet([frozen], 60, reissue=True)

    def lose():
        fleet.router.add_worker(good)  # added after the request went to the frozen one
        assert fleet.router.mark_lost(frozen, "frozen")

    replies, seconds = asyncio.run(send_then(fleet, lose))
    assert [r["output_ids"] for r in replies] == [[7], [7]]
    assert seconds < 2 and fleet.reissued_samples == 2
    assert fleet.router.lost() == {frozen: "frozen"} and not fleet.router.mark_lost(frozen, "again")


def test_a_refused_connection_marks_the_engine_lost_and_goes_to_another(servers):
    dead, good = dead_url(), servers(Answers)
    fleet = EngineFleet([dead, good], 60, reissue=True)
    fleet.router.workers[1].outstanding_tokens = 10**6  # the dead one is picked first
    replies, _ = asyncio.run(send_then(fleet, lambda: None, 0))
    assert len(replies) == 2 and dead in fleet.router.lost() and "ConnectError" in fleet.router.lost()[dead]
    assert fleet.num_engines == 1 and [w.url for w in fleet.router.serving] == [good]


def test_with_every_engine_lost_a_request_waits_for_the_replacement(servers):
    frozen, good = servers(Frozen), servers(Answers)
    fleet = EngineFleet([frozen], 60, reissue=True)

    def lose_and_replace_later():
        fleet.router.mark_lost(frozen, "frozen")
        threading.Timer(0.5, fleet.replace, (frozen, good)).start()

    replies, seconds = asyncio.run(send_then(fleet, lose_and_replace_later))
    assert len(replies) == 2 and 0.4 < seconds < 5
    assert [w.url for w in fleet.router.workers] == [good] and fleet.router.lost() == {}


def test_without_reissue_a_lost_engine_fails_the_request_naming_it(servers):
    frozen = servers(Frozen)
    fleet = EngineFleet([frozen], 60, reissue=False)
    with pytest.raises(GenerationError, match=f"rollout 0: lost the connection to {frozen} .*frozen"):
        asyncio.run(send_then(fleet, lambda: fleet.router.mark_lost(frozen, "frozen")))


def test_waiting_for_a_replacement_is_bounded(servers):
    router = Router([servers(Frozen)], timeout_s=0.5)
    router.mark_lost(router.workers[0].url, "frozen")
    with pytest.raises(NoHealthyWorker, match=r"lost: .*frozen.*waited 0s for a replacement"):
        asyncio.run(router.pick_async(10))
    with pytest.raises(NoHealthyWorker):  # none lost, none healthy: no replacement is coming
        asyncio.run(Router([], timeout_s=60).pick_async(10))


def test_other_cancellations_are_not_taken_for_a_lost_engine(servers):
    router = Router([servers(Frozen)], timeout_s=60)

    async def main():
        async with httpx.AsyncClient() as client:
            task = asyncio.create_task(router.generate_async(client, PAYLOAD))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    assert router.lost() == {} and router.workers[0].waiting == set()


def test_a_request_bound_to_a_worker_already_lost_raises_engine_lost(servers):
    router = Router([servers(Answers)], timeout_s=60)
    worker = router.workers[0]
    router.mark_lost(worker.url, "dead")

    async def main():
        async with router.bound(worker):
            pass

    with pytest.raises(EngineLost, match="dead"):
        asyncio.run(main())


def test_the_heartbeat_marks_frozen_and_dead_engines_lost_and_busy_ones_not(servers):
    good, frozen, busy, dead = servers(Answers), servers(Frozen), servers(Busy), dead_url()
    router = Router([good, frozen, busy, dead], timeout_s=60)
    watch = EngineWatch(router, interval_s=3600, timeout_s=1.0)
    try:
        assert watch.check_once()[frozen] is not None
        assert router.lost() == {}  # not watching: no rollout runs, silence says nothing
        with watch.watching():
            start = time.perf_counter()
            found = watch.check_once()
            assert time.perf_counter() - start < 3  # probed concurrently
        assert found[good] is None and found[busy] is None
        assert found[frozen] == "no answer to /health_generate within 1s (frozen)"
        assert set(router.lost()) == {frozen, dead} and "ConnectError" in router.lost()[dead]
    finally:
        watch.close()


class Broken(Answers):
    status = 500


def test_an_engine_error_or_timeout_names_the_engine(servers):
    async def send(fleet):
        async with httpx.AsyncClient(timeout=0.5) as client:
            await fleet.send(client, PAYLOAD, "rollout 0")

    broken, frozen = servers(Broken), servers(Frozen)
    with pytest.raises(GenerationError, match=f"rollout 0: {broken}/generate answered 500"):
        asyncio.run(send(EngineFleet([broken], 60)))
    with pytest.raises(GenerationError, match=f"rollout 0: no answer from {frozen}/generate within"):
        asyncio.run(send(EngineFleet([frozen], 0.5)))
