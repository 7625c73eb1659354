"""How far a model's positions reach: its rotary-embedding parameters and the context they allow."""

from __future__ import annotations

from transformers import PretrainedConfig

# rope scalings whose tables are the same at every length: positions past max_position_embeddings
# take them as they are (dynamic NTK recomputes its frequencies past it; longrope switches factors)
_STRETCHING = ("linear", "yarn")


def rope_parameters(config: PretrainedConfig) -> dict:
    """rope_theta and rope_scaling in one dict, whichever transformers version wrote the config."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def context_limit(config: PretrainedConfig) -> int:
    """The longest context the model allows: max_position_embeddings, or as vLLM derives it where
    a linear or yarn rope scaling stretches the positions (yarn: its original length times the factor,
    e.g. Qwen3's 32,768 x 4 = 131,072)."""
    limit = getattr(config, "max_position_embeddings", None) or 4096
    params = rope_parameters(config)
    factor = params.get("factor")
    if params["rope_type"] not in _STRETCHING or not isinstance(factor, (int, float)) or factor <= 1:
        return limit
    base = params.get("original_max_position_embeddings") if params["rope_type"] == "yarn" else None
    return max(limit, int((base or limit) * factor))


def sliding_window(config: PretrainedConfig) -> int | None:
    """The window of the model's sliding-window attention, None where no layer has one: as the
    config's layer_types say where it has them (Qwen2 keeps full attention below max_window_layers),
    else wherever one is set."""
    window = getattr(config, "sliding_window", None)
    if not window or not getattr(config, "use_sliding_window", True):
        return None
    layer_types = getattr(config, "layer_types", None)
    return window if layer_types is None or "sliding_attention" in layer_types else None


def layer_windows(config: PretrainedConfig, max_model_len: int | None = None) -> list[int | None]:
    """Each layer's sliding window, None where it attends in full. A query at position p attends the
    keys k with p - window < k <= p (transformers' sliding_window_overlay). Where the config has
    layer_types (Qwen2 makes them from max_window_layers: sliding from that layer on) they say which
    layers slide, else every layer does. A window of max_model_len or more slides past no key within
    the context: it is left out (so, capped at the window, --disable-sliding-window is full attention)."""
    window = sliding_window(config)
    layers = config.num_hidden_layers
    if window is None or (max_model_len is not None and window >= max_model_len):
        return [None] * layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return [window] * layers
    return [window if kind == "sliding_attention" else None for kind in layer_types[:layers]]


def kv_window(config: PretrainedConfig, max_model_len: int | None = None) -> int | None:
    """How many of a sequence's last keys its queries can still attend: the widest layer window where
    every layer slides, None where some layer attends in full. Blocks wholly before it can be freed."""
    windows = layer_windows(config, max_model_len)
    return None if None in windows else max(windows)
