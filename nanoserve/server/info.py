"""The small routes: models, health, version, metrics, tokenize, detokenize, tokenizer_info."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from nanoserve import __version__
from nanoserve.server.chat import check_continuation, render_chat
from nanoserve.server.errors import APIError
from nanoserve.server.metrics import CONTENT_TYPE
from nanoserve.server.chat_protocol import DetokenizeRequest, TokenizeRequest
from nanoserve.server.state import ServerState, off_the_loop_if_long
from nanoserve.server.wire import json_response, parse_body

router = APIRouter()


def get(path: str):
    """A GET route that answers HEAD too, as RFC 9110 asks of every server (probes and monitors use it)."""
    return router.api_route(path, methods=["GET", "HEAD"])


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _model_card(state: ServerState, name: str) -> dict:
    # "root" is the served name, not the folder: a path tells a client nothing it can use and an
    # attacker how the machine is laid out
    return {"id": name, "object": "model", "created": state.created, "owned_by": "nanoserve",
            "root": name, "max_model_len": state.engine.config.max_model_len}


@get("/v1/models")
async def list_models(request: Request) -> Response:
    state = _state(request)
    return json_response({"object": "list",
                          "data": [_model_card(state, name) for name in state.settings.served_model_names]})


@get("/v1/models/{name:path}")
async def get_model(request: Request, name: str) -> Response:
    state = _state(request)
    return json_response(_model_card(state, state.model_name(name)))


@get("/health")
async def health(request: Request) -> Response:
    state = _state(request)
    engine = state.engine
    if not engine.healthy:
        reason = str(engine.error) if engine.error else "the engine is not running"
        raise APIError(f"Unhealthy: {reason}", 503, code="engine_dead")
    silent, limit = engine.silent_seconds, state.settings.engine_stall_timeout_s
    if silent > limit:
        raise APIError(f"Unhealthy: the engine core has sent nothing, not even its heartbeat, for {silent:.0f} s "
                       f"(--engine-stall-timeout {limit:g})", 503, code="engine_stalled")
    return json_response({"status": "ok"})


@router.api_route("/ping", methods=["GET", "HEAD", "POST"])
async def ping(request: Request) -> Response:
    """vLLM's probe for SageMaker-style hosts (GET or POST): /health's answer."""
    return await health(request)


@get("/version")
async def version() -> Response:
    return json_response({"version": __version__})


@get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    state = _state(request)
    req = await parse_body(request, TokenizeRequest)
    state.model_name(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError("Give exactly one of 'prompt' and 'messages'", param="prompt")
    if req.prompt is not None:
        state.prompt_size.check(len(req.prompt), "prompt")
        tokens = await run_in_threadpool(state.tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        check_continuation(req.continue_final_message, req.add_generation_prompt)
        tokens = await run_in_threadpool(render_chat, state, req.messages, req.add_generation_prompt, req.tools,
                                         req.chat_template_kwargs, req.continue_final_message)
    # a Python call per token: 570k of them held the event loop, and every stream, for 0.35 s
    token_strs = (await off_the_loop_if_long(len(tokens), state.tokenizer.convert_ids_to_tokens, tokens)
                  if req.return_token_strs else None)
    return json_response({"count": len(tokens), "max_model_len": state.engine.config.max_model_len,
                          "tokens": tokens, "token_strs": token_strs})


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    state = _state(request)
    req = await parse_body(request, DetokenizeRequest)
    state.model_name(req.model)
    limit = state.engine.config.max_model_len
    if len(req.tokens) > limit:   # no sequence of this server is longer; decoding millions stalls a thread
        raise APIError(f"'tokens' has {len(req.tokens)} ids; at most {limit} (max_model_len)", param="tokens",
                       code="context_length_exceeded")
    state.check_token_ids(req.tokens, "tokens")
    text = await off_the_loop_if_long(4 * len(req.tokens), state.tokenizer.decode, req.tokens)  # ~4 characters an id
    return json_response({"prompt": text})


@get("/tokenizer_info")
async def tokenizer_info(request: Request) -> Response:
    """The tokenizer's config as vLLM serves it, so that clients (lm-evaluation-harness) need no hub."""
    tok = _state(request).tokenizer
    config = {k: v for k, v in (getattr(tok, "init_kwargs", None) or {}).items()
              if k not in ("tokenizer_object", "added_tokens_decoder", "tokenizer_file", "vocab_file", "merges_file")}
    config["name_or_path"] = tok.name_or_path
    config["tokenizer_class"] = type(tok).__name__
    if tok.chat_template:
        config["chat_template"] = tok.chat_template
    return json_response(_json_safe(config))


def _json_safe(value: Any) -> Any:
    """Special tokens are objects in init_kwargs: their text is what a client can use."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
