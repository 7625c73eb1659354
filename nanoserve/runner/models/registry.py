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
    activation = getattr(config, "hidden_act", "silu")
    if activation not in ("silu", "swish"):
        # the MLP's kernels are SiLU's: another activation would load and answer wrongly
        raise ValueError(f"{arch} with hidden_act {activation!r} is not supported: only silu")
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(config, flag, False):
            # transformers adds biases to o_proj (and the MLP's projections), which these layers do not have
            raise ValueError(f"{arch} with {flag}=true is not supported")
    if sliding_window_in_use(config) and config.sliding_window < max_model_len:
        # within the window, sliding-window attention is plain causal attention
        raise ValueError(f"{arch} uses sliding-window attention over {config.sliding_window} tokens, which is not "
                         f"supported: pass max_model_len <= {config.sliding_window}")
    return MODELS[arch]


def sliding_window_in_use(config: PretrainedConfig) -> bool:
    """Whether any layer attends over a sliding window: as the config's layer_types say where it
    has them (Qwen2 keeps full attention below max_window_layers), else wherever one is set."""
    sliding = getattr(config, "sliding_window", None)
    if not sliding or not getattr(config, "use_sliding_window", True):
        return False
    layer_types = getattr(config, "layer_types", None)
    return layer_types is None or "sliding_attention" in layer_types
