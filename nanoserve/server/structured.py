"""Structured outputs on the HTTP side: which grammar a request asks for, checked before it is queued.

A request may ask through OpenAI's `response_format`, vLLM's `structured_outputs` object, or vLLM's
older `guided_*` fields; at most one of them. The spec is compiled here once (its verdict remembered),
so that a schema xgrammar cannot compile, or not in time, is a 400 naming the problem, not a
failed or stalled request later.
"""

from __future__ import annotations

import dataclasses
import math

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from transformers import PreTrainedTokenizerBase

from nanoserve.engine.grammar import tokenizer_info
from nanoserve.sampling_params import SamplingParams
from nanoserve.server.compile_workers import CompilersBusy, CompileTimeout, CompileWorkers
from nanoserve.server.errors import APIError
from nanoserve.server.protocol import SamplingFields
from nanoserve.server.wire import unless_disconnected
from nanoserve.structured_outputs_params import StructuredOutputsParams


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
                                             "disable_any_whitespace": so.disable_any_whitespace}))
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
    """Compiles specs in worker processes of the front end's own (server/compile_workers.py), which
    are killed when a spec takes longer than `timeout_s`; their verdicts are remembered, so a spec
    checked again costs a lookup and never waits for a worker."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, timeout_s: float) -> None:
        self.tokenizer, self.vocab_size, self.timeout_s = tokenizer, vocab_size, timeout_s
        self._workers: CompileWorkers | None = None

    async def check(self, spec: StructuredOutputsParams) -> None:
        """Raise ValueError naming the problem when xgrammar cannot compile the spec, CompileTimeout
        when it does not compile in time, CompilersBusy when no compiler came free in that time."""
        if self._workers is None:
            # built on first use: a large vocabulary takes a while, and most servers never need it
            info = await run_in_threadpool(_tokenizer_info_json, self.tokenizer, self.vocab_size)
            if self._workers is None:
                self._workers = CompileWorkers(info)
        reason = await self._workers.check(spec, self.timeout_s)
        if reason is not None:
            raise ValueError(reason)

    def close(self) -> None:
        if self._workers is not None:
            self._workers.close()


def _tokenizer_info_json(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> str:
    return tokenizer_info(tokenizer, vocab_size).serialize_json()


async def constrain(checker: SpecChecker, params: SamplingParams,
                    asked: tuple[str, StructuredOutputsParams] | None, request: Request) -> SamplingParams:
    """`params` with the request's grammar, once it compiles (in a worker process, within the
    deadline); a 499 if the client leaves while it waits for a worker or for the compile."""
    if asked is None:
        return params
    param, spec = asked
    try:
        await unless_disconnected(request, checker.check(spec))
    except ValueError as exc:
        raise APIError(str(exc), param=param, code="invalid_grammar") from None
    except CompileTimeout:
        raise APIError(f"The structured-output spec in '{param}' did not compile within {checker.timeout_s:g} s "
                       "(--timeout-grammar-compile): compile time grows steeply with the number of repeated or "
                       "optional parts (a*, b?, ...); simplify it", param=param,
                       code="grammar_too_complex") from None
    except CompilersBusy:
        # the spec may be fine: overload, which the openai client retries after Retry-After
        wait_s = math.ceil(checker.timeout_s)
        raise APIError(f"Every structured-output compiler stayed busy with other specs for {checker.timeout_s:g} s "
                       f"(--timeout-grammar-compile); try again in {wait_s} s", 503,
                       code="grammar_compilers_busy", headers={"Retry-After": str(wait_s)}) from None
    return dataclasses.replace(params, structured_outputs=spec)
