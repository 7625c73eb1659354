"""The engine core's process, started before the server has loaded: it imports torch and the model
code while the front end imports its own (each takes seconds), then waits for its arguments.

Importing this module loads neither: `serve` starts the process right after its flags are checked.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os

from nanoserve.lifetime import die_with_parent, ignore_stop_signals, start_ignoring_sigint


class EarlyEngineProcess:
    """A spawned process that becomes the engine core once `run` sends it run_engine_process's
    arguments. If the server exits first (a refused flag, a port in use), the process reads the end
    of its pipe and exits 0, having done nothing."""

    def __init__(self) -> None:
        spawn = multiprocessing.get_context("spawn")   # a CUDA context cannot be forked
        receive, self._send = spawn.Pipe(duplex=False)
        self.process = spawn.Process(target=_wait_then_run, args=(receive, os.getpid()), name="nanoserve-engine")
        start_ignoring_sigint(self.process)   # Ctrl-C is the server's to handle; the core stops when it is told
        receive.close()   # the child's copy is the one that reads; ours would keep the pipe open
        # multiprocessing joins its children at exit: a server that exits before `run` (a flag refused,
        # a port in use) first ends the wait, so the process exits and the join returns
        atexit.register(self._send.close)

    def run(self, *args) -> multiprocessing.process.BaseProcess:
        """Hand the process run_engine_process's arguments; it is the core from here on. A process that
        already died is returned all the same: its sentinel tells the caller."""
        try:
            self._send.send(args)
        except OSError:   # BrokenPipeError: it died while importing, and its exit says how
            pass
        finally:
            self._send.close()
        return self.process


def _wait_then_run(receive: multiprocessing.connection.Connection, parent_pid: int) -> None:
    die_with_parent(parent_pid)
    ignore_stop_signals()
    from nanoserve.engine.core import run_engine_process   # torch and the model code, while the server loads

    try:
        args = receive.recv()
    except EOFError:   # the server stopped before its engine was needed
        return
    finally:
        receive.close()
    run_engine_process(*args)
