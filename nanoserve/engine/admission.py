"""How many sequences a front end lets in: those running plus at most max_queue_len waiting."""

from __future__ import annotations

import random
import time
from collections import deque

from nanoserve.engine.validation import RequestRefused


class QueueFullError(RuntimeError):
    """More sequences are waiting than the server admits; the client should retry later."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Admission:
    """At most `max_num_seqs + max_queue_len` sequences (prompts × n) at once, running and waiting;
    None admits all. Front ends that share a core count the others' sequences from its stats."""

    def __init__(self, max_num_seqs: int, max_queue_len: int | None) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_queue_len = max_queue_len
        self.others = 0   # sequences of the other front ends in the core, at its last stats
        self._finished_times: deque[float] = deque(maxlen=4096)  # recent completions, for Retry-After

    def check(self, num_seqs: int, admitted: int, param: str) -> None:
        """Raise RequestRefused for a request larger than the server ever holds, QueueFullError for
        one that does not fit now beside the `admitted` sequences of this front end."""
        if self.max_queue_len is None:
            return
        capacity = self.max_num_seqs + self.max_queue_len
        if num_seqs > capacity:
            raise RequestRefused(f"The request asks for {num_seqs} sequences (prompts × n), more than this server "
                                 f"ever holds at once ({capacity}: max_num_seqs + max_queue_len)", param,
                                 "too_many_sequences")
        admitted += self.others
        if admitted + num_seqs > capacity:
            waiting = max(0, admitted - self.max_num_seqs)
            raise QueueFullError(f"{waiting} sequences are already waiting (max_queue_len {self.max_queue_len}); "
                                 "retry later", self._retry_after(waiting + num_seqs))

    def finished(self) -> None:
        self._finished_times.append(time.monotonic())

    def _retry_after(self, queued: int) -> int:
        """Seconds until about `queued` sequences have drained, at the recent rate; jittered so that
        refused clients do not all come back in the same second."""
        now = time.monotonic()
        recent = [t for t in self._finished_times if now - t < 30.0]
        rate = len(recent) / 30.0
        estimate = queued / rate if rate > 0 else 5.0
        return max(1, min(60, round(estimate * random.uniform(0.75, 1.25))))
