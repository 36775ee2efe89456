"""Qwen3: per-head RMSNorm of queries and keys (q_norm, k_norm) before RoPE; q/k/v biases only with
``attention_bias``."""

from hybridflow.families import weights as w
from hybridflow.families.family import Family

FAMILY = Family("Qwen3ForCausalLM", "qwen3", attention=w.NORMS + w.ATTENTION + w.QK_NORM, qkv_bias_if="attention_bias")
