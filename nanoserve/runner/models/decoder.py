"""The decoder-only transformer that Llama, Mistral, Qwen2 and Qwen3 share.

Families differ in two switches (q/k/v bias, per-head q/k RMSNorm) and in their
config fields; each family file picks its switches.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoserve.positions import context_limit, layer_windows
from nanoserve.runner.batch import AttentionMetadata
from nanoserve.runner.layers.linear import PackedLinear, RowParallelLinear
from nanoserve.runner.layers.norm import RMSNorm
from nanoserve.runner.layers.ops import EAGER_OPS, LayerOps
from nanoserve.runner.layers.rotary import NewTokenRope, RotaryTables
from nanoserve.runner.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from nanoserve.runner.parallel import SINGLE, TensorParallel


class Biases(NamedTuple):
    """Which projections carry a bias: q/k/v, o, and the MLP's gate/up and down."""
    qkv: bool = False
    o: bool = False
    mlp: bool = False


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Attention(nn.Module):
    """Self-attention over this rank's heads (all of them without tensor parallelism)."""

    def __init__(self, config: PretrainedConfig, biases: Biases, qk_norm: bool,
                 rotary: RotaryTables, ops: LayerOps, tp: TensorParallel = SINGLE, window: int | None = None) -> None:
        super().__init__()
        self.ops = ops
        # sliding-window attention: a query at position p attends keys p - window < k <= p (None: all)
        self.window = window
        self.eps = config.rms_norm_eps
        self.head_dim = d = head_dim_of(config)
        first_head, self.num_heads = tp.split_heads(config.num_attention_heads)
        first_kv, self.num_kv_heads = tp.split_heads(config.num_key_value_heads)
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        self.scale = d ** -0.5
        q = (config.num_attention_heads * d, first_head * d, self.q_size)
        kv = (config.num_key_value_heads * d, first_kv * d, self.kv_size)
        self.qkv_proj = PackedLinear(config.hidden_size, {"q": q, "k": kv, "v": kv}, bias=biases.qkv)
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size, tp, bias=biases.o)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        # an fp8 cache stores k / k_scale and v / v_scale; the loader reads them from checkpoints
        # that carry them (self_attn.k_scale, self_attn.v_scale), else they stay 1.0
        self.k_scale = 1.0
        self.v_scale = 1.0
        # bound by the model runner once the cache is allocated
        self.backend = None
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of the packed q/k/v projection (qkv_proj's output), through o_proj."""
        norms = (self.q_norm.weight, self.k_norm.weight, self.eps) if self.q_norm is not None else ()
        if self.backend.fuses_kv_store:
            # q/k norm, rotary and the K/V store inside the backend's kernels; attention then reads the cache
            rope = NewTokenRope(self.rotary.cos, self.rotary.sin, *(norms or (None, None, 0.0)))
            o = self.backend.attend_qkv(positions, qkv, self.num_heads, self.num_kv_heads, self.head_dim, rope,
                                        self.k_cache, self.v_cache, meta, self.scale, self.k_scale, self.v_scale,
                                        self.window)
        else:
            q, k, v = self.ops.qkv_rope(positions, qkv, self.num_heads, self.num_kv_heads,
                                        self.head_dim, self.rotary.cos, self.rotary.sin, *norms)
            o = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale,
                                     self.k_scale, self.v_scale, self.window)
        return self.o_proj(o.flatten(1))


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, ops: LayerOps, tp: TensorParallel = SINGLE,
                 bias: bool = False) -> None:
        super().__init__()
        self.ops = ops
        first, local = tp.split(intermediate_size)
        part = (intermediate_size, first, local)
        self.gate_up_proj = PackedLinear(hidden_size, {"gate": part, "up": part}, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp, bias=bias)
        self.down_proj.takes_gated_input = True

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The MLP of the packed gate/up projection (gate_up_proj's output)."""
        return self.down_proj.forward_gated(gate_up, self.ops.silu_mul)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, biases: Biases, qk_norm: bool,
                 rotary: RotaryTables, ops: LayerOps, tp: TensorParallel = SINGLE, window: int | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(config, biases, qk_norm, rotary, ops, tp, window)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, ops, tp, biases.mlp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        # each norm feeds one packed projection, which may fold the norm (and the residual add) in
        self.self_attn.qkv_proj.takes_normed_input = True
        self.mlp.gate_up_proj.takes_normed_input = True

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = self.self_attn.qkv_proj.forward_normed(x, residual, self.input_layernorm)
        x = self.self_attn(positions, qkv, meta)
        gate_up, residual = self.mlp.gate_up_proj.forward_normed(x, residual, self.post_attention_layernorm)
        return self.mlp(gate_up), residual


class DecoderModel(nn.Module):
    def __init__(self, config: PretrainedConfig, biases: Biases, qk_norm: bool, ops: LayerOps,
                 windows: list[int | None], tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        rotary = RotaryTables(config, head_dim_of(config), context_limit(config))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, biases, qk_norm, rotary, ops, tp, window)
                                    for window in windows)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        return self.norm(x, residual)[0]


class DecoderForCausalLM(nn.Module):
    """Hidden states from `forward`, logits from `compute_logits` on the rows that sample."""

    qkv_bias = False
    qk_norm = False
    # which config flags add biases, as the family's transformers modeling reads them: `attention_bias`
    # (q, k, v and o) and `mlp_bias` (gate, up and down); the others ignore them
    attention_bias_flag = False
    mlp_bias_flag = False
    # checkpoint name fragment -> (our packed parameter fragment, shard)
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                      "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}

    def __init__(self, config: PretrainedConfig, ops: LayerOps = EAGER_OPS, tp: TensorParallel = SINGLE,
                 max_model_len: int | None = None) -> None:
        """max_model_len: the engine's context, past which no sliding window reaches (positions.layer_windows)."""
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.biases(config), self.qk_norm, ops,
                                  layer_windows(config, max_model_len), tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def biases(cls, config: PretrainedConfig) -> Biases:
        attention = cls.attention_bias_flag and bool(getattr(config, "attention_bias", False))
        return Biases(qkv=cls.qkv_bias or attention, o=attention,
                      mlp=cls.mlp_bias_flag and bool(getattr(config, "mlp_bias", False)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of `hidden`'s rows; `out` (one rank only) receives them."""
        return self.lm_head(hidden, out)
