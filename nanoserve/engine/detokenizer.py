"""Incremental detokenization with stop strings, safe for multi-byte UTF-8 split across tokens."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

# the tokens of the last few characters, re-decoded with their left context so that
# tokenizers that merge or strip spaces at boundaries give the same text as a full decode
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Never emits half a character: a decode that ends in U+FFFD waits for the next token.
    Text that might be the start of a stop string is held back until it is known not to be one;
    a matched stop string ends the text and is not returned (unless include_stop is set).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 stop: list[str] | None = None, include_stop: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.include_stop = include_stop
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""          # all text decoded so far (before stop truncation)
        self.emitted = 0        # characters of self.text already returned
        self.stopped: str | None = None  # the stop string that ended the text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_token_ids: list[int], finished: bool = False) -> str:
        """Append tokens; return the text that is now safe to show."""
        if self.stopped is not None:
            return ""
        for token in new_token_ids:
            self.tokens.append(token)
            prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
            full = self._decode(self.tokens[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix):]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        if finished and self.read_offset < len(self.tokens):
            # the sequence ended on an incomplete character: show what the tokenizer makes of it
            prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
            self.text += self._decode(self.tokens[self.prefix_offset:])[len(prefix):]
            self.read_offset = len(self.tokens)
        return self._release(finished)

    def _release(self, finished: bool) -> str:
        if self.stop:
            # a stop string may start inside text already emitted minus the held-back tail
            search_from = max(0, self.emitted - self.hold)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
            if hits:
                index, stop = min(hits)
                self.stopped = stop
                end = index + len(stop) if self.include_stop else index
                delta = self.text[self.emitted:end]
                self.emitted = max(self.emitted, end)
                return delta
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
