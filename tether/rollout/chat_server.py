"""The HTTP side of chat sessions: an OpenAI-compatible server in the rollout's process.

    POST /sessions/<id>/v1/chat/completions     GET /sessions/<id>/v1/models
    POST /sessions/<id>/v1/messages             Anthropic's Messages API  (tether/rollout/chat_formats.py)
    POST /sessions/<id>/v1/responses            OpenAI's Responses API

One server per process, started on first use on a free loopback port (uvicorn in a thread). A
session registers itself for the life of its ``async with``; a request is handed to the session's
own event loop (the rollout's), so the engine calls, seeds and aborts are the rollout's, whatever
thread or process the agent's client runs in.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import StreamingResponse

from tether.engine.protocol import include_usage
from tether.engine.streaming import chat_reply_events
from tether.http.guard import ServerLimits, guard
from tether.http.server import ThreadedServer
from tether.rollout.chat_formats import (anthropic_events, anthropic_reply, anthropic_request, responses_events,
                                         responses_reply, responses_request)
from tether.rollout.chat_session import ChatRequestError, ChatSession, SessionAborted


class ChatServer(ThreadedServer):
    _shared: ChatServer | None = None
    _lock = threading.Lock()

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.sessions: dict[str, ChatSession] = {}
        super().__init__(self._app(), host, port, "chat session server")

    @classmethod
    def shared(cls) -> ChatServer:
        """This process's server, started on first use."""
        with cls._lock:
            if cls._shared is None:
                cls._shared = cls().start()
            return cls._shared

    def add(self, session: ChatSession) -> None:
        self.sessions[session.id] = session

    def remove(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    def _session(self, session_id: str) -> ChatSession:
        session = self.sessions.get(session_id)
        if session is None:
            raise HTTPException(status_code=404, detail=f"no open chat session {session_id!r} (sessions live for "
                                                        "the generate function's `async with ctx.chat_session(...)`)")
        return session

    def _app(self) -> FastAPI:
        # Agents inside the rollout call it on loopback with their own clients: limits, no key.
        app = guard(FastAPI(title="tether chat sessions"), ServerLimits())

        @app.get("/sessions/{session_id}/v1/models")
        def models(session_id: str) -> dict:
            self._session(session_id)
            return {"object": "list", "data": [{"id": "tether", "object": "model", "owned_by": "tether"}]}

        async def turn(session_id: str, request: Request, translate: Callable[[dict], dict]) -> tuple[dict, dict]:
            """(the request body, the session's chat completion for it)."""
            session = self._session(session_id)
            try:
                body = await request.json()
            except ValueError as err:
                raise HTTPException(status_code=400, detail=f"request body is not JSON: {err}") from None
            if not isinstance(body, dict):
                raise HTTPException(status_code=400, detail="request body must be a JSON object")
            try:
                chat = translate(body)
                # The turn runs on the rollout's loop: its HTTP client, seeds and aborts live there.
                assert session.loop is not None  # set before the session is added to the server
                reply = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(session.complete(chat), session.loop))
            except ChatRequestError as err:
                raise HTTPException(status_code=400, detail=str(err)) from None
            except SessionAborted as err:  # 410: OpenAI and Anthropic clients do not retry it
                raise HTTPException(status_code=410, detail=str(err)) from None
            except Exception as err:  # the session keeps the error and raises it in the generate function
                raise HTTPException(status_code=500, detail=f"{type(err).__name__}: {err}") from None
            return body, reply

        @app.post("/sessions/{session_id}/v1/chat/completions")
        async def chat(session_id: str, request: Request) -> Any:
            body, reply = await turn(session_id, request, lambda b: b)
            if body.get("stream"):  # the turn is recorded whole; a streaming client gets it as chunks
                events = chat_reply_events(reply, include_usage(body.get("stream_options")))
                return StreamingResponse(iter(events), media_type="text/event-stream")
            return reply

        @app.post("/sessions/{session_id}/v1/messages")
        async def messages(session_id: str, request: Request) -> Any:
            body, reply = await turn(session_id, request, anthropic_request)
            message = anthropic_reply(reply)
            if body.get("stream"):
                return StreamingResponse(iter(anthropic_events(message)), media_type="text/event-stream")
            return message

        @app.post("/sessions/{session_id}/v1/responses")
        async def responses(session_id: str, request: Request) -> Any:
            body, reply = await turn(session_id, request, responses_request)
            response = responses_reply(reply)
            if body.get("stream"):
                return StreamingResponse(iter(responses_events(response)), media_type="text/event-stream")
            return response

        return app
