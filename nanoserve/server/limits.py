"""What one request may cost: its body's bytes, its prompt's characters, its sequences and stop lists.

Each limit is checked before the work it bounds (reading the body, tokenizing, queueing), so a
hostile request costs time and memory in proportion to the limit, not to what it sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nanoserve.server.errors import APIError

MiB = 1024 * 1024

# Normalizers can fold characters together (NFC/NFKC compose "e" + U+0301 into one): allow this
# many characters per character a token's vocabulary string can cover
NORMALIZER_SLACK = 2


@dataclass(frozen=True)
class ServerLimits:
    """Per-request and per-connection limits; each is a `nanoserve serve` flag of the same name."""

    # 256 prompts of 128 KB of text each, or a 128k-token context as JSON ids (~1 MB) many times
    # over; the bytes are held once as the body and about 4x as the parsed strings
    max_request_body_bytes: int = 32 * MiB
    # values a body's JSON may hold (counted as its commas and colons, before parsing): parsing holds
    # the interpreter lock throughout, ~0.1-0.35 us a value, so 32 MB of tiny values stalled every
    # stream for over a second; a million still takes a batch of 256 prompts of 4k token ids
    max_request_json_values: int = 1 << 20
    # prompts x n of one request: the default --max-num-seqs, one full batch
    max_seqs_per_request: int = 256
    max_stop_strings: int = 64          # each is matched against every new piece of text
    max_stop_string_chars: int = 256    # text that might start a stop string is held back this long
    max_stop_token_ids: int = 256
    max_connections: int = 4096         # past it, new connections get 503 (but /health answers)
    timeout_keep_alive: float = 5.0     # seconds an idle connection stays open after a response
    timeout_headers: float = 10.0       # seconds from a connection's first byte to its complete headers
    # seconds from complete headers to the body's last byte; also how long a response may wait with
    # none of it read by the client before the connection is closed
    timeout_body: float = 60.0
    # seconds a structured-output spec may take to compile (a worker process, killed past it): a
    # few KB of "a*a*a*..." takes minutes, and nothing else can stop a compile
    timeout_grammar_compile: float = 10.0
    # MiB of output held for clients that have not read it, over all connections (server/backlog.py):
    # past it the responses furthest behind are ended. A stream of 32k tokens with 20 logprobs
    # holds ~88 MB for a client that does not read it
    max_undelivered_mb: float = 1024.0

    def __post_init__(self) -> None:
        for name in ("max_request_body_bytes", "max_request_json_values", "max_seqs_per_request", "max_stop_strings",
                     "max_stop_string_chars", "max_stop_token_ids", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("timeout_keep_alive", "timeout_headers", "timeout_body", "timeout_grammar_compile"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")
        if not 0 < self.max_undelivered_mb < math.inf:   # inf overflowed the byte count, a traceback at start
            raise ValueError(f"max_undelivered_mb (--max-undelivered-mb) must be a finite positive number of MiB, "
                             f"got {self.max_undelivered_mb}")

    def check_request(self, num_prompts: int, n: int, stop: str | list[str] | None,
                      stop_token_ids: list[int] | None) -> None:
        """400 naming the field when a request asks for more sequences or stop conditions than allowed."""
        if num_prompts * n > self.max_seqs_per_request:
            raise APIError(f"This request asks for {num_prompts} prompt(s) x n={n} = {num_prompts * n} sequences; "
                           f"this server allows at most {self.max_seqs_per_request} per request "
                           "(--max-seqs-per-request): split it into smaller requests",
                           param="n" if num_prompts == 1 else "prompt", code="too_many_sequences")
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > self.max_stop_strings:
            raise APIError(f"'stop' has {len(stops)} strings; this server allows at most {self.max_stop_strings} "
                           "(--max-stop-strings)", param="stop")
        longest = max(map(len, stops), default=0)
        if longest > self.max_stop_string_chars:
            raise APIError(f"A string in 'stop' has {longest} characters; this server allows at most "
                           f"{self.max_stop_string_chars} (--max-stop-string-chars)", param="stop")
        if stop_token_ids and len(stop_token_ids) > self.max_stop_token_ids:
            raise APIError(f"'stop_token_ids' has {len(stop_token_ids)} ids; this server allows at most "
                           f"{self.max_stop_token_ids} (--max-stop-token-ids)", param="stop_token_ids")


class PromptSize:
    """The most characters a prompt of max_model_len tokens can have, from the tokenizer's longest token.

    A token covers at most as many characters as its vocabulary string has (a byte-level BPE
    string has one character per byte; a SentencePiece one its text plus the "▁" marker), so a
    text longer than max_model_len such tokens (with slack for normalizers) cannot fit the context,
    and is refused without being tokenized: tokenizing 20 MB took 28 s and 3 GB.
    """

    def __init__(self, vocabulary: list[str], max_model_len: int) -> None:
        self.chars_per_token = max(map(len, vocabulary), default=1) * NORMALIZER_SLACK
        self.max_model_len = max_model_len
        self.max_chars = max_model_len * self.chars_per_token

    def check(self, chars: int, param: str, what: str | None = None) -> None:
        """400 about `param` when `what` (the field itself unless named) has more characters than fit."""
        if chars > self.max_chars:
            raise APIError(f"{f'The {what}' if what else repr(param)} has {chars} characters: more than {self.max_model_len} tokens "
                           f"(max_model_len) can hold, at most {self.max_chars} characters for this tokenizer; "
                           "shorten it", param=param, code="context_length_exceeded")

    def tail(self, text: str, tokens: int) -> str:
        """The end of `text` that still holds its last `tokens` tokens (for truncate_prompt_tokens).

        It keeps room for `tokens` + 64 of the longest tokens, so the cut falls well before the
        tokens kept: they tokenize as they would in the whole text unless one word spans the cut."""
        # a prompt of max_model_len tokens or more is refused after tokenizing, so no more is needed
        return text[-(min(tokens, self.max_model_len) + 64) * self.chars_per_token:]


class RequestTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"The request body is larger than {limit} bytes (--max-request-body-bytes); send less, "
                         "or split the work into several requests", 413, code="request_too_large",
                         # the client may still be sending: close rather than read the rest
                         headers={"connection": "close"})


class BodyLimitMiddleware:
    """413 for a body over `max_bytes`: at once from Content-Length, else as a chunked body passes it.

    A declared length over the limit is answered before a byte of the body is read. A chunked
    body is counted as the app reads it; the read that crosses the limit raises RequestTooLarge,
    which the app's APIError handler turns into the 413, having held at most the limit in memory.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await RequestTooLarge(self.max_bytes).response()(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise RequestTooLarge(self.max_bytes)
            return message

        await self.app(scope, counted, send)
