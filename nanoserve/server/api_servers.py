"""`serve --api-server-count N`: N front-end processes share the listening socket and one engine core.

One front end is one event loop: HTTP parsing, tokenizing, detokenizing and SSE for every request
run on one core (on the H200's host, 0.83 of it while streaming 34k tokens/s of short answers; more
with tool or reasoning parsing, structured outputs, longer answers or more connections). Here the server's main process binds the port, starts the engine core and N
front ends, and supervises them: the kernel hands each new connection to one front end, each
front end sends its requests to the core and gets back only their outputs (engine/core.py routes
them), and every front end sees the core's stats. Any process that dies unasked stops the server
with a non-zero exit, as a single front end does when its engine dies.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import time

import zmq

from nanoserve.config import EngineConfig
from nanoserve.defaults import LOG_FORMAT
from nanoserve.engine.async_engine import AsyncEngine, CoreLink, exit_reason
from nanoserve.engine.ipc_dir import remove_socket_dir, socket_dir
from nanoserve.engine.early_start import EarlyEngineProcess
from nanoserve.engine.messages import Shutdown, input_encoder
from nanoserve.lifetime import die_with_parent, start_ignoring_sigint
from nanoserve.server.app import FORCE_NOW_SIGNAL, FORCE_SOON_SIGNAL, HTTPOptions, run_front_end
from nanoserve.server.state import ServerSettings

logger = logging.getLogger(__name__)

_CORE_STOP_S = 30.0   # for the core to stop once every front end has gone


def run_api_servers(config: EngineConfig, settings: ServerSettings, options: HTTPOptions, sock: socket.socket,
                    count: int, early: EarlyEngineProcess) -> int:
    """Run the core in `early`, the process started before the server loaded (engine/early_start.py),
    and start `count` front ends on the bound `sock`; supervise them until all have exited. The exit
    code: 0 after a clean stop, 1 if any process failed or died unasked."""
    workdir = socket_dir(f"output-{count - 1}")
    metrics_dir = os.path.join(workdir, "metrics")
    os.mkdir(metrics_dir)
    # prometheus_client reads it as each front end imports it (they are spawned: they inherit it)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    spawn = multiprocessing.get_context("spawn")   # a CUDA context cannot be forked
    admitted = spawn.Array("q", count, lock=False)   # each front end's admitted sequences (engine/admission.py)
    links = [CoreLink(i, count, f"ipc://{workdir}/input-{i}", f"ipc://{workdir}/output-{i}", 0, admitted)
             for i in range(count)]
    level = options.log_level.upper()
    control = f"ipc://{workdir}/control"   # this process's own line to the core, to stop it
    core = early.run(config, [control, *(link.input_address for link in links)],
                     [link.output_address for link in links], os.getpid(), level)
    supervisor = _Supervisor(core, control)   # from here a SIGTERM or SIGINT is a stop, whatever has started
    try:
        for link in links:
            # one line of engine statistics for the server, not one per front end
            own = dataclasses.replace(settings, metrics_dir=metrics_dir, log_stats=settings.log_stats and link.index == 0)
            front_end = spawn.Process(target=_front_end_main, name=f"nanoserve-api-{link.index}",
                                      args=(config, own, options, sock, dataclasses.replace(link, core_pid=core.pid),
                                            os.getpid()))
            start_ignoring_sigint(front_end)
            supervisor.front_ends.append(front_end)
        sock.close()   # the front ends hold their own copies
        code = supervisor.run()
        # every process has stopped: a stop asked for from here on finds nothing to stop, and Python's
        # default handlers, back while it exits, would let it replace the server's verdict by "killed"
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return code
    finally:
        for process in [core, *supervisor.front_ends]:
            if process.is_alive():
                process.kill()
        remove_socket_dir(workdir)


def _front_end_main(config: EngineConfig, settings: ServerSettings, options: HTTPOptions, sock: socket.socket,
                    link: CoreLink, parent_pid: int) -> None:
    die_with_parent(parent_pid)
    # started with SIGINT ignored and blocked (start_ignoring_sigint): one that came meanwhile is
    # dropped, and uvicorn's handler takes the next once it serves
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    logging.basicConfig(level=options.log_level.upper(), format=LOG_FORMAT.replace("%(name)s", f"[api {link.index}] %(name)s"))
    engine = AsyncEngine(config, max_queue_len=options.max_queue_len, log_level=options.log_level.upper(), link=link)
    sys.exit(run_front_end(engine, settings, options, sock, supervised=True))


class _Supervisor:
    """Waits for the front ends; forwards a stop to them; stops them all when one fails unasked; then
    sees the core out. SIGINT from a terminal reaches every process of the group: a front end takes
    its own as a drain, the stages after it come from here, and the core waits for the front ends."""

    def __init__(self, core: multiprocessing.process.BaseProcess, control_address: str) -> None:
        self.core = core
        self.context = zmq.Context()
        self.control = self.context.socket(zmq.PUSH)
        self.control.bind(control_address)
        self.front_ends: list[multiprocessing.process.BaseProcess] = []
        self.stopping = False
        self.interrupts = 0
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.interrupt)

    def stop(self, *_) -> None:
        self.stopping = True
        self._forward(signal.SIGTERM)   # uvicorn drains on SIGTERM; a second SIGINT would cut

    def interrupt(self, *_) -> None:
        """Each SIGINT steps the stop on as it would with one front end: the first drains, the second
        ends the open requests with an error and forces the stop soon, the third at once. The front
        ends get the stage it reaches, whether the Ctrl-C came to the group or to this process alone."""
        self.interrupts += 1
        if self.interrupts == 1 or not self.stopping:
            self.stop()
        else:
            self._forward(FORCE_SOON_SIGNAL if self.interrupts == 2 else FORCE_NOW_SIGNAL)

    def _forward(self, sig: int) -> None:
        for process in self.front_ends:
            if process.is_alive():
                os.kill(process.pid, sig)

    def run(self) -> int:
        """The exit code: 0 after a clean stop, 1 if any process failed or died unasked."""
        code = 0
        running = {process.sentinel: process for process in self.front_ends}
        if self.stopping:   # asked before the last front end had started
            self.stop()
        while running:
            for sentinel in multiprocessing.connection.wait(list(running)):
                process = running.pop(sentinel)
                process.join()
                # a front end stopped before it had set up its handlers dies of the SIGTERM itself,
                # with nothing in flight: that is a clean stop too. One that ends unasked, even with
                # 0 (a SIGTERM sent to it alone drains it), stops the server: a failure to the
                # service manager, which would not restart a server that exits 0
                if not self.stopping or process.exitcode not in (0, -signal.SIGTERM):
                    code = 1
                if not self.stopping:
                    logger.error("Front end %s %s; stopping the server", process.name, exit_reason(process))
                    self.stop()
        return self._see_core_out(code)

    def _see_core_out(self, code: int) -> int:
        # a front end that stopped cleanly told the core so, one that failed or was stopped while it
        # started did not: the core stops now, having finished its step and closed its workers
        core, deadline = self.core, time.monotonic() + _CORE_STOP_S
        while core.is_alive() and time.monotonic() < deadline:
            try:   # a core still importing has not connected yet: the message waits for it
                self.control.send(input_encoder.encode(Shutdown(everyone=True)), zmq.NOBLOCK)
                break
            except zmq.Again:
                core.join(0.05)
        self.control.close(linger=1000)
        self.context.term()
        core.join(max(0.0, deadline - time.monotonic()))
        if core.is_alive():
            logger.warning("The engine core did not stop in %.0f s after the front ends; killing it", _CORE_STOP_S)
            core.kill()
            core.join()
            return 1
        if core.exitcode != 0:
            logger.error("The engine core %s", exit_reason(core))
            return 1
        return code
