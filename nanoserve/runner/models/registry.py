"""Maps `config.architectures[0]` to the class that implements it."""

from __future__ import annotations

from transformers import PretrainedConfig

from nanoserve.runner.models.decoder import DecoderForCausalLM
from nanoserve.runner.models.llama import LlamaForCausalLM, MistralForCausalLM
from nanoserve.runner.models.qwen2 import Qwen2ForCausalLM
from nanoserve.runner.models.qwen3 import Qwen3ForCausalLM

MODELS: dict[str, type[DecoderForCausalLM]] = {
    cls.__name__: cls for cls in (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)
}


def model_class(config: PretrainedConfig, max_model_len: int) -> type[DecoderForCausalLM]:
    arch = (getattr(config, "architectures", None) or ["<none>"])[0]
    if arch not in MODELS:
        raise ValueError(f"Unknown architecture {arch!r}; supported: {', '.join(sorted(MODELS))}")
    sliding = getattr(config, "sliding_window", None)
    # within the window, sliding-window attention is plain causal attention
    if getattr(config, "use_sliding_window", sliding is not None) and sliding and sliding < max_model_len:
        raise ValueError(f"{arch} uses sliding-window attention over {sliding} tokens, which is not "
                         f"supported: pass max_model_len <= {sliding}")
    return MODELS[arch]
