"""The engine core: an LLMEngine in a busy loop behind two ZeroMQ sockets.

`serve` runs it in a process of its own (`run_engine_process`), so that the device never waits
on HTTP work and HTTP work never waits on the device. Tests may run the same loop on a thread
of their own process (`EngineCore(...).run(engine)`), where they can make a step fail on purpose.
Per step it sends one EngineOutputs message: every request's new tokens and a stats snapshot.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import msgspec
import torch
import zmq

from nanoserve.config import EngineConfig
from nanoserve.defaults import ENGINE_HEARTBEAT_S, LOG_FORMAT
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.messages import (AbortRequests, AddRequest, EngineDied, EngineOutputs, EngineReady, EngineStats,
                                       RequestFailed, Shutdown, StepOutput, input_decoder, output_encoder)
from nanoserve.lifetime import die_with_parent, freeze_startup_heap, ignore_stop_signals

logger = logging.getLogger(__name__)

_PARENT_CHECK_MS = 1000  # how often an idle core checks that its front end still lives
_STALLED_WAIT_MS = 1     # how long a core whose step did nothing waits before trying again


class EngineCore:
    """Steps an engine while it has work; blocks on the input sockets while it has none.

    It serves one front end, or several (`serve --api-server-count N`): the inputs of all are read
    as they come, each request's outputs go back to the front end that added it, and the stats
    snapshot, heartbeats, readiness and death go to every one."""

    def __init__(self, input_addresses: list[str], output_addresses: list[str], parent_pid: int | None = None) -> None:
        self.parent_pid = parent_pid
        self.context = zmq.Context()
        self.inputs = self.context.socket(zmq.PULL)
        for address in input_addresses:
            self.inputs.connect(address)
        self.outputs = []
        for address in output_addresses:
            socket = self.context.socket(zmq.PUSH)
            socket.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a slow front end
            socket.connect(address)
            self.outputs.append(socket)
        self.client_of: dict[str, int] = {}   # request id -> the front end that added it, while in the engine
        self.open_clients = len(self.outputs)  # front ends that have not yet said Shutdown

    def send(self, message) -> None:
        """To every front end."""
        frame = output_encoder.encode(message)
        for socket in self.outputs:
            socket.send(frame, copy=False)

    def send_step(self, outputs: list[StepOutput], stats: EngineStats, failed: list[RequestFailed]) -> None:
        """Each front end gets its own requests' outputs and failures, and the stats."""
        if len(self.outputs) == 1:
            self._forget(outputs, failed)
            self.send(EngineOutputs(outputs, stats, failed))
            return
        routed = [([], []) for _ in self.outputs]
        for output in outputs:
            client = self.client_of.get(output.request_id)
            if client is not None:   # else aborted by its front end, which wants nothing more of it
                routed[client][0].append(output)
        for failure in failed:
            client = self.client_of.get(failure.request_ids[0])
            if client is not None:
                routed[client][1].append(failure)
        self._forget(outputs, failed)
        for socket, (client_outputs, client_failed) in zip(self.outputs, routed):
            socket.send(output_encoder.encode(EngineOutputs(client_outputs, stats, client_failed)), copy=False)

    def _forget(self, outputs: list[StepOutput], failed: list[RequestFailed]) -> None:
        for output in outputs:
            if output.finished:
                self.client_of.pop(output.request_id, None)
        for failure in failed:
            for request_id in failure.request_ids:
                self.client_of.pop(request_id, None)

    def died(self, exc: BaseException) -> None:
        """Tell the front ends the core is gone, and why (for their log), then close the sockets."""
        self.send(EngineDied(f"{type(exc).__name__}: {exc}"))
        self.close()

    def close(self, linger_ms: int = 1000) -> None:
        """`linger_ms`: how long what is still unsent may hold the close, for front ends to read it."""
        self.inputs.close(linger=0)
        for socket in self.outputs:
            socket.close(linger=linger_ms)
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
        # every front end has said Shutdown and reads nothing more: a heartbeat queued for one that has
        # already gone held the close a whole second (--api-server-count N stopped a second late)
        self.close(linger_ms=0)

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
            if self._take_inputs():
                return
            outputs = engine.step() if engine.has_unfinished_requests() else []
            failed = [RequestFailed(ids, why) for ids, why in engine.take_failures()]
            stats = engine.stats()
            if outputs or failed or stats != last_stats or time.monotonic() - last_sent >= ENGINE_HEARTBEAT_S:
                self.send_step(outputs, stats, failed)
                last_stats, last_sent = stats, time.monotonic()
            elif engine.has_unfinished_requests():
                # work that cannot run yet (a grammar still compiling): wait for input, do not spin
                self.inputs.poll(_STALLED_WAIT_MS)

    def _take_inputs(self) -> bool:
        """Add and abort what the front ends sent; True once every front end has said Shutdown."""
        while True:
            try:
                message = input_decoder.decode(self.inputs.recv(zmq.NOBLOCK, copy=False))
            except zmq.Again:
                return False
            except msgspec.DecodeError:  # a front end's bug must not stop the engine for everyone
                logger.exception("Dropped a message the engine core could not decode")
                continue
            if isinstance(message, AddRequest):
                self._add(message)
            elif isinstance(message, AbortRequests):
                for request_id in message.request_ids:
                    self.engine.abort_request(request_id)
                    self.client_of.pop(request_id, None)
            elif isinstance(message, Shutdown):
                self.open_clients -= 1
                if self.open_clients <= 0 or message.everyone:
                    return True

    def _add(self, message: AddRequest) -> None:
        if not 0 <= message.client < len(self.outputs):
            logger.error("Dropped a request from front end %d of %d", message.client, len(self.outputs))
            return
        for request_id, prompt, fork_ids in zip(message.request_ids, message.prompts, message.fork_ids):
            ids = [request_id, *fork_ids]
            try:
                self.engine.add_request(request_id, prompt, message.params, fork_ids, message.priority)
            except ValueError as exc:  # this prompt alone is bad; the engine is fine
                # sent to its front end now: an id already in use must not take the other request's outputs
                self.outputs[message.client].send(output_encoder.encode(
                    EngineOutputs([], self.engine.stats(), [RequestFailed(ids, str(exc))])), copy=False)
                continue
            for rid in ids:
                self.client_of[rid] = message.client


def run_engine_process(config: EngineConfig, input_addresses: list[str], output_addresses: list[str],
                       parent_pid: int, log_level: str = "INFO") -> None:
    """The engine process's main: load the model, report ready, loop. Exits non-zero on failure."""
    die_with_parent(parent_pid)
    ignore_stop_signals()
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    start = time.perf_counter()
    core = EngineCore(input_addresses, output_addresses, parent_pid)
    try:
        engine = LLMEngine(config, show_progress=True)
    except BaseException as exc:  # the front end still has to hear of it
        if isinstance(exc, (ValueError, OSError)):   # the model's folder or the flags: the reason says it all
            logger.error("The engine failed to start: %s", exc)
        else:
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
