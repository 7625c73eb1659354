"""The worker processes of tensor parallelism: ranks 1..N-1, each running its shard of every step.

Rank 0 (the engine's process) starts them, then all ranks join one process group. A worker builds
the same ModelRunner as rank 0, so profiling and graph capture run in lockstep, and then runs each
step that rank 0 broadcasts until it receives None.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.synchronize
import os
import socket

from nanoserve.config import EngineConfig
from nanoserve.lifetime import die_with_parent, ignore_stop_signals
from nanoserve.runner.parallel import TensorParallel, init_process_group

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_workers(config: EngineConfig) -> tuple[TensorParallel, list[multiprocessing.Process]]:
    """Start ranks 1..N-1 and join them as rank 0."""
    size = config.tensor_parallel_size
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked into a child
    started = [context.Event() for _ in range(1, size)]
    workers = [context.Process(target=_worker_main, args=(config, rank, init_method, os.getpid(), started[rank - 1]),
                               daemon=True, name=f"nanoserve-tp{rank}") for rank in range(1, size)]
    for worker in workers:
        worker.start()
    # multiprocessing's own exit hook SIGTERMs daemon children, which these ignore, and then waits
    # for them forever: a process that never closed its engine hung at exit. This hook runs first.
    atexit.register(_kill_left_over, workers)
    _wait_until_started(workers, started)
    logger.info("started %d tensor-parallel workers", len(workers))
    return init_process_group(0, size, init_method, config.device), workers


def _wait_until_started(workers: list[multiprocessing.Process],
                        started: list[multiprocessing.synchronize.Event]) -> None:
    """Wait until each worker runs its own code; RuntimeError if one exits first. Rank 0 would
    otherwise wait in the process group's rendezvous for a rank that is gone (30 minutes, silent)."""
    for worker, event in zip(workers, started):
        while not event.wait(0.1):
            if not worker.is_alive():
                _kill_left_over(workers)
                raise RuntimeError(
                    f"Tensor-parallel worker {worker.name} exited (code {worker.exitcode}) before it started; its "
                    "error is printed above. A worker process imports the script that started it (multiprocessing's "
                    "spawn), so a script that builds LLM(...) at its top level needs that code under "
                    "`if __name__ == \"__main__\":`, as multiprocessing requires")


def _kill_left_over(workers: list[multiprocessing.Process]) -> None:
    """At exit, the workers the engine did not stop (never closed, or failed during startup)."""
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            worker.join(timeout=10)


def _worker_main(config: EngineConfig, rank: int, init_method: str, parent_pid: int,
                 started: multiprocessing.synchronize.Event) -> None:
    from nanoserve.runner.model_runner import ModelRunner

    die_with_parent(parent_pid)  # a SIGKILLed engine must not leave its workers on the GPU
    ignore_stop_signals()
    started.set()
    tp = init_process_group(rank, config.tensor_parallel_size, init_method, config.device)
    runner = ModelRunner(config, tp=tp)
    runner.serve_steps()
    runner.close()
