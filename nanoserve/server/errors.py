"""OpenAI error objects: every failure the client sees is {"error": {message, type, param, code}}.

Bad input is always a 400, never pydantic's 422 and never a 500: the `openai` client retries
5xx and 429, so a 500 for bad input would triple the load.
"""

from __future__ import annotations

import logging
import uuid

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

logger = logging.getLogger(__name__)

# request fields of the OpenAI API that this server knows of but does not implement
UNSUPPORTED_FIELDS = {"functions", "function_call",
                      "audio", "prediction", "web_search_options", "reasoning_effort"}
# vLLM's request fields that this server refuses on purpose, and what to do instead
REFUSED_FIELDS = {
    # as vLLM does unless told to trust request templates
    "chat_template": "a chat template is code the server runs, so a request may not bring one; start the "
                     "server with --chat-template, or pass variables through chat_template_kwargs",
}


class APIError(Exception):
    """Raise anywhere in a route to answer with an OpenAI error object."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.headers = message, status, param, code, headers
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(orjson.dumps(self.body()), self.status, self.headers, media_type="application/json")


# characters of one part of a field's path that an error repeats: an unknown key is the
# request's own text, and a 5 MB one came back whole twice (message and param), 10 MB of error
MAX_PATH_PART_CHARS = 80


def _user_path(err: dict) -> list[str]:
    """The error's location in the request; union members show up there as type names
    ("list[int]", "NamedToolChoice"), which are left out. An unknown field's own key ends its
    location and is kept whatever it looks like ("Temperature", "str" were left out as members)."""
    loc = [str(part) for part in err.get("loc", ()) if part != "body"]
    own = loc.pop() if err.get("type") == "extra_forbidden" and loc else None
    path = [part for part in loc if not any(c in part for c in "[]()") and part not in ("str", "int", "float", "bool")
            and not part[:1].isupper()]
    return [part[:MAX_PATH_PART_CHARS] for part in (path if own is None else [*path, own])]


def from_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """One 400 naming the first bad field, in the words of the OpenAI API where it has them."""
    # a list past its bound is refused for its length whatever its items hold (a union's other
    # members fail at its first item: 20,000 prompts were "prompt.0: should be a valid integer");
    # else, of a union's members, the one that got furthest into the value says what is wrong with
    # it (a text part's unknown key, not "should be a string"); otherwise the first error
    errors = exc.errors()
    err = max(errors, key=lambda e: (e.get("type") == "too_long", len(_user_path(e))))
    path = _user_path(err)
    param = ".".join(path) or None
    kind = err.get("type", "")
    if kind == "json_invalid":
        why = err["msg"]
        if "hex escape" in why:   # the parser's words for a lone surrogate (Python's json.dumps writes them)
            why += (": a \\u escape of a UTF-16 surrogate (\\ud800-\\udfff) encodes no character unless a high "
                    "one is followed by a low one")
        return APIError(f"We could not parse the JSON body of your request ({why}); send a valid "
                        "UTF-8 JSON object", param=None, code="invalid_json")
    if kind == "missing":
        return APIError(f"Missing required parameter: '{param}'", param=param, code="missing_required_parameter")
    if kind == "extra_forbidden":
        if param in REFUSED_FIELDS:
            return APIError(f"'{param}' is not supported by this server: {REFUSED_FIELDS[param]}", param=param,
                            code="unsupported_parameter")
        if param in UNSUPPORTED_FIELDS:
            return APIError(f"'{param}' is not supported by this server", param=param, code="unsupported_parameter")
        return APIError(f"Unrecognized request argument supplied: {param}", param=param,
                        code="unrecognized_argument")
    if kind == "literal_error" and path[-1:] == ["type"] and path[-3:-2] == ["content"]:
        part = str(err.get("input"))[:40]
        return APIError(f"Content part type {part!r} is not supported: this server's model reads text only; "
                        "send parts of type 'text'", param=param, code="invalid_value")
    if kind == "too_long" and err.get("ctx", {}).get("field_type") == "List":   # in the OpenAI API's words
        ctx = err["ctx"]
        return APIError(f"Invalid '{param}': array too long. Expected an array with maximum length "
                        f"{ctx['max_length']}, but got an array with length {ctx['actual_length']} instead.",
                        param=param, code="array_above_max_length")
    if kind == "model_type" and param is None:
        return APIError("The request body must be a JSON object", param=param, code="invalid_type")
    if kind == "model_type":   # pydantic's words name the class ("instance of ChatMessage")
        return APIError(f"Invalid type for '{param}': expected a JSON object", param=param, code="invalid_type")
    if kind.endswith("_type") or kind.endswith("_parsing") or kind == "union_tag_invalid":
        return APIError(f"Invalid type for '{param}': {err['msg']}", param=param, code="invalid_type")
    return APIError(f"Invalid value for '{param}': {err['msg']}", param=param, code="invalid_value")


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = {404: "Not found: no such route; see /v1/completions, /v1/chat/completions, /v1/responses, /v1/models",
                   405: "Method not allowed on this route"}.get(exc.status_code, str(exc.detail))
        return APIError(message, exc.status_code, code=code, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        # the exception's text can hold paths, tensor shapes or a prompt: the log gets it, the
        # client an id to quote when reporting it
        error_id = uuid.uuid4().hex[:16]
        logger.exception("Unhandled error in %s %s (error id %s)", request.method, request.url.path, error_id)
        # Starlette raises the error again once this answer is sent, and uvicorn then closes the
        # connection: without saying so, a keep-alive client sent its next request, however good,
        # into the closed socket and got a connection reset
        return APIError(f"Internal server error (error id {error_id}); the server log has the details",
                        500, code="internal_error", headers={"connection": "close"}).response()
