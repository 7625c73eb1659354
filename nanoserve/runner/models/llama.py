"""Llama 2/3 (rope_scaling 'llama3' included) and Mistral: the plain decoder."""

from nanoserve.runner.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    attention_bias_flag = True
    mlp_bias_flag = True


class MistralForCausalLM(DecoderForCausalLM):
    pass
