"""A prompt's logprobs, packed: filled by the engine chunk by chunk, sent to the front end whole.

Four arrays, not a tuple per token and per alternative: 16 prompts of 2,000 tokens with 20
alternatives were 700k Python objects in each process, that every full garbage collection walked
for as long as the request lived (/health answered in up to 47 ms while one was served).
"""

from __future__ import annotations

import msgspec
import numpy as np

from nanoserve.runner.batch import PromptScores

# (logprob of the prompt token, [(token id, logprob), ...] of the top alternatives, rank of the
# token: 1 + how many tokens the model found more likely); the offline API's form of one entry
PromptTokenLogprob = tuple[float, list[tuple[int, float]], int]


class PromptLogprobs(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The logprobs of a prompt's tokens from the second on (nothing predicts the first): row i is
    the token at position i + 1. Each array travels as one msgpack bin of its raw bytes, in this
    host's byte order (the engine core and the front end share the host), and is read in place."""

    top_n: int                # alternatives per row
    logprob_bytes: bytes      # float32[rows], the prompt token's logprob
    rank_bytes: bytes         # int32[rows], the prompt token's rank
    top_id_bytes: bytes       # int32[rows, top_n], the most likely tokens, best first
    top_logprob_bytes: bytes  # float32[rows, top_n], their logprobs

    def __len__(self) -> int:
        return len(self.logprob_bytes) // 4

    @property
    def logprobs(self) -> np.ndarray:
        return np.frombuffer(self.logprob_bytes, dtype=np.float32)

    @property
    def ranks(self) -> np.ndarray:
        return np.frombuffer(self.rank_bytes, dtype=np.int32)

    @property
    def top_ids(self) -> np.ndarray:
        return np.frombuffer(self.top_id_bytes, dtype=np.int32).reshape(len(self), self.top_n)

    @property
    def top_logprobs(self) -> np.ndarray:
        return np.frombuffer(self.top_logprob_bytes, dtype=np.float32).reshape(len(self), self.top_n)

    @property
    def nbytes(self) -> int:
        return len(self.logprob_bytes) + len(self.rank_bytes) + len(self.top_id_bytes) + len(self.top_logprob_bytes)

    def entries(self, top_n: int | None = None) -> list[PromptTokenLogprob | None]:
        """One entry per prompt token, None first, with at most `top_n` alternatives (all: None).
        Python floats of the float32 values, as the JSON writes them."""
        top_n = self.top_n if top_n is None else min(top_n, self.top_n)
        ids, values = self.top_ids[:, :top_n].tolist(), self.top_logprobs[:, :top_n].tolist()
        return [None, *((lp, list(zip(i, v)), rank)
                        for lp, i, v, rank in zip(self.logprobs.tolist(), ids, values, self.ranks.tolist()))]


class PromptLogprobBuffer:
    """One sequence's prompt logprobs while its prompt is scored, chunk by chunk. A chunk scored
    again (the prompt recomputed after a preemption) writes its rows again, in place."""

    def __init__(self, num_prompt_tokens: int, top_n: int) -> None:
        rows = max(num_prompt_tokens - 1, 0)
        self.top_n = top_n
        self.logprobs = np.zeros(rows, dtype=np.float32)
        self.ranks = np.zeros(rows, dtype=np.int32)
        self.top_ids = np.zeros((rows, top_n), dtype=np.int32)
        self.top_logprobs = np.zeros((rows, top_n), dtype=np.float32)

    def write(self, start: int, scores: PromptScores) -> None:
        """The scores of a chunk that starts at prompt position `start`: those of tokens start + 1 ..."""
        end = start + len(scores)
        self.logprobs[start:end] = scores.logprobs
        self.ranks[start:end] = scores.ranks
        self.top_ids[start:end] = scores.top_ids
        self.top_logprobs[start:end] = scores.top_logprobs

    def packed(self) -> PromptLogprobs:
        return PromptLogprobs(self.top_n, self.logprobs.tobytes(), self.ranks.tobytes(), self.top_ids.tobytes(),
                              self.top_logprobs.tobytes())
