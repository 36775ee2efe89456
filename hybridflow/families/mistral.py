"""Mistral: Llama's layout without biases (transformers' MistralAttention ignores attention_bias); its
sliding window is on unless config.json turns it off (refused where it is shorter than the context:
megatron's attention here is full causal)."""

from hybridflow.families import weights as w
from hybridflow.families.family import Family

FAMILY = Family("MistralForCausalLM", "mistral", attention=w.NORMS + w.ATTENTION, sliding_window_by_default=True)
