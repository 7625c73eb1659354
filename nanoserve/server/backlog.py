"""Output that clients have not read yet, held within one budget for the whole front end.

A response waits for its client in three places, all in this process: the request's stream,
where updates the response has not taken yet merge (RequestStream.pending_bytes), and what its
outputs keep once the engine is done with it (a whole response's text and logprobs, an echoed
prompt's logprobs: kept_bytes); the one body message uvicorn's
`send` holds while it waits for the socket to drain (it waits before writing, so a client that
does not read stops its response here); and the connection's transport buffer (up to its
high-water mark plus the last message written). Admission stops counting a request once the
engine finishes it, so without a bound 64 streams trickling a byte every 0.5 s held 110 MB here
with nothing running, and --max-connections of them could exhaust memory.

OutputBudget sums each open response's backlog a few times a second; past the budget it ends the
responses furthest behind (the largest backlogs) until the rest fit: the request is aborted in
the engine (its KV blocks freed), its pending output dropped, and its connection aborted. An
error event would only queue behind what the client is not reading, so none is sent. Other
responses go on as before: nothing here waits on a client.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nanoserve.engine.async_engine import RequestFailedError, RequestStream

logger = logging.getLogger(__name__)

MiB = 1024 * 1024
# the connection's transport, where the HTTP protocol (server/connections.py) puts it in the scope
TRANSPORT_KEY = "nanoserve.transport"
DELIVERY_KEY = "nanoserve.delivery"
# how often backlogs are summed: at ~25k tokens/s with 20 logprobs a backlog grows ~70 MB/s, so the
# budget is overshot by ~17 MB at most; summing 4,096 connections takes ~1 ms
CHECK_INTERVAL_S = 0.25
# a body message this large is checked at once: 8 choices echoing a long prompt's logprobs put
# megabytes in the buffers between two periodic checks
LARGE_MESSAGE_BYTES = 256 * 1024


class OutputBacklogError(RequestFailedError):
    """This request's client read its output too slowly while the server's budget for unread output was spent."""


class Delivery:
    """One HTTP request's response on its way to the client: where its unread bytes wait."""

    __slots__ = ("transport", "stream", "in_hand", "label")

    def __init__(self, scope: Scope) -> None:
        self.transport: asyncio.Transport | None = scope.get(TRANSPORT_KEY)
        # weak: a whole response's outputs count while something still needs them, and are not
        # kept alive by this count once its body is built
        self.stream: weakref.ref[RequestStream] | None = None
        self.in_hand = 0     # bytes of the body message `send` holds while the socket drains
        self.label = scope.get("path", "")

    def backlog(self) -> int:
        """About how many bytes of this response this process holds for its client."""
        held = self.in_hand
        if self.transport is not None and not self.transport.is_closing():
            held += self.transport.get_write_buffer_size()
        stream = self.stream() if self.stream is not None else None
        if stream is not None:
            held += stream.pending_bytes
            if stream.engine_done:   # running, its outputs are the engine's work, bounded by admission
                held += stream.kept_bytes
        return held


class OutputBudget:
    """At most `max_bytes` of output held for clients that have not read it, over every connection."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.deliveries: set[Delivery] = set()
        self.held_bytes = 0      # at the last check
        self.num_ended = 0       # responses ended for their backlog, since start
        self._check_due = False  # a check is scheduled on the event loop

    def watch(self, scope: Scope, stream: RequestStream, label: str) -> None:
        """Count `stream`'s pending output as part of the response of the request of `scope`."""
        delivery = scope.get(DELIVERY_KEY)
        if delivery is not None:
            delivery.stream = weakref.ref(stream)
            delivery.label = label

    def check_soon(self) -> None:
        """Check once the current callback is done; many calls before then make one check."""
        if not self._check_due:
            self._check_due = True
            asyncio.get_running_loop().call_soon(self.check)

    def check(self) -> None:
        """End the responses with the largest backlogs until the rest fit the budget."""
        self._check_due = False
        held = [(delivery.backlog(), delivery) for delivery in self.deliveries]
        total = sum(size for size, _ in held)
        if total > self.max_bytes:
            held.sort(key=lambda entry: entry[0], reverse=True)
            for size, delivery in held:
                if total <= self.max_bytes:
                    break
                self._end(delivery, size, total)
                total -= size
        self.held_bytes = total

    def _end(self, delivery: Delivery, size: int, total: int) -> None:
        self.deliveries.discard(delivery)
        self.num_ended += 1
        logger.warning("%s ended: its client left %.1f MB of output unread, the most of any, while the server held "
                       "%.1f MB for slow readers (--max-undelivered-mb %g)", delivery.label, size / MiB, total / MiB,
                       self.max_bytes / MiB)
        stream = delivery.stream() if delivery.stream is not None else None
        if stream is not None:
            stream.drop_pending()
            stream.fail(OutputBacklogError(f"The client read this response too slowly: {size / MiB:.1f} MB of it "
                                           "waited unread while the server's budget for unread output was spent"))
            stream.close()   # aborted in the engine: its KV blocks are freed now
        if delivery.transport is not None:
            # close() would wait to flush what the client is not reading; abort drops the buffer, and
            # the response's handler sees the disconnect and ends
            delivery.transport.abort()

    async def run(self) -> None:
        """Check the budget every CHECK_INTERVAL_S, while the server runs."""
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the budget must outlive one bad count
                logger.exception("Could not check the output held for slow readers")


class BudgetMiddleware:
    """Gives each HTTP request a Delivery that the budget counts while the request is open."""

    def __init__(self, app: ASGIApp, budget: OutputBudget) -> None:
        self.app, self.budget = app, budget

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        delivery = scope[DELIVERY_KEY] = Delivery(scope)

        async def counted(message: Message) -> None:
            if message["type"] != "http.response.body":
                await send(message)
                return
            delivery.in_hand = len(message.get("body", b""))
            if delivery.in_hand > LARGE_MESSAGE_BYTES:
                self.budget.check_soon()
            try:
                await send(message)
            finally:
                delivery.in_hand = 0

        self.budget.deliveries.add(delivery)
        try:
            await self.app(scope, receive, counted)
        finally:
            self.budget.deliveries.discard(delivery)


class BudgetCollector(Collector):
    """/metrics: the output held for clients now, and how many responses were ended for it."""

    def __init__(self, budget: OutputBudget) -> None:
        self.budget = budget

    def collect(self) -> Iterator[Metric]:
        held = sum(delivery.backlog() for delivery in self.budget.deliveries)
        yield GaugeMetricFamily("nanoserve:undelivered_output_bytes",
                                "Output held for clients that have not read it yet (estimated bytes)", held)
        yield CounterMetricFamily("nanoserve:undelivered_output_ended_requests",
                                  "Responses ended because their clients left too much output unread "
                                  "(--max-undelivered-mb)", self.budget.num_ended)
