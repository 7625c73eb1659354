"""Structured outputs after the reasoning: a grammar that holds only once the model has thought.

A reasoning model writes `<think> ... </think>` before its answer. A grammar applied from the first
token would forbid the thinking (the JSON would open at once, and a reasoning parser would then read
it as reasoning where the template opened `<think>` in the prompt). So, as vLLM does, a request whose
spec names the reasoning's tokens leaves its output free while the model reasons, and its matcher
sees only the tokens after the reasoning's end. The end token itself is not part of the answer.
"""

from __future__ import annotations

from nanoserve.structured_outputs_params import StructuredOutputsParams

UNDECIDED, REASONING, ANSWERING = range(3)


class ReasoningGate:
    """Where one sequence's output stands: before its first token (it may open its reasoning, or
    answer at once under the grammar), inside its reasoning (free), or in its answer (the grammar)."""

    __slots__ = ("start", "end", "state")

    def __init__(self, spec: StructuredOutputsParams) -> None:
        self.start, self.end = spec.reasoning_start_id, spec.reasoning_end_id
        self.state = REASONING if spec.reasoning_open else UNDECIDED

    @property
    def answering(self) -> bool:
        return self.state == ANSWERING

    @property
    def reasoning(self) -> bool:
        return self.state == REASONING

    def passes(self, token: int) -> bool:
        """Take the next sampled token; whether the grammar's matcher takes it too."""
        if self.state == ANSWERING:
            return True
        if self.state == UNDECIDED:
            # the first token opens the reasoning, or it is the answer's first (drawn under the grammar)
            self.state = REASONING if token == self.start else ANSWERING
            return self.state == ANSWERING
        if token == self.end:
            self.state = ANSWERING
        return False


def reasoning_gate(spec: StructuredOutputsParams) -> ReasoningGate | None:
    """The gate a spec asks for; None where it names no reasoning (the grammar holds from the start)."""
    return ReasoningGate(spec) if spec.reasoning_end_id is not None else None
