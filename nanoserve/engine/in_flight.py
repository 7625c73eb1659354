"""A step launched on the device and not yet sampled or read back: what the engine needs to
finish it once its logits (or its sampled ids) are in."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoserve.engine.sequence import Sequence
from nanoserve.runner.batch import SequenceWork
from nanoserve.runner.model_runner import PendingSample, StepLogits


@dataclass
class InFlightStep:
    """A launched step: its sampling sequences in row order, and where each one's token goes.

    `pending` is None while the forward pass runs unsampled: a step with grammar rows samples only
    once the previous step's tokens have advanced their matchers."""

    forward: StepLogits
    pending: PendingSample | None = None
    sequences: list[Sequence] = field(default_factory=list)
    constrained: list[int] = field(default_factory=list)  # rows whose sequence has a grammar
    bans: dict[int, tuple[int, ...]] = field(default_factory=dict)  # constrained rows' bans (token_rules.banned_tokens)
    rows: list[SequenceWork] = field(default_factory=list)  # the sampling rows' work, in row order (if listening)
    # rows whose bans depend on the tokens before them (bad words of several tokens): recomputed
    # when sampling, which waits for the previous launch's tokens as a grammar's rows do
    listening: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # index of the placeholder in token_ids
    scored: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, chunk start) with prompt logprobs
