"""Qwen3: the plain decoder with a per-head RMSNorm on q and k before rotary."""

from nanoserve.runner.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    qk_norm = True
    attention_bias_flag = True
