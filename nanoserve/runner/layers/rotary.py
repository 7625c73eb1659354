"""Rotary position embedding tables (GPT-NeoX layout), with the scaled variants of transformers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from nanoserve.positions import rope_parameters


def inverse_frequencies(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    params = rope_parameters(config)
    if params["rope_type"] == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    if params["rope_type"] == "longrope":
        # its long factors take over past original_max_position_embeddings, per sequence: one table
        # for every position cannot hold both
        raise ValueError("Unsupported rope type 'longrope' (its factors change with the sequence's length)")
    if params["rope_type"] not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"Unsupported rope type {params['rope_type']!r}; supported: default, "
                         f"{', '.join(sorted(ROPE_INIT_FUNCTIONS))}")
    # llama3, yarn, linear...: the same formulas transformers uses, so outputs match it exactly
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")


class RotaryTables(nn.Module):
    """cos and sin of every position up to max_position, [positions, head_dim] float32."""

    def __init__(self, config: PretrainedConfig, head_dim: int, max_position: int) -> None:
        super().__init__()
        inv_freq, scaling = inverse_frequencies(config, head_dim)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)


@dataclass(frozen=True)
class NewTokenRope:
    """What an attention backend needs to make q, k and v from the packed projection itself: the
    rotary tables [positions, head_dim] and the per-head q/k RMSNorm weights (None: no norm, as
    in Llama) with their eps."""

    cos: torch.Tensor
    sin: torch.Tensor
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    eps: float
