"""The engine core: an LLMEngine in a busy loop behind two ZeroMQ sockets.

`serve` runs it in a process of its own (`run_engine_process`), so that the device never waits
on HTTP work and HTTP work never waits on the device. Tests may run the same loop on a thread
of their own process (`EngineCore(...).run(engine)`), where they can make a step fail on purpose.
Per step it sends one EngineOutputs message: every request's new tokens and a stats snapshot.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import msgspec
import torch
import zmq

from nanoserve.config import EngineConfig
from nanoserve.defaults import ENGINE_HEARTBEAT_S, LOG_FORMAT
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.messages import (AbortRequests, AddRequest, EngineDied, EngineOutputs, EngineReady,
                                       RequestFailed, Shutdown, input_decoder, output_encoder)
from nanoserve.lifetime import die_with_parent, freeze_startup_heap

logger = logging.getLogger(__name__)

_PARENT_CHECK_MS = 1000  # how often an idle core checks that its front end still lives
_STALLED_WAIT_MS = 1     # how long a core whose step did nothing waits before trying again


class EngineCore:
    """Steps an engine while it has work; blocks on the input socket while it has none."""

    def __init__(self, input_address: str, output_address: str, parent_pid: int | None = None) -> None:
        self.parent_pid = parent_pid
        self.context = zmq.Context()
        self.inputs = self.context.socket(zmq.PULL)
        self.inputs.connect(input_address)
        self.outputs = self.context.socket(zmq.PUSH)
        self.outputs.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a slow front end
        self.outputs.connect(output_address)

    def send(self, message) -> None:
        self.outputs.send(output_encoder.encode(message), copy=False)

    def died(self, exc: BaseException) -> None:
        """Tell the front end the core is gone, and why (for its log), then close the sockets."""
        self.send(EngineDied(f"{type(exc).__name__}: {exc}"))
        self.close()

    def close(self) -> None:
        self.inputs.close(linger=0)
        self.outputs.close(linger=1000)
        self.context.term()

    def run(self, engine: LLMEngine, load_seconds: float = 0.0) -> None:
        """Report ready, then loop until told to shut down; any error is sent as EngineDied, then raised."""
        self.engine = engine
        config = engine.config
        self.send(EngineReady(engine.block_manager.num_blocks, config.block_size, config.device,
                              str(config.dtype).removeprefix("torch."), load_seconds,
                              engine.runner.graph_capture_seconds))
        try:
            if config.device.startswith("cuda:"):
                # the current device is per thread: make it the engine's, not cuda:0 by default
                torch.cuda.set_device(torch.device(config.device))
            self._loop()
        except BaseException as exc:
            logger.exception("The engine core failed; every request in flight fails with it")
            self.died(exc)
            raise
        self.close()

    def _loop(self) -> None:
        engine, last_stats, last_sent = self.engine, None, 0.0
        while True:
            if not engine.has_unfinished_requests() and not self.inputs.poll(_PARENT_CHECK_MS):
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    return  # orphaned where the kernel could not be asked to kill us
                if time.monotonic() - last_sent >= ENGINE_HEARTBEAT_S:
                    self.send(EngineOutputs([], engine.stats(), []))  # alive, and idle
                    last_sent = time.monotonic()
                continue
            failed, stop = self._take_inputs()
            if stop:
                return
            outputs = engine.step() if engine.has_unfinished_requests() else []
            failed += [RequestFailed(ids, why) for ids, why in engine.take_failures()]
            stats = engine.stats()
            if outputs or failed or stats != last_stats or time.monotonic() - last_sent >= ENGINE_HEARTBEAT_S:
                self.send(EngineOutputs(outputs, stats, failed))
                last_stats, last_sent = stats, time.monotonic()
            elif engine.has_unfinished_requests():
                # work that cannot run yet (a grammar still compiling): wait for input, do not spin
                self.inputs.poll(_STALLED_WAIT_MS)

    def _take_inputs(self) -> tuple[list[RequestFailed], bool]:
        failed: list[RequestFailed] = []
        while True:
            try:
                message = input_decoder.decode(self.inputs.recv(zmq.NOBLOCK, copy=False))
            except zmq.Again:
                return failed, False
            except msgspec.DecodeError:  # a front end's bug must not stop the engine for everyone
                logger.exception("Dropped a message the engine core could not decode")
                continue
            if isinstance(message, AddRequest):
                for request_id, prompt, fork_ids in zip(message.request_ids, message.prompts, message.fork_ids):
                    try:
                        self.engine.add_request(request_id, prompt, message.params, fork_ids, message.priority)
                    except ValueError as exc:  # this prompt alone is bad; the engine is fine
                        failed.append(RequestFailed([request_id, *fork_ids], str(exc)))
            elif isinstance(message, AbortRequests):
                for request_id in message.request_ids:
                    self.engine.abort_request(request_id)
            elif isinstance(message, Shutdown):
                return failed, True


def run_engine_process(config: EngineConfig, input_address: str, output_address: str, parent_pid: int,
                       log_level: str = "INFO") -> None:
    """The engine process's main: load the model, report ready, loop. Exits non-zero on failure."""
    die_with_parent(parent_pid)
    # Ctrl-C reaches the whole process group: the front end drains, then tells the core to stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    start = time.perf_counter()
    core = EngineCore(input_address, output_address, parent_pid)
    try:
        engine = LLMEngine(config, show_progress=True)
    except BaseException as exc:  # the front end still has to hear of it
        logger.exception("The engine failed to start")
        core.died(exc)
        sys.exit(1)
    freeze_startup_heap()
    try:
        core.run(engine, time.perf_counter() - start)
    except BaseException:
        sys.exit(1)
    finally:
        engine.close()
