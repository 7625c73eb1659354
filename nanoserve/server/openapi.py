"""/openapi.json as the server really behaves: each route's request body and the errors it can answer.

The routes read their bodies themselves (server/wire.py `parse_body`, so that a bad body is a
400 in OpenAI's shape, never FastAPI's 422), so FastAPI cannot see the models: they are added
here, with the OpenAI error object under every status a route can return, and 422 taken out.
"""

from __future__ import annotations

import warnings

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from nanoserve.server.connections import always_served
from nanoserve.server.chat_protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from nanoserve.server.protocol import CompletionRequest
from nanoserve.server.responses_protocol import ResponsesRequest

REF = "#/components/schemas/{model}"

BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}

ERROR_SCHEMA = {
    "type": "object", "required": ["error"], "title": "ErrorResponse",
    "description": "The OpenAI error object; every failure has this shape.",
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string", "description": "what went wrong and how to fix it"},
        "type": {"type": "string", "enum": ["invalid_request_error", "server_error"]},
        "param": {"type": ["string", "null"], "description": "the request field at fault, if one is"},
        "code": {"type": ["string", "null"], "description": "a machine-readable reason"}}}},
}

STATUS_MEANING = {
    400: "Invalid request: a field out of range, a prompt too long for the context, malformed JSON",
    401: "Missing or wrong API key (when the server has one)",
    404: "Unknown model",
    413: "Request body over --max-request-body-bytes",
    500: "Internal error; the message carries an error id to find in the server log",
    503: "Overloaded (queue, --max-connections or the grammar compilers full; see Retry-After) or the engine is not running",
}


def error_statuses(path: str, has_api_key: bool) -> list[int]:
    """The statuses `path` can answer besides 200."""
    if always_served(path):
        return [503]  # open to probes: no key, no connection cap
    statuses = [500, 503]  # any route: an internal error; past --max-connections
    if has_api_key:
        statuses.append(401)
    if path in BODIES:
        statuses += [400, 404, 413]
    elif path == "/v1/models/{name}" or path.startswith("/v1/responses/"):
        statuses.append(404)
    return sorted(statuses)


def openapi_schema(app: FastAPI, has_api_key: bool) -> dict:
    if app.openapi_schema is not None:
        return app.openapi_schema
    with warnings.catch_warnings():   # _unique_operation_ids gives each operation its own id below
        warnings.filterwarnings("ignore", message="Duplicate Operation ID")
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                             description="OpenAI-compatible API; request bodies are validated strictly (unknown "
                                         "fields and wrong types are 400s).")
    _, defs = models_json_schema([(model, "validation") for model in BODIES.values()], ref_template=REF)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(defs.get("$defs", {}))
    components["ErrorResponse"] = ERROR_SCHEMA
    for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 shapes: never sent
        components.pop(name, None)
    _unique_operation_ids(schema)
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            if path in BODIES:
                operation["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": REF.format(model=BODIES[path].__name__)}}}}
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            for status in error_statuses(path, has_api_key):
                responses[str(status)] = {"description": STATUS_MEANING[status], "content": {
                    "application/json": {"schema": {"$ref": REF.format(model="ErrorResponse")}}}}
    app.openapi_schema = schema
    return schema


HTTP_METHODS = frozenset({"get", "put", "post", "delete", "options", "head", "patch", "trace"})


def _unique_operation_ids(schema: dict) -> None:
    """FastAPI names each method of a route after one of them (GET and HEAD both `..._head`), which
    client generators refuse: each operation ends in its own method, and any repeat left gets a number."""
    seen: set[str] = set()
    for operations in schema["paths"].values():
        for method, operation in operations.items():
            name = operation.get("operationId")
            if name is None:
                continue
            stem, _, last = name.rpartition("_")
            name = f"{stem}_{method}" if stem and last in HTTP_METHODS else name
            unique, n = name, 2
            while unique in seen:
                unique, n = f"{name}_{n}", n + 1
            seen.add(unique)
            operation["operationId"] = unique


def install_openapi(app: FastAPI, has_api_key: bool) -> None:
    app.openapi = lambda: openapi_schema(app, has_api_key)  # type: ignore[method-assign]
