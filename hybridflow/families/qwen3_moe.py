"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention; sparse layers route to ``num_experts``
experts, no shared expert."""

from hybridflow.families import weights as w
from hybridflow.families.family import Family

FAMILY = Family("Qwen3MoeForCausalLM", "qwen3_moe", attention=w.NORMS + w.ATTENTION + w.QK_NORM,
                sparse_mlp=w.ROUTER, expert=w.EXPERT, qkv_bias_if="attention_bias")
