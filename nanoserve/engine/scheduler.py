"""Continuous batching: each step hands a token budget to sequences, running ones first."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.sequence import Sequence, SequenceStatus


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
    When blocks run out the newest running sequence is preempted and later recomputed."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            if self._reserve(seq, n, step):
                step.seqs.append(seq)
                step.num_new_tokens.append(n)
                budget -= n
                i += 1
        # admitting while preempting would only thrash: the preempted go first next time
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and not step.num_preempted):
            seq = self.waiting[0]
            if not seq.block_table:
                self.block_manager.admit(seq)
            n = seq.num_tokens - seq.num_computed_tokens
            if n > budget and not self.enable_chunked_prefill:
                self.block_manager.release(seq)
                break
            n = min(n, budget)
            if not self.block_manager.allocate_slots(seq, n):
                self.block_manager.release(seq)
                break
            self.waiting.popleft()
            self.block_manager.record_prefix_hit(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            step.seqs.append(seq)
            step.num_new_tokens.append(n)
            budget -= n
        return step

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
        self.waiting.appendleft(seq)

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
