"""Build megatron-core GPT models (policy or value) from a Hugging Face causal LM config: Qwen2, Qwen3, Llama,
Mistral (dense) and Qwen3-MoE, Qwen2-MoE, GLM-4.5 (megatron-core MoE layers with expert parallelism)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from hybridflow import device
from hybridflow import families
from hybridflow.megatron import context_parallel, moe_config
from hybridflow.megatron.overrides import check_transformer_overrides
from hybridflow.megatron.attention_config import (check_rope_supported, latent_attention_fields, rope_theta,
                                                 rotary_percent, sink_fields, use_hf_rope_frequencies, uses_yarn,
                                                 window_fields, windowed_layers, yarn_attributes)
from hybridflow.families import SUPPORTED_ARCHS, head_dim, is_moe, qk_layernorm, qkv_bias
from hybridflow.patches import megatron_core, megatron_layers, megatron_mla


def check_architecture(hf_config) -> None:
    """One line naming an architecture (or a variant of a supported one) that conversion cannot reproduce."""
    archs = getattr(hf_config, "architectures", None) or []
    if archs and archs[0] not in SUPPORTED_ARCHS:
        raise ValueError(f"model architecture {archs[0]} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
    windowed = windowed_layers(hf_config)
    if any(windowed) and not all(windowed) and not families.of(hf_config).layer_windows:
        raise ValueError(f"sliding_window {hf_config.sliding_window} on some layers only (layer_types) is not supported "
                         "(vLLM's Qwen2 refuses it too): every layer or none")
    experts = families.num_experts(hf_config)
    if is_moe(hf_config) and getattr(hf_config, "num_experts_per_tok", 0) > experts:
        raise ValueError(f"num_experts_per_tok {hf_config.num_experts_per_tok} > num_experts {experts}")
    if is_moe(hf_config) and families.of(hf_config).expert_bias:
        moe_config.check_sigmoid_router(hf_config)


def check_grouped_gemm_dtype(megatron_cfg, key: str) -> None:
    """Grouped-GEMM experts compute in bfloat16 (megatron's GroupedMLP asserts it; verl runs TE's so): known from the
    config alone, so refused before anything is built (``key``: the role's megatron.override_transformer_config)."""
    if megatron_cfg.override_transformer_config.get("moe_grouped_gemm") and megatron_cfg.dtype != "bfloat16":
        raise ValueError(f"{key}.moe_grouped_gemm: grouped-GEMM experts compute in bfloat16 (megatron's GroupedMLP "
                         f"asserts it; verl runs TE's so): set {key.rsplit('.', 1)[0]}.dtype=bfloat16")


def check_trained_layout(hf_config, megatron_cfg, key: str) -> None:
    """A trained role's layout megatron computes the gradients of wrongly, refused in one line (``key``: the role's
    megatron section): multi-latent attention at TP > 1 without sequence parallelism, where each rank's gradient of
    the rope key (shared by all heads) holds its own heads' part only: megatron sums it over TP in the sequence-
    parallel gather alone (multi_latent_attention.py get_query_key_value_tensors)."""
    tp = megatron_cfg.tensor_model_parallel_size
    if families.of(hf_config).multi_latent and tp > 1 and not megatron_cfg.sequence_parallel:
        raise ValueError(f"{key}.sequence_parallel: multi-latent attention trains at tensor_model_parallel_size {tp} "
                         "with sequence parallelism only (megatron sums the rope key's gradient over TP in its gather)")


def check_transformer_config(hf_config, megatron_cfg, key: str) -> None:
    """Build the role's whole TransformerConfig once (no process group needed) so that megatron-core's own
    checks of the overrides (``TransformerConfig.__post_init__``: e.g. full recompute without a
    recompute_method) fail before any worker starts, in one line naming ``key`` (the role's
    ``megatron.override_transformer_config``)."""
    m = megatron_cfg
    if not m.override_transformer_config:  # hybridflow's own settings alone: nothing of the user's to check
        return
    try:
        transformer_config_from_hf(
            hf_config, tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size,
            sequence_parallel=m.sequence_parallel, params_dtype=device.torch_dtype(m.dtype),
            overrides=m.override_transformer_config, key=key)
    except (ValueError, AssertionError, TypeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(msg if msg.startswith(key) else f"{key}: {msg}") from None


def transformer_config_from_hf(hf_config, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
                               cp: int = 1, vpp: int = 1, sequence_parallel: bool = False,
                               params_dtype: torch.dtype = torch.float32, overrides: dict | None = None,
                               key: str = "megatron.override_transformer_config"):
    """The megatron TransformerConfig equivalent to a HF Qwen2/Llama config (no fused CUDA kernels on CPU),
    with ``overrides`` (``check_transformer_overrides``; e.g. activation recompute) set on top, as verl's
    ``override_transformer_config``."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    extra = check_transformer_overrides(overrides or {}, key)
    _check_buildable(hf_config, extra, key, cp)
    latent = families.of(hf_config).multi_latent
    on_gpu = device.has_gpu()
    base = dict(
        **_architecture_fields(hf_config),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # a dense model ignores the expert layout (megatron refuses EP without experts)
        expert_model_parallel_size=ep if is_moe(hf_config) else 1,
        expert_tensor_parallel_size=(etp or tp) if is_moe(hf_config) else tp,
        variable_seq_lengths=True,
        # all_to_all over the expert-parallel group (gloo has it on CPU); allgather
        # rejects variable sequence lengths
        moe_token_dispatcher_type="alltoall",
        batch_p2p_comm=False,  # gloo + batched p2p gives wrong pipeline losses (measured)
        attention_softmax_in_fp32=True,
        bias_dropout_fusion=on_gpu,
        apply_rope_fusion=False,
        # Only the local spec (no TE) reads this, and its fused kernels come from Apex, which may be absent.
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=not on_gpu,
    )
    config = (MLATransformerConfig if latent else TransformerConfig)(**{**base, **extra})
    if uses_yarn(hf_config) and not latent:  # read with getattr by GPTModel and the attention (no dataclass fields in 0.16.1)
        for name, value in yarn_attributes(hf_config).items():
            setattr(config, name, value)
    return config


def _check_buildable(hf_config, overrides: dict, key: str, cp: int) -> None:
    """One line for a model (or a model at context parallel ``cp``) transformer_config_from_hf cannot build."""
    check_architecture(hf_config)
    _check_grouped_biased_experts(hf_config, overrides, key)
    check_rope_supported(hf_config)
    if cp > 1 and any(windowed_layers(hf_config)):
        raise ValueError(f"megatron.context_parallel_size={cp}: a model with a sliding window "
                         f"({hf_config.sliding_window}) runs without context parallelism here")
    if cp > 1 and families.of(hf_config).multi_latent:
        raise ValueError(f"megatron.context_parallel_size={cp}: multi-latent attention runs without context "
                         "parallelism here (megatron's MLA rotates by its own per-layer table, not the CP split)")


def _check_grouped_biased_experts(hf_config, overrides: dict, key: str) -> None:
    if overrides.get("moe_grouped_gemm") and families.of(hf_config).linear_bias:
        raise ValueError(f"{key}.moe_grouped_gemm: {families.of(hf_config).architecture}'s experts have biases, which "
                         "megatron's GroupedMLP refuses (moe/experts.py); its experts run as SequentialMLP here")


def _architecture_fields(hf_config) -> dict:
    """The TransformerConfig fields the HF architecture fixes (Qwen2/Llama-style blocks, their MoE layers)."""
    return dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=head_dim(hf_config),
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        **_activation_fields(hf_config),
        add_bias_linear=families.of(hf_config).linear_bias,
        add_qkv_bias=qkv_bias(hf_config),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=getattr(hf_config, "initializer_range", 0.02),
        qk_layernorm=qk_layernorm(hf_config),
        **window_fields(hf_config),
        **sink_fields(hf_config),
        **moe_config.moe_fields(hf_config),
    ) | latent_attention_fields(hf_config)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """megatron's quick_gelu, ``x * sigmoid(1.702 x)``, not compiled: megatron wraps its own in torch.compile
    (fusions/fused_bias_geglu.py ``@jit_fuser``), and that compiled CPU kernel corrupts memory here (torch 2.13 CPU:
    "malloc(): unaligned tcache chunk detected" on a [4, 64] input; garbage outputs under AVX2 dispatch). megatron
    reads the function only to pick a fused bias-activation kernel (bias_activation_fusion, off here)."""
    return x * torch.sigmoid(1.702 * x)


def _activation_fields(hf_config) -> dict:
    """SwiGLU, or gpt-oss's clamped one (transformers' GptOssExperts._apply_gate): gate clamped above and up on both
    sides at swiglu_limit, ``gate * sigmoid(alpha * gate) * (up + 1)``; megatron's quick_gelu is alpha 1.702 (the
    one value gpt-oss uses), its glu with activation_func_clamp_value and glu_linear_offset 1 (transformer/mlp.py)."""
    if not families.of(hf_config).clamped_swiglu:
        return dict(activation_func=F.silu)
    alpha = float(getattr(hf_config, "swiglu_alpha", 1.702))
    if abs(alpha - 1.702) > 1e-9:
        raise ValueError(f"swiglu_alpha {alpha}: megatron's clamped SwiGLU uses quick_gelu's 1.702")
    return dict(activation_func=quick_gelu, activation_func_clamp_value=float(hf_config.swiglu_limit),
                glu_linear_offset=1.0)


def te_available() -> bool:
    """Transformer Engine usable here: a GPU, and TE's torch bindings import. ``import transformer_engine``
    alone proves nothing: its __init__ swallows an ImportError of ``transformer_engine.pytorch`` (a missing
    or mismatched torch extension; TransformerEngine transformer_engine/__init__.py ``try: from . import
    pytorch except (ImportError, StopIteration): pass``). megatron-core's own ``HAVE_TE`` of the layer specs
    (gpt_layer_specs.py, which imports megatron.core.extensions.transformer_engine and with it
    ``transformer_engine.pytorch.fp8``) must agree, or the TE spec it would build is not there."""
    if not device.has_gpu():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    from megatron.core.models.gpt import gpt_layer_specs

    return bool(gpt_layer_specs.HAVE_TE)


def layer_spec(config):
    """Transformer Engine spec when TE and CUDA are present, megatron's local spec otherwise.

    Both use the causal attention mask type: TE's flash/cuDNN backends then ignore any attention_mask
    (and so does the local spec's fused softmax on GPU), which is why rows are laid out so that the
    causal mask alone is exact (workers/row_layout.py) and no padding mask is passed at all.
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs

    grouped = bool(config.num_moe_experts and config.moe_grouped_gemm)
    moe = dict(num_experts=config.num_moe_experts, moe_grouped_gemm=grouped, qk_layernorm=config.qk_layernorm,
               multi_latent_attention=config.multi_latent_attention)
    if config.num_moe_experts:  # the router reads moe_utils.te_general_gemm, undefined without TE (any device)
        megatron_core.define_missing_router_gemm()
    if te_available():  # grouped experts: TEGroupedMLP
        return specs.get_gpt_layer_with_transformer_engine_spec(**moe)
    if grouped:  # megatron's GroupedMLP (the local spec's only grouped experts: LocalSpecProvider.grouped_mlp_modules)
        megatron_core.torch_grouped_gemm()
    if config.sequence_parallel:
        megatron_layers.allow_sequence_parallel_torch_norm()
    if config.window_size is not None:
        megatron_layers.window_within_rows()
    # The local spec's RMSNorm layer norms are WrappedTorchNorm with or without Apex
    # (backends.LocalSpecProvider.layer_norm(rms_norm=True)).
    spec = specs.get_gpt_layer_local_spec(normalization="RMSNorm", **moe)
    if config.context_parallel_size > 1:
        spec.submodules.self_attention.submodules.core_attention = context_parallel.gathered_kv_attention()
    if config.multi_latent_attention:
        _local_latent_attention(spec.submodules.self_attention.submodules)
    return spec


def _local_latent_attention(submodules) -> None:
    """MLA on the local spec: its core attention taking MLA's arguments (patches/megatron_mla.py), and the latent
    down-projections whole on every TP rank, as the TE spec holds them (TELinear 'duplicated') and vLLM does. The
    local spec's ColumnParallelLinear would split them and gather their outputs, and that gather's backward keeps
    each rank's own slice of the gradient: the rope key, shared by every head, then gets only the last rank's heads'
    gradient (measured: weights 9x the fp32 tolerance off the single rank after one update at TP 2). Whole, the rope
    key comes through the sequence-parallel gather, whose backward sums over the ranks (multi_latent_attention.py
    get_query_key_value_tensors), and megatron all-reduces the whole weights' gradients over TP as it does the norms'
    (modelopt Linear marks them sequence_parallel; finalize_model_grads)."""
    from megatron.core.post_training.modelopt.layers import Linear

    megatron_mla.have_te_in_mla()
    submodules.core_attention = megatron_mla.local_core_attention()
    submodules.linear_q_down_proj = submodules.linear_kv_down_proj = Linear


def final_norm():
    """The decoder's final norm, named explicitly: left to itself, TransformerBlock takes its module-level
    ``LayerNormImpl`` (transformer/transformer_block.py), which is Apex's FusedLayerNorm whenever Apex is
    importable and TE is not, and FusedLayerNorm asserts ``normalization == "LayerNorm"``
    (fusions/fused_layer_norm.py); Qwen2/Llama use RMSNorm. Same norm family as ``layer_spec``."""
    if te_available():
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return WrappedTorchNorm


def block_spec(config, vp_stage: int | None = None):
    """This pipeline stage's (virtual stage ``vp_stage``'s) decoder layers and final norm, as megatron's
    get_gpt_decoder_block_spec builds them (layers evenly split over stages) but with ``final_norm``."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    n, offset = get_num_layers_to_build(config, vp_stage), get_transformer_layer_offset(config, vp_stage)
    if not config.num_moe_experts:
        return TransformerBlockSubmodules(layer_specs=[layer_spec(config)] * n, layer_norm=final_norm())
    # Dense layers of a MoE model (Qwen-MoE's mlp_only_layers / decoder_sparse_step) get the dense spec.
    pattern = moe_config.moe_layer_pattern_of(config)
    dense = copy.copy(config)
    dense.num_moe_experts = None
    specs = {0: layer_spec(dense), 1: layer_spec(config)}
    return TransformerBlockSubmodules(layer_specs=[specs[pattern[offset + i]] for i in range(n)],
                                      layer_norm=final_norm())


class ValueHead(torch.nn.Linear):
    """hidden -> scalar value; replaces GPTModel's vocab output layer for critics.

    The weight is replicated on every TP rank; under sequence parallel the hidden states are gathered
    first so every rank computes (and differentiates) the same full-sequence values. The gather's
    backward must only split (not reduce-scatter): every rank already holds the full gradient.
    """

    def __init__(self, hidden_size: int, sequence_parallel: bool, dtype: torch.dtype):
        super().__init__(hidden_size, 1, bias=False, dtype=dtype)  # the trunk's params dtype
        torch.nn.init.zeros_(self.weight)  # start from V=0: no random value scale to unlearn
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden, weight=None, runtime_gather_output=None):  # noqa: ARG002 (GPTModel API)
        if self.sequence_parallel:
            from megatron.core import tensor_parallel

            hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return super().forward(hidden), None


def build_gpt(hf_config, tf_config, *, value_head: bool = False, pre_process: bool = True,
              post_process: bool = True, device: torch.device | None = None, vp_stage: int | None = None):
    """A GPTModel for this rank's pipeline stage (its virtual stage ``vp_stage``: a chunk of its layers) (a
    policy with vocab logits, or a value model), on
    ``device``: megatron-core never moves a module to the GPU by itself (Megatron-LM's get_model and verl
    call ``model.cuda()`` after building), and with CPU initialization nothing would reach it otherwise."""
    from megatron.core.models.gpt import GPTModel

    tie = bool(getattr(hf_config, "tie_word_embeddings", False)) and not value_head
    with megatron_core.cpu_scope():
        model = GPTModel(
            config=tf_config,
            transformer_layer_spec=block_spec(tf_config, vp_stage),
            vocab_size=hf_config.vocab_size,
            max_sequence_length=hf_config.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=tie,
            # MLA: each attention layer rotates by its own table (MultiLatentAttention.rotary_pos_emb), none here
            position_embedding_type="yarn" if uses_yarn(hf_config) and not tf_config.multi_latent_attention else "rope",
            rotary_base=rope_theta(hf_config),
            rotary_percent=rotary_percent(hf_config),
            parallel_output=True,
            vp_stage=vp_stage,
        )
    if not tf_config.multi_latent_attention:  # MLA: megatron's own default / YaRN tables (latent_attention_fields)
        use_hf_rope_frequencies(model.rotary_pos_emb, hf_config)
    if value_head and post_process:
        model.output_layer = ValueHead(tf_config.hidden_size, tf_config.sequence_parallel, tf_config.params_dtype)
    # Every param in the params dtype, as Megatron-LM's Float16Module casts the module: the local spec's
    # torch norms are created in fp32 whatever params_dtype says. The routers' expert bias stays float32, as
    # megatron keeps it (router.py _maintain_float32_expert_bias: otherwise only at the next forward).
    model = model.to(device=device, dtype=tf_config.params_dtype)
    for m in model.modules():
        if getattr(m, "expert_bias", None) is not None:
            m._maintain_float32_expert_bias()
    if tf_config.num_moe_experts and tf_config.add_bias_linear:
        megatron_layers.mend_biased_experts(model)
    return model
