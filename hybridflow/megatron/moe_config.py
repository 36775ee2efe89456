"""megatron-core's MoE settings for a HF mixture-of-experts config (Qwen-MoE's softmax router, DeepSeek-V3's and
GLM-4.5's sigmoid one with its expert bias, and what of the latter megatron cannot reproduce), and which decoder
layers are sparse."""

from __future__ import annotations

from hybridflow import families
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
    SequentialMLP's names for conversion, resharding and export (convert.canonical_names, grouped_expert_views).
    GLM-4.5's (DeepSeek-V3's) router instead: _sigmoid_router_fields; its shared experts ungated."""
    if not is_moe(hf_config):
        return {}
    pattern = moe_layer_pattern(hf_config)
    family = families.of(hf_config)
    return dict(
        num_moe_experts=families.num_experts(hf_config),
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=family.expert_width(hf_config),
        moe_shared_expert_intermediate_size=families.shared_expert_width(hf_config) or None,
        moe_shared_expert_gate=family.shared_expert_gate,
        moe_aux_loss_coeff=float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0),
        moe_router_load_balancing_type="none",
        moe_grouped_gemm=False,
        moe_layer_freq=pattern if 0 in pattern else 1,
        **(_sigmoid_router_fields(hf_config) if family.expert_bias else dict(
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not getattr(hf_config, "norm_topk_prob", family.norm_topk_by_default))),
    )


def _sigmoid_router_fields(hf_config) -> dict:
    """megatron's router equal to DeepSeek-V3's (GLM-4.5's): sigmoid scores in float32 (transformers computes the
    router in float32, vLLM with a float32 gate), the expert bias added to choose, group-limited top-k
    (check_sigmoid_router), the chosen scores renormalized and times routed_scaling_factor.

    The expert bias is frozen at the checkpoint's values (``moe_router_bias_update_rate`` 0): megatron would
    otherwise move it after every optimizer step by the sign of each expert's load (finalize_model_grads
    ``_update_router_expert_bias``). Deliberate difference: verl 0.9.1's legacy converter keeps megatron's update
    (rate 0.001; Megatron-Bridge the same); RL steps are few and the pretrained balance is what the rollout was
    served with. ``override_transformer_config.moe_router_bias_update_rate`` turns the update on; the bias is a
    declared weight (families/weights.py EXPERT_BIAS), so it is synced to vLLM, exported and checkpointed."""
    groups, chosen = _router_groups(hf_config)
    return dict(
        moe_router_score_function="sigmoid",
        moe_router_pre_softmax=False,
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,
        moe_router_topk_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0),
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=chosen if groups > 1 else None,
        moe_router_dtype="fp32",
    )


def _router_groups(hf_config) -> tuple[int, int]:
    """(expert groups, groups each token may choose) of a DeepSeek-V3 router: n_group, topk_group."""
    return getattr(hf_config, "n_group", None) or 1, getattr(hf_config, "topk_group", None) or 1


def check_sigmoid_router(hf_config) -> None:
    """One line for a DeepSeek-V3 router megatron's would not reproduce. megatron renormalizes the k chosen
    sigmoid scores whenever k > 1 and never when k = 1 (moe_utils.topk_routing_with_score_function); it ranks
    the groups by the sum of their top k/topk_group scores (group_limited_topk), transformers and vLLM by their
    top 2 (modeling_glm4_moe.Glm4MoeTopkRouter, modeling_deepseek_v3.py): equal when k/topk_group is 2 or
    there is one group (GLM-4.5, Kimi-K2; DeepSeek-V3's 8 of 4 groups)."""
    k, experts = hf_config.num_experts_per_tok, families.num_experts(hf_config)
    groups, chosen = _router_groups(hf_config)
    for key, value in families.of(hf_config).router_config:
        if getattr(hf_config, key, None) != value:
            raise ValueError(f"{key} {getattr(hf_config, key, None)!r}: transformers' router computes as {key} {value!r} "
                             "does, and vLLM reads this key (config.json must say so)")
    if bool(getattr(hf_config, "norm_topk_prob", True)) != (k > 1):
        raise ValueError(f"norm_topk_prob {getattr(hf_config, 'norm_topk_prob', True)} with num_experts_per_tok {k}: "
                         "megatron's sigmoid router renormalizes the chosen scores exactly when more than one is chosen")
    if experts % groups or chosen > groups:
        raise ValueError(f"n_group {groups} must divide the {experts} experts, and topk_group {chosen} be at most n_group")
    if groups > 1 and (k % chosen or k // chosen != 2):
        raise ValueError(f"n_group {groups} with num_experts_per_tok {k} / topk_group {chosen} != 2: megatron ranks "
                         f"the groups by their top {k // chosen} scores, transformers and vLLM by their top 2")
