"""Build megatron-core GPT models (policy or value) from a Hugging Face Llama/Qwen2 config."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from hybridflow.megatron import cpu_compat

SUPPORTED_ARCHS = ("Qwen2ForCausalLM", "LlamaForCausalLM")


def _rope_theta(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def transformer_config_from_hf(hf_config, *, tp: int = 1, pp: int = 1, sequence_parallel: bool = False,
                               params_dtype: torch.dtype = torch.float32):
    """The megatron TransformerConfig equivalent to a HF Qwen2/Llama config (no fused CUDA kernels on CPU)."""
    from megatron.core.transformer import TransformerConfig

    archs = getattr(hf_config, "architectures", None) or []
    if archs and archs[0] not in SUPPORTED_ARCHS:
        raise ValueError(f"model architecture {archs[0]} is not supported (supported: {SUPPORTED_ARCHS})")
    on_gpu = not cpu_compat.cuda_absent()
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    qkv_bias = hf_config.model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False))
    return TransformerConfig(
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


def te_available() -> bool:
    if cpu_compat.cuda_absent():
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
    causal mask alone is exact (workers/role_ops.py) and no padding mask is passed at all.
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if te_available():
        return specs.get_gpt_layer_with_transformer_engine_spec()
    if config.sequence_parallel:
        _allow_sequence_parallel_torch_norm()
    return specs.get_gpt_layer_local_spec(normalization="RMSNorm")


_torch_norm_patched = False


def _allow_sequence_parallel_torch_norm() -> None:
    """The local spec's norm without Apex (WrappedTorchNorm, torch_norm.py) asserts
    ``not config.sequence_parallel``, on GPU as on CPU. A plain norm is correct under sequence parallel
    as long as its weight gradients are all-reduced across TP, which megatron does for params marked
    ``sequence_parallel`` (finalize_model_grads): build it with the flag off and mark its params."""
    global _torch_norm_patched
    if _torch_norm_patched:
        return
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
            normalization="LayerNorm"):
        sp = config.sequence_parallel
        config.sequence_parallel = False
        try:
            norm = original_new(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)
        finally:
            config.sequence_parallel = sp
        for p in norm.parameters():
            setattr(p, "sequence_parallel", sp)
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(new)
    _torch_norm_patched = True


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
    with cpu_compat.megatron_cpu_scope():
        model = GPTModel(
            config=tf_config,
            transformer_layer_spec=layer_spec(tf_config),
            vocab_size=hf_config.vocab_size,
            max_sequence_length=hf_config.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=tie,
            position_embedding_type="rope",
            rotary_base=_rope_theta(hf_config),
            parallel_output=True,
        )
    if value_head and post_process:
        model.output_layer = ValueHead(tf_config.hidden_size, tf_config.sequence_parallel, tf_config.params_dtype)
    # Every param in the params dtype, as Megatron-LM's Float16Module casts the module: the local spec's
    # torch norms are created in fp32 whatever params_dtype says.
    return model.to(device=device, dtype=tf_config.params_dtype)


@contextlib.contextmanager
def rope_at_positions(model, position_ids: torch.Tensor):
    """Rotary embeddings at ``position_ids`` [b, s] for the forwards of the GPTModel ``model`` run inside: megatron-core 0.16's
    GPTModel rotates by index (0..s-1, ``RotaryEmbedding.forward(max_seq_len)``) and reads position ids only
    for learned position embeddings, so a packed row whose responses all continue from one prompt needs
    its own. Same formula as ``RotaryEmbedding.get_emb`` (non-interleaved), one [s, b, 1, dim] table that
    ``_apply_rotary_pos_emb_bshd`` broadcasts per row."""
    rope = model.rotary_pos_emb

    def at_positions(*_, **__):
        freqs = position_ids.t()[..., None].to(rope.inv_freq) * rope.inv_freq  # [s, b, dim/2]
        return torch.cat((freqs, freqs), dim=-1)[:, :, None, :]

    rope.forward = at_positions  # shadows the (cached) class method for this instance only
    try:
        yield
    finally:
        del rope.forward