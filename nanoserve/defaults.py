"""Names the CLI needs before it knows whether it will load a model: nothing here imports torch.

`nanoserve --help` must answer in well under a second, and torch plus transformers take seconds.
"""

from __future__ import annotations

import os

DEFAULT_MODEL = os.path.join(os.path.dirname(__file__), "assets", "tiny-qwen3")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's names: auto = the model's dtype, fp8 = fp8_e4m3 = e4m3
# vLLM's --max-logprobs default (the OpenAI API's top_logprobs limit): alternatives a request may ask for
DEFAULT_MAX_LOGPROBS = 20
# the most --max-logprobs may allow: every alternative is carried for every token (a prefill step's
# prompt logprobs are max_num_batched_tokens rows of them), so the whole vocabulary (vLLM's -1) is not offered
MAX_LOGPROBS_CEILING = 1024
SCHEDULING_POLICIES = ("fcfs", "priority")   # vLLM's names
FP8_FLASH_ATTN_REFUSAL = ("kv_cache_dtype='fp8' needs the triton attention backend (torch on the CPU): the "
                          "flash_attn backend cannot read an fp8 KV cache; use --attention-backend triton (or "
                          "torch on the CPU) with --kv-cache-dtype fp8, or --kv-cache-dtype auto")
# a core that has nothing to say still says so this often (the front end's liveness); idle, it
# looks up from its input socket once a second, so two heartbeats can be up to 2 s apart
ENGINE_HEARTBEAT_S = 1.0
# --max-num-seqs: the memory profile builds a step of this many sequences, and the step's buffers hold
# one block-table row each; 10**12 looped at startup for good
MAX_NUM_SEQS = 65536
MAX_API_SERVERS = 64   # --api-server-count: front-end processes, each with a model's tokenizer in memory
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"   # the server's and the engine process's
# bytes of compiled grammars that the engine's sequences may hold at once, by xgrammar's count of
# their size (engine/grammar_queue.py): the largest spec a request may give compiles to ~34 MB,
# an ordinary JSON schema to ~0.2 MB
MAX_GRAMMAR_BYTES = 1 << 30
# what the engine may grow by while sequences hold grammars, mostly matchers' state, which grows
# with every accepted token (~8.5 KB a token for `[a-z]{0,5000}`; engine/grammar_state.py): past
# it, the requests with grammars that have accepted the most tokens are ended
MAX_GRAMMAR_STATE_BYTES = 4 << 30
