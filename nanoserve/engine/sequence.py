"""One request's tokens and its place in the KV cache."""

from __future__ import annotations

import enum
import itertools
import time

from nanoserve.engine.prompt_logprobs import PromptLogprobBuffer
from nanoserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count()


class Sequence:
    """Prompt and output tokens of one request, and the KV blocks that hold them.

    `num_computed_tokens` counts tokens whose K/V are already in the cache; the scheduler
    hands out the rest (`num_tokens - num_computed_tokens`) in chunks. A preempted sequence
    drops its blocks and recomputes from zero, prefix cache permitting.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival: int = 0, priority: int = 0) -> None:
        self.request_id = request_id
        self.seq_id = next(_seq_ids)   # unique in this process, unlike a client's request id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.arrival = arrival
        self.added_at = time.monotonic()
        self.scheduled_at: float | None = None   # when it first ran: its time in the queue ends there
        self.priority = priority   # under the priority policy, lower values are served first
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0   # prefix-cache hits at the last admission
        self.num_hashed_blocks = 0   # leading full blocks registered in the prefix cache
        self.num_dropped_blocks = 0  # leading blocks given back behind a sliding window (stand-ins in the table)
        self.block_hashes: list[int] = []
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.max_tokens = params.max_tokens
        self.pending_row = -1  # row of the launched step whose sampled id is still on the device
        self.stop_token_ids: frozenset[int] = frozenset(params.stop_token_ids)  # eos added by the engine
        # structured outputs: xgrammar's matcher over the output tokens so far (set by the engine
        # once the grammar compiled). It advances with each sampled token and never rolls back:
        # preemption recomputes the KV cache but keeps the tokens, so the matcher stays right
        self.grammar = None
        self.gate = None   # engine/reasoning_gate.ReasoningGate: the grammar waits for the reasoning's end
        self.bad_words = None  # engine/bad_words.BadWords, set by the engine when params has any
        self.prompt_logprobs: PromptLogprobBuffer | None = PromptLogprobBuffer(
            self.num_prompt_tokens, params.prompt_logprobs) if params.prompt_logprobs is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")
