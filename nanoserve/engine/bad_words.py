"""vLLM's bad_words: the token that would complete a bad word is banned at the step it would.

Each bad word is tokenized as it would start a text and, where the tokenizer writes a leading
space into the token (byte-level BPE, SentencePiece), as it would follow one (vLLM's rule, after
transformers' NoBadWordsLogitsProcessor). The last token of such a sequence is banned whenever the
tokens generated so far end with the rest of it; a one-token word is banned at every step. Only
generated tokens count, as in vLLM: a prompt that ends inside a bad word does not ban its end.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from nanoserve.sampling_params import SamplingParams


def bad_words_token_ids(tokenizer: PreTrainedTokenizerBase, words: Sequence[str]) -> list[list[int]]:
    """The token sequences of the words, as vLLM builds them: each word (its leading whitespace
    stripped) as is, and with a leading space where that gives another first token but as many
    tokens (a word that splits differently after a space is left at its first form)."""
    found: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            continue
        found.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            found.append(spaced)
    return found


def with_bad_words_token_ids(params: SamplingParams, tokenizer: PreTrainedTokenizerBase) -> SamplingParams:
    """`params` carrying its bad words' token sequences, tokenized now unless they already are.
    Once per request: 128 words of 256 characters take ~65 ms, which per each of n=128 choices
    held the engine's loop, and every other stream, for 8 s."""
    if not params.bad_words or params.bad_words_token_ids is not None:
        return params
    return params.derived(bad_words_token_ids=bad_words_token_ids(tokenizer, params.bad_words))


class BadWords:
    """One sequence's bad words, indexed for a check per step that costs the words that could end
    now, not all of them."""

    def __init__(self, sequences: list[list[int]], vocab_size: int) -> None:
        # a last token outside the model's vocabulary can never be drawn: nothing to ban
        sequences = [s for s in sequences if s[-1] < vocab_size]
        self.always = tuple(sorted({s[0] for s in sequences if len(s) == 1}))
        # by the last token of the prefix: (the prefix, the token it must not be followed by)
        self.after: dict[int, list[tuple[list[int], int]]] = {}
        for s in sequences:
            if len(s) > 1:
                self.after.setdefault(s[-2], []).append((s[:-1], s[-1]))

    @property
    def needs_history(self) -> bool:
        """Whether a ban depends on the tokens generated before it (a word of several tokens)."""
        return bool(self.after)

    def banned(self, token_ids: Sequence[int], start: int, end: int) -> tuple[int, ...]:
        """The tokens that must not follow token_ids[start:end], the tokens generated so far
        (indexed in place: a slice of a long output each step would cost its length)."""
        if not self.after or end <= start:
            return self.always
        extra = [last for prefix, last in self.after.get(token_ids[end - 1], ())
                 if end - len(prefix) >= start and token_ids[end - len(prefix):end] == prefix]
        return self.always + tuple(extra) if extra else self.always
