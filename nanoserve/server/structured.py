"""Structured outputs on the HTTP side: which grammar a request asks for, checked before it is queued.

A request may ask through OpenAI's `response_format`, vLLM's `structured_outputs` object, or vLLM's
older `guided_*` fields; at most one of them. The spec is compiled here once (cached by xgrammar),
so that a schema xgrammar cannot compile is a 400 naming the problem, not a failed request later.
"""

from __future__ import annotations

import dataclasses
import threading

import xgrammar as xgr
from starlette.concurrency import run_in_threadpool
from transformers import PreTrainedTokenizerBase

from nanoserve.engine.grammar import compile_spec, new_compiler
from nanoserve.sampling_params import SamplingParams, StructuredOutputsParams
from nanoserve.server.errors import APIError
from nanoserve.server.protocol import SamplingFields


def requested_spec(req: SamplingFields) -> tuple[str, StructuredOutputsParams] | None:
    """(the field that asked, the spec) for the request's one grammar; 400 when it asks twice."""
    asked: list[tuple[str, dict]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError("response_format of type json_schema needs json_schema.schema, the JSON schema the "
                           "output must follow", param="response_format.json_schema")
        asked.append(("response_format", {"json": fmt.json_schema.schema_}))
    so = req.structured_outputs
    if so is not None:
        asked.append(("structured_outputs", {"json": so.json_, "regex": so.regex, "choice": so.choice,
                                             "grammar": so.grammar, "json_object": bool(so.json_object),
                                             "any_whitespace": not so.disable_any_whitespace}))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            asked.append((name, {key: getattr(req, name)}))
    if not asked:
        return None
    if len(asked) > 1:
        raise APIError(f"Give one structured-output constraint, not several: got {[n for n, _ in asked]}",
                       param=asked[1][0])
    param, fields = asked[0]
    try:
        return param, StructuredOutputsParams(**fields)
    except ValueError as exc:
        raise APIError(f"Invalid '{param}': {exc}", param=param) from None


class SpecChecker:
    """Compiles specs with a compiler of the front end's own (the engine may live in another
    process), built on first use; xgrammar caches the result, so a spec checked again costs its
    cache lookup and the one-row check that it admits a first token."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()

    def check(self, spec: StructuredOutputsParams) -> None:
        """Raise ValueError naming the problem when xgrammar cannot compile the spec."""
        with self._lock:
            if self._compiler is None:
                self._compiler = new_compiler(self.tokenizer, self.vocab_size)
        compile_spec(self._compiler, spec)


async def constrain(checker: SpecChecker, params: SamplingParams,
                    asked: tuple[str, StructuredOutputsParams] | None) -> SamplingParams:
    """`params` with the request's grammar, once it compiles (off the event loop: a big schema takes a while)."""
    if asked is None:
        return params
    param, spec = asked
    try:
        await run_in_threadpool(checker.check, spec)
    except ValueError as exc:
        raise APIError(str(exc), param=param, code="invalid_grammar") from None
    return dataclasses.replace(params, structured_outputs=spec)
