"""The benchmarks' stand-in tokenizer covers a model's whole vocabulary, so grammars see every token."""

from __future__ import annotations

from nanoserve.benchmarks.synthetic_tokenizer import EOS, synthetic_tokenizer
from nanoserve.engine.grammar import GrammarManager
from nanoserve.structured_outputs_params import StructuredOutputsParams


def test_every_id_is_a_token_and_json_text_round_trips(tmp_path):
    tok = synthetic_tokenizer(str(tmp_path), 5000)
    assert len(tok) == 5000 and tok.convert_ids_to_tokens(4999) == EOS and tok.eos_token_id == 4999
    assert all(tok.decode([i]) for i in range(0, 5000, 97))
    text = '{"text": "a list of words"}'
    ids = tok.encode(text)
    assert tok.decode(ids) == text

    grammars = GrammarManager(tok, 5000, [tok.eos_token_id])
    compiled = grammars.compile(StructuredOutputsParams(json={"type": "object", "properties": {
        "text": {"type": "string"}}, "required": ["text"]})).result()
    matcher = grammars.matcher(compiled, frozenset([tok.eos_token_id]))
    assert all(matcher.accept_token(t) for t in ids) and matcher.accept_token(tok.eos_token_id)
    grammars.close()
