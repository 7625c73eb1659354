"""The contract between engine and runner: what one step asks the device to do."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from nanoserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanoserve.runner.attention.prefill_splits import PrefillSplits


@dataclass(slots=True)
class SequenceWork:
    """One sequence's share of a step, owned by the engine and read-only to the runner.

    The runner computes `token_ids[start:start + num_new]` at positions `start...`, whose K/V go
    into `block_table`. When `params` is set this chunk reaches the end of the known tokens and
    the runner samples the next one.
    """

    token_ids: list[int]                 # prompt + output so far (not copied: the engine's list)
    num_prompt_tokens: int
    start: int                           # tokens already in the KV cache
    num_new: int                         # tokens to compute this step
    block_table: list[int]
    params: SamplingParams | None        # None: a prefill chunk that does not end the prompt
    banned_token_ids: tuple[int, ...] = ()  # never sampled this step (stop tokens before min_tokens)
    # >= 0: token_ids[start] is not known on the host yet; it is the token the previous launch
    # sampled for its row `prev_row`, still on the device (pipelined scheduling)
    prev_row: int = -1
    # set: also return, for every prompt position of this chunk that has a next prompt token, the
    # logprob of that token and this many top alternatives (prompt logprobs)
    prompt_logprobs: int | None = None
    # the sequence's id, unique for the engine's lifetime (-1: none, e.g. a profiling step); the
    # runner keeps per-sequence state (penalty counts) under it from step to step
    seq_id: int = -1

    def for_workers(self) -> SequenceWork:
        """What a tensor-parallel worker needs of this work: the tokens this step computes (and the
        next, a prompt-logprob target), not the whole history, which grows every step."""
        end = self.start + self.num_new + 1
        return dataclasses.replace(self, token_ids=TokenWindow(self.start, self.token_ids[self.start:end]))


class TokenWindow:
    """A slice of a sequence's tokens that is indexed by position in the whole sequence."""

    __slots__ = ("offset", "tokens")

    def __init__(self, offset: int, tokens: list[int]) -> None:
        self.offset, self.tokens = offset, tokens

    def __getstate__(self) -> tuple[int, list[int]]:
        return self.offset, self.tokens

    def __setstate__(self, state: tuple[int, list[int]]) -> None:
        self.offset, self.tokens = state

    def __getitem__(self, key: int | slice) -> int | list[int]:
        if isinstance(key, slice):
            return self.tokens[key.start - self.offset:key.stop - self.offset]
        return self.tokens[key - self.offset]


@dataclass
class TokenMask:
    """Which tokens the constrained sampling rows of a step may draw (structured outputs).

    Built by the engine from its grammar matchers; the sampler sets every other logit of those
    rows to -inf. Rows not listed are not touched."""

    bitmask: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32 on the host; bit t of a row set = token t allowed
    rows: list[int]        # the sampling row (index among the step's sampling rows) of each bitmask row


PENDING_TOKEN = -1  # stands in the engine's token lists for a sampled id not yet read back


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, shared by every layer. Sequence i owns query rows
    query_start_loc[i]:query_start_loc[i+1], and its keys are positions 0..seq_lens[i]-1."""

    slot_mapping: torch.Tensor      # [num_tokens] int64, cache slot of each new token; -1 = padding
    query_start_loc: torch.Tensor   # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor          # [num_seqs] int32, keys per sequence incl. the new tokens; 0 = padding
    block_tables: torch.Tensor      # [num_seqs, max_blocks] int32, physical block ids, -1 past the end
    max_query_len: int
    max_seq_len: int
    query_lens_host: list[int]      # host copies, for backends that loop or size launches
    seq_lens_host: list[int]
    decode_order: torch.Tensor | None = None  # [num_seqs] int32, the rows longest first (Triton decode)
    prefill_tiles: torch.Tensor | None = None  # int32 (sequence, query tile) programs of a captured step (Triton prefill)
    # a captured step's: whether one-query rows go to the decode kernel (a prompts-only graph has
    # none to send); None: the host's counts decide, step by step
    split_decode_rows: bool | None = None
    # a captured small step's key splits and their scratch (Triton prefill: prefill_splits.py)
    prefill_splits: PrefillSplits | None = None

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1

    # counted once a step, not once a layer: every layer's attention reads them
    @functools.cached_property
    def num_query_tokens(self) -> int:
        return sum(self.query_lens_host)

    @functools.cached_property
    def num_decode_rows(self) -> int:
        """Sequences of one query this step (a mixed step's decode rows)."""
        return self.query_lens_host.count(1)


@dataclass
class PromptScores:
    """The prompt logprobs one step computed for one sequence, packed (a few arrays, not a Python
    object per token): row i scores the prompt token at position start + 1 + i of its chunk."""

    logprobs: np.ndarray      # [rows] float32, the prompt token's logprob (MIN_LOGPROB at most negative)
    ranks: np.ndarray         # [rows] int32, 1 + how many tokens the model found more likely
    top_ids: np.ndarray       # [rows, top_n] int32, the most likely tokens, best first
    top_logprobs: np.ndarray  # [rows, top_n] float32, their logprobs

    def __len__(self) -> int:
        return len(self.logprobs)


@dataclass
class SampleOutput:
    """Sampled token per sampling row, with logprobs where asked for."""

    token_ids: list[int]
    # per row: (logprob of the sampled token, [(token id, logprob), ...] top-N) or None
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]
    # per sequence that asked for prompt logprobs, in work order: the prompt tokens it predicted
    # this step (positions start + 1 ...)
    prompt_logprobs: list[PromptScores] = field(default_factory=list)
