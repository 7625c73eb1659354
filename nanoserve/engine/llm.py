"""The offline API: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import numbers
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from typing import Sequence as Seq

from tqdm import tqdm

from nanoserve.config import EngineConfig
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.validation import (as_token_ids, check_logprobs, check_params_token_ids, check_priority,
                                         check_prompt, logprobs_cap, tokens_kept, truncated)
from nanoserve.engine.outputs import CompletionOutput, RequestState
from nanoserve.engine.vllm_logprobs import PositionLogprobs, no_text, sequence_logprobs, token_decoder
from nanoserve.generation_defaults import sampling_defaults
from nanoserve.sampling_params import SamplingParams

# a text, token ids, or vLLM's TextPrompt / TokensPrompt: {"prompt": text} / {"prompt_token_ids": ids}
Prompt = str | list[int] | dict[str, Any]
_PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


@dataclass
class RequestOutput:
    """A finished request: its prompt and its n completions (the first also read directly)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    decode: Callable[[int], str | None] = field(default=no_text, repr=False, compare=False)

    @functools.cached_property
    def prompt_logprobs(self) -> list[PositionLogprobs | None] | None:
        """With SamplingParams.prompt_logprobs, vLLM's form: None for the first prompt token, then per
        token {token id: Logprob}, the token itself first. Listed once, on first read, from the
        packed arrays the engine keeps (CompletionOutput.prompt_logprobs)."""
        scored = self.outputs[0].prompt_logprobs
        return None if scored is None else sequence_logprobs(self.prompt_token_ids, scored.entries(), self.decode)

    def __getstate__(self) -> dict[str, Any]:
        # the prompt logprobs are listed now, so that the decoder (a closure over the tokenizer) stays
        # behind: outputs pickle, as vLLM's do, for multiprocessing and for saving results
        self.prompt_logprobs
        return {**self.__dict__, "decode": no_text}

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def finished(self) -> bool:
        return all(out.finished() for out in self.outputs)


class LLM:
    """Batch generation on one model. `LLM()` serves the bundled model.

    Keyword arguments are EngineConfig fields: device, dtype, max_model_len, max_num_seqs,
    max_num_batched_tokens, block_size, num_kvcache_blocks, enable_prefix_caching, load_format...
    """

    def __init__(self, model: str | None = None, config: EngineConfig | None = None,
                 generation_config: str = "auto", **kwargs) -> None:
        """`config` replaces `model` and the keyword arguments when given (benchmarks build one).
        `generation_config`, as vLLM's: where generate() without SamplingParams takes its defaults
        ("auto": the model folder's generation_config.json; "vllm": none; or another folder)."""
        self.engine = LLMEngine(config or EngineConfig(model=model, **kwargs), show_progress=True)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        self._defaults = sampling_defaults(self.engine.config.model, generation_config)
        # one call at a time: two threads' steps interleaved in the engine took each other's outputs
        self._lock = threading.Lock()

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the sampling settings the model's generation_config.json sets, over ours."""
        return SamplingParams(**self._defaults)

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget the prefix cache, so that the next prompts compute their prefixes (a cold
        run of a benchmark in the same process); False if a call is still generating."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return self.engine.reset_prefix_cache()
        finally:
            self._lock.release()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (they also end with this process)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Seq[int] | None = None,
                 lora_request: None = None) -> list[RequestOutput]:
        """Generate for every prompt (texts, token-id lists, or vLLM's prompt dicts); outputs keep the
        prompts' order. Without SamplingParams, those of get_default_sampling_params().

        `priority`, one per prompt, orders them under `scheduling_policy="priority"` (lower first).
        Calls from several threads take turns."""
        if lora_request is not None:
            raise ValueError("LoRA adapters are not supported (lora_request)")
        with self._lock:
            return self._generate(prompts, sampling_params, use_tqdm, priority)

    def _generate(self, prompts, sampling_params, use_tqdm, priority) -> list[RequestOutput]:
        _check_prompt_type(prompts)
        if isinstance(prompts, (str, dict)) or (len(prompts) and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                       else [sampling_params] * len(prompts))
        if len(params_list) != len(prompts):
            raise ValueError(f"Got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        params_list = _checked_copies(params_list)
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"Got {len(priorities)} priorities for {len(prompts)} prompts")
        texts, token_ids = [], []
        for i, prompt in enumerate(prompts):
            text, ids, salt = self._prompt(prompt)
            ids = truncated(ids, tokens_kept(params_list[i].truncate_prompt_tokens, self.engine.config.max_model_len))
            texts.append(text)
            token_ids.append(ids)
            if salt is not None:
                params_list[i] = dataclasses.replace(params_list[i], cache_salt=salt)
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
            for text, ids, params, rank in zip(texts, token_ids, params_list, priorities):
                result = RequestOutput(str(next(self._ids)), text, ids,
                                       decode=token_decoder(self.tokenizer, params.detokenize))
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
                    if out.finished():
                        bar.update(1)
        except BaseException:
            # an error or Ctrl-C: left in the engine, this call's requests would hold their KV
            # blocks, and the next call would get outputs of requests it does not know
            for request_id in states:
                self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        for result, state in states.values():
            _as_vllm_logprobs(state.output, result.decode)
        return results

    def chat(self, messages: Seq[dict] | Seq[Seq[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None, lora_request: None = None,
             chat_template_content_format: str = "auto", mm_processor_kwargs: None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: generate for one conversation (a list of {"role", "content"} messages) or
        several, each written as the model's chat template writes it (`chat_template` replaces it).
        A message's text parts reach the template as one string (vLLM's content format "string")."""
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format {chat_template_content_format!r} is not offered: a "
                             "message's text parts reach the template as one string ('auto' or 'string')")
        if mm_processor_kwargs is not None:
            raise ValueError("mm_processor_kwargs: this engine serves text-only models")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if isinstance(messages, str) or not all(isinstance(conversation, (list, tuple)) and conversation
                                                and all(isinstance(m, dict) for m in conversation)
                                                for conversation in conversations):
            raise TypeError("LLM.chat takes a conversation (a list of {'role': ..., 'content': ...} dicts) or a "
                            "list of conversations")
        # as vLLM merges them, chat_template_kwargs win over the arguments (add_generation_prompt
        # among them); the template's text is what this path needs, whatever `tokenize` says
        arguments = {"chat_template": chat_template, "tools": tools, "add_generation_prompt": add_generation_prompt,
                     "continue_final_message": continue_final_message, **(chat_template_kwargs or {}),
                     "tokenize": False}
        if arguments["add_generation_prompt"] and arguments["continue_final_message"]:
            raise ValueError("continue_final_message continues the last message, so it cannot be set beside "
                             "add_generation_prompt, which opens a new one; set add_generation_prompt=False")
        if arguments["chat_template"] is None and not self.tokenizer.chat_template:
            raise ValueError("This model has no chat template: pass chat_template=..., or use generate()")
        prompts = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template([_text_content(message) for message in conversation],
                                                      **arguments)
            # the template writes every special token the model expects (BOS included)
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _prompt(self, prompt: Prompt) -> tuple[str | None, list[int], str | None]:
        """(its text if it has one, its token ids, its cache_salt) of one prompt of generate()."""
        _check_prompt_type(prompt)
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt), None
        if not isinstance(prompt, dict):
            return None, as_token_ids(prompt), None
        unknown = sorted(prompt.keys() - _PROMPT_KEYS)
        if unknown:
            raise ValueError(f"A prompt dict takes 'prompt' (text) or 'prompt_token_ids', and 'cache_salt'; "
                             f"{unknown} are not supported (text-only models)")
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), as_token_ids(prompt["prompt_token_ids"]), prompt.get("cache_salt")
        if not isinstance(prompt.get("prompt"), str):
            raise ValueError(f"A prompt dict needs 'prompt' (a text) or 'prompt_token_ids', got {prompt!r:.80}")
        return prompt["prompt"], self.tokenizer.encode(prompt["prompt"]), prompt.get("cache_salt")

    def _raise_failures(self, request_ids) -> bool:
        """Raise ValueError for a request the engine dropped (a grammar that cannot compile), after
        aborting the rest of this call's requests; else False."""
        failures = self.engine.take_failures()
        if failures:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise ValueError(failures[0][1])
        return False


def _check_prompt_type(prompt: Any) -> None:
    """TypeError for what is no prompt: bytes were iterated as token ids, a number or None failed on len()."""
    if prompt is None or isinstance(prompt, (bytes, bytearray, memoryview, numbers.Number)):
        raise TypeError(f"A prompt is a text, a list of token ids or a prompt dict ({{'prompt': ...}} or "
                        f"{{'prompt_token_ids': [...]}}), got {type(prompt).__name__}"
                        + ("; decode bytes to a text first" if isinstance(prompt, (bytes, bytearray)) else ""))


def _as_vllm_logprobs(out: CompletionOutput, decode: Callable[[int], str | None]) -> None:
    """A finished output's logprobs in vLLM's form, and their sum (vLLM's cumulative_logprob)."""
    if out.logprobs is not None:
        out.cumulative_logprob = sum(entry[0] for entry in out.logprobs)
        out.logprobs = sequence_logprobs(out.token_ids, out.logprobs, decode)


def _text_content(message: dict) -> dict:
    """The message with OpenAI's list of content parts joined into its text, as vLLM writes it for
    a template that takes a string ("text" parts, one a line); other parts are refused by name."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" else "text"   # an assistant's refusal in history is what it said
        if kind not in ("text", "input_text", "output_text", "refusal") or not isinstance(part.get(key), str):
            raise ValueError(f"Message content parts must be text parts ({{'type': 'text', 'text': ...}}): "
                             f"this model reads text only; got {str(part)[:80]}")
        texts.append(part[key])
    return {**message, "content": "\n".join(texts)}


def _checked_copies(params_list: list[SamplingParams]) -> list[SamplingParams]:
    """A checked copy of each distinct SamplingParams, made now: one changed since an earlier call
    (params.logit_bias = ...) kept the arrays the engine had made from its old values, and one
    changed to a value it would refuse (n = 0) failed deep in the engine."""
    copies: dict[int, SamplingParams] = {}
    for params in params_list:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if id(params) not in copies:
            copies[id(params)] = dataclasses.replace(params)
    return [copies[id(params)] for params in params_list]
