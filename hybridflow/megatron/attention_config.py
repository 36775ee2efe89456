"""Attention's settings from a HF config: which layers slide a window and megatron's window for them, and RoPE (the
rope types megatron reproduces, its base, the rotated share of each head, HF's scaled frequencies)."""

from __future__ import annotations

from hybridflow import families
from hybridflow.patches import megatron_layers
from hybridflow.patches.transformers_rope import hf_inverse_frequencies


def windowed_layers(hf_config) -> list[bool]:
    """Which decoder layers attend within HF's ``sliding_window`` (the key at most ``sliding_window - 1`` positions
    before the query): those ``layer_types`` names sliding, or every layer where the config has none (Mistral,
    whose config.json's window is on unless absent or null; Qwen2/3 with ``use_sliding_window``, transformers
    then also setting layer_types from ``max_window_layers``). None where the window is no shorter than
    max_position_embeddings (it changes nothing)."""
    window = getattr(hf_config, "sliding_window", None)
    uses = getattr(hf_config, "use_sliding_window", families.of(hf_config).sliding_window_by_default)
    n = hf_config.num_hidden_layers
    if not (uses and window and window < hf_config.max_position_embeddings):
        return [False] * n
    types = getattr(hf_config, "layer_types", None)
    return [t == "sliding_attention" for t in types] if types else [True] * n


def window_fields(hf_config) -> dict:
    """megatron's window (``window_size`` = keys before, after the query) for a config whose layers all slide."""
    if not any(windowed_layers(hf_config)):
        return {}
    return dict(window_size=(hf_config.sliding_window - 1, 0), window_attn_skip_freq=None)


# HF rope types that megatron's RotaryEmbedding reproduces once it holds HF's inverse frequencies: both
# rotate position p by p * inv_freq with no cos/sin scale. Types that also scale cos/sin (yarn, longrope:
# HF's "attention_factor") or recompute the frequencies per sequence length (dynamic) are refused.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config) -> dict:
    # transformers 5.x folds a config.json's legacy ``rope_scaling`` (and ``rope_theta``) into this dict.
    return getattr(hf_config, "rope_parameters", None) or {}


def rope_theta(hf_config) -> float:
    return float(rope_parameters(hf_config).get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def rotary_percent(hf_config) -> float:
    """The share of each head RoPE rotates (GLM-4.5: its first half), rotate-half style in both transformers and
    megatron (apply_rotary_pos_emb / _apply_rotary_pos_emb_bshd pass the rest through)."""
    return float(rope_parameters(hf_config).get("partial_rotary_factor",
                                                 getattr(hf_config, "partial_rotary_factor", 1.0) or 1.0))


def check_rope_supported(hf_config) -> None:
    kind = rope_parameters(hf_config).get("rope_type", "default")
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type '{kind}' is not supported yet (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def use_hf_rope_frequencies(rope, hf_config) -> None:
    """Give megatron's RotaryEmbedding ``rope`` the inverse frequencies of the HF model's scaled RoPE.

    megatron-core 0.16's GPTModel hands RotaryEmbedding only ``rope_scaling_factor``; its ``_apply_scaling``
    keeps Llama 3.1's low_freq_factor=1, high_freq_factor=4 and original context 8192 whatever the config
    says (models/common/embeddings/rotary_pos_embedding.py). So the frequencies come from transformers'
    own function for the config's rope type (modeling_rope_utils.ROPE_INIT_FUNCTIONS, what the HF model
    uses), computed on the embedding's device before any forward: the same numbers on CPU and GPU, and
    every rotary table megatron builds (``get_emb``, our ``rope_at_positions``) reads ``inv_freq``.
    The rollout needs nothing: vLLM reads the same ``rope_parameters`` from config.json itself
    (model_executor/layers/rotary_embedding get_rope)."""
    kind = rope_parameters(hf_config).get("rope_type", "default")
    if kind != "default":
        megatron_layers.set_rope_inverse_frequencies(rope, hf_inverse_frequencies(hf_config, kind, rope.inv_freq.device))
