"""Qwen2 and Qwen2.5: biased q/k/v projections."""

from hybridflow.families import weights as w
from hybridflow.families.family import Family

FAMILY = Family("Qwen2ForCausalLM", "qwen2", attention=w.NORMS + w.ATTENTION + w.QKV_BIAS)
