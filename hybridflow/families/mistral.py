"""Mistral: Llama's layout; its sliding window is on unless config.json turns it off (refused where it is
shorter than the context: megatron's attention here is full causal)."""

from hybridflow.families import weights as w
from hybridflow.families.family import Family

FAMILY = Family("MistralForCausalLM", "mistral", attention=w.NORMS + w.ATTENTION, qkv_bias_if="attention_bias",
                sliding_window_by_default=True)
