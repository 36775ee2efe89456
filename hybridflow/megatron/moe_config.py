"""megatron-core's MoE settings for a HF mixture-of-experts config, and which decoder layers are sparse."""

from __future__ import annotations

from hybridflow.families import is_moe, moe_layer_pattern


def moe_layer_pattern_of(tf_config) -> list[int]:
    """1 per decoder layer with a MoE block, from a TransformerConfig (its moe_layer_freq)."""
    if not tf_config.num_moe_experts:
        return [0] * tf_config.num_layers
    freq = tf_config.moe_layer_freq
    return list(freq) if isinstance(freq, list) else [int(i % freq == 0) for i in range(tf_config.num_layers)]


def moe_fields(hf_config) -> dict:
    """megatron-core MoE settings equal to transformers' Qwen3-MoE / Qwen2-MoE blocks, as verl 0.9.1's
    config_converter sets them (hf_to_mcore_config_qwen3moe/qwen2moe): softmax router over all experts,
    top-k, renormalized over the k (norm_topk_prob) unless ``moe_router_pre_softmax`` (softmax first, no
    renormalization: Qwen2-MoE); the aux-loss coefficient from ``router_aux_loss_coef`` but load balancing
    off ("none", verl: it hurts RL), which ``override_transformer_config`` turns on
    (moe_router_load_balancing_type: aux_loss). Deliberate difference: experts are megatron's SequentialMLP
    unless ``override_transformer_config.moe_grouped_gemm`` (verl turns grouped GEMM on by default): megatron's
    grouped experts without TE compute in bf16 only, and the CPU runs are fp32. Grouped experts' weights keep
    SequentialMLP's names for conversion, resharding and export (convert.canonical_names, grouped_expert_views)."""
    if not is_moe(hf_config):
        return {}
    pattern = moe_layer_pattern(hf_config)
    shared = getattr(hf_config, "shared_expert_intermediate_size", None) or None
    return dict(
        num_moe_experts=hf_config.num_experts,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not getattr(hf_config, "norm_topk_prob", False),
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=shared is not None,
        moe_aux_loss_coeff=float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0),
        moe_router_load_balancing_type="none",
        moe_grouped_gemm=False,
        moe_layer_freq=pattern if 0 in pattern else 1,
    )
