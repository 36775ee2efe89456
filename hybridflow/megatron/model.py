"""Build megatron-core GPT models (policy or value) from a Hugging Face Llama/Qwen2 config."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridflow import device
from hybridflow.patches import megatron_core
from hybridflow.patches.transformers_rope import hf_inverse_frequencies

SUPPORTED_ARCHS = ("Qwen2ForCausalLM", "LlamaForCausalLM")


# HF rope types that megatron's RotaryEmbedding reproduces once it holds HF's inverse frequencies: both
# rotate position p by p * inv_freq with no cos/sin scale. Types that also scale cos/sin (yarn, longrope:
# HF's "attention_factor") or recompute the frequencies per sequence length (dynamic) are refused.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _rope_parameters(hf_config) -> dict:
    # transformers 5.x folds a config.json's legacy ``rope_scaling`` (and ``rope_theta``) into this dict.
    return getattr(hf_config, "rope_parameters", None) or {}


def _rope_theta(hf_config) -> float:
    return float(_rope_parameters(hf_config).get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def check_rope_supported(hf_config) -> None:
    kind = _rope_parameters(hf_config).get("rope_type", "default")
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type '{kind}' is not supported yet (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def _use_hf_rope_frequencies(rope, hf_config) -> None:
    """Give megatron's RotaryEmbedding ``rope`` the inverse frequencies of the HF model's scaled RoPE.

    megatron-core 0.16's GPTModel hands RotaryEmbedding only ``rope_scaling_factor``; its ``_apply_scaling``
    keeps Llama 3.1's low_freq_factor=1, high_freq_factor=4 and original context 8192 whatever the config
    says (models/common/embeddings/rotary_pos_embedding.py). So the frequencies come from transformers'
    own function for the config's rope type (modeling_rope_utils.ROPE_INIT_FUNCTIONS, what the HF model
    uses), computed on the embedding's device before any forward: the same numbers on CPU and GPU, and
    every rotary table megatron builds (``get_emb``, our ``rope_at_positions``) reads ``inv_freq``.
    The rollout needs nothing: vLLM reads the same ``rope_parameters`` from config.json itself
    (model_executor/layers/rotary_embedding get_rope)."""
    kind = _rope_parameters(hf_config).get("rope_type", "default")
    if kind != "default":
        megatron_core.set_rope_inverse_frequencies(rope, hf_inverse_frequencies(hf_config, kind, rope.inv_freq.device))


# TransformerConfig fields hybridflow sets itself, and where each comes from: an override of one is refused
# (override_transformer_config), naming the key to use instead where there is one.
_FROM_MODEL = "the model's config.json"
DECIDED_FIELDS = {
    **{name: _FROM_MODEL for name in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
        "normalization", "layernorm_epsilon", "gated_linear_unit", "activation_func", "add_bias_linear",
        "add_qkv_bias", "init_method_std")},
    "tensor_model_parallel_size": "megatron.tensor_model_parallel_size",
    "pipeline_model_parallel_size": "megatron.pipeline_model_parallel_size",
    "sequence_parallel": "megatron.sequence_parallel",
    **{name: "megatron.dtype" for name in ("params_dtype", "pipeline_dtype", "bf16", "fp16")},
    # layouts hybridflow does not build
    **{name: "hybridflow (not supported)" for name in (
        "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
        "virtual_pipeline_model_parallel_size")},
    # what the role's training loop and CPU support rely on (role.py, patches/megatron_core.py)
    **{name: "hybridflow" for name in (
        "variable_seq_lengths", "finalize_model_grads_func", "grad_scale_func", "use_cpu_initialization",
        "batch_p2p_comm", "moe_token_dispatcher_type")},
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
    return out


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


def check_transformer_config(hf_config, megatron_cfg, key: str) -> None:
    """Build the role's whole TransformerConfig once (no process group needed) so that megatron-core's own
    checks of the overrides (``TransformerConfig.__post_init__``: e.g. full recompute without a
    recompute_method) fail before any worker starts, in one line naming ``key`` (the role's
    ``megatron.override_transformer_config``)."""
    from hybridflow import device as devices

    m = megatron_cfg
    if not m.override_transformer_config:  # hybridflow's own settings alone: nothing of the user's to check
        return
    try:
        transformer_config_from_hf(
            hf_config, tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size,
            sequence_parallel=m.sequence_parallel, params_dtype=devices.torch_dtype(m.dtype),
            overrides=m.override_transformer_config, key=key)
    except (ValueError, AssertionError, TypeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(msg if msg.startswith(key) else f"{key}: {msg}") from None


def transformer_config_from_hf(hf_config, *, tp: int = 1, pp: int = 1, sequence_parallel: bool = False,
                               params_dtype: torch.dtype = torch.float32, overrides: dict | None = None,
                               key: str = "megatron.override_transformer_config"):
    """The megatron TransformerConfig equivalent to a HF Qwen2/Llama config (no fused CUDA kernels on CPU),
    with ``overrides`` (``check_transformer_overrides``; e.g. activation recompute) set on top, as verl's
    ``override_transformer_config``."""
    from megatron.core.transformer import TransformerConfig

    extra = check_transformer_overrides(overrides or {}, key)
    archs = getattr(hf_config, "architectures", None) or []
    if archs and archs[0] not in SUPPORTED_ARCHS:
        raise ValueError(f"model architecture {archs[0]} is not supported (supported: {SUPPORTED_ARCHS})")
    check_rope_supported(hf_config)
    on_gpu = device.has_gpu()
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    qkv_bias = hf_config.model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False))
    base = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=getattr(hf_config, "initializer_range", 0.02),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # dense models; allgather rejects variable lengths
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
    return TransformerConfig(**{**base, **extra})


def te_available() -> bool:
    if not device.has_gpu():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def layer_spec(config):
    """Transformer Engine spec when TE and CUDA are present, megatron's local spec otherwise.

    Both use the causal attention mask type: TE's flash/cuDNN backends then ignore any attention_mask
    (and so does the local spec's fused softmax on GPU), which is why rows are laid out so that the
    causal mask alone is exact (workers/row_layout.py) and no padding mask is passed at all.
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if te_available():
        return specs.get_gpt_layer_with_transformer_engine_spec()
    if config.sequence_parallel:
        megatron_core.allow_sequence_parallel_torch_norm()
    # The local spec's RMSNorm layer norms are WrappedTorchNorm with or without Apex
    # (backends.LocalSpecProvider.layer_norm(rms_norm=True)).
    return specs.get_gpt_layer_local_spec(normalization="RMSNorm")


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


def block_spec(config):
    """This pipeline stage's decoder layers and final norm, as megatron's get_gpt_decoder_block_spec
    builds them (layers evenly split over stages) but with ``final_norm``."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    return TransformerBlockSubmodules(layer_specs=[layer_spec(config)] * get_num_layers_to_build(config),
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
              post_process: bool = True, device: torch.device | None = None):
    """A GPTModel for this rank's pipeline stage (a policy with vocab logits, or a value model), on
    ``device``: megatron-core never moves a module to the GPU by itself (Megatron-LM's get_model and verl
    call ``model.cuda()`` after building), and with CPU initialization nothing would reach it otherwise."""
    from megatron.core.models.gpt import GPTModel

    tie = bool(getattr(hf_config, "tie_word_embeddings", False)) and not value_head
    with megatron_core.cpu_scope():
        model = GPTModel(
            config=tf_config,
            transformer_layer_spec=block_spec(tf_config),
            vocab_size=hf_config.vocab_size,
            max_sequence_length=hf_config.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=tie,
            position_embedding_type="rope",
            rotary_base=_rope_theta(hf_config),
            parallel_output=True,
        )
    _use_hf_rope_frequencies(model.rotary_pos_emb, hf_config)
    if value_head and post_process:
        model.output_layer = ValueHead(tf_config.hidden_size, tf_config.sequence_parallel, tf_config.params_dtype)
    # Every param in the params dtype, as Megatron-LM's Float16Module casts the module: the local spec's
    # torch norms are created in fp32 whatever params_dtype says.
    return model.to(device=device, dtype=tf_config.params_dtype)
