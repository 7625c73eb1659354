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


def model_class(config: PretrainedConfig) -> type[DecoderForCausalLM]:
    """The class for the config's architecture; refuses what these layers would compute wrongly."""
    arch = (getattr(config, "architectures", None) or ["<none>"])[0]
    if arch not in MODELS:
        raise ValueError(f"Unknown architecture {arch!r}; supported: {', '.join(sorted(MODELS))}")
    activation = getattr(config, "hidden_act", "silu")
    if activation not in ("silu", "swish"):
        # the MLP's kernels are SiLU's: another activation would load and answer wrongly
        raise ValueError(f"{arch} with hidden_act {activation!r} is not supported: only silu")
    return MODELS[arch]

