"""How many sequences a front end lets in: those running plus at most max_queue_len waiting."""

from __future__ import annotations

import random
import time
from collections import deque
from typing import Any

from nanoserve.engine.validation import RequestRefused


_RATE_WINDOW_S = 30.0   # Retry-After reads the completion rate of this last stretch


class QueueFullError(RuntimeError):
    """More sequences are waiting than the server admits; the client should retry later."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class SharedCounts:
    """The sequences each front end that shares a core has admitted, in memory their processes share
    (a multiprocessing Array of int64, one slot a front end, written by that front end alone).

    The core's stats lag by a step or more, and while it was idle every front end read 0 from them:
    a burst spread over N front ends was admitted up to N times over."""

    def __init__(self, slots: Any, index: int) -> None:
        self.slots, self.index = slots, index

    def publish(self, admitted: int) -> None:
        self.slots[self.index] = admitted

    def others(self) -> int:
        return sum(self.slots) - self.slots[self.index]


class Admission:
    """At most `max_num_seqs + max_queue_len` sequences (prompts × n) at once, running and waiting;
    None admits all. Front ends that share a core (`shared`) count each other's admitted sequences."""

    def __init__(self, max_num_seqs: int, max_queue_len: int | None, shared: SharedCounts | None = None) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_queue_len = max_queue_len
        self.shared = shared if max_queue_len is not None else None
        self._finished_times: deque[float] = deque(maxlen=4096)  # recent completions, for Retry-After

    def check(self, num_seqs: int, admitted: int, param: str) -> None:
        """Raise RequestRefused for a request larger than the server ever holds, QueueFullError for
        one that does not fit now beside the `admitted` sequences of this front end. With other
        front ends, a request that fits is claimed at once: `settle` the count once it is registered."""
        if self.max_queue_len is None:
            return
        capacity = self.max_num_seqs + self.max_queue_len
        if num_seqs > capacity:
            raise RequestRefused(f"The request asks for {num_seqs} sequences (prompts × n), more than this server "
                                 f"ever holds at once ({capacity}: max_num_seqs + max_queue_len)", param,
                                 "too_many_sequences")
        total = admitted
        if self.shared is not None:
            # claimed before the others are read: two front ends admitting at once each see the
            # other's claim (and may both refuse), so together they never pass the capacity
            self.shared.publish(admitted + num_seqs)
            total += self.shared.others()
        if total + num_seqs > capacity:
            self.settle(admitted)
            waiting = max(0, total - self.max_num_seqs)
            raise QueueFullError(f"{waiting} sequences are already waiting (max_queue_len {self.max_queue_len}); "
                                 "retry later", self._retry_after(waiting + num_seqs))

    def settle(self, admitted: int) -> None:
        """This front end now holds `admitted` unfinished sequences (for the other front ends' checks)."""
        if self.shared is not None:
            self.shared.publish(admitted)

    def finished(self) -> None:
        self._finished_times.append(time.monotonic())

    def _retry_after(self, queued: int) -> int:
        """Seconds until about `queued` sequences have drained, at the recent rate; jittered so that
        refused clients do not all come back in the same second."""
        now = time.monotonic()
        recent = [t for t in self._finished_times if now - t < _RATE_WINDOW_S]
        # over the time the completions were seen in: just after startup a full window's span
        # understated the rate (19-34 s advised where the queue drained in 2)
        span = max(1.0, now - recent[0]) if recent else _RATE_WINDOW_S
        rate = len(recent) / span
        estimate = queued / rate if rate > 0 else 5.0
        return max(1, min(60, round(estimate * random.uniform(0.75, 1.25))))
