"""JSON Schema keywords that xgrammar compiles and does not enforce are refused, naming the keyword and
where it is; what it does enforce compiles. Each refused case is checked against xgrammar itself: its
grammar takes a text that breaks the schema."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from nanoserve import LLM, SamplingParams
from nanoserve.config import DEFAULT_MODEL
from nanoserve.engine.schema_support import unenforced_keyword
from nanoserve.structured_outputs_params import StructuredOutputsParams

# (schema, a text that breaks it, what the refusal names)
UNENFORCED = [
    ({"not": {"type": "integer"}}, "5", "'not'"),
    ({"type": "array", "items": {"enum": [1]}, "uniqueItems": True}, "[1, 1]", "'uniqueItems'"),
    ({"type": "array", "items": {"type": "string"}, "contains": {"const": "zz"}}, "[]", "'contains'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, '{"a": 1}', "'dependentRequired'"),
    ({"type": "string", "if": {"maxLength": 1}, "then": {"const": "x"}}, '"y"', "'if'"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "5", "'allOf'"),
    ({"type": "integer", "multipleOf": 7, "minimum": 1}, "5", "'multipleOf'"),
    ({"type": "object", "properties": {}, "required": ["a"], "additionalProperties": False}, "{}", "'required'"),
    ({"type": "object", "required": ["a"], "additionalProperties": True}, "{}", "'required'"),
    ({"type": []}, "5", "'type'"),
    ({"$ref": "other.json#/x"}, "1.5", "'$ref'"),
    ({"$ref": "https://example.com/a.json"}, '{"a": 1}', "'$ref'"),
    ({"$ref": "#name", "$defs": {"n": {"$anchor": "name", "type": "string"}}}, "5", "'$ref'"),
]

ENFORCED = [
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]},
    {"type": "integer", "multipleOf": 7},
    {"type": "array", "items": {"type": "integer"}, "uniqueItems": False, "minItems": 1},
    {"allOf": [{"$ref": "#/$defs/A"}], "$defs": {"A": {"type": "string", "format": "email"}}},
    {"type": "object", "properties": {"not": {"type": "string"}, "if": {"enum": ["not", "contains"]}},
     "required": ["not"]},   # properties named as keywords, and keywords as data
]


@pytest.mark.parametrize("schema, breaking, named", UNENFORCED, ids=[c[2].strip("'") + str(i) for i, c in enumerate(UNENFORCED)])
def test_a_keyword_xgrammar_leaves_out_is_named_with_its_place(schema, breaking, named):
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert _is_grammar_accept_string(grammar, breaking)   # xgrammar alone would let it through
    nested = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    assert named in unenforced_keyword(schema) and unenforced_keyword(nested).endswith("(at #/properties/x)")


@pytest.mark.parametrize("schema", ENFORCED)
def test_what_xgrammar_enforces_is_not_refused(schema):
    assert unenforced_keyword(schema) is None


def test_the_engine_refuses_such_a_schema_before_anything_runs():
    spec = StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}, "uniqueItems": True})
    with LLM(DEFAULT_MODEL, device="cpu", num_kvcache_blocks=128, block_size=16) as llm:
        with pytest.raises(ValueError, match="'uniqueItems' is not enforced \\(at #\\)"):
            llm.generate(["A list"], SamplingParams(max_tokens=8, structured_outputs=spec), use_tqdm=False)
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
