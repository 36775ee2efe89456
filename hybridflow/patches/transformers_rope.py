"""transformers' RoPE frequency functions, which the megatron models reuse for scaled RoPE."""

from __future__ import annotations

from hybridflow.patches.registry import declare

ROPE_INIT = declare(
    "transformers.rope_init_functions", "transformers", ">=5.16.1,<5.20",
    "transformers.modeling_rope_utils:ROPE_INIT_FUNCTIONS",
    "read, not replaced: the inverse frequencies of each rope type exactly as the HF model computes them "
    "(Llama 3.1 scaling), handed to megatron's RotaryEmbedding")


def hf_inverse_frequencies(hf_config, rope_type: str, device):
    """The HF model's RoPE inverse frequencies for ``rope_type`` (its cos/sin scale is 1 for the types
    megatron supports); a tensor on ``device``."""
    inv_freq, _ = ROPE_INIT.require()[rope_type](hf_config, device)
    return inv_freq
