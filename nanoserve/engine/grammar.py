"""Structured outputs in the engine: grammars compiled off the step loop, one matcher per sequence.

xgrammar compiles a spec (JSON schema, regex, choice, EBNF) into a CompiledGrammar for this
tokenizer; a GrammarMatcher per sequence walks it token by token and, before each sample, fills
the row of a bitmask of the tokens allowed next. The runner only ever sees that bitmask.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
import xgrammar as xgr  # imported by the engine only once a request asks for structured outputs
from transformers import PreTrainedTokenizerBase

from nanoserve.engine.grammar_cache import CompileCache
from nanoserve.engine.grammar_time import MatcherClock
from nanoserve.engine.reasoning_gate import ReasoningGate
from nanoserve.engine.schema_support import unenforced_keyword
from nanoserve.runner.batch import TokenMask
from nanoserve.structured_outputs_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# an untrained or confused model can emit whitespace between JSON tokens forever: cap each run
# (pretty-printed JSON of a few levels of indentation still fits)
JSON_MAX_WHITESPACE = 24


def tokenizer_info(tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                   stop_token_ids: list[int] | None = None) -> xgr.TokenizerInfo:
    """xgrammar's view of the tokenizer; `vocab_size` is the model's (its logits may be wider than the tokenizer)."""
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)


def new_compiler(tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: list[int] | None = None,
                 max_threads: int = 2) -> xgr.GrammarCompiler:
    """A compiler for this tokenizer (see tokenizer_info and compiler_for)."""
    return compiler_for(tokenizer_info(tokenizer, vocab_size, stop_token_ids), max_threads)


def compiler_for(info: xgr.TokenizerInfo, max_threads: int = 2) -> xgr.GrammarCompiler:
    """A compiler without xgrammar's cache, which its callers keep themselves: even with a byte
    limit it held ~36 MB more of the process for each distinct 128 KiB spec, evicted or not, and
    a 128 KiB compile took 2.3 s with it against 0.6 s without (2-core CPU)."""
    return xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)


def choice_grammar(choices: list[str]) -> str:
    # JSON string literals are valid EBNF literals in xgrammar's dialect (same escapes)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def compile_spec(compiler: xgr.GrammarCompiler, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
    """The compiled grammar; ValueError naming what xgrammar could not compile and why."""
    # not truthiness: an empty regex, grammar or schema text is given too (and refused by xgrammar)
    kind = next(k for k in ("json", "json_object", "regex", "choice", "grammar") if getattr(spec, k) not in (None, False))
    try:
        compiled = _compile(compiler, spec)
    except Exception as exc:  # xgrammar raises RuntimeError, ValueError or its own InvalidJSONError
        raise ValueError(f"The {kind} given for structured outputs cannot be compiled: {_reason(exc)}") from None
    if not _admits_a_first_token(compiled):
        # the sampler would draw from nothing: refuse rather than return text the grammar forbids
        raise ValueError(f"The {kind} given for structured outputs admits no output at all")
    return compiled


def _compile(compiler: xgr.GrammarCompiler, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
    if spec.json is not None:
        why = unenforced_keyword(json.loads(spec.json))
        if why is not None:
            raise ValueError(f"{why}; structured outputs could not hold the output to it, so leave it out")
        return compiler.compile_json_schema(spec.json, any_whitespace=spec.any_whitespace,
                                            max_whitespace_cnt=JSON_MAX_WHITESPACE)
    if spec.json_object:
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=spec.any_whitespace,
                                            strict_mode=False, max_whitespace_cnt=JSON_MAX_WHITESPACE)
    if spec.regex is not None:
        return compiler.compile_regex(whole_output_regex(spec.regex))
    if spec.choice is not None:
        return compiler.compile_grammar(choice_grammar(spec.choice))
    return compiler.compile_grammar(spec.grammar)


# letters whose escapes xgrammar does not know: it warns and matches the letter itself, so
# "\\Aabc\\Z" held the output to "AabcZ"
_LETTER_ESCAPES_READ_AS_LETTERS = frozenset("ghijlmoqyzACEFGHIJKLMNOQRTUVXYZ")


def whole_output_regex(pattern: str) -> str:
    """`pattern` as xgrammar should read it. The whole output must match, as if anchored, so a
    leading \\A and a trailing \\Z or \\z are dropped (as xgrammar drops ^ and $); ValueError
    for an anchor elsewhere or another escape that xgrammar would read as its letter."""
    if pattern.startswith("\\A"):
        pattern = pattern[2:]
    i = pattern.find("\\")   # escapes pair from the left: "\\\\Z" is a backslash, then Z
    while 0 <= i < len(pattern) - 1:
        letter = pattern[i + 1]
        if letter in "Zz" and i == len(pattern) - 2:
            return pattern[:i]
        if letter in "AZz":
            raise ValueError(f"\\{letter} is taken as an anchor only at the {'start' if letter == 'A' else 'end'} of "
                             "the pattern here (the whole output must match it): leave it out")
        if letter in _LETTER_ESCAPES_READ_AS_LETTERS:
            raise ValueError(f"the escape \\{letter} is not supported by the structured-output regex engine "
                             f"(it would match the letter {letter!r} itself)")
        i = pattern.find("\\", i + 2)
    return pattern


def _admits_a_first_token(compiled: xgr.CompiledGrammar) -> bool:
    """Whether the grammar allows any token at its start (a stop token counts: the empty output)."""
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


def _reason(exc: Exception) -> str:
    # "[07:45:10] /project/cpp/json_schema_converter.cc:5082: Unsupported type "foo"" -> the last part
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip()) or type(exc).__name__


def _token_bits(tokens: Sequence[int], num_words: int) -> np.ndarray:
    """A bitmask row (uint32 words) with the tokens' bits set; ids past its end are left out."""
    ids = np.asarray(tokens, dtype=np.int64)
    ids = ids[ids < 32 * num_words]
    bits = np.zeros(num_words, dtype=np.uint32)
    np.bitwise_or.at(bits, ids >> 5, np.left_shift(1, ids & 31).astype(np.uint32))
    return bits


def _narrow(words: np.ndarray, keep: np.ndarray) -> None:
    """Keep only the `keep` bits of one bitmask row, unless no token would be left: the grammar's
    own choice then stands (where it must end, or where an allow list shares none of its tokens)."""
    kept = words & keep
    if kept.any():
        words[:] = kept


def _leave_out(words: np.ndarray, tokens: tuple[int, ...]) -> None:
    """Clear the tokens' bits in one row of a bitmask (bans), unless no other token would be left."""
    _narrow(words, ~_token_bits(tokens, len(words)))


class GrammarManager:
    """Compiles specs on a thread pool, caches them by spec, and builds each step's bitmask.

    The engine asks `compile(spec)` when a request arrives and schedules the request only once the
    future is done, so a slow compile delays that request alone."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: list[int],
                 max_workers: int = 2, pin_memory: bool = False) -> None:
        self.vocab_size = vocab_size
        # a pageable upload would wait for the device to finish the forward pass it follows
        self.pin_memory = pin_memory
        self.compiler = new_compiler(tokenizer, vocab_size, stop_token_ids)
        self.pool = ThreadPoolExecutor(max_workers, thread_name_prefix="nanoserve-grammar")
        self.compiled = CompileCache()
        # fills many rows' masks on xgrammar's own threads (C++, outside the GIL): at a few tens of
        # microseconds per row for a large vocabulary, 256 rows one by one would outlast a GPU step
        self.batch = xgr.BatchGrammarMatcher()
        # every request of a step waits for its grammar work: a matcher too slow for that is named here
        self.clock = MatcherClock()
        self._every_token: np.ndarray | None = None   # a reasoning row's mask, made when first needed

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """A future of the CompiledGrammar; raises ValueError from result() when it cannot compile."""
        key = spec.key
        future = self.compiled.get(key)
        if future is None:
            future = self.pool.submit(compile_spec, self.compiler, spec)
            self.compiled.put(key, future)
        return future

    @staticmethod
    def matcher(compiled: xgr.CompiledGrammar, stop_token_ids: frozenset[int]) -> xgr.GrammarMatcher:
        """A matcher at the grammar's start. It ends on the request's own stop tokens, where it has any."""
        return xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_token_ids) or None)

    def bitmask(self, matchers: list[xgr.GrammarMatcher | None], bans: dict[int, tuple[int, ...]] | None = None,
                allowed: dict[int, Sequence[int]] | None = None,
                gates: dict[int, ReasoningGate] | None = None) -> TokenMask | None:
        """The allowed next tokens of each sampling row that has a matcher; None when no row has one.

        A terminated matcher has no next token (xgrammar refuses to fill it): its row, whose
        token will be dropped, is left unconstrained. `bans`: per row, tokens to leave out (stop
        tokens before min_tokens) unless the grammar allows nothing else, as where it must end.
        `allowed`: per row, its allow list (allowed_token_ids), kept to on the same terms; the
        sampler leaves such rows' logits to this mask. Rows given the same list object (a
        request's n choices) share its bits, made once. `gates`: rows whose grammar waits for the
        reasoning's end (not yet answering): a reasoning row may take any token, and a row before
        its first token may also open its reasoning; the bans and allow lists hold for them too."""
        rows = [r for r, m in enumerate(matchers) if m is not None and not m.is_terminated()]
        if not rows:
            return None
        # not cleared: each matcher writes its whole row (clearing 256 rows of pinned memory took
        # 0.5 ms of the step on an H200's host)
        bitmask = torch.empty((len(rows), xgr.get_bitmask_shape(1, self.vocab_size)[1]), dtype=torch.int32,
                              pin_memory=self.pin_memory)
        index = {row: i for i, row in enumerate(rows)} if bans or allowed or gates else {}
        free = {index[row] for row, gate in gates.items() if row in index and gate.reasoning} if gates else ()
        if not free:   # the common case: every row's matcher fills it
            self.clock.run([matchers[r] for r in rows], lambda m, i: m.fill_next_token_bitmask(bitmask, i),
                           lambda ms, rows_: self._fill(ms, bitmask, rows_), closes_step=True)
        else:
            if self._every_token is None:   # every token of the model's vocabulary (reasoning_gate.py)
                self._every_token = _token_bits(range(self.vocab_size), bitmask.shape[1]).view(np.int32)
            for i in free:
                bitmask[i] = torch.from_numpy(self._every_token)
            filled = [i for i in range(len(rows)) if i not in free]
            self.clock.run([matchers[rows[i]] for i in filled],
                           lambda m, j: m.fill_next_token_bitmask(bitmask, filled[j]),
                           lambda ms, js: self._fill(ms, bitmask, [filled[j] for j in js]), closes_step=True)
        for row, gate in (gates or {}).items():
            if row in index and not gate.reasoning and gate.start is not None:
                # before the first token: the grammar's tokens, or the one that opens the reasoning
                words = bitmask[index[row]].numpy().view(np.uint32)
                words |= _token_bits((gate.start,), len(words))
        kept: dict[int, np.ndarray] = {}   # id of an allow list -> its bits
        for row, tokens in (allowed or {}).items():   # rare: no pass over every row without one
            if row in index:
                words = bitmask[index[row]].numpy().view(np.uint32)
                if id(tokens) not in kept:
                    kept[id(tokens)] = _token_bits(tokens, len(words))
                _narrow(words, kept[id(tokens)])
        if bans:   # rare (min_tokens beside a grammar): no pass over every row without them
            for row, ban in bans.items():
                if row in index:
                    _leave_out(bitmask[index[row]].numpy().view(np.uint32), ban)
        return TokenMask(bitmask, rows)

    def _fill(self, matchers: list[xgr.GrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)

    def advance(self, steps: list[tuple[xgr.GrammarMatcher, int]]) -> None:
        """Each matcher accepts its sampled token. The token was drawn under that matcher's mask,
        so it is always accepted."""
        if not steps:
            return
        matchers, tokens = zip(*steps)
        # rows: every one but the suspects, all of them in the common case (no pass over them then)
        self.clock.run(list(matchers), lambda m, i: m.accept_token(tokens[i]),
                       lambda ms, rows: self._accept(ms, list(tokens) if len(rows) == len(tokens)
                                                     else [tokens[i] for i in rows]), closes_step=False)

    def _accept(self, matchers: list[xgr.GrammarMatcher], tokens: list[int]) -> None:
        if len(matchers) == 1:
            matchers[0].accept_token(tokens[0])
        else:
            self.batch.batch_accept_token(matchers, tokens)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
