"""Logprobs in the OpenAI shapes, and each token's own bytes and text.

A token may hold part of a UTF-8 character; its text is then written as the OpenAI API does,
"bytes:\\xe6\\x97", and `bytes` carries the exact bytes so clients can join them.
"""

from __future__ import annotations

import codecs
import re

from transformers import PreTrainedTokenizerBase

from nanoserve.engine.outputs import TokenLogprob

_HEX_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece byte-fallback tokens


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-unicode table, which byte-level BPE vocabularies are written in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_DECODER = _byte_decoder()


def _is_byte_level(tokenizer: PreTrainedTokenizerBase) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and "ByteLevel" in repr(backend.decoder)


class TokenTexts:
    """Bytes and display text of single tokens of one tokenizer, cached by id."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.byte_level = _is_byte_level(tokenizer)
        self.special = set(tokenizer.all_special_ids)
        self._cache: dict[int, tuple[bytes, str]] = {}

    def get(self, token_id: int) -> tuple[bytes, str]:
        found = self._cache.get(token_id)
        if found is None:
            raw = self._bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            found = self._cache[token_id] = (raw, text)
        return found

    def text(self, token_id: int) -> str:
        return self.get(token_id)[1]

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id in self.special:
            return piece.encode()
        if self.byte_level and all(c in _BYTE_DECODER for c in piece):
            return bytes(_BYTE_DECODER[c] for c in piece)
        if match := _HEX_BYTE.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode()  # sentencepiece writes spaces as U+2581


class TokenIdNames:
    """Tokens named "token_id:N" in logprobs (vLLM's return_tokens_as_token_ids), in place of
    TokenTexts: no two tokens share a name, whatever their text; `bytes` are the name's, as vLLM's."""

    def get(self, token_id: int) -> tuple[bytes, str]:
        name = self.text(token_id)
        return name.encode(), name

    def text(self, token_id: int) -> str:
        return f"token_id:{token_id}"


TOKEN_ID_NAMES = TokenIdNames()


class TextOffsets:
    """Where the tokens of one choice start in its text, counted in the text's characters.

    A token's display text is no measure of what it adds: "bytes:\\xe6" adds a third of a
    character, and a special token that the output skips adds nothing. The offset moves by the
    characters that each token's bytes complete, as the detokenizer writes them."""

    def __init__(self, texts: TokenTexts, skip_special_tokens: bool, start: int = 0) -> None:
        self.texts, self.skip_special, self.offset = texts, skip_special_tokens, start
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, token_id: int, generated: bool) -> int:
        """The offset of this token; the next one starts after it. An echoed prompt's special
        tokens are in its text, a generated one only when special tokens are not skipped."""
        start = self.offset
        if not (generated and self.skip_special and token_id in self.texts.special):
            self.offset += len(self._utf8.decode(self.texts.get(token_id)[0]))
        return start


def completion_logprobs(texts: TokenTexts | TokenIdNames, token_ids: list[int], logprobs: list[TokenLogprob | None],
                        offsets: TextOffsets, num_prompt_tokens: int = 0) -> dict:
    """The /v1/completions `logprobs` object for these tokens, the first `num_prompt_tokens` of
    them an echoed prompt's; `offsets` moves past them.

    top_logprobs holds the top-N alternatives plus the chosen token, as vLLM returns them. A None
    entry (an echoed prompt's first token, which nothing predicts) gives null logprobs.
    """
    tokens, token_logprobs, top, text_offset = [], [], [], []
    for i, (token_id, scored) in enumerate(zip(token_ids, logprobs)):
        text = texts.text(token_id)
        tokens.append(text)
        text_offset.append(offsets.advance(token_id, generated=i >= num_prompt_tokens))
        if scored is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        chosen, alternatives, _ = scored
        token_logprobs.append(chosen)
        entry = {texts.text(tid): lp for tid, lp in alternatives}
        entry.setdefault(text, chosen)
        top.append(entry)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": text_offset}


def chat_logprobs(texts: TokenTexts | TokenIdNames, token_ids: list[int], logprobs: list[TokenLogprob], top_n: int) -> dict:
    """The /v1/chat/completions `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for token_id, (chosen, alternatives, _) in zip(token_ids, logprobs):
        raw, text = texts.get(token_id)
        top = [{"token": texts.text(tid), "logprob": lp, "bytes": list(texts.get(tid)[0])}
               for tid, lp in alternatives[:top_n]]
        content.append({"token": text, "logprob": chosen, "bytes": list(raw), "top_logprobs": top})
    return {"content": content}
