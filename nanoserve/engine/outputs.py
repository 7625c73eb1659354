"""The text view of a request, built from the engine's per-step token deltas (StepOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from nanoserve.engine.detokenizer import IncrementalDetokenizer
from nanoserve.engine.messages import StepOutput, TokenLogprob
from nanoserve.engine.prompt_logprobs import PromptLogprobs, PromptTokenLogprob
from nanoserve.engine.vllm_logprobs import PositionLogprobs
from nanoserve.sampling_params import SamplingParams

__all__ = ["CompletionOutput", "PromptLogprobs", "PromptTokenLogprob", "RequestState", "StepOutput", "TokenLogprob"]


@dataclass
class CompletionOutput:
    """The text view of one request so far; `text_delta` is what the last update added.

    A state made with `keep=False` (a streamed response, which sends each update as it comes)
    keeps no text, token ids or logprobs here, only `num_tokens`."""

    index: int
    text: str = ""
    text_delta: str = ""
    token_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0  # tokens generated so far, kept or not
    # the engine's entries while it runs; the offline API gives vLLM's dicts once it has finished
    logprobs: list[TokenLogprob] | list[PositionLogprobs] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # see StepOutput (RequestOutput lists them)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    cumulative_logprob: float | None = None  # vLLM's: the sampled tokens' logprobs summed (offline)

    def finished(self) -> bool:
        """Whether it has ended (a method, as vLLM's CompletionOutput has it)."""
        return self.finish_reason is not None


class RequestState:
    """Detokenizes one request's token stream and applies stop strings.

    Lives on the consumer side (offline loop or asyncio task), off the engine thread. When a stop
    string matches, `stopped` becomes True and the owner must abort the engine request. With
    `keep=False` the output keeps only its count of tokens: a stream's sent text and logprobs
    (~2.5 KB a token with 20 alternatives) would otherwise stay until its client read the last byte.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 params: SamplingParams, index: int = 0, streaming: bool = True, keep: bool = True) -> None:
        self.params = params
        # without streaming or stop strings, one decode at the end gives the same text for less work
        self.incremental = streaming or bool(params.stop)
        self.keep = keep or not self.incremental   # decoding once at the end needs every token
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.stop,
                                                  params.include_stop_str_in_output, params.skip_special_tokens,
                                                  params.min_tokens, params.spaces_between_special_tokens)
        self.output = CompletionOutput(index=index, logprobs=[] if params.logprobs is not None else None)
        self.eos_token_id = tokenizer.eos_token_id

    @property
    def stopped(self) -> bool:
        return self.detokenizer.stopped is not None

    def _ended_by_stop_token(self, step: StepOutput) -> bool:
        # the engine's "stop" is always a token's: EOS, a stop_token_id, or the stop token that
        # completes a grammar; stop strings end the output here, on this side. Before min_tokens a
        # stop token is the text's (the engine does not stop on it): a grammar whose last token is
        # one of the stop ids, complete before min_tokens, ended it
        return (step.finished and step.finish_reason == "stop" and bool(step.new_token_ids)
                and not self.params.include_stop_str_in_output and self._past_min_tokens)

    @property
    def _past_min_tokens(self) -> bool:
        return self.output.num_tokens >= self.params.min_tokens

    def update(self, step: StepOutput) -> CompletionOutput:
        out = self.output
        if out.finished():
            out.text_delta = ""
            return out
        tokens = step.new_token_ids
        out.num_tokens += len(tokens)
        if self.keep:
            out.token_ids.extend(tokens)
            if out.logprobs is not None and step.logprobs:
                out.logprobs.extend(step.logprobs)
        if step.prompt_logprobs is not None:
            out.prompt_logprobs = step.prompt_logprobs
        if self.params.detokenize and (self.incremental or step.finished):
            pending = tokens if self.incremental else out.token_ids
            if self._ended_by_stop_token(step):
                # as in vLLM, the EOS or stop token that ended the output is in its token ids, not
                # its text (a non-special stop token, or EOS with special tokens shown, would be)
                pending = pending[:-1]
            out.text_delta = self.detokenizer.add(pending, finished=step.finished)
            if self.keep:
                # with no other reference CPython appends in place; `out.text += ...` copied the
                # whole text every update (O(n^2): 0.45 s for one choice of 64k tokens)
                text, out.text = out.text, ""
                text += out.text_delta
                out.text = text
        if self.stopped:
            out.finish_reason, out.stop_reason = "stop", self.detokenizer.stopped
        elif step.finished:
            out.finish_reason = step.finish_reason
            last = tokens[-1] if tokens else None
            # as vLLM reports it: the tokenizer's EOS is checked first and has no stop reason; any other
            # stop token has, a stop_token_id or an EOS id that only generation_config.json names
            # (vLLM adds those to the stop ids): Qwen3's <|endoftext|> beside its <|im_end|>
            eos = last == self.eos_token_id and not self.params.ignore_eos
            if step.finish_reason == "stop" and last is not None and not eos and self._past_min_tokens:
                out.stop_reason = last
        return out
