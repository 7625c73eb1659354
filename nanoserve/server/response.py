"""What /v1/completions and /v1/chat/completions share: ids, envelopes, draining, usage."""

from __future__ import annotations

import time

from nanoserve.engine.async_engine import EngineDeadError, RequestStream
from nanoserve.server.errors import APIError
from nanoserve.server.metrics import RequestTimer
from nanoserve.server.state import ServerState, new_id, timed


class OpenAIResponse:
    """One request between validation and its last byte. Subclasses name their object types."""

    id_prefix = ""
    body_object = ""   # "text_completion" / "chat.completion"
    chunk_object = ""  # the object of each SSE chunk

    def __init__(self, state: ServerState, req, model: str) -> None:
        self.state, self.req, self.model = state, req, model
        self.id, self.created = new_id(self.id_prefix), int(time.time())
        self.cached: dict[int, int] = {}  # choice index -> its prompt tokens found in the prefix cache

    def envelope(self, object_: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model, "choices": choices}

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        body = self.envelope(self.chunk_object, choices)
        if self.req.include_usage:
            body["usage"] = usage
        return body

    async def drain(self, stream: RequestStream, timer: RequestTimer) -> None:
        """Read every update of a whole-response request; the texts accumulate in stream.outputs."""
        try:
            async for update in timed(stream, timer):
                self.cached[update.index] = update.num_cached_tokens
        except EngineDeadError as exc:
            raise APIError(str(exc), 500, code="engine_dead") from None
        finally:
            stream.close()
