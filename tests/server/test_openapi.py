"""/openapi.json describes each route's request body and the errors the route really answers."""

from __future__ import annotations

import httpx
import pytest

from nanoserve.server.openapi import BODIES

BODY_ROUTES = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest",
               "/v1/responses": "ResponsesRequest", "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest"}


@pytest.fixture(scope="module")
def schema(server):
    r = httpx.get(f"{server.url}/openapi.json", timeout=30)
    assert r.status_code == 200
    return r.json()


def resolve(schema: dict, ref: str) -> dict:
    assert ref.startswith("#/components/schemas/"), ref
    return schema["components"]["schemas"][ref.rsplit("/", 1)[1]]


@pytest.mark.parametrize("path, model", sorted(BODY_ROUTES.items()))
def test_each_body_route_names_its_request_model(schema, path, model):
    body = schema["paths"][path]["post"]["requestBody"]
    assert body["required"] is True
    target = resolve(schema, body["content"]["application/json"]["schema"]["$ref"])
    assert target["title"] == model and target["additionalProperties"] is False
    assert set(BODIES[path].model_fields) <= set(target["properties"])


def test_the_model_schemas_carry_the_bounds(schema):
    completion = schema["components"]["schemas"]["CompletionRequest"]
    assert "prompt" in completion["required"]
    top_k = next(s for s in completion["properties"]["top_k"]["anyOf"] if s.get("type") == "integer")
    assert (top_k["minimum"], top_k["maximum"]) == (-1, 2**31 - 1)
    chat = schema["components"]["schemas"]["ChatCompletionRequest"]
    # every nested reference resolves inside the document
    assert resolve(schema, chat["properties"]["messages"]["items"]["$ref"])["title"] == "ChatMessage"


def test_every_operation_has_its_own_id(schema):
    ids = [(path, method, op["operationId"]) for path, ops in schema["paths"].items() for method, op in ops.items()]
    assert len({op_id for _, _, op_id in ids}) == len(ids), sorted(op_id for _, _, op_id in ids)
    for path, method, op_id in ids:
        assert op_id.rpartition("_")[2] == method or op_id.rsplit("_", 2)[1] == method, (path, method, op_id)


def test_no_422_anywhere_and_every_error_is_the_openai_object(schema):
    assert "422" not in str(schema) and "HTTPValidationError" not in schema["components"]["schemas"]
    error = schema["components"]["schemas"]["ErrorResponse"]
    assert set(error["properties"]["error"]["required"]) == {"message", "type", "param", "code"}
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            for status, response in operation["responses"].items():
                if status != "200":
                    assert response["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")


@pytest.mark.parametrize("path, method, statuses", [
    ("/v1/completions", "post", {"400", "404", "413", "500", "503"}),
    ("/v1/chat/completions", "post", {"400", "404", "413", "500", "503"}),
    ("/v1/responses", "post", {"400", "404", "413", "500", "503"}),
    ("/v1/responses/{response_id}", "get", {"404", "500", "503"}),
    ("/v1/models/{name}", "get", {"404", "500", "503"}),
    ("/health", "get", {"503"}),
    ("/ping", "post", {"503"}),
])
def test_routes_list_the_errors_they_answer(schema, path, method, statuses):
    assert set(schema["paths"][path][method]["responses"]) - {"200"} == statuses


def test_the_listed_statuses_are_real(server):
    # each status the document promises for /v1/completions, produced for real (401 is only with a key)
    url = f"{server.url}/v1/completions"
    assert httpx.post(url, json={"prompt": "x", "top_k": -5}, timeout=30).status_code == 400
    assert httpx.post(url, json={"prompt": "x", "model": "nope"}, timeout=30).status_code == 404
    big = httpx.post(url, content=b"{" + b" " * (33 * 1024 * 1024) + b"}", timeout=60,
                     headers={"Content-Type": "application/json"})
    assert big.status_code == 413


def test_a_server_with_a_key_lists_401(server_model, tmp_path):
    from tests.server.conftest import ServerProcess

    proc = ServerProcess(server_model, tmp_path, "--num-kvcache-blocks", "128", "--block-size", "16", api_key="k")
    try:
        schema = httpx.get(f"{proc.url}/openapi.json", headers=proc.headers, timeout=30).json()
    finally:
        proc.stop()
    assert "401" in schema["paths"]["/v1/completions"]["post"]["responses"]
    assert "401" not in schema["paths"]["/health"]["get"]["responses"]
