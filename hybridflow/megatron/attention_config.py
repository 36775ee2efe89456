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
    """megatron's window (``window_size`` = keys before, after the query) and the layers it applies to
    (``window_attn_skip_freq``: None for all, else 1 per windowed layer: megatron's is_layer_window_attention
    reads a list by global layer number), as ``windowed_layers`` says."""
    windowed = windowed_layers(hf_config)
    if not any(windowed):
        return {}
    return dict(window_size=(hf_config.sliding_window - 1, 0),
                window_attn_skip_freq=None if all(windowed) else [int(x) for x in windowed])


def sink_fields(hf_config) -> dict:
    """gpt-oss's sinks: one learned logit per head joins each query's softmax (transformers' eager_attention_forward
    concatenates it to the scores, then drops its column), megatron's learnable softmax offset (SoftmaxOne)."""
    return dict(softmax_type="learnable") if families.of(hf_config).attention_sinks else {}


# HF rope types that megatron's RotaryEmbedding reproduces once it holds HF's inverse frequencies: both
# rotate position p by p * inv_freq with no cos/sin scale. Types that also scale cos/sin (yarn, longrope:
# HF's "attention_factor") or recompute the frequencies per sequence length (dynamic) are refused, except
# YaRN for the families whose RoPE it is (Family.yarn: megatron's YarnRotaryEmbedding, yarn_fields).
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


def uses_yarn(hf_config) -> bool:
    return rope_parameters(hf_config).get("rope_type") == "yarn" and families.of(hf_config).yarn


def check_rope_supported(hf_config) -> None:
    kind = rope_parameters(hf_config).get("rope_type", "default")
    if kind not in SUPPORTED_ROPE_TYPES and not uses_yarn(hf_config):
        raise ValueError(f"rope_type '{kind}' is not supported yet (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if uses_yarn(hf_config):
        yarn_attributes(hf_config)


def yarn_attributes(hf_config) -> dict:
    """The attributes megatron's YaRN reads from the TransformerConfig (GPTModel and attention getattr them; they
    are no dataclass fields in 0.16.1) equal to transformers' _compute_yarn_parameters: the attention factor
    0.1 ln(factor) + 1 unless both mscale and mscale_all_dim are given (their ratio), beta_fast/slow defaulting
    to 32/1, and the correction range rounded out unless ``truncate`` is false (gpt-oss). A given
    ``attention_factor`` or a missing ``factor`` is refused in one line."""
    p = rope_parameters(hf_config)
    if p.get("attention_factor") is not None:
        raise ValueError("rope_parameters.attention_factor: a YaRN attention factor given explicitly is not "
                             "supported (megatron derives it from factor, mscale and mscale_all_dim)")
    if not p.get("factor") or not p.get("original_max_position_embeddings"):
        raise ValueError("rope_parameters: YaRN needs factor and original_max_position_embeddings")
    both = bool(p.get("mscale") and p.get("mscale_all_dim"))
    return dict(yarn_rotary_scaling_factor=float(p["factor"]),
                yarn_original_max_position_embeddings=int(p["original_max_position_embeddings"]),
                yarn_beta_fast=float(p.get("beta_fast") or 32), yarn_beta_slow=float(p.get("beta_slow") or 1),
                yarn_mscale=float(p["mscale"]) if both else None,
                yarn_mscale_all_dim=float(p["mscale_all_dim"]) if both else None,
                yarn_correction_range_round_to_int=bool(p.get("truncate", True)))


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
    if kind != "default" and not uses_yarn(hf_config):  # YaRN: megatron's own (yarn_attributes)
        megatron_layers.set_rope_inverse_frequencies(rope, hf_inverse_frequencies(hf_config, kind, rope.inv_freq.device))


def latent_attention_fields(hf_config) -> dict:
    """MLATransformerConfig's fields for DeepSeek-V3's multi-latent attention (none for other families): the
    latent ranks and head parts; the local core attention sized by ``kv_channels`` = v_head_dim, one query group
    per head (each head has its own key); ``qk_layernorm`` so the local spec builds the latents' norms. RoPE is MLA's
    own per layer (megatron's ``rope`` or ``yarn`` rope_type) on the interleaved rope part, as transformers'
    ``rope_interleave`` and vLLM's DeepSeek attention (is_neox_style False) do; a config without it is refused.
    YaRN: megatron's MLA scales the softmax by mscale(factor, mscale_all_dim)^2 and cos/sin by mscale(factor,
    mscale) / mscale(factor, mscale_all_dim), transformers' DeepseekV3Attention and _compute_yarn_parameters
    the same where both are given (DeepSeek-V3's and Kimi-K2's configs); one of them alone is refused."""
    if not families.of(hf_config).multi_latent:
        return {}
    if not getattr(hf_config, "rope_interleave", True):
        raise ValueError("rope_interleave false: megatron's MLA rotates the interleaved rope part only "
                         "(rope_utils._apply_rotary_pos_emb_bshd), as vLLM's DeepSeek attention does")
    fields = dict(q_lora_rank=getattr(hf_config, "q_lora_rank", None), kv_lora_rank=hf_config.kv_lora_rank,
                  qk_head_dim=hf_config.qk_nope_head_dim, qk_pos_emb_head_dim=hf_config.qk_rope_head_dim,
                  v_head_dim=hf_config.v_head_dim, kv_channels=hf_config.v_head_dim,
                  num_query_groups=hf_config.num_attention_heads, qk_layernorm=True, rotary_base=rope_theta(hf_config),
                  rope_type="yarn" if uses_yarn(hf_config) else "rope")
    if uses_yarn(hf_config):
        fields.update(_latent_yarn_fields(hf_config))
    return fields


def _latent_yarn_fields(hf_config) -> dict:
    yarn, p = yarn_attributes(hf_config), rope_parameters(hf_config)
    if bool(p.get("mscale")) != bool(p.get("mscale_all_dim")):
        raise ValueError("rope_parameters: mscale and mscale_all_dim are given together or not at all for MLA "
                         "(megatron's MLA and transformers derive YaRN's scale from both)")
    if not yarn["yarn_correction_range_round_to_int"]:
        raise ValueError("rope_parameters.truncate false: megatron's MLA rounds YaRN's correction range")
    return dict(rotary_scaling_factor=yarn["yarn_rotary_scaling_factor"],
                original_max_position_embeddings=yarn["yarn_original_max_position_embeddings"],
                beta_fast=yarn["yarn_beta_fast"], beta_slow=yarn["yarn_beta_slow"],
                mscale=yarn["yarn_mscale"] or 1.0, mscale_all_dim=yarn["yarn_mscale_all_dim"] or 0.0)
