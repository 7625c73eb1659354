"""Incremental detokenization: whole characters only, stop strings found across tokens and never leaked."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from nanoserve.engine.detokenizer import IncrementalDetokenizer
from nanoserve.engine.outputs import RequestState, StepOutput
from nanoserve.sampling_params import SamplingParams
from tests.conftest import _save_tokenizer

MULTIBYTE = "naïve café — 日本語 ✓ 🙂 done"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("byte-level-tokenizer")
    _save_tokenizer(str(folder))  # byte-level BPE trained on English: every non-ASCII character is split
    return AutoTokenizer.from_pretrained(folder)


def feed(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """Deltas after each token, the last one marked finished, as the engine reports them."""
    return [detok.add([t], finished=i == len(ids) - 1) for i, t in enumerate(ids)]


def test_characters_split_across_tokens_are_never_emitted_in_part(tokenizer):
    ids = tokenizer.encode(MULTIBYTE)
    # the premise: some characters really are spread over several tokens
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    deltas = feed(IncrementalDetokenizer(tokenizer, []), ids)
    assert "".join(deltas) == MULTIBYTE
    assert not any("\ufffd" in d for d in deltas)
    # the three bytes of 日 arrive as three tokens: the first two add nothing, the third adds the character
    assert "日" in deltas


def test_prompt_context_does_not_leak_into_the_output(tokenizer):
    prompt = tokenizer.encode("The quick brown")
    ids = tokenizer.encode(" fox jumps 日本")
    assert "".join(feed(IncrementalDetokenizer(tokenizer, prompt), ids)) == " fox jumps 日本"


def test_a_sequence_ending_inside_a_character_shows_what_the_tokenizer_makes_of_it(tokenizer):
    ids = tokenizer.encode("ok 日")[:-1]  # cut the last byte of 日
    deltas = feed(IncrementalDetokenizer(tokenizer, []), ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas[:-1])


@pytest.mark.parametrize("stop", ["own fo", "語 ✓", "x jum"])
def test_stop_string_spanning_tokens_ends_the_text_and_is_not_returned(tokenizer, stop):
    text = "The quick brown fox jumps 日本語 ✓ over"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [], stop=[stop])
    deltas, expected = [], text[:text.index(stop)]
    for i, t in enumerate(ids):
        deltas.append(detok.add([t], finished=i == len(ids) - 1))
        # at every moment, what was shown is a prefix of the final answer: nothing past the stop leaked
        assert expected.startswith("".join(deltas))
        if detok.stopped:
            break
    assert "".join(deltas) == expected
    assert detok.stopped == stop
    # the stop string spans tokens: no single token holds it
    assert not any(stop in tokenizer.decode([t]) for t in ids)


def test_possible_stop_prefix_is_held_back_then_released(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=["fox!"])
    shown = detok.add(tokenizer.encode("The fox"))
    assert "fox" not in shown, "'fox' could be the start of 'fox!': it must wait"
    shown += detok.add(tokenizer.encode(" jumps"))
    assert "fox" in shown  # ' j' proved it is not the stop string
    shown += detok.add([], finished=True)
    assert shown == "The fox jumps"
    assert detok.stopped is None


def test_include_stop_str_in_output_keeps_the_stop_string(tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["brown f"], include_stop=True)
    assert "".join(feed(detok, ids)) == "The quick brown f"


def test_stop_strings_wait_for_min_tokens(tokenizer):
    # min_tokens 5 with a stop string in the first token ended the text empty, with finish "stop"
    ids = tokenizer.encode("a list holds items in order")
    assert len(ids) > 6
    detok = IncrementalDetokenizer(tokenizer, [], stop=["a", "in order"], min_tokens=5)
    assert "".join(feed(detok, ids)) == "a list holds items "
    assert detok.stopped == "in order"
    # a stop string inside the first min_tokens tokens' text does not end it later either
    detok = IncrementalDetokenizer(tokenizer, [], stop=["items"], min_tokens=len(ids) - 1)
    assert "".join(feed(detok, ids)) == tokenizer.decode(ids)
    assert detok.stopped is None


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode("a list holds items in order")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["in order", "holds"])
    assert "".join(feed(detok, ids)) == "a list "
    assert detok.stopped == "holds"


def test_request_state_reports_stop_and_ignores_tokens_after_it(tokenizer):
    params = SamplingParams(stop=["brown"], max_tokens=50)
    ids = tokenizer.encode("The quick brown fox jumps")
    state = RequestState(tokenizer, [1, 2], params)
    texts = []
    for t in ids:
        out = state.update(StepOutput("r", [t], None, False, None, 2, 0))
        texts.append(out.text_delta)
        if state.stopped:
            break
    assert out.finish_reason == "stop" and out.stop_reason == "brown"
    assert out.text == "The quick "
    late = state.update(StepOutput("r", ids[-1:], None, True, "length", 2, 0))
    assert late.text == "The quick " and late.text_delta == "" and late.finish_reason == "stop"


def byte_tokens(tokenizer) -> dict[int, int]:
    """byte -> id of the byte-level tokenizer's one-byte tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = tokenizer.get_vocab()
    return {b: vocab[c] for b, c in bytes_to_unicode().items() if c in vocab}


def test_a_kept_text_grows_in_place_not_by_a_copy_per_update(tokenizer):
    # `out.text += delta` copied the whole text for every update of a whole response with stop
    # strings: O(n^2), 0.45 s of the event loop for one choice of 64k tokens. A copy per update
    # shows as a peak of twice the text (the old and the new one alive at once)
    import tracemalloc

    state = RequestState(tokenizer, [], SamplingParams(stop=["zzzz"], max_tokens=None), streaming=False)
    step = StepOutput("r", tokenizer.encode(" list dict"), None, False, None, 0, 0)
    for _ in range(2000):   # the text is well past the detokenizer's own, which it keeps short
        state.update(step)
    tracemalloc.start()
    try:
        for _ in range(4000):
            state.update(step)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(state.output.text) > 50_000
    # growth in place: no moment holds the text twice (token ids and the like are held either way)
    assert peak - held < 0.5 * len(state.output.text)


def test_a_long_output_keeps_only_the_text_a_stop_string_may_still_start_in(tokenizer):
    # all of it was kept, and `self.text +=` copied all of it for every token: O(n^2), 0.5 s of the
    # event loop for one choice of 64k tokens
    ids = tokenizer.encode(" list dict") * 4000 + tokenizer.encode(" dict the end")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["dict the"], include_stop=True)
    deltas, kept = [], 0
    for t in ids:
        deltas.append(detok.add([t]))
        kept = max(kept, len(detok.text))
    text = tokenizer.decode(ids)
    assert "".join(deltas) == text[:text.index("dict the") + len("dict the")]
    assert detok.stopped == "dict the"
    assert kept < 20_000 < len(text)


@pytest.mark.parametrize("decoder", ["stream", "window"])
def test_bytes_no_character_can_complete_are_shown_as_they_come(tokenizer, decoder):
    # a run of UTF-8 continuation bytes (forced with an allow list or a logit bias) never completes a
    # character: it was held whole to the end, each token decoding all of it again (O(n^2): 16k
    # tokens took 9.5 s of the front end's event loop, every stream's)
    from nanoserve.engine.detokenizer import _WindowDecoder

    ids = [byte_tokens(tokenizer)[0x80]] * 2000
    prompt = tokenizer.encode("The list")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    if decoder == "window":
        detok.decoder = _WindowDecoder(tokenizer, prompt[-5:], True)
    deltas = feed(detok, ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert all("".join(deltas[i:i + 16]) for i in range(0, 1984, 16))   # text at least every 16 tokens


def test_runs_of_stray_bytes_beside_characters_detokenize_to_the_full_decode(tokenizer):
    import random

    by_byte = byte_tokens(tokenizer)
    # continuation and lead bytes, ASCII, and whole multi-byte characters split over tokens
    pieces = [[by_byte[b]] for b in (0x80, 0x9F, 0xBF, 0xC3, 0xE2, 0xF0, 0x41)]
    pieces += [tokenizer.encode(c) for c in "é€🙂日"]
    rng = random.Random(5)
    for _ in range(40):
        ids = [t for _ in range(rng.randrange(20, 120)) for t in rng.choice(pieces)]
        deltas = feed(IncrementalDetokenizer(tokenizer, tokenizer.encode("The list")), ids)
        assert "".join(deltas) == tokenizer.decode(ids)


@pytest.mark.parametrize("decoder", ["stream", "window"])
def test_random_tokens_detokenize_to_the_full_decode_with_either_decoder(tokenizer, decoder):
    """DecodeStream for fast tokenizers; a short re-decoded window for those without a Rust backend."""
    import random

    from nanoserve.engine.detokenizer import _WindowDecoder

    rng = random.Random(3)
    for _ in range(50):
        prompt = tokenizer.encode("The list")
        ids = [rng.randrange(len(tokenizer)) for _ in range(25)]
        detok = IncrementalDetokenizer(tokenizer, prompt)
        if decoder == "window":
            detok.decoder = _WindowDecoder(tokenizer, prompt[-5:], True)
        deltas = feed(detok, ids)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def spaced_tokenizer(tmp_path_factory):
    """A WordPiece tokenizer, whose decoder puts a space before every word and added token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10,
                            trainers.WordPieceTrainer(vocab_size=100, special_tokens=["[UNK]", "[A]", "[B]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", additional_special_tokens=["[A]", "[B]"])


def test_no_spaces_between_special_tokens_joins_adjacent_added_tokens_as_vllm_does(spaced_tokenizer):
    ids = spaced_tokenizer.encode("the fox [A][B] dog [B]")

    def text(**kw) -> str:
        return "".join(feed(IncrementalDetokenizer(spaced_tokenizer, [], **kw), ids))

    assert text(skip_special_tokens=False) == spaced_tokenizer.decode(ids) == "the fox [A] [B] dog [B]"
    # only between two added tokens in a row: a special token after a word keeps its space
    assert text(skip_special_tokens=False, spaces_between_special_tokens=False) == "the fox [A][B] dog [B]"
    # with special tokens skipped there is nothing between them to join
    assert text(spaces_between_special_tokens=False) == text() == "the fox dog"


def test_spaces_between_special_tokens_reaches_the_detokenizer_from_sampling_params(spaced_tokenizer):
    ids = spaced_tokenizer.encode("[A][B][A]")
    for spaces, expected in ((True, "[A] [B] [A]"), (False, "[A][B][A]")):
        params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)
        for streaming in (True, False):
            state = RequestState(spaced_tokenizer, [], params, streaming=streaming)
            for i, t in enumerate(ids):
                out = state.update(StepOutput("r", [t], None, i == len(ids) - 1, "length" if i == len(ids) - 1 else None,
                                              0, 0))
            assert out.text == expected, (spaces, streaming)


def test_a_byte_level_tokenizer_never_spaces_special_tokens_either_way():
    """The bundled model's tokenizer (byte-level BPE) writes its special tokens as they are: the
    flag leaves its text alone, as in vLLM."""
    from nanoserve.config import DEFAULT_MODEL

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    ids = tok.encode("<|im_start|><|im_end|>user<|im_end|><|im_start|>")
    for spaces in (True, False):
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False, spaces_between_special_tokens=spaces)
        assert "".join(feed(detok, ids)) == "<|im_start|><|im_end|>user<|im_end|><|im_start|>"
