"""A role's ``megatron.override_transformer_config`` (verl's key): which TransformerConfig fields a user may set,
and the one-line refusals of values megatron-core 0.16.1 would fail on later (in a worker, at the first forward)."""

from __future__ import annotations

from hybridflow.plan.stages import STAGE_LAYER_KEYS

# TransformerConfig fields hybridflow sets itself, and where each comes from: an override of one is refused
# (override_transformer_config), naming the key to use instead where there is one.
_FROM_MODEL = "the model's config.json"
DECIDED_FIELDS = {
    **{name: _FROM_MODEL for name in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
        "normalization", "layernorm_epsilon", "gated_linear_unit", "activation_func", "add_bias_linear",
        "add_qkv_bias", "init_method_std", "activation_func_clamp_value", "glu_linear_offset", "softmax_type",
        "window_size", "window_attn_skip_freq")},
    "tensor_model_parallel_size": "megatron.tensor_model_parallel_size",
    "pipeline_model_parallel_size": "megatron.pipeline_model_parallel_size",
    "sequence_parallel": "megatron.sequence_parallel",
    **{name: "megatron.dtype" for name in ("params_dtype", "pipeline_dtype", "bf16", "fp16")},
    "context_parallel_size": "megatron.context_parallel_size",
    "virtual_pipeline_model_parallel_size": "megatron.virtual_pipeline_model_parallel_size",
    "expert_model_parallel_size": "megatron.expert_model_parallel_size",
    "expert_tensor_parallel_size": "megatron.expert_tensor_parallel_size",
    **{name: _FROM_MODEL for name in (
        "qk_layernorm", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_router_pre_softmax",
        "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_layer_freq",
        "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
        "moe_router_num_groups", "moe_router_group_topk")},
    # what the role's training loop and CPU support rely on (role.py, patches/megatron_core.py)
    **{name: "hybridflow" for name in (
        "variable_seq_lengths", "finalize_model_grads_func", "grad_scale_func", "use_cpu_initialization",
        "batch_p2p_comm")},
}


def check_transformer_overrides(overrides: dict, key: str) -> dict:
    """``overrides`` (a role's ``megatron.override_transformer_config``, found at ``key``) as TransformerConfig
    keyword arguments: each name must be a TransformerConfig field that hybridflow does not set itself.
    Raises a one-line ValueError naming the key; needs no process group (config validation calls it).
    An ``attention_backend`` given by name becomes megatron's enum, as verl's
    ``mapping_string_to_attn_backend`` does."""
    if not isinstance(overrides, dict):
        raise ValueError(f"{key} must be a mapping of TransformerConfig fields, got {type(overrides).__name__}")
    if not overrides:  # nothing to check: the usual start-up stays off megatron's import (seconds)
        return {}
    import dataclasses

    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    fields = {f.name for f in dataclasses.fields(TransformerConfig) if f.init}
    out = {}
    for name, value in overrides.items():
        if name not in fields:
            raise ValueError(f"{key}.{name}: megatron-core's TransformerConfig has no field {name!r}")
        if name in DECIDED_FIELDS:
            raise ValueError(f"{key}.{name}: set by hybridflow from {DECIDED_FIELDS[name]}, not overridable")
        if name == "attention_backend" and isinstance(value, str):
            if value not in AttnBackend.__members__:
                names = ", ".join(AttnBackend.__members__)
                raise ValueError(f"{key}.attention_backend: {value!r} is not one of {names}")
            value = AttnBackend[value]
        out[name] = value
    _check_recompute_modules(out, key)
    _check_rope_fusion(out, key)
    _check_grad_accumulation_fusion(out, key)
    _check_pipeline_split(out, key)
    _check_token_dispatcher(out, key)
    return out


def _check_token_dispatcher(overrides: dict, key: str) -> None:
    """The experts' token exchange: hybridflow's ``alltoall`` (gloo has it on CPU; ``allgather`` rejects variable
    sequence lengths), or ``flex`` (verl's DeepSeek-V3 scripts: DeepEP's fused all-to-all on NVIDIA GPUs) where
    megatron found its backend (transformer/moe/fused_a2a.py imports ``deep_ep``; without it the dispatcher fails
    at the first forward). The routing, and so the results, are the same."""
    value = overrides.get("moe_token_dispatcher_type", "alltoall")
    if value == "alltoall":
        return
    if value != "flex":
        raise ValueError(f"{key}.moe_token_dispatcher_type: {value!r} is not built here (alltoall, or flex with DeepEP)")
    from megatron.core.transformer.moe import fused_a2a

    hybrid = overrides.get("moe_flex_dispatcher_backend") == "hybridep"
    if not (fused_a2a.HAVE_HYBRIDEP if hybrid else fused_a2a.HAVE_DEEP_EP):
        raise ValueError(f"{key}.moe_token_dispatcher_type: flex needs DeepEP (the deep_ep package, NVIDIA GPUs), "
                         "which is not installed here; leave it alltoall (the same routing)")


# stage splits beyond first/last layer counts (plan/stages.py, which conversion, resharding and checkpoints read):
# an embedding or loss counted as a layer, or a per-stage layout string
_OTHER_SPLITS = ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
                 "pipeline_model_parallel_layout")


def _check_pipeline_split(overrides: dict, key: str) -> None:
    """Stage splits other than num_layers_in_first/last_pipeline_stage are refused in one line (a value other
    than megatron's default: None or False); those two must be whole numbers."""
    for name in _OTHER_SPLITS:
        if overrides.get(name) not in (None, False):
            raise ValueError(f"{key}.{name}: this pipeline split is not built here; num_layers_in_first_pipeline_stage"
                             " / num_layers_in_last_pipeline_stage place uneven stages")
    for name in STAGE_LAYER_KEYS:
        value = overrides.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{key}.{name}: a number of layers (1 or more), got {value!r}")


def _check_rope_fusion(overrides: dict, key: str) -> None:
    """megatron's fused rotary embedding is Transformer Engine's (models/common/embeddings/rope_utils.py imports
    ``fused_apply_rotary_pos_emb`` from its TE extension, None without TE, and asserts it at the first forward):
    ``apply_rope_fusion`` is refused where that import failed. hybridflow itself never turns it on."""
    from megatron.core.models.common.embeddings import rope_utils

    if overrides.get("apply_rope_fusion") and rope_utils.fused_apply_rotary_pos_emb is None:
        raise ValueError(f"{key}.apply_rope_fusion: megatron's fused rotary embedding needs Transformer Engine, which "
                         "is not installed here; leave it false")


def _check_grad_accumulation_fusion(overrides: dict, key: str) -> None:
    """megatron's fused weight-gradient accumulation is a CUDA extension (tensor_parallel/layers.py imports
    ``fused_weight_gradient_mlp_cuda`` from Apex or TE; without it every linear layer raises as it is built):
    refused in one line where that import failed."""
    from megatron.core.tensor_parallel import layers

    if overrides.get("gradient_accumulation_fusion") and not layers._grad_accum_fusion_available:
        raise ValueError(f"{key}.gradient_accumulation_fusion: needs the fused_weight_gradient_mlp_cuda extension "
                         "(Apex or Transformer Engine), which is not installed here; leave it false")


def _check_recompute_modules(overrides: dict, key: str) -> None:
    """Selective recompute of ``layernorm`` goes through megatron-core 0.16.1's CheckpointWithoutOutput,
    which calls Transformer Engine's FP8GlobalStateManager whatever the precision (``fp8 is not None`` is
    True for its default ``fp8=False``; tensor_parallel/random.py): without TE it fails at the first
    forward. ``core_attn`` and ``mlp`` use ``tensor_parallel.checkpoint`` and run anywhere."""
    from megatron.core.tensor_parallel import random as mrandom

    modules = overrides.get("recompute_modules") or []
    if overrides.get("recompute_granularity") == "selective" and "layernorm" in modules and not mrandom.HAVE_TE:
        raise ValueError(f"{key}.recompute_modules: 'layernorm' needs Transformer Engine, which is not installed "
                         "(megatron-core's CheckpointWithoutOutput calls it); core_attn and mlp work without it")
