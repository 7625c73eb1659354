"""Connections that cannot pile up: a deadline for request headers, and a cap past which only /health is served.

uvicorn closes a connection idle after a response (`timeout_keep_alive`) but not one that was
opened and never sent a request, nor one that sends its headers a byte at a time: h11 and
httptools have no header timeout, so ~20,000 such connections used up the file descriptors and
/health failed with everything else. This subclass of uvicorn's httptools protocol (the one
uvicorn[standard] picks) adds the deadline, and answers 503 on connections past the cap, as
uvicorn's own `limit_concurrency` does but with an OpenAI error object and /health exempt, so
that a load balancer still sees the server alive while it sheds connections.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus

import httptools
import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from nanoserve.server.backlog import TRANSPORT_KEY
from nanoserve.server.errors import APIError
from nanoserve.server.limits import ServerLimits

logger = logging.getLogger(__name__)

OVER_CAP_LOG_EVERY_S = 10.0
# probes: load balancers and Docker's HEALTHCHECK reach these with no API key and past the connection cap
ALWAYS_SERVED = {"/health", "/ping"}
# descriptors kept free beyond --max-connections: model files, the tensor-parallel sockets, and
# the connections past the cap, which are accepted to be answered 503 (or /health) and closed
RESERVED_FDS = 512
# bytes a request's line and headers may take: httptools has no cap, and 100 MB of small headers
# took 1.1 GB of memory that was never given back (nginx allows 32 KB, h11 16 KB)
MAX_HEAD_BYTES = 64 * 1024
# chunks a request body may come in (Transfer-Encoding: chunked): each is a Python call, and
# uvicorn joins each to the body read so far, so a 16 MB body in 1-byte chunks held the event loop,
# and every stream, for 10 s. 32 MiB (the default body limit) in chunks of 512 bytes still fits
MAX_BODY_CHUNKS = 65536
# what is left of a read after a request that asks for an upgrade is parsed in pieces this large
UPGRADE_PIECE_BYTES = 4096
# how long a connection refused mid-body is read and dropped after its answer: closed at once
# with the client still sending, it is reset, and the reset loses the answer before it is read
LINGER_S = 5.0


def canonical_path(path: str) -> str:
    """The path a route serves it under: no trailing slash, no doubled slashes ("//health/" is "/health")."""
    return "/" + "/".join(part for part in path.split("/") if part)


def route_path(scope: Scope) -> str:
    """The path after the app's root_path (--root-path) where the request's path starts with it, as
    Starlette's router reads it: a proxy may strip the prefix or keep it."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):] or "/"
    return path


def always_served(path: str) -> bool:
    """A probe path: served without the API key and past the connection cap ("/health/" too)."""
    return canonical_path(path) in ALWAYS_SERVED


def raise_open_file_limit(max_connections: int) -> None:
    """Raise this process's soft limit of open files toward the hard one, as vLLM does, so that
    --max-connections, not the descriptors, is what stops new connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + RESERVED_FDS
    if soft < wanted:
        try:
            target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError):  # some sandboxes forbid setrlimit: serve within the limit given
            pass
    if soft < wanted:
        logger.warning("Only %d open files are allowed (ulimit -n), fewer than --max-connections %d + %d spare: "
                       "raise the limit or lower --max-connections", soft, max_connections, RESERVED_FDS)


def over_capacity(app: ASGIApp, max_connections: int) -> ASGIApp:
    """The app for a connection past the cap: /health as usual, anything else 503; then close."""
    refusal = APIError(f"The server has more than {max_connections} open connections (--max-connections); "
                       "retry later, or reuse a connection", 503, code="too_many_connections",
                       headers={"connection": "close", "retry-after": "1"})

    async def app_over_capacity(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not always_served(scope["path"]):
            await refusal.response()(scope, receive, send)
            return

        async def closing(message: Message) -> None:
            if message["type"] == "http.response.start":  # this connection must not linger either
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await app(scope, receive, closing)

    return app_over_capacity


def _raw_response(error: APIError) -> bytes:
    """`error` as the bytes of a whole HTTP/1.1 response that closes its connection, for answers
    written by the connection itself, outside any request's ASGI cycle."""
    body = orjson.dumps(error.body())
    return (f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def _unchunked(cycle: RequestResponseCycle) -> Callable[[Message], Awaitable[None]]:
    """`cycle.send` for an HTTP/1.0 request: a response of unknown length (a stream) goes out as is,
    ended by closing the connection, where uvicorn would chunk it. HTTP/1.0 has no chunked coding,
    so its clients read the chunk sizes as part of the body (RFC 9112 6.1); uvicorn closes every
    HTTP/1.0 connection after its response, which is what ends such a body."""
    send = cycle.send
    unknown_length = False

    async def send_unchunked(message: Message) -> None:
        nonlocal unknown_length
        if message["type"] == "http.response.start":
            names = {name.lower() for name, _ in message.get("headers", [])}
            if b"content-length" not in names and b"transfer-encoding" not in names:
                unknown_length = True
                # uvicorn chunks when this is None, and counts the body down from the expected length
                cycle.chunked_encoding = False
                cycle.expected_content_length = 1 << 62
        elif unknown_length and message["type"] == "http.response.body" and not message.get("more_body", False):
            cycle.expected_content_length = len(message.get("body", b""))   # the last piece ends it exactly
        await send(message)

    return send_unchunked


def _cancelled(deadline: asyncio.TimerHandle | None) -> None:
    """Cancel a pending deadline, if any; None, for the attribute that held it."""
    if deadline is not None:
        deadline.cancel()


def connection_protocol(limits: ServerLimits) -> type[HttpToolsProtocol]:
    """uvicorn's `http=` protocol class enforcing `limits.timeout_headers`, `limits.timeout_body` (for
    the request body, and for a response the client leaves unread) and `limits.max_connections`."""

    class LimitedConnection(HttpToolsProtocol):
        _header_deadline: asyncio.TimerHandle | None = None
        _body_deadline: asyncio.TimerHandle | None = None
        _send_deadline: asyncio.TimerHandle | None = None
        _head_bytes: int | None = None   # bytes read of a request whose headers are not complete yet
        _last_bytes = b""                # the end of the last read, where a head's blank line may begin
        _body_chunks = 0                 # chunks of the current request's body read so far
        _dropping = False                # refused mid-body: whatever else arrives is dropped unread
        _linger: asyncio.TimerHandle | None = None
        _over_cap_quiet_until = 0.0      # of the class: the over-cap warning's next time, for every connection

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                now = time.monotonic()
                if now >= LimitedConnection._over_cap_quiet_until:   # a flood of connections made one line each
                    LimitedConnection._over_cap_quiet_until = now + OVER_CAP_LOG_EVERY_S
                    logger.warning("%d open connections (--max-connections %d): refusing new requests but /health "
                                   "(logged at most every %.0f s)", len(self.connections), limits.max_connections,
                                   OVER_CAP_LOG_EVERY_S)
                self.app = over_capacity(self.app, limits.max_connections)
            self._arm_header_deadline()  # a connection that never sends a request counts too

        def data_received(self, data: bytes) -> None:
            if self._dropping:
                return
            if self._between_requests() and self._header_deadline is None:
                self._arm_header_deadline()  # the first byte of the next request on a kept-alive connection
            if self._head_bytes is not None:
                # counted from the read after the one that began the request (at most one read over)
                # up to the head's blank line: what follows it in the read (a body, pipelined
                # requests) was counted too, and a burst of pipelined requests refused as one head
                self._head_bytes += self._head_part(data)
                if self._head_bytes > MAX_HEAD_BYTES:
                    self._refuse_head()
                    return
            self._feed(data)
            self._last_bytes = data[-3:]

        def _head_part(self, data: bytes) -> int:
            """The bytes of `data` up to the end of the head in progress, all of them if it goes on."""
            joint = (self._last_bytes + data[:3]).find(b"\r\n\r\n")   # a blank line across two reads
            if joint >= 0:
                return joint + 4 - len(self._last_bytes)
            end = data.find(b"\r\n\r\n")
            return len(data) if end < 0 else end + 4

        def _feed(self, data: bytes) -> None:
            # uvicorn's data_received, but for an upgrade, which this server never makes (no
            # WebSocket routes, no h2c): httptools skips the body of a request that asks for one,
            # so `curl --http2` (Connection: Upgrade, Upgrade: h2c) got a 400 for an empty JSON body
            self._unset_keepalive_if_required()
            pieces = [data]   # what is left of the read, its last piece first
            while pieces:
                piece = pieces.pop()
                try:
                    self.parser.feed_data(piece)
                except httptools.HttpParserError:
                    self.send_400_response("Invalid HTTP request received.")
                    return
                except httptools.HttpParserUpgrade as upgrade:
                    if not self._parse_again_without_upgrade():
                        return
                    # its body and what follows, in pieces: a read of thousands of such requests
                    # is then not copied whole again for each (httptools' offset needs bytes)
                    rest = range(upgrade.args[0], len(piece), UPGRADE_PIECE_BYTES)
                    pieces += [piece[i:i + UPGRADE_PIECE_BYTES] for i in reversed(rest)]

        def _parse_again_without_upgrade(self) -> bool:
            """Start the request again, its head less the upgrade, on a new parser: a server may
            ignore Upgrade (RFC 9110 7.8). False for CONNECT, refused (and the connection closed)."""
            method = self.parser.get_method()
            if method == b"CONNECT":   # the one method that always asks for a tunnel
                refusal = APIError("CONNECT is not served: this server is not a proxy", 405,
                                   code="method_not_allowed")
                self.transport.write(_raw_response(refusal))
                self.transport.close()
                return False
            head = [b"%s %s HTTP/%s\r\n" % (method, self.url, self.parser.get_http_version().encode())]
            for name, value in self.headers:
                if name == b"connection":
                    value = b",".join(t for t in value.split(b",") if t.strip().lower() != b"upgrade")
                if name != b"upgrade" and value.strip():
                    head.append(b"%s: %s\r\n" % (name, value))
            self.parser = httptools.HttpRequestParser(self)
            try:
                self.parser.feed_data(b"".join(head) + b"\r\n")   # a head it read once already
            except httptools.HttpParserError:
                self.send_400_response("Invalid HTTP request received.")
                return False
            return True

        def send_400_response(self, msg: str) -> None:
            # uvicorn answers what its parser cannot read in plain text; clients parse an error object
            refusal = APIError("The request is not valid HTTP/1.1 (a malformed request line, header or chunk "
                               "framing) and could not be read", 400, code="invalid_http_request")
            self.transport.write(_raw_response(refusal))
            self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_bytes = 0
            self._body_chunks = 0

        def on_chunk_header(self) -> None:
            # httptools calls this per chunk, before the chunk's on_body (uvicorn defines none)
            self._body_chunks += 1
            if self._body_chunks == MAX_BODY_CHUNKS + 1:
                self._refuse_body()

        def on_body(self, body: bytes) -> None:
            if not self._dropping:   # the rest of the read that was refused is not kept
                super().on_body(body)

        def _refuse_body(self) -> None:
            logger.warning("a request body came in more than %d chunks: answered 413 and closed", MAX_BODY_CHUNKS)
            self._dropping = True
            cycle = self.cycle
            # the answer goes first unless an earlier response is still being written (pipelining)
            answer = not cycle.response_started and not self.pipeline
            # its handler, waiting for the rest of the body, reads a disconnect and writes nothing
            cycle.disconnected = True
            cycle.message_event.set()
            if not answer:
                self.transport.close()
                return
            refusal = APIError(f"The request body came in more than {MAX_BODY_CHUNKS} chunks (Transfer-Encoding: "
                               "chunked); send it with a Content-Length, or in fewer, larger chunks", 413,
                               code="too_many_body_chunks")
            self.transport.write(_raw_response(refusal))
            # the client is still sending: its data is read and dropped (a call per read, not per
            # chunk) until it closes, or for LINGER_S, so that the answer reaches it
            self.flow.resume_reading()
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self._linger = self.loop.call_later(LINGER_S, self.transport.close)

        def _refuse_head(self) -> None:
            self._head_bytes = None
            self.flow.pause_reading()   # nothing more of this connection is read
            if not self._between_requests():
                # a pipelined request's head: the response in flight finishes, then the connection closes
                self.cycle.keep_alive = False
                return
            logger.warning("request headers over %d bytes: answered 431 and closed", MAX_HEAD_BYTES)
            refusal = APIError(f"The request line and headers are larger than {MAX_HEAD_BYTES} bytes; send "
                               "fewer or shorter headers", 431, code="request_header_fields_too_large")
            self.transport.write(_raw_response(refusal))
            self.transport.close()

        def on_headers_complete(self) -> None:
            # a request pipelined behind a refused body is not started; nor one that asks for an
            # upgrade, which is parsed again without it (_parse_again_without_upgrade)
            if self._dropping or self.parser.should_upgrade():
                return
            self._header_deadline = _cancelled(self._header_deadline)
            self._head_bytes = None
            super().on_headers_complete()
            # the output budget (server/backlog.py) reads what waits in its buffer, and aborts it
            self.scope[TRANSPORT_KEY] = self.transport   # type: ignore[typeddict-unknown-key]
            if self.cycle is not None and self.cycle.scope is self.scope and self.scope["http_version"] == "1.0":
                self.cycle.send = _unchunked(self.cycle)   # type: ignore[method-assign]
            # a body that never completes would hold its connection (and its handler) for good
            self._body_deadline = self.loop.call_later(limits.timeout_body, self._body_deadline_passed)

        def on_message_complete(self) -> None:
            if self.parser.should_upgrade():   # its body was skipped: it is parsed again
                return
            self._body_deadline = _cancelled(self._body_deadline)
            super().on_message_complete()

        def pause_writing(self) -> None:
            super().pause_writing()
            # a client that stops reading holds its response, and the stream's merged update grows
            # to the whole answer (~1.4 KB a token with 20 logprobs): it must not hold them for good
            self._arm_send_deadline()

        def resume_writing(self) -> None:
            self._send_deadline = _cancelled(self._send_deadline)
            super().resume_writing()

        def _arm_send_deadline(self) -> None:
            self._send_deadline = self.loop.call_later(limits.timeout_body, self._send_deadline_passed,
                                                       self.transport.get_write_buffer_size())

        def _send_deadline_passed(self, buffered_then: int) -> None:
            # nothing is added while writing is paused: a smaller buffer means the client read some
            if self.transport.get_write_buffer_size() < buffered_then:
                self._arm_send_deadline()
                return
            self._send_deadline = None
            logger.warning("a client read none of its response for %.0f s (--timeout-body): connection closed",
                           limits.timeout_body)
            self.transport.abort()   # close() would wait to flush what the client does not read

        def connection_lost(self, exc: Exception | None) -> None:
            self._header_deadline = _cancelled(self._header_deadline)
            self._body_deadline = _cancelled(self._body_deadline)
            self._send_deadline = _cancelled(self._send_deadline)
            self._linger = _cancelled(self._linger)
            super().connection_lost(exc)

        def _body_deadline_passed(self) -> None:
            self._body_deadline = None
            if not self.transport.is_closing():
                logger.warning("a request body was not complete %.0f s after its headers (--timeout-body): "
                               "connection closed", limits.timeout_body)
                self.transport.close()

        def _between_requests(self) -> bool:
            return (self.cycle is None or self.cycle.response_complete) and not self.pipeline

        def _arm_header_deadline(self) -> None:
            self._header_deadline = self.loop.call_later(limits.timeout_headers, self._header_deadline_passed)

        def _header_deadline_passed(self) -> None:
            self._header_deadline = None
            if self._between_requests() and not self.transport.is_closing():
                # no response is owed: a request whose headers never completed was never started
                self.transport.close()

    return LimitedConnection


def uvicorn_options(limits: ServerLimits) -> dict:
    """Keyword arguments of uvicorn.run / uvicorn.Config that apply `limits` to connections."""
    # ws "none": a WebSocket handshake is an ordinary request here (an OpenAI error object for
    # the route), where a handshake was answered 403 or 400 in plain text
    return {"http": connection_protocol(limits), "timeout_keep_alive": limits.timeout_keep_alive, "ws": "none"}
