"""The offline API: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

import functools
import itertools
import numbers
from dataclasses import dataclass, field
from typing import Sequence as Seq

from tqdm import tqdm

from nanoserve.config import EngineConfig
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.validation import (as_token_ids, check_logprobs, check_params_token_ids, check_priority,
                                         check_prompt, logprobs_cap)
from nanoserve.engine.outputs import CompletionOutput, PromptTokenLogprob, RequestState
from nanoserve.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass
class RequestOutput:
    """A finished request: its prompt and its n completions (the first also read directly)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0

    @functools.cached_property
    def prompt_logprobs(self) -> list[PromptTokenLogprob | None] | None:
        """With SamplingParams.prompt_logprobs: per prompt token (None for the first) its logprob,
        top-N alternatives and rank. Listed once, on first read, from the packed arrays the engine
        keeps (CompletionOutput.prompt_logprobs)."""
        scored = self.outputs[0].prompt_logprobs
        return None if scored is None else scored.entries()

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


class LLM:
    """Batch generation on one model. `LLM()` serves the bundled model.

    Keyword arguments are EngineConfig fields: device, dtype, max_model_len, max_num_seqs,
    max_num_batched_tokens, block_size, num_kvcache_blocks, enable_prefix_caching, load_format...
    """

    def __init__(self, model: str | None = None, config: EngineConfig | None = None, **kwargs) -> None:
        """`config` replaces `model` and the keyword arguments when given (benchmarks build one)."""
        self.engine = LLMEngine(config or EngineConfig(model=model, **kwargs), show_progress=True)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (they also end with this process)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Seq[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs keep the prompts' order.

        `priority`, one per prompt, orders them under `scheduling_policy="priority"` (lower first)."""
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]
        params_list = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                       else [sampling_params or SamplingParams()] * len(prompts))
        if len(params_list) != len(prompts):
            raise ValueError(f"Got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"Got {len(priorities)} priorities for {len(prompts)} prompts")
        token_ids = [self.tokenizer.encode(p) if isinstance(p, str) else as_token_ids(p) for p in prompts]
        # all checked before any is queued: a bad prompt leaves nothing behind
        for ids, params, rank in zip(token_ids, params_list, priorities):
            check_prompt(ids, None, self.engine.config.max_model_len, self.engine.vocab_size)
            check_params_token_ids(params, self.engine.vocab_size)
            check_logprobs(params, logprobs_cap(self.engine.config.max_logprobs, self.engine.vocab_size))
            check_priority(rank, self.engine.config.scheduling_policy)
        results: list[RequestOutput] = []
        states: dict[str, tuple[RequestOutput, RequestState]] = {}
        bar = tqdm(total=sum(params.n for params in params_list), desc="Generating", disable=not use_tqdm)
        try:
            for prompt, ids, params, rank in zip(prompts, token_ids, params_list, priorities):
                result = RequestOutput(str(next(self._ids)), prompt if isinstance(prompt, str) else None, ids)
                results.append(result)
                request_ids = [f"{result.request_id}-{index}" for index in range(params.n)]
                for index, request_id in enumerate(request_ids):
                    state = RequestState(self.tokenizer, ids, params, index, streaming=False)
                    result.outputs.append(state.output)
                    states[request_id] = (result, state)
                self.engine.add_request(request_ids[0], ids, params, fork_ids=request_ids[1:], priority=rank)
            while self._raise_failures(states) or self.engine.has_unfinished_requests():
                for step in self.engine.step():
                    result, state = states[step.request_id]
                    result.num_cached_tokens = max(result.num_cached_tokens, step.num_cached_tokens)
                    out = state.update(step)
                    if state.stopped and not step.finished:
                        self.engine.abort_request(step.request_id)
                    if out.finished:
                        bar.update(1)
        except BaseException:
            # an error or Ctrl-C: left in the engine, this call's requests would hold their KV
            # blocks, and the next call would get outputs of requests it does not know
            for request_id in states:
                self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return results

    def chat(self, messages: Seq[dict] | Seq[Seq[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: generate for one conversation (a list of {"role", "content"} messages) or
        several, each written as the model's chat template writes it (`chat_template` replaces it)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message continues the last message, so it cannot be set beside "
                             "add_generation_prompt, which opens a new one; set add_generation_prompt=False")
        if chat_template is None and not self.tokenizer.chat_template:
            raise ValueError("This model has no chat template: pass chat_template=..., or use generate()")
        prompts = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                list(conversation), tokenize=False, chat_template=chat_template, tools=tools,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}))
            # the template writes every special token the model expects (BOS included)
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _raise_failures(self, request_ids) -> bool:
        """Raise ValueError for a request the engine dropped (a grammar that cannot compile), after
        aborting the rest of this call's requests; else False."""
        failures = self.engine.take_failures()
        if failures:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise ValueError(failures[0][1])
        return False
