"""POST /invocations: Amazon SageMaker's one route for inference, as vLLM serves it. A body with
`messages` is a chat completion request, one with `prompt` a completion request; each is then
served, validated and refused exactly as on its own route."""

from __future__ import annotations

import msgspec
import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from nanoserve.server.chat import create_chat_completion
from nanoserve.server.completions import create_completion
from nanoserve.server.errors import APIError
from nanoserve.server.wire import read_body

router = APIRouter()


class _Keys(msgspec.Struct):
    """The keys that choose the route; their values stay unread (the route validates them). Empty
    when absent."""

    messages: msgspec.Raw = msgspec.Raw()
    prompt: msgspec.Raw = msgspec.Raw()


def _given(value: msgspec.Raw) -> bool:
    return len(value) > 0 and bytes(value) != b"null"


_keys = msgspec.json.Decoder(_Keys)


def _valid_json(body: bytes) -> bool:
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return True


@router.post("/invocations")
async def invocations(request: Request) -> Response:
    body = await read_body(request)   # kept for the route's own read
    try:
        keys = _keys.decode(body)
    except (msgspec.DecodeError, RecursionError):   # RecursionError: nested past msgspec's depth
        return await create_completion(request)     # which says what is wrong with the body
    if _given(keys.messages):
        return await create_chat_completion(request)
    if _given(keys.prompt):
        return await create_completion(request)
    if not _valid_json(body):   # the keys read skipped the rest: invalid UTF-8 in another key passed
        return await create_completion(request)
    raise APIError("/invocations takes a chat completion request (with 'messages') or a completion request "
                   "(with 'prompt'); this body has neither", param=None, code="invalid_request")
