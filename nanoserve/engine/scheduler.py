"""Continuous batching: each step hands a token budget to sequences, running ones first."""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)

SchedulingPolicy = Literal["fcfs", "priority"]


def rank(seq: Sequence) -> tuple[int, int]:
    """Under the priority policy, who goes first: the lower priority value, then the earlier arrival."""
    return seq.priority, seq.arrival


@dataclass
class ScheduledStep:
    """The sequences to run this step and how many new tokens each computes."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    """Phase-free scheduling: a prefill is a sequence with many tokens to compute, a decode one
    with one. Long prompts are chunked to the budget, so decodes keep flowing beside them.
    When blocks run out the newest running sequence is preempted and later recomputed.

    Under the priority policy (vLLM's `--scheduling-policy priority`) both queues are kept in
    `rank` order, so the same rules favour the lower priority value: it is admitted first, the
    last in rank is preempted first, and a waiting sequence that outranks a running one by
    priority preempts it when there is no room (no blocks, or `max_num_seqs` running)."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, policy: SchedulingPolicy = "fcfs") -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.by_priority = policy == "priority"
        # first come first: a deque; by priority: a list in rank order (a few thousand at most)
        self.waiting: deque[Sequence] | list[Sequence] = [] if self.by_priority else deque()
        self.running: list[Sequence] = []  # oldest first (by priority: in rank order)
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence, first: bool = False) -> None:
        """Queue a sequence; `first` puts it ahead of the others where arrival decides the order."""
        if self.by_priority:
            bisect.insort(self.waiting, seq, key=rank)
        elif first:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if not self._can_run(seq):
                logger.error("Sequence %s holds a token still being sampled behind %d uncomputed tokens; it "
                             "waits a step", seq.request_id, seq.num_tokens - seq.num_computed_tokens)
                i += 1
                continue
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            if self._reserve(seq, n, step):
                step.seqs.append(seq)
                step.num_new_tokens.append(n)
                budget -= n
                i += 1
        # admitting while running sequences had to be preempted would only thrash: they go first next time
        starved = step.num_preempted > 0
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if not self._can_run(seq):
                break   # preempted while its last token was being sampled: it is computed again once that is read
            outranks = self.by_priority and self.running and seq.priority < self.running[-1].priority
            if (len(self.running) >= self.max_num_seqs or starved) and not outranks:
                if seq.block_table:   # its prefix, held while it preempted lower ones that did not free enough
                    self.block_manager.release(seq)
                break
            if len(self.running) >= self.max_num_seqs:
                budget += self._preempt_last(step)
                continue
            if not seq.block_table:
                self.block_manager.admit(seq)
            n = seq.num_tokens - seq.num_computed_tokens
            if n > budget and not self.enable_chunked_prefill:
                self.block_manager.release(seq)
                break
            n = min(n, budget)
            if not self.block_manager.allocate_slots(seq, n):
                if outranks:   # its cached prefix stays held: the blocks freed are for the rest
                    budget += self._preempt_last(step)
                    continue
                self.block_manager.release(seq)
                break
            self._pop_waiting()
            self.block_manager.record_prefix_hit(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.scheduled_at is None:
                seq.scheduled_at = time.monotonic()
            if self.by_priority:
                bisect.insort(self.running, seq, key=rank)
            else:
                self.running.append(seq)
            step.seqs.append(seq)
            step.num_new_tokens.append(n)
            budget -= n
        return step

    @staticmethod
    def _can_run(seq: Sequence) -> bool:
        """With pipelined steps a sequence's last token may still be being sampled (`pending_row`): the
        runner reads it on the device only as the first new token of a step, so such a sequence runs
        only as that token's decode. A preempted one, all to compute again, waits until it is read
        back (the engine died of a placeholder -1 that went into the model in its place)."""
        return seq.pending_row < 0 or seq.num_computed_tokens == seq.num_tokens - 1

    def _pop_waiting(self) -> Sequence:
        return self.waiting.pop(0) if self.by_priority else self.waiting.popleft()

    def _preempt_last(self, step: ScheduledStep) -> int:
        """Preempt the last running sequence for a waiting one that outranks it; give back the
        tokens of this step it held, if it was already scheduled."""
        victim = self.running.pop()
        self._preempt(victim)
        step.num_preempted += 1
        for i, seq in enumerate(step.seqs):
            if seq is victim:
                del step.seqs[i]
                return step.num_new_tokens.pop(i)
        return 0

    def _reserve(self, seq: Sequence, n: int, step: ScheduledStep) -> bool:
        """Find blocks for `n` tokens of `seq`, preempting the newest running sequences."""
        while not self.block_manager.allocate_slots(seq, n):
            victim = self.running.pop()
            self._preempt(victim)
            step.num_preempted += 1
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq, first=True)

    def finish(self, seq: Sequence, reason: str) -> None:
        # a sequence preempted while its last step was in flight finishes from the waiting queue
        (self.running if seq.status == SequenceStatus.RUNNING else self.waiting).remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.release(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.block_manager.release(seq)
                    seq.status = SequenceStatus.FINISHED
                    seq.finish_reason = "abort"
                    return seq
        return None
