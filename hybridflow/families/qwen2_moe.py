"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention; sparse layers route to ``num_experts`` experts
beside a shared expert with a sigmoid gate."""

from hybridflow.families import weights as w
from hybridflow.families.family import Family

FAMILY = Family("Qwen2MoeForCausalLM", "qwen2_moe", attention=w.NORMS + w.ATTENTION + w.QKV_BIAS,
                sparse_mlp=w.ROUTER + w.SHARED_EXPERT, expert=w.EXPERT)
