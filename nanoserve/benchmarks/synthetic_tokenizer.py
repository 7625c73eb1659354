"""A byte-level tokenizer with exactly as many tokens as a model's vocabulary, for random-weight benchmarks.

Benchmarks of a bare config.json borrow the bundled model's 4,096-token tokenizer, which is fine
while they feed and read token ids. A grammar reads token strings: with 148k of Qwen3's 151,936
ids unknown to that tokenizer, xgrammar advanced a matcher in 30 us instead of under 1 us and
filled a mask ten times slower than with a real vocabulary of that size (measured on the CPU).
This one covers every id: the 256 byte tokens, then lowercase pieces of 2-5 letters with and
without a leading space, like the words of a real BPE vocabulary, and one end-of-text token.
"""

from __future__ import annotations

import itertools
import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"


def synthetic_tokenizer(folder: str, vocab_size: int) -> PreTrainedTokenizerFast:
    """Write the tokenizer to `folder` (for EngineConfig(tokenizer=folder)) and return it."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    pieces = ((space + "".join(letters)) for n in range(2, 6) for space in ("Ġ", "")
              for letters in itertools.product(string.ascii_lowercase, repeat=n))
    for piece in pieces:
        if len(vocab) >= vocab_size - 1:
            break
        vocab[piece] = len(vocab)
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    fast.save_pretrained(folder)
    return fast
