"""The FastAPI app around one AsyncEngine, and `serve()`, which runs it under uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import anyio
import uvicorn
from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from nanoserve import __version__
from nanoserve.config import EngineConfig
from nanoserve.engine.async_engine import AsyncEngine, EngineDeadError
from nanoserve.engine.early_start import EarlyEngineProcess
from nanoserve.lifetime import freeze_startup_heap
from nanoserve.server import chat, completions, info, invocations, responses
from nanoserve.server.backlog import BudgetMiddleware
from nanoserve.server.connections import uvicorn_options
from nanoserve.server.errors import install_handlers
from nanoserve.server.limits import BodyLimitMiddleware
from nanoserve.server.middleware import (APIKeyMiddleware, CanonicalPathMiddleware, RequestIdHeaderMiddleware,
                                         StartFailureMiddleware)
from nanoserve.server.openapi import install_openapi
from nanoserve.server.state import ServerSettings, ServerState
from nanoserve.server.tls import TLSFiles, end_waiting_tls_closes

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 10.0


def build_app(engine: AsyncEngine, settings: ServerSettings,
              on_fatal: Callable[[int], None] | None = None) -> FastAPI:
    """The app; the engine core starts with the app's lifespan and stops with it.

    If the engine core dies, /health answers 503 at once, and `settings.engine_death_grace_s`
    later `on_fatal(1)` is called: `serve` then exits non-zero, so a supervisor restarts it."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # anyio loads its asyncio backend on first use: that was the first streamed response,
        # 17 ms of imports before its first event (2-core CPU); load it while the model loads
        await anyio.sleep(0)
        try:
            await engine.start()
        except EngineDeadError:
            await engine.shutdown()
            app.state.start_failure = "The engine failed to start; its error is logged above"
            raise RuntimeError(app.state.start_failure) from None
        tasks = [asyncio.create_task(app.state.server.budget.run())]
        if settings.log_stats:
            tasks.append(asyncio.create_task(_log_stats(engine)))
        if on_fatal is not None:
            tasks.append(asyncio.create_task(_exit_after_engine_death(engine, settings.engine_death_grace_s,
                                                                      on_fatal)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            app.state.server.specs.close()
            await engine.shutdown()

    docs = {} if settings.api_docs else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="nanoserve", version=__version__, lifespan=lifespan, **docs)
    app.state.server = ServerState(engine, settings)
    install_handlers(app)
    install_openapi(app, has_api_key=bool(settings.api_key))
    for module in (completions, chat, responses, info, invocations):
        app.include_router(module.router)
    # innermost: it counts the body messages the routes send
    app.add_middleware(BudgetMiddleware, budget=app.state.server.budget)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.limits.max_request_body_bytes)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    if settings.allowed_origins:  # outside the key check, so it answers preflights without a key
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins,
                           allow_methods=settings.allowed_methods, allow_headers=settings.allowed_headers,
                           allow_credentials=settings.allow_credentials)
    if settings.request_id_headers:   # outside the key check: a refusal carries its id too
        app.add_middleware(RequestIdHeaderMiddleware)
    # outermost: the key check, the limits and the routes all see the path that is served
    app.add_middleware(CanonicalPathMiddleware, root_path=settings.root_path)
    app.add_middleware(StartFailureMiddleware, state=app.state)
    app.router.redirect_slashes = False   # no route answers with a redirect, whatever the path
    return app


async def _exit_after_engine_death(engine: AsyncEngine, grace_s: float, on_fatal: Callable[[int], None]) -> None:
    await engine.dead.wait()
    logger.error("The engine is dead; /health answers 503 and the server exits in %.0f s", grace_s)
    await asyncio.sleep(grace_s)
    on_fatal(1)


async def _log_stats(engine: AsyncEngine) -> None:
    """A line every STATS_INTERVAL_S while there is work, as vLLM prints one."""
    last = engine.stats
    while True:
        await asyncio.sleep(STATS_INTERVAL_S)
        if engine.dead.is_set():   # its last stats are of requests that have failed since
            return
        now = engine.stats
        if now == last and not now.num_running and not now.num_waiting:
            continue
        generated = now.generated_tokens - last.generated_tokens
        prompt = now.computed_tokens - last.computed_tokens - generated
        logger.info("Engine: %d running, %d waiting, KV cache %.1f%% used, prompt %.1f tok/s, generation %.1f "
                    "tok/s, prefix-cache hits %d of %d prompt tokens, %d preemptions", now.num_running,
                    now.num_waiting, 100 * now.kv_cache_usage, prompt / STATS_INTERVAL_S,
                    generated / STATS_INTERVAL_S, now.prefix_hit_tokens, now.prefix_queried_tokens,
                    now.num_preemptions)
        last = now


# after a second Ctrl-C, what the open requests have to send their error before the stop is forced
FORCED_STOP_GRACE_S = 1.0
# what a supervisor of several front ends (server/api_servers.py) sends them for its second and
# third SIGINT: a stop stage, not one more SIGINT, since a Ctrl-C reaches each front end itself too
FORCE_SOON_SIGNAL = signal.SIGUSR1
FORCE_NOW_SIGNAL = signal.SIGUSR2
_DRAIN, _FORCE_SOON, _FORCE_NOW = 1, 2, 3


class Server(uvicorn.Server):
    """uvicorn's server, and what it lacks: an exit code that says how serving ended, a shutdown
    deadline that ends the requests still open with an OpenAI error instead of cutting them, the
    same error for them when a second Ctrl-C forces the stop, and HTTPS connections held to the
    deadlines plain ones have (the TLS handshake to --timeout-headers, a close to what it must send)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, supervised: bool = False,
                 tls_handshake_timeout: float = 10.0) -> None:
        super().__init__(config)
        self.engine = engine
        self.supervised = supervised
        self.tls_handshake_timeout = tls_handshake_timeout
        self.tls_closes: asyncio.Task | None = None
        self.exit_code = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stage = 0

    def handle_exit(self, sig: int, frame: object) -> None:
        """SIGTERM or a first SIGINT drains, as in uvicorn. Each SIGINT after that is one stage more: the
        second ends the open requests with an OpenAI error (an SSE error event and [DONE] for streams)
        and forces the stop FORCED_STOP_GRACE_S later; the third forces it at once. uvicorn's second
        SIGINT cancelled the request handlers at once, and whole responses got its plain-text 500.

        A front end under a supervisor (server/api_servers.py) takes its own SIGINT as a drain only:
        the supervisor forwards each stage of a Ctrl-C, which reaches both, and the forward of the
        first (SIGTERM) may come before the front end's own SIGINT, which then read as a second."""
        if sig == signal.SIGINT and self.supervised:
            sig = signal.SIGTERM
        if sig == signal.SIGINT and self.should_exit and self.loop is not None:
            self._captured_signals.append(sig)   # re-raised once serving ends, as uvicorn does
            self.reach(max(self.stage, _DRAIN) + 1)
            return
        super().handle_exit(sig, frame)
        self.stage = max(self.stage, _DRAIN)

    def reach(self, stage: int) -> None:
        """Go on to `stage` of the stop unless it is already there: a stage forwarded by a supervisor
        may come beside the same Ctrl-C that this process got itself."""
        if stage <= self.stage or self.loop is None:
            return
        self.stage = stage
        self.should_exit = True
        self.exit_code = self.exit_code or 1
        self.loop.call_soon_threadsafe(self._force, stage)

    def _force(self, stage: int) -> None:
        if self.engine.num_unfinished:
            logger.warning("Forced stop: ending %d unfinished sequences with an error", self.engine.num_unfinished)
            self.engine.fail_all(EngineDeadError("The server was stopped before this request finished"))
        if stage >= _FORCE_NOW:
            self.force_exit = True
        else:
            asyncio.get_running_loop().call_later(FORCED_STOP_GRACE_S, setattr, self, "force_exit", True)

    def fatal(self, code: int) -> None:
        self.exit_code = code
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        tls = self.config.ssl is not None
        if tls:
            # uvicorn gives the event loop no TLS handshake timeout, and its default is 60 s: a
            # connection that never finished its handshake is not yet a connection of ours (no header
            # deadline, no --max-connections count), so enough of them held every descriptor for 60 s
            self.loop.create_server = functools.partial(self.loop.create_server,
                                                        ssl_handshake_timeout=self.tls_handshake_timeout)
        try:
            await super().startup(sockets)   # the lifespan: the engine core is ready once it returns
        finally:
            if tls:
                del self.loop.create_server
        if self.started:
            freeze_startup_heap()
            if tls:
                self.tls_closes = asyncio.create_task(end_waiting_tls_closes(self.server_state.connections))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timeout = self.config.timeout_graceful_shutdown
        cut = None
        if timeout is not None:
            # a moment before uvicorn cancels the handlers, end their requests so each can still
            # send its error: a JSON error object, or an SSE error event and [DONE]
            margin = min(2.0, timeout / 4)
            cut = asyncio.create_task(self._cut_at(timeout - margin, margin / 2))
        try:
            await super().shutdown(sockets)
        finally:
            if self.tls_closes is not None:
                self.tls_closes.cancel()
            if cut is not None:
                cut.cancel()
            # an engine that died before this stop (within its grace period, or during the drain)
            # is a failure, however the stop came: a supervisor reads the exit code, not the log
            if self.engine.crashed:
                self.exit_code = self.exit_code or 1

    async def _cut_at(self, delay: float, sending_s: float) -> None:
        await asyncio.sleep(delay)
        if self.engine.num_unfinished:
            logger.error("Shutdown deadline: ending %d unfinished sequences with an error", self.engine.num_unfinished)
            self.engine.fail_all(EngineDeadError("The server shut down before this request finished"))
            self.exit_code = self.exit_code or 1
        await asyncio.sleep(sending_s)   # the errors just made go out
        # a response the engine finished that its client reads too slowly: uvicorn cancelled its
        # handler at the deadline, logged a traceback and exited 0 with the response cut. Cut here,
        # the handler ends quietly (its sends go nowhere), and the exit code says the drain was cut
        sending = [c for c in list(self.server_state.connections)
                   if getattr(c, "cycle", None) is not None and not c.cycle.response_complete]
        if sending:
            logger.error("Shutdown deadline: cutting %d responses that their clients are still reading", len(sending))
            for connection in sending:
                connection.transport.abort()
            self.exit_code = self.exit_code or 1


@dataclass(frozen=True)
class HTTPOptions:
    """How a front end listens, admits and stops: the HTTP side of `serve`."""

    host: str = "0.0.0.0"
    port: int = 8000
    max_queue_len: int | None = None    # sequences waiting past max_num_seqs before a 503
    shutdown_timeout: float = 30.0      # the drain's limit on SIGTERM
    log_level: str = "info"
    tls: TLSFiles | None = None         # serve HTTPS with these files
    uvicorn_log_level: str | None = None   # uvicorn's own lines (access lines included); log_level's by default
    access_log: bool = True             # false drops the access lines alone
    uds: str | None = None              # listen on this Unix socket's path instead of host:port

    @property
    def address(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}+unix://{self.uds}" if self.uds else f"{scheme}://{self.host}:{self.port}"


def serve(config: EngineConfig, settings: ServerSettings, options: HTTPOptions, api_server_count: int,
          early: EarlyEngineProcess, sock: socket.socket) -> None:
    """Serve until SIGINT/SIGTERM; exit non-zero if the engine died or the drain was cut short.

    `sock` listens already (server/listen.py): the engine core loads the model in its own process
    while connections wait in its backlog. On SIGTERM uvicorn stops accepting connections and
    waits up to `options.shutdown_timeout` seconds for requests in flight, streams included, to
    finish. With `api_server_count` > 1 that many front-end processes share the port and the core
    (server/api_servers.py). `early`: the core's process, started before the server loaded.
    """
    logger.info("Serving %s as %s on %s once the engine is ready (device %s, dtype %s%s)",
                config.model, settings.served_model_names, options.address, config.device,
                str(config.dtype).removeprefix("torch."),
                f", {api_server_count} front-end processes" if api_server_count > 1 else "")
    if api_server_count > 1:
        from nanoserve.server.api_servers import run_api_servers
        code = run_api_servers(config, settings, options, sock, api_server_count, early)
    else:
        engine = AsyncEngine(config, max_queue_len=options.max_queue_len, log_level=options.log_level.upper(),
                             early=early)
        code = run_front_end(engine, settings, options, sock)
    sys.exit(code)   # a Unix socket's file is removed as the process exits (server/listen.py)


def run_front_end(engine: AsyncEngine, settings: ServerSettings, options: HTTPOptions, sock: socket.socket,
                  supervised: bool = False) -> int:
    """uvicorn serving the app around `engine` on the bound `sock` until it is told to stop; the exit
    code. `supervised`: one of several front ends, whose supervisor forwards the stages of a stop."""
    uv_config = uvicorn.Config(None, host=options.host, port=options.port,
                               log_level=options.uvicorn_log_level or options.log_level,
                               access_log=options.access_log, timeout_graceful_shutdown=options.shutdown_timeout,
                               **uvicorn_options(settings.limits),
                               **(options.tls.uvicorn_options() if options.tls else {}))
    server = Server(uv_config, engine, supervised, tls_handshake_timeout=settings.limits.timeout_headers)
    uv_config.app = build_app(engine, settings, on_fatal=server.fatal)
    main = threading.current_thread() is threading.main_thread()   # where signal handlers may be set
    if main:
        # uvicorn drains, then re-raises SIGTERM or SIGINT to the handler it found: exit with the
        # drain's verdict (SIGINT's default handler, or asyncio's, raised KeyboardInterrupt: a traceback)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: sys.exit(server.exit_code))
        signal.signal(FORCE_SOON_SIGNAL, lambda *_: server.reach(_FORCE_SOON))
        signal.signal(FORCE_NOW_SIGNAL, lambda *_: server.reach(_FORCE_NOW))
    server.run(sockets=[sock])
    if main:
        # a stage forwarded once serving has ended finds nothing to stop; left to the default it
        # would end this process by the signal and turn a finished drain into a failure
        for sig in (FORCE_SOON_SIGNAL, FORCE_NOW_SIGNAL):
            signal.signal(sig, signal.SIG_IGN)
    return server.exit_code or (0 if server.started else 1)
