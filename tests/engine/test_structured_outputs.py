"""The engine's grammars: compiled off the step loop, a matcher per sequence, correct under
preemption, pipelined scheduling and n > 1."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import numpy as np
import pytest
import xgrammar as xgr

from nanoserve import LLM, SamplingParams
from nanoserve.config import DEFAULT_MODEL
from nanoserve.engine.grammar import GrammarManager, compile_spec
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.structured_outputs_params import MAX_SPEC_CHARS, StructuredOutputsParams

REGEX = r"(ab|cd)[0-9]{2,4}(-[a-z]{1,12}){2,3}"
PROMPTS = ["The function returns", "A list is", "In Python, a class"]


def constrained(n: int = 1, temperature: float = 0.0, seed: int | None = None, regex: str = REGEX) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, n=n, max_tokens=80,
                          structured_outputs=StructuredOutputsParams(regex=regex))


@pytest.fixture(scope="module")
def llm():
    with LLM(DEFAULT_MODEL, device="cpu", num_kvcache_blocks=256, block_size=16) as model:
        yield model


def texts(model: LLM, params: SamplingParams) -> list[list[str]]:
    return [[c.text for c in out.outputs] for out in model.generate(PROMPTS, params, use_tqdm=False)]


def test_spec_key_is_equal_for_equal_schemas_and_tells_property_orders_apart():
    """The grammar writes properties in the schema's order: schemas that differ only in that
    order must not share a compiled grammar."""
    a = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}, "b": {}}})
    again = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}, "b": {}}})
    swapped = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {"type": "integer"}}})
    assert a.key == again.key != StructuredOutputsParams(regex="a").key
    assert a.key != swapped.key
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])


def test_a_schema_is_written_as_json_dumps_writes_it_and_refused_as_soon_as_it_passes_the_limit():
    schema = {"type": "object", "properties": {"é": {"type": "string", "pattern": "a\\d\n"},
                                               "n": {"maximum": 1e308, "minimum": -(10 ** 30)}, "x": [None, True, 2.5]}}
    assert StructuredOutputsParams(json=schema).json == json.dumps(schema, ensure_ascii=False)
    # what lies past the limit is never written: json.dumps of the whole would fail on the object
    huge = {"description": "x" * (MAX_SPEC_CHARS + 1), "unwritable": object()}
    with pytest.raises(ValueError, match=f"over {MAX_SPEC_CHARS} characters"):
        StructuredOutputsParams(json=huge)


def test_compile_errors_name_the_problem(llm):
    manager = GrammarManager(llm.tokenizer, 4096, [0])
    with pytest.raises(ValueError, match='regex .*parenthesis'):
        compile_spec(manager.compiler, StructuredOutputsParams(regex="(a"))
    with pytest.raises(ValueError, match="regex .*admits no output"):
        compile_spec(manager.compiler, StructuredOutputsParams(regex="[^\\s\\S]"))
    with pytest.raises(ValueError, match="grammar .*cannot be compiled"):
        compile_spec(manager.compiler, StructuredOutputsParams(grammar=""))
    assert compile_spec(manager.compiler, StructuredOutputsParams(json={})) is not None  # any JSON
    assert compile_spec(manager.compiler, StructuredOutputsParams(regex="")) is not None  # the empty text
    first = manager.compile(StructuredOutputsParams(choice=["x", "y"]))
    assert manager.compile(StructuredOutputsParams(choice=["x", "y"])) is first  # the cache
    assert first.result() is not None
    manager.close()


def accepts(compiled, text: str) -> bool:
    """Whether the grammar takes `text` as a whole output: all of it, then the stop token."""
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.accept_token(compiled.tokenizer_info.stop_token_ids[0])


def test_python_anchors_hold_the_whole_output_and_escapes_read_as_letters_are_refused(llm):
    manager = GrammarManager(llm.tokenizer, 4096, [0])
    # xgrammar read \A and \Z as the letters: "\Aabc\Z" held the output to "AabcZ"
    for pattern in ("\\Aabc\\Z", "\\Aabc\\z", "abc\\Z", "\\Aabc"):
        compiled = compile_spec(manager.compiler, StructuredOutputsParams(regex=pattern))
        assert accepts(compiled, "abc") and not accepts(compiled, "AabcZ"), pattern
    # an escaped backslash before the letter is no anchor: the text ends in a backslash and a Z
    compiled = compile_spec(manager.compiler, StructuredOutputsParams(regex="ab\\\\Z"))
    assert accepts(compiled, "ab\\Z") and not accepts(compiled, "ab")
    for pattern, words in (("a\\Ab", "\\\\A is taken as an anchor only at the start"),
                           ("a\\Zb", "\\\\Z is taken as an anchor only at the end"),
                           ("\\Gab", "escape \\\\G is not supported"), ("a\\Kb", "escape \\\\K"),
                           ("\\Qa.b\\E", "escape \\\\Q")):
        with pytest.raises(ValueError, match=f"regex .*{words}"):
            compile_spec(manager.compiler, StructuredOutputsParams(regex=pattern))
    manager.close()


def test_a_terminated_matcher_leaves_its_row_unconstrained_instead_of_failing_the_step(llm):
    """xgrammar refuses to fill the mask of a matcher that has accepted its stop token; such a
    row's token is dropped anyway, so the step goes on without it."""
    manager = GrammarManager(llm.tokenizer, 4096, [0])
    compiled = manager.compile(StructuredOutputsParams(choice=["a"])).result()
    done, fresh = manager.matcher(compiled, frozenset([0])), manager.matcher(compiled, frozenset([0]))
    for token in [*llm.tokenizer.encode("a", add_special_tokens=False), 0]:
        assert done.accept_token(token)
    assert done.is_terminated()
    mask = manager.bitmask([done, None, fresh])
    assert mask.rows == [2] and mask.bitmask.shape[0] == 1
    manager.close()


def test_rows_that_share_an_allow_list_have_its_bits_made_once_per_step(llm, monkeypatch):
    # a request's n choices share its allow list; its bits were made from the list once per row,
    # every step: n=128 with 131k ids over a 152k vocabulary took ~0.7 s of the engine's step
    from nanoserve.engine import grammar

    made = []
    real = grammar._token_bits
    monkeypatch.setattr(grammar, "_token_bits", lambda tokens, words: made.append(len(tokens)) or real(tokens, words))
    manager = GrammarManager(llm.tokenizer, 4096, [0])
    compiled = manager.compile(StructuredOutputsParams(regex="[a-z]+")).result()
    params = SamplingParams(allowed_token_ids=list(range(0, 4096, 2)))
    matchers = [manager.matcher(compiled, frozenset([0])) for _ in range(9)]
    # as the engine gives them: the choices of one request, one array
    allowed = {**dict.fromkeys(range(8), params.allowed_token_ids_array),
               8: SamplingParams(allowed_token_ids=[5, 7]).allowed_token_ids_array}
    mask = manager.bitmask(matchers, allowed=allowed)
    assert sorted(made) == [2, 2048]
    bits = mask.bitmask.numpy().view(np.uint32)
    alone = manager.bitmask([matchers[0]], allowed={0: params.allowed_token_ids_array}).bitmask.numpy().view(np.uint32)
    assert all((bits[row] == alone[0]).all() for row in range(8))
    manager.close()


def test_every_choice_matches_and_n_forks_each_walk_their_own_grammar(llm):
    outs = texts(llm, constrained(n=3, temperature=1.0, seed=1))
    assert all(re.fullmatch(REGEX, t) for choices in outs for t in choices)
    assert any(len(set(choices)) > 1 for choices in outs)


def test_greedy_constrained_output_is_the_same_under_preemption_and_pipelining(llm):
    params = constrained(n=2, regex=r"[a-z ]{40,60}\.")
    reference = texts(llm, params)
    assert all(re.fullmatch(r"[a-z ]{40,60}\.", t) for choices in reference for t in choices)
    # 16 blocks of 4 tokens: six sequences of some 20 tokens cannot all hold their blocks at once
    with LLM(DEFAULT_MODEL, device="cpu", num_kvcache_blocks=16, block_size=4, max_model_len=64,
             async_scheduling=True) as tight:
        assert texts(tight, params) == reference
        assert tight.engine.scheduler.num_preemptions > 0


def test_constrained_steps_are_pipelined_and_draw_what_synchronous_steps_draw(llm):
    """With async scheduling a constrained step is launched before the last step's tokens are
    read; its masks are filled once they are. Seeded draws match the synchronous engine's."""
    params = constrained(n=2, temperature=1.0, seed=3)
    reference = texts(llm, params)
    with LLM(DEFAULT_MODEL, device="cpu", num_kvcache_blocks=256, block_size=16, async_scheduling=True) as piped:
        engine, real_step, overlapped = piped.engine, piped.engine.step, []

        def step():
            outputs = real_step()
            # a step left in flight with grammar rows: launched before the previous one was read
            overlapped.append(engine.in_flight is not None and
                              any(seq.grammar is not None for seq in engine.in_flight.sequences))
            return outputs

        engine.step = step
        assert texts(piped, params) == reference
    assert sum(overlapped) > 20


def test_a_request_waits_for_its_grammar_without_holding_others_up(llm, monkeypatch):
    engine: LLMEngine = llm.engine
    compiling: Future = Future()
    monkeypatch.setattr(engine.grammars, "compile", lambda spec: compiling)
    engine.add_request("slow", llm.tokenizer.encode("A list"), constrained())
    engine.add_request("plain", llm.tokenizer.encode("A dict"), SamplingParams(temperature=0.0, max_tokens=3))
    seen: dict[str, list[int]] = {"slow": [], "plain": []}
    for _ in range(5):
        for out in engine.step():
            seen[out.request_id] += out.new_token_ids
    assert len(seen["plain"]) == 3 and seen["slow"] == [] and engine.num_waiting == 1
    monkeypatch.undo()
    compiling.set_result(compile_spec(engine.grammars.compiler, constrained().structured_outputs))
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id] += out.new_token_ids
    assert re.fullmatch(REGEX, llm.tokenizer.decode(seen["slow"][:-1]))


def test_a_request_whose_grammar_fails_in_the_engine_is_reported_with_its_forks(llm, monkeypatch):
    engine: LLMEngine = llm.engine
    broken: Future = Future()
    broken.set_exception(ValueError("The regex given for structured outputs cannot be compiled: no"))
    monkeypatch.setattr(engine.grammars, "compile", lambda spec: broken)
    engine.add_request("bad", llm.tokenizer.encode("A list"), constrained(), fork_ids=["bad-1"])
    assert engine.step() == []   # it waits in the grammar queue until the step looks at its compile
    assert engine.take_failures() == [(["bad", "bad-1"], "The regex given for structured outputs cannot be "
                                                         "compiled: no")]
    assert not engine.has_unfinished_requests() and engine.step() == []
    with pytest.raises(ValueError, match="cannot be compiled"):  # the offline API raises it
        llm.generate("A list", constrained(n=2), use_tqdm=False)
    assert not engine.has_unfinished_requests()


def test_a_prefix_cache_hit_gives_the_same_constrained_output(llm):
    prompt = "A dictionary maps keys to values, and a list holds items in order; both are containers."
    first, second = (llm.generate(prompt, constrained(), use_tqdm=False)[0] for _ in range(2))
    assert second.num_cached_tokens > 0 and first.num_cached_tokens == 0
    assert second.text == first.text and re.fullmatch(REGEX, first.text)


@pytest.mark.parametrize("spec", [StructuredOutputsParams(json={"type": "object", "properties": {"a": {"enum": [1]}}}),
                                  StructuredOutputsParams(json='{"type": "array"}', disable_any_whitespace=True),
                                  StructuredOutputsParams(choice=["x", "y"]), StructuredOutputsParams(json_object=True)])
def test_the_spec_travels_to_the_engine_process_in_its_add_message(spec):
    from nanoserve.engine.messages import AddRequest, input_decoder, input_encoder

    sent = AddRequest(["r1"], [[1, 2, 3]], SamplingParams(max_tokens=5, structured_outputs=spec), [[]])
    received = input_decoder.decode(input_encoder.encode(sent))
    assert received.params.structured_outputs == spec and received.params.structured_outputs.key == spec.key


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=3), dict(temperature=1.0, top_k=5),
                                      dict(temperature=1.0, top_p=0.9, n=2)],
                         ids=["greedy", "seeded", "top-k", "top-p-n2"])
def test_min_tokens_gives_way_where_the_grammar_must_end_and_holds_where_it_may_go_on(llm, sampling):
    """min_tokens bans the stop tokens; a grammar that allows nothing else would leave no token
    to draw (the draw then broke the grammar). The grammar wins there; elsewhere min_tokens does."""
    def run(spec: StructuredOutputsParams, min_tokens: int) -> list:
        params = SamplingParams(max_tokens=20, min_tokens=min_tokens, structured_outputs=spec, **sampling)
        return llm.generate(PROMPTS[:2], params, use_tqdm=False)

    for out in run(StructuredOutputsParams(choice=["yes", "no"]), 8):
        assert all(c.text in ("yes", "no") and c.finish_reason == "stop" for c in out.outputs), out.outputs
    for out in run(StructuredOutputsParams(regex="(ab)+"), 7):
        for c in out.outputs:
            assert re.fullmatch("(ab)+", c.text) and len(c.token_ids) >= 7, (c.text, c.token_ids)


def test_a_grammar_that_ends_on_a_stop_id_before_min_tokens_keeps_it_as_its_text(llm):
    # the choice "x" is also a stop id: the grammar ended the output on it before min_tokens, and
    # the text lost the "x" and said stop_reason 90, as if the stop id had ended it
    (x,) = llm.tokenizer.encode("x", add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=5, min_tokens=2, stop_token_ids=[x],
                            structured_outputs=StructuredOutputsParams(choice=["x"]))
    out = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    assert (out.text, out.token_ids, out.stop_reason) == ("x", [x], None), out
    # past min_tokens the same stop id ends it as a stop id: left out of the text, and named
    out = llm.generate(PROMPTS[:1], params.derived(min_tokens=0), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] == x and out.stop_reason == x and not out.text.endswith("x"), out
