"""Llama (2, 3, 3.1-3.3): the plain decoder; q/k/v biases only with ``attention_bias``."""

from hybridflow.families import weights as w
from hybridflow.families.family import Family

FAMILY = Family("LlamaForCausalLM", "llama", attention=w.NORMS + w.ATTENTION, qkv_bias_if="attention_bias")
