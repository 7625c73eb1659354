"""The app's own ASGI middleware: the API key, the request id header, answers while the engine
fails to start, and the canonical form of a route's path."""

from __future__ import annotations

import hmac
import uuid

from starlette.datastructures import Headers, State
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nanoserve.server.connections import always_served, canonical_path, route_path
from nanoserve.server.errors import APIError


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` matches, compared in constant time; /health stays open."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not always_served(scope["path"]) and scope["method"] != "OPTIONS":
            # the scheme's case is free (RFC 7235) and a stray space around the key is no reason to refuse
            scheme, _, key = Headers(scope=scope).get("authorization", "").strip().partition(" ")
            given = key.strip().encode() if scheme.lower() == "bearer" else b""
            if not hmac.compare_digest(given, self.expected):
                response = APIError("Incorrect or missing API key: send the header 'Authorization: Bearer <key>' "
                                    "with the key given to --api-key", 401, code="invalid_api_key").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestIdHeaderMiddleware:
    """vLLM's --enable-request-id-headers: every response carries X-Request-Id, the client's own
    header when it sent one, else a new id, so that a client can quote it in a report."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope["headers"] if name == b"x-request-id"), None)
        request_id = given or uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class StartFailureMiddleware:
    """Why the engine failed to start, in one line: starlette hands uvicorn the lifespan's whole
    traceback to log, some 30 lines of it framework frames, and the reason was lost in them."""

    def __init__(self, app: ASGIApp, state: State) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def send_reason(message: Message) -> None:
            reason = getattr(self.state, "start_failure", None)
            if message["type"] == "lifespan.startup.failed" and reason:
                message = {**message, "message": reason}
            await send(message)

        await self.app(scope, receive, send_reason)


class CanonicalPathMiddleware:
    """Serves a path with a trailing slash or doubled slashes ("/v1/completions/", "//health",
    "/v1//models") as its route's own path. Starlette answered a trailing slash with a 307 to the
    canonical path, which some clients follow by re-sending a POST's body, others by dropping it;
    doubled slashes come from a base URL that ends in "/" joined to a path that starts with one.
    It also sets --root-path as the request's root_path (FastAPI's own parameter is deprecated):
    the router matches, and the API docs name, the path that follows it."""

    def __init__(self, app: ASGIApp, root_path: str = "") -> None:
        self.app, self.root_path = app, root_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if self.root_path:
                scope = {**scope, "root_path": self.root_path}
            # behind a proxy that keeps the --root-path prefix, the route's path is what follows it
            path = canonical_path(route_path(scope))
            if path != scope["path"]:
                scope = {**scope, "path": path}
        await self.app(scope, receive, send)
