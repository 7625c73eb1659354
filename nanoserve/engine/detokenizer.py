"""Incremental detokenization with stop strings, safe for multi-byte UTF-8 split across tokens."""

from __future__ import annotations

import functools

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

# the tokens of the last few characters, decoded with their left context so that tokenizers that
# merge or strip spaces at boundaries (SentencePiece's leading "▁") give the text of a full decode
_CONTEXT_TOKENS = 5
# tokens in a row that add no text before what they hold is shown anyway. A character has at most
# 4 bytes, so such a run holds bytes that no later token can complete (UTF-8 continuation bytes, as
# a logit bias or an allow list can force): held, every step decoded all of them again, O(n^2) of
# the event loop (16k such tokens: 9.5 s), and the stream showed nothing until its end
_MAX_UNSHOWN = 16
# of those, the last few stay held: their bytes may still begin a character
_KEEP_UNSHOWN = 3
# characters of text shown already that may go before it is dropped (see _forget_shown)
_SHOWN_SLACK = 8192


@functools.lru_cache(maxsize=8)
def _added_tokens(backend: Tokenizer) -> dict[int, str]:
    """id -> text of each added token, built once per tokenizer (a few hundred tokens for a large
    vocabulary), not for every request that asks for no spaces between special tokens. Keyed by
    the tokenizer itself, not its id(), which a later tokenizer may reuse."""
    return {i: t.content for i, t in backend.get_added_tokens_decoder().items()}


class _Decoder:
    """What both decoders share: a full decode, and the text that tokens add after a prefix of them."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.spaces = spaces_between_special_tokens

    def _decode(self, ids: list[int]) -> str:
        # slow tokenizers of transformers 4 read the flag; fast ones (and transformers 5) ignore it
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip, spaces_between_special_tokens=self.spaces)

    def _text_after(self, ids: list[int], start: int) -> str:
        """The text of ids[start:], decoded with ids[:start] as left context."""
        return self._decode(ids)[len(self._decode(ids[:start])):]


class _StreamDecoder(_Decoder):
    """O(1) per token through the tokenizers library's DecodeStream (fast tokenizers)."""

    def __init__(self, backend: Tokenizer, tokenizer: PreTrainedTokenizerBase, context: list[int],
                 skip_special_tokens: bool, spaces_between_special_tokens: bool = True) -> None:
        super().__init__(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        self.backend = backend
        # vLLM's rule for fast tokenizers: with special tokens shown and no spaces between them, an
        # added token right after another is its own text, without the space the decoder put before
        # it (a WordPiece or Metaspace decoder does; a byte-level BPE one never does)
        self.joined = {} if skip_special_tokens or spaces_between_special_tokens else _added_tokens(backend)
        self.after_added = False
        self.recent: list[int] = []   # the last tokens fed, for the final flush
        self.unshown = 0              # of those, how many produced no text yet
        self._restart(context)

    def _restart(self, context: list[int]) -> None:
        """A fresh stream after `context`, tokens whose text is shown already."""
        context = self._context(context)
        self.stream = DecodeStream(skip_special_tokens=self.skip)
        for token in context:
            self.stream.step(self.backend, token)
        self.recent, self.unshown = context, 0

    def add(self, token: int) -> str:
        self.recent.append(token)
        if len(self.recent) > 2 * _CONTEXT_TOKENS + self.unshown:
            del self.recent[:len(self.recent) - _CONTEXT_TOKENS - self.unshown - 1]
        text = self.stream.step(self.backend, token)
        if self.joined:
            added = self.joined.get(token)
            if added is not None and self.after_added:
                text = added
            self.after_added = added is not None
        if text is None:
            self.unshown += 1
            return self._show_undecodable() if self.unshown >= _MAX_UNSHOWN else ""
        self.unshown = 0
        return text

    def _show_undecodable(self) -> str:
        """The text of the held tokens but the last few, as the tokenizer renders it (U+FFFD for
        bytes that no character can complete); the stream goes on afresh after them. Cut where the
        two parts decode to the whole's text, so that no character (or run of bad bytes the
        tokenizer renders as one U+FFFD) is split: such a run spans at most 4 bytes, which the
        kept tokens' bytes decide."""
        recent, shown = self.recent, len(self.recent) - self.unshown
        whole, before = self._decode(recent), self._decode(recent[:shown])
        for cut in range(len(recent) - _KEEP_UNSHOWN, shown, -1):
            head, kept = self._decode(recent[:cut]), recent[cut:]
            context = self._context(recent[:cut])
            if head + self._text_after(context + kept, len(context)) == whole:
                break
        else:   # no cut keeps the text whole (never seen): show all of it, as at the end
            text = self.flush()
            self._restart(self.recent)
            return text
        self._restart(recent[:cut])
        text = head[len(before):]
        for token in kept:
            self.recent.append(token)
            piece = self.stream.step(self.backend, token)
            self.unshown = self.unshown + 1 if piece is None else 0
            text += piece or ""
        return text

    def _context(self, tokens: list[int]) -> list[int]:
        """The last of `tokens` as a stream's context: one that ends inside a character would leak
        that character's bytes into the output."""
        context = list(tokens[-_CONTEXT_TOKENS:])
        while context and self._decode(context).endswith("\ufffd"):
            context = context[:-1]
        return context

    def flush(self) -> str:
        """The text of tokens that ended inside a character, as the tokenizer renders them."""
        if not self.unshown:
            return ""
        shown, self.unshown = len(self.recent) - self.unshown, 0
        return self._text_after(self.recent, shown)


class _WindowDecoder(_Decoder):
    """For tokenizers without a Rust backend: re-decode a short window around each new token."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, context: list[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool = True) -> None:
        super().__init__(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        self.tokens = list(context)
        self.prefix_offset, self.read_offset = 0, len(self.tokens)

    def add(self, token: int) -> str:
        self.tokens.append(token)
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        held = len(self.tokens) - self.read_offset
        if (len(full) <= len(prefix) or full.endswith("\ufffd")) and held < _MAX_UNSHOWN:
            return ""
        # a long run is shown as the tokenizer renders it (see _MAX_UNSHOWN), its bytes as U+FFFD
        del self.tokens[:self.prefix_offset]  # keep the window short: O(1) per token
        self.prefix_offset, self.read_offset = self.read_offset - self.prefix_offset, len(self.tokens)
        return full[len(prefix):]

    def flush(self) -> str:
        if self.read_offset == len(self.tokens):
            return ""
        window, start = self.tokens[self.prefix_offset:], self.read_offset - self.prefix_offset
        self.read_offset = len(self.tokens)
        return self._text_after(window, start)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Never emits half a character: a token that ends inside one adds nothing until the character
    is complete. Text that might be the start of a stop string is held back until it is known not
    to be one; a matched stop string ends the text and is not returned (unless include_stop is set).
    Stop strings count only once more than `min_tokens` tokens are in, as stop tokens do, and only
    where they start after those tokens' text.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 stop: list[str] | None = None, include_stop: bool = False,
                 skip_special_tokens: bool = True, min_tokens: int = 0,
                 spaces_between_special_tokens: bool = True) -> None:
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        backend = getattr(tokenizer, "_tokenizer", None)
        spaces = spaces_between_special_tokens
        self.decoder = (_StreamDecoder(backend, tokenizer, context, skip_special_tokens, spaces)
                        if isinstance(backend, Tokenizer) else _WindowDecoder(tokenizer, context, skip_special_tokens, spaces))
        self.stop = [s for s in (stop or []) if s]
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.num_tokens = 0     # tokens added so far
        self.stop_from = 0      # where a stop string may start: after the first min_tokens tokens' text
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""          # text decoded so far (before stop truncation), less what _forget_shown dropped
        self.emitted = 0        # characters of self.text already returned
        self.stopped: str | None = None  # the stop string that ended the text

    def add(self, new_token_ids: list[int], finished: bool = False) -> str:
        """Append tokens; return the text that is now safe to show."""
        if self.stopped is not None:
            return ""
        self.num_tokens += len(new_token_ids)
        self.text += "".join([self.decoder.add(token) for token in new_token_ids])
        if self.num_tokens <= self.min_tokens:
            self.stop_from = len(self.text)
        if finished:
            self.text += self.decoder.flush()
        return self._release(finished)

    def _release(self, finished: bool) -> str:
        if self.stop and self.num_tokens > self.min_tokens:
            # a stop string may start inside text already emitted minus the held-back tail
            search_from = max(self.stop_from, self.emitted - self.hold)
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
        self._forget_shown()
        return delta

    def _forget_shown(self) -> None:
        """Drop the text shown already but the tail a stop string may still start in: kept whole,
        `self.text +=` copied all of it for every token, O(n^2) (a choice of 64k tokens: 0.5 s of
        the event loop). Now and then, so that the copy of what is kept is not made every token."""
        cut = self.emitted - self.hold
        if cut > _SHOWN_SLACK:
            self.text = self.text[cut:]
            self.emitted -= cut
            self.stop_from = max(0, self.stop_from - cut)   # before the cut: searching starts at it anyway
