"""Per-request sampling settings, shared by the engine (stopping) and the runner (sampling)."""

from __future__ import annotations

import copy
import functools
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nanoserve.structured_outputs_params import StructuredOutputsParams

if TYPE_CHECKING:
    import numpy as np


# Every integer the sampler puts in a tensor must fit int32 (kernels index with it) and int64
# (torch.tensor of a Python int past 2**63 raises inside the engine loop, killing every request)
MAX_INT = 2**31 - 1
# choices of one request: each is a sequence of its own (~0.6 ms of host work apiece on this machine's
# CPU even for one token), and n = 10**9 ran for hours where it should be refused; vLLM's default cap
MAX_N = 16384
# torch.Generator.manual_seed takes any integer in [-2**63, 2**64)
SEED_RANGE = (-(2**63), 2**64 - 1)
# below this a temperature is greedy (as in vLLM): logits / 1e-300 overflow float32 to inf and NaN
GREEDY_TEMPERATURE = 1e-5
# below float32's smallest normal number a penalty rounds to 0 on the device: treat it as 0 here
# so that the host agrees with the device about whether it applies
TINY = 1.2e-38
MIN_REPETITION_PENALTY = 0.01  # dividing logits by less overflows float32 (1e-300 rounds to 0)
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS = 100.0
# what a bias of -MAX_LOGIT_BIAS adds: OpenAI calls -100 a ban, and added as -100 it was none
# beside a repetition penalty below 1 (0.01 made a seen token's logit of 2 into 200). Finite, so a
# row whose every token is banned still samples one of them rather than NaN
BANNING_BIAS = -1e9
# each bad word is tokenized (twice) when its request is queued, and the engine checks, every step,
# the words that could end there
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
# as vLLM bounds it; the salt is hashed once per sequence, so its length costs next to nothing
MAX_CACHE_SALT_CHARS = 1024


def max_tokens_in_context(max_tokens: int | None, prompt_len: int, max_model_len: int) -> int:
    """The tokens a sequence may generate: max_tokens within the room its prompt leaves in the
    context, all of that room where max_tokens is unset."""
    room = max_model_len - prompt_len
    return room if max_tokens is None else min(max_tokens, room)


def fork_seed(seed: int, offset: int) -> int:
    """seed + offset (the seed of an n > 1 request's later choices), wrapped into SEED_RANGE."""
    low, high = SEED_RANGE
    return (seed + offset - low) % (high - low + 1) + low


class InvalidSamplingParam(ValueError):
    """A field of SamplingParams out of its range; `param` names it (the HTTP error's "param")."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


# fields and the cached arrays made from them (SamplingParams.derived drops a changed one's)
_ARRAYS_OF = {"logit_bias": "logit_bias_arrays", "allowed_token_ids": "allowed_token_ids_array"}


@dataclass
class SamplingParams:
    """How one request picks tokens and when it stops.

    temperature 0 (or below GREEDY_TEMPERATURE) means greedy (argmax). top_k -1 (or 0) and top_p 1.0
    and min_p 0.0 disable those filters; a top_k past the vocabulary keeps all of it. max_tokens
    None means "whatever is left of the context". Every number is checked against what the
    sampler's tensors can hold, so no request can fail inside a batch it shares with others.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these ids may be sampled (every other logit is -inf); logprobs stay the model's
    allowed_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # vLLM's: the token that would complete one of these words (as it starts a text or follows a
    # space) is never sampled; see engine/bad_words.py
    bad_words: list[str] = field(default_factory=list)
    # their token sequences (engine/bad_words.py), tokenized once where the request is queued, so
    # that the engine core, its n choices and its prompts never tokenize them again
    bad_words_token_ids: list[list[int]] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    # logprob of every prompt token after the first, with this many top alternatives; such a
    # prompt is computed in full (prefix-cache hits would skip the positions that score it)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # with special tokens shown: False drops the space a tokenizer's decoder may put between two
    # added tokens in a row (vLLM's rule; a byte-level BPE decoder never puts one)
    spaces_between_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only, no text (saves host time in benchmarks)
    structured_outputs: StructuredOutputsParams | None = None  # the output follows this grammar
    # vLLM's: not a sampling setting, but it travels with the request as these do. The prefix
    # cache shares blocks only between requests of equal salt (None included), so that a tenant
    # cannot learn from cache hits (time to first token) what another tenant's prompts were
    cache_salt: str | None = None
    # vLLM's: the offline API keeps only the prompt's last k tokens (-1: the last max_model_len)
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list("stop", self.stop)
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids)
        self.bad_words = _as_list("bad_words", [self.bad_words] if isinstance(self.bad_words, str) else self.bad_words)
        if isinstance(self.structured_outputs, dict):  # e.g. decoded from a message
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        # numbers of the right kind, as the engine's message schema declares them: an integral float
        # where an int belongs (a generation_config.json's "top_k": 20.0) is taken as that int, while
        # a value the schema refuses would be dropped by the engine core and its request never end
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            setattr(self, name, _as_float(name, getattr(self, name)))
        self.top_k = _as_int("top_k", self.top_k)   # its range below
        if abs(self.presence_penalty) < TINY:
            self.presence_penalty = 0.0
        if abs(self.frequency_penalty) < TINY:
            self.frequency_penalty = 0.0
        self.n = _as_int("n", self.n, 1, MAX_N)
        if self.temperature < 0:
            raise InvalidSamplingParam("temperature", f"temperature must be >= 0, got {self.temperature}")
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParam("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k > MAX_INT:
            raise InvalidSamplingParam("top_k", f"top_k must be -1 or 0 (disabled) or in [1, {MAX_INT}], got {self.top_k}")
        if self.top_k == 0:   # vLLM's other "off", as the server takes it
            self.top_k = -1
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidSamplingParam("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise InvalidSamplingParam("presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise InvalidSamplingParam("frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidSamplingParam("repetition_penalty", f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}], "
                             f"got {self.repetition_penalty}")
        if self.seed == -1 and not isinstance(self.seed, bool):   # vLLM's "no seed"
            self.seed = None
        if self.seed is not None:
            self.seed = _as_int("seed", self.seed, *SEED_RANGE)
        if self.max_tokens is not None:
            self.max_tokens = _as_int("max_tokens", self.max_tokens, 1, MAX_INT)
        self.min_tokens = _as_int("min_tokens", self.min_tokens, 0, MAX_INT)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidSamplingParam("min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        # how many the engine returns is bounded by its max_logprobs (validation.check_logprobs)
        if self.logprobs is not None:
            self.logprobs = _as_int("logprobs", self.logprobs, 0, MAX_INT)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _as_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_INT)
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise InvalidSamplingParam("bad_words", f"bad_words takes at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}")
        for word in self.bad_words:
            if not isinstance(word, str) or not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
                raise InvalidSamplingParam("bad_words", "each of bad_words must be a string of 1 to "
                                           f"{MAX_BAD_WORD_CHARS} characters, not only whitespace; got {str(word)[:40]!r}")
        if not all(isinstance(text, str) for text in self.stop):
            raise InvalidSamplingParam("stop", f"stop must be a string or a list of strings, got {self.stop!r:.80}")
        if self.stop and not self.detokenize:
            # stop strings are matched in the text, which detokenize=False does not make (vLLM refuses it too)
            raise InvalidSamplingParam("stop", "stop strings need detokenize=True: they are matched in the text")
        if not all(self.stop):
            # as vLLM refuses it: "" matches before any text, and dropping it silently hid a client's bug
            raise InvalidSamplingParam("stop", "stop cannot contain an empty string; leave it out, or send the "
                                       "strings that should end the text")
        self.stop_token_ids = [_as_int("stop_token_ids", token, 0, MAX_INT) for token in self.stop_token_ids]
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt
                                            or len(self.cache_salt) > MAX_CACHE_SALT_CHARS):
            raise InvalidSamplingParam("cache_salt", f"cache_salt must be a string of 1 to {MAX_CACHE_SALT_CHARS} "
                                       f"characters, got {str(self.cache_salt)[:40]!r}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            self.truncate_prompt_tokens = _as_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, MAX_INT)
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise InvalidSamplingParam("logit_bias", f"logit_bias must map token ids to biases, got {self.logit_bias!r:.80}")
        if self.logit_bias:
            if not (only_of_type(int, self.logit_bias) and only_of_type(float, self.logit_bias.values())):
                self.logit_bias = {_as_int("logit_bias", token): _as_float("logit_bias", bias)
                                   for token, bias in self.logit_bias.items()}
            for token, bias in self.logit_bias.items():
                _check_int("logit_bias", token, 0, MAX_INT)
                if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                    raise InvalidSamplingParam("logit_bias", f"logit_bias of token {token} must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_list("allowed_token_ids", self.allowed_token_ids)
            if not only_of_type(int, self.allowed_token_ids):   # 1.5 was taken as 1
                self.allowed_token_ids = [_as_int("allowed_token_ids", token) for token in self.allowed_token_ids]
            if not self.allowed_token_ids:
                # nothing to sample from: every logit would be -inf
                raise InvalidSamplingParam("allowed_token_ids", "allowed_token_ids must hold at least one token id")
            # min and max at C speed: a list as long as the vocabulary costs no Python loop
            if min(self.allowed_token_ids) < 0 or max(self.allowed_token_ids) > MAX_INT:
                bad = next(t for t in self.allowed_token_ids if not 0 <= t <= MAX_INT)
                _check_int("allowed_token_ids", bad, 0, MAX_INT)

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's name)."""
        return copy.deepcopy(self)

    def derived(self, **fields: Any) -> SamplingParams:
        """A copy with `fields` set and not checked again: for what the engine derives from params
        already checked (a fork's seed, the bad words' token ids, prompt logprobs dropped), where
        a new check only repeats the first; over a logit_bias of a 150k vocabulary it took ~25 ms."""
        unknown = fields.keys() - self.__dataclass_fields__.keys()
        if unknown:
            raise TypeError(f"SamplingParams has no field {sorted(unknown)}")
        out = copy.copy(self)
        for name, value in fields.items():
            setattr(out, name, value)
        for name in _ARRAYS_OF.keys() & fields.keys():   # the copy's arrays were made from the old field
            out.__dict__.pop(_ARRAYS_OF[name], None)
        return out

    # the sampler reads these every step, for every row: a 131k-entry dict or list took ~7 ms a
    # row to walk, each step. Made once per params (n choices share theirs), in the engine only

    @functools.cached_property
    def logit_bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """logit_bias as (token ids, int64; biases, float32), -MAX_LOGIT_BIAS as BANNING_BIAS."""
        import numpy as np   # here: the front end's --help stays light

        bias = self.logit_bias or {}
        values = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
        return (np.fromiter(bias.keys(), dtype=np.int64, count=len(bias)),
                np.where(values <= -MAX_LOGIT_BIAS, np.float32(BANNING_BIAS), values))

    @functools.cached_property
    def allowed_token_ids_array(self) -> np.ndarray:
        """allowed_token_ids as int64 (empty for None)."""
        import numpy as np

        return np.asarray(self.allowed_token_ids or [], dtype=np.int64)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _check_int(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise InvalidSamplingParam(name, f"{name} must be in [{low}, {high}], got {value}")


def _as_int(name: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    """value as a plain int (in [low, high] when given): an integral float becomes its int; a bool,
    another float or a non-number is refused."""
    integral = isinstance(value, numbers.Integral) or isinstance(value, float) and value.is_integer()
    if isinstance(value, bool) or not integral:
        raise InvalidSamplingParam(name, f"{name} must be an integer, got {value!r}")
    value = int(value)   # numpy's integers too
    if low is not None and high is not None:
        _check_int(name, value, low, high)
    return value


def only_of_type(kind: type, values: Iterable) -> bool:
    """Whether every value is exactly a `kind` (not a subclass: True is no int here), in one pass at C
    speed: a list as long as the vocabulary took ~5 ms as a Python loop."""
    return set(map(type, values)) <= {kind}


def _as_list(name: str, value: Any) -> list:
    """value (a list, tuple or other sized sequence) as a list, None as none (as vLLM takes it); a lone
    number, a mapping or a set is refused."""
    if value is None:
        return []
    if isinstance(value, (str, bytes, dict, set, frozenset)) or not hasattr(value, "__len__"):
        raise InvalidSamplingParam(name, f"{name} must be a list, got {value!r:.80}")
    return list(value)


def _as_float(name: str, value: Any) -> float:
    """value as a finite float (an int is one); a bool or a non-number is refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidSamplingParam(name, f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise InvalidSamplingParam(name, f"{name} must be a finite number, got {value}")
    return value
