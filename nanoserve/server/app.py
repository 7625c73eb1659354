"""The FastAPI app around one AsyncEngine, and `serve()`, which runs it under uvicorn."""

from __future__ import annotations

import contextlib
import hmac
import logging
import signal
import sys
import threading
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI
from sse_starlette.sse import AppStatus
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from nanoserve import __version__
from nanoserve.config import EngineConfig
from nanoserve.engine.async_engine import AsyncEngine
from nanoserve.server import chat, completions, info
from nanoserve.server.connections import uvicorn_options
from nanoserve.server.errors import APIError, install_handlers
from nanoserve.server.limits import BodyLimitMiddleware
from nanoserve.server.openapi import install_openapi
from nanoserve.server.state import ServerSettings, ServerState

logger = logging.getLogger(__name__)

OPEN_PATHS = {"/health"}  # load balancers and Docker's HEALTHCHECK probe it without a key


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` matches, compared in constant time; /health stays open."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            given = Headers(scope=scope).get("authorization", "").encode()
            if not hmac.compare_digest(given, self.expected):
                response = APIError("Incorrect or missing API key: send the header 'Authorization: Bearer <key>' "
                                    "with the key given to --api-key", 401, code="invalid_api_key").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    """The app; the engine thread starts with the app's lifespan and stops with it."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="nanoserve", version=__version__, lifespan=lifespan)
    app.state.server = ServerState(engine, settings)
    install_handlers(app)
    install_openapi(app, has_api_key=bool(settings.api_key))
    for module in (completions, chat, info):
        app.include_router(module.router)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.limits.max_request_body_bytes)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    if settings.allowed_origins:  # added last, so it is outermost and answers preflights without a key
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)
    return app


def serve(config: EngineConfig, settings: ServerSettings, host: str = "0.0.0.0", port: int = 8000,
          max_queue_len: int | None = None, shutdown_timeout: float = 30.0, log_level: str = "info") -> None:
    """Load the model, then serve until SIGINT/SIGTERM.

    On SIGTERM uvicorn stops accepting connections and waits up to `shutdown_timeout` seconds for
    requests in flight, streams included, to finish; then the engine stops.
    """
    engine = AsyncEngine(config, max_queue_len=max_queue_len)  # the model loads before the port opens
    # by default sse-starlette ends every stream as soon as shutdown begins; in-flight requests
    # must finish instead, and uvicorn's graceful timeout bounds how long that may take
    AppStatus.disable_automatic_graceful_drain()
    app = build_app(engine, settings)
    logger.info("Serving %s as %s on http://%s:%d", config.model, settings.served_model_names, host, port)
    if threading.current_thread() is threading.main_thread():
        # uvicorn drains, then re-raises SIGTERM to the handler it found: make that a clean exit (0)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout,
                **uvicorn_options(settings.limits))
