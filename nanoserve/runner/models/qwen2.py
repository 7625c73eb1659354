"""Qwen2 / Qwen2.5: the plain decoder with biases on q, k and v."""

from nanoserve.runner.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    qkv_bias = True
