"""What every route shares: the engine, the served names, metrics, and how a request is started."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from starlette.concurrency import run_in_threadpool

from nanoserve.engine.async_engine import (AsyncEngine, EngineDeadError, QueueFullError, RequestFailedError,
                                          RequestStream, RequestUpdate)
from nanoserve.engine.bad_words import with_bad_words_token_ids
from nanoserve.engine.validation import RequestRefused, check_prompt_length
from nanoserve.generation_defaults import sampling_defaults
from nanoserve.sampling_params import SamplingParams
from nanoserve.server.backlog import BudgetCollector, OutputBudget
from nanoserve.server.conversation import template_compile_error
from nanoserve.server.errors import APIError
from nanoserve.server.limits import MiB, PromptSize, ServerLimits
from nanoserve.server.logprobs import TokenTexts
from nanoserve.server.metrics import RequestTimer, ServerMetrics
from nanoserve.server.protocol import SamplingFields
from nanoserve.server.structured import SpecChecker

T = TypeVar("T")
logger = logging.getLogger(__name__)


@dataclass
class ServerSettings:
    """HTTP-side settings; the engine's own live in EngineConfig."""

    served_model_names: list[str]
    api_key: str | None = None
    allowed_origins: list[str] = field(default_factory=list)  # CORS: empty = off
    allow_credentials: bool = False   # CORS: browsers may send cookies and Authorization
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])   # CORS
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])   # CORS
    force_include_usage: bool = False   # every stream ends with its usage, asked for or not
    stream_interval: int = 1   # tokens a streamed choice gathers before an event (first and last at once)
    metrics_prefix: str = "nanoserve"   # of every /metrics name: "nanoserve" or vLLM's "vllm"
    request_id_headers: bool = False   # every response carries X-Request-Id (the client's, else a new one)
    log_requests: bool = True  # one log line per finished request
    log_stats: bool = True  # a line of engine statistics every 10 s while there is work
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N" unless a request says
    api_docs: bool = True  # /docs, /redoc and /openapi.json
    engine_death_grace_s: float = 30.0  # /health answers 503 this long after the engine died, then the server exits
    engine_stall_timeout_s: float = 60.0  # /health answers 503 while the engine core has been silent this long
    chat_template: str | None = None  # Jinja text that replaces the tokenizer's own
    generation_config: str = "auto"  # where default temperature etc. come from (see generation_defaults.py)
    generation_overrides: dict = field(default_factory=dict)  # request fields set over generation_config's
    tool_call_parser: str | None = None  # reads tool calls out of the text (server/tool_parsers)
    enable_auto_tool_choice: bool = False  # tool_choice "auto" needs it, as in vLLM
    reasoning_parser: str | None = None  # splits reasoning_content from content (server/reasoning.py)
    response_role: str = "assistant"     # vLLM's --response-role: who a chat reply speaks as
    limits: ServerLimits = field(default_factory=ServerLimits)
    root_path: str = ""   # the path prefix of a proxy in front ("/llm"): served with it and without it
    metrics_dir: str | None = None   # several front ends: where their request metrics meet (server/metrics.py)


class ServerState:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.tokenizer = engine.tokenizer
        if settings.chat_template is not None:
            self.tokenizer.chat_template = settings.chat_template
        elif isinstance(self.tokenizer.chat_template, str) and (
                error := template_compile_error(self.tokenizer.chat_template)) is not None:
            logger.error("The model's chat template does not compile (%s): every chat request will fail with a 500 "
                         "until the server is given a working one with --chat-template", error)
        self.texts = TokenTexts(engine.tokenizer)
        self.sampling_defaults = sampling_defaults(engine.config.model, settings.generation_config,
                                                   settings.generation_overrides)
        if self.sampling_defaults:
            logger.info("Default sampling settings: %s (generation_config.json unless --generation-config vllm, "
                        "then --override-generation-config; a request's own fields win)", self.sampling_defaults)
        # structured-output specs, checked here before the engine sees them
        self.specs = SpecChecker(self.tokenizer, engine.vocab_size, settings.limits.timeout_grammar_compile)
        self.prompt_size = PromptSize(list(engine.tokenizer.get_vocab()), engine.config.max_model_len)
        config = engine.config
        cache_info = {"block_size": str(config.block_size), "cache_dtype": config.kv_cache_dtype,
                      "enable_prefix_caching": str(config.enable_prefix_caching),
                      "gpu_memory_utilization": str(config.gpu_memory_utilization)}
        self.metrics = ServerMetrics(lambda: engine.stats, settings.log_requests, lambda: engine.error is None,
                                     settings.metrics_prefix, settings.metrics_dir, config.max_model_len,
                                     settings.served_model_names[0], cache_info)
        self.budget = OutputBudget(int(settings.limits.max_undelivered_mb * MiB))
        self.metrics.registry.register(BudgetCollector(self.budget))
        self.created = int(time.time())

    def check_logprobs(self, req: SamplingFields) -> None:
        """The request's logprobs fields against --max-logprobs."""
        req.check_logprobs(self.engine.logprobs_cap)

    def model_name(self, requested: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        names = self.settings.served_model_names
        if not requested:   # left out, null or "": the served model, as vLLM reads an empty name
            return names[0]
        if requested not in names:
            # cut, as every echo of a request's text in an error is: the body of a 20 MB name came back whole
            raise APIError(f"The model {requested[:80]!r} does not exist; this server serves {names}", 404,
                           param="model", code="model_not_found")
        return requested

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        try:
            self.engine.check_token_ids(token_ids, f"'{param}'")
        except RequestRefused as exc:
            raise APIError(str(exc), param=param) from None

    def check_prompt_length(self, num_tokens: int) -> None:
        """The engine's own check of a prompt's length, made as soon as the prompt is tokenized."""
        try:
            check_prompt_length(num_tokens, self.engine.config.max_model_len)
        except RequestRefused as exc:
            raise refusal(exc) from None

    async def start(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                    streamed: bool = False, priority: int = 0) -> RequestStream:
        """Queue the request, turning engine refusals into OpenAI errors. A `streamed` request's
        outputs keep only counts: each update is sent as it comes, and a slow reader's backlog
        should not hold its whole answer a second time."""
        # the engine client would tokenize the bad words on the event loop (~65 ms for 128 long ones)
        params = await off_the_loop_if_long(sum(map(len, params.bad_words)), with_bad_words_token_ids, params,
                                            self.tokenizer)
        try:
            return self.engine.add_request(request_id, prompts, params, keep_outputs=not streamed, priority=priority,
                                           stream_interval=self.settings.stream_interval if streamed else 1)
        except RequestRefused as exc:
            raise refusal(exc) from None
        except QueueFullError as exc:
            raise APIError(f"The server is overloaded: {exc}", 503, code="queue_full",
                           headers={"Retry-After": str(exc.retry_after_s)}) from None
        except EngineDeadError as exc:
            raise engine_error(exc) from None


def refusal(exc: RequestRefused) -> APIError:
    """The 400 for a request the engine refuses, with the field and code it names."""
    return APIError(str(exc), param=exc.param, code=exc.code)


def engine_error(exc: EngineDeadError | RequestFailedError) -> APIError:
    """The OpenAI error for a request the engine could not finish: 503 when the engine is gone (the
    client may retry once it is restarted); 400 when the request's own content failed (its grammar
    past a bound), which clients do not retry, since it would fail the same; else 500."""
    if isinstance(exc, EngineDeadError):
        return APIError(str(exc), 503, code="engine_dead")
    return APIError(str(exc), 400 if exc.own_fault else 500, code="request_failed")


def sampling_error(exc: ValueError) -> APIError:
    return APIError(f"Invalid sampling parameters: {exc}", param=getattr(exc, "param", None))


async def timed(stream: RequestStream, timer: RequestTimer) -> AsyncIterator[RequestUpdate]:
    """The stream's updates, recording latencies and token counts on the way; the request's metrics
    are recorded once it ends, however it ends."""
    try:
        async for update in stream:
            timer.tokens(len(update.token_ids), update.index)
            if update.finish_reason is not None:
                timer.finished(update.finish_reason)
            yield update
    finally:
        timer.timing = stream.timing
        # what the engine produced, read or not: a client cut off by --timeout-body or gone left
        # updates unread, and counting only those read undercounted tokens and finishes
        timer.produced(sum(out.num_tokens for out in stream.outputs),
                       [out.finish_reason for out in stream.outputs if out.finish_reason is not None],
                       len(stream.outputs))
        timer.done()


def usage(stream: RequestStream, n: int, prompt_lens: list[int], cached: dict[int, int]) -> dict:
    """OpenAI usage: each prompt counted once however many choices it has.

    `cached` maps a choice index to its prompt tokens found in the prefix cache."""
    completion = sum(out.num_tokens for out in stream.outputs)
    prompt = sum(prompt_lens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached.get(p * n, 0) for p in range(len(prompt_lens)))}}


# text this short tokenizes in well under a millisecond: a hop to a worker thread would cost the
# event loop more than the work it moves (measured: the hop was a quarter of a request's admission)
_INLINE_TEXT_CHARS = 8192


def texts_length(prompt: str | list) -> int:
    """Characters of text in a prompt field: a string, a list of strings, or token ids (none)."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) for p in prompt if isinstance(p, str))


async def off_the_loop_if_long(num_chars: int, fn: Callable[..., T], *args) -> T:
    """`fn(*args)`, on a worker thread when it has enough text to tokenize that other streams would
    notice the event loop stall (a 1.8 MB prompt once stalled every stream for 1.8 s)."""
    if num_chars <= _INLINE_TEXT_CHARS:
        return fn(*args)
    return await run_in_threadpool(fn, *args)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
