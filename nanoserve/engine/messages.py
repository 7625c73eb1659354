"""The messages between the front end and the engine core, and their msgpack codecs.

The engine core runs in its own process (engine/core.py). The front end sends it adds and
aborts; after every step it sends back one EngineOutputs with every request's new tokens. All
are msgspec Structs encoded with msgpack: typed, fast, and nothing is pickled per step.
"""

from __future__ import annotations

import msgspec

from nanoserve.engine.prompt_logprobs import PromptLogprobs
from nanoserve.sampling_params import SamplingParams

# (logprob of the chosen token, [(token id, logprob), ...] of the top alternatives, rank of the
# chosen token: 1 + how many tokens the model found more likely), as a prompt token's entry is
TokenLogprob = tuple[float, list[tuple[int, float]], int]


class StepOutput(msgspec.Struct, array_like=True, gc=False):
    """New tokens of one request from one engine step."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None       # "stop", "length", "abort" once finished
    num_prompt_tokens: int
    num_cached_tokens: int
    # with the first token of a request that asked for them, its whole prompt's; siblings (n > 1)
    # get none, their prompt's are those of its first choice
    prompt_logprobs: PromptLogprobs | None = None
    # with the first token: (seconds queued before it first ran, seconds from then to this token)
    timing: tuple[float, float] | None = None


# vLLM's buckets of iteration_tokens_total: tokens run through the model in one step
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class EngineStats(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A snapshot of the engine core after a step; the front end serves /metrics and admission from it."""

    num_running: int = 0
    num_waiting: int = 0            # in the scheduler's queue
    num_blocks: int = 0
    num_free_blocks: int = 0        # free or cached-but-unreferenced: what new requests can take
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache, ever
    prefix_hit_tokens: int = 0      # of those, found there
    num_preemptions: int = 0
    generated_tokens: int = 0       # sampled tokens, ever
    computed_tokens: int = 0        # tokens run through the model (prompt chunks and decodes), ever
    # steps by their tokens, counted in STEP_TOKEN_BUCKETS (+Inf last), ever; their sum is computed_tokens
    step_token_counts: list[int] = msgspec.field(default_factory=list)

    @property
    def blocks_in_use(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def kv_cache_usage(self) -> float:
        return self.blocks_in_use / self.num_blocks if self.num_blocks else 0.0


# ---- front end -> engine core

class AddRequest(msgspec.Struct, tag="add", array_like=True):
    """Queue a request's prompts: `prompts[p]` as `request_ids[p]`, with `fork_ids[p]`, its n-1
    siblings, started once its prompt is cached. One message per request, so that its params are
    decoded once, not once per prompt (a logit_bias over a 150k vocabulary is 1.7 MB and ~80 ms to
    decode and check: per prompt of a 256-prompt batch, ~20 s of the engine's loop)."""

    request_ids: list[str]
    prompts: list[list[int]]
    params: SamplingParams
    fork_ids: list[list[str]]
    priority: int = 0   # under the priority policy, lower values are served first
    client: int = 0     # which front end sent it (of --api-server-count): its outputs go back there


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """This front end is done. Once every front end has said so, the core stops stepping, closes the
    tensor-parallel workers and exits; at once with `everyone` (the server's main process: all its
    front ends have exited, whether or not each said so)."""

    everyone: bool = False


EngineInput = AddRequest | AbortRequests | Shutdown


# ---- engine core -> front end

class EngineReady(msgspec.Struct, tag="ready", array_like=True):
    """Sent once the model is loaded and the KV cache allocated."""

    num_blocks: int
    block_size: int
    device: str
    dtype: str
    load_seconds: float
    graph_capture_seconds: float


class RequestFailed(msgspec.Struct, array_like=True):
    """A request the engine refused or could not serve for what it holds itself (a grammar that does not
    compile or outgrew a bound, a prompt refused late); the engine itself is fine."""

    request_ids: list[str]
    message: str


class EngineOutputs(msgspec.Struct, tag="outputs", array_like=True, gc=False):
    """Everything one step produced, in one message."""

    outputs: list[StepOutput]
    stats: EngineStats
    failed: list[RequestFailed] = []


class EngineDied(msgspec.Struct, tag="died", array_like=True):
    """The engine core's last words: the error that stopped its loop."""

    message: str


EngineMessage = EngineReady | EngineOutputs | EngineDied

input_encoder = msgspec.msgpack.Encoder()
input_decoder = msgspec.msgpack.Decoder(EngineInput)
output_encoder = msgspec.msgpack.Encoder()
output_decoder = msgspec.msgpack.Decoder(EngineMessage)
