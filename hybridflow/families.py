"""What each supported Hugging Face architecture family is, answered in one place from its config (torch-free):
whether it is a mixture of experts and which layers are sparse, its attention's biases and per-head norms.
megatron/model.py builds from these answers; the run plan and the memory plan count with them."""

from __future__ import annotations

SUPPORTED_ARCHS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
                   "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")


def num_experts(hf_config) -> int:
    """Routed experts per sparse layer (0: a dense model)."""
    return getattr(hf_config, "num_experts", None) or 0


def is_moe(hf_config) -> bool:
    """A mixture of experts (Qwen3-MoE, Qwen2-MoE): routed experts in its sparse layers."""
    return num_experts(hf_config) > 0


def moe_layer_pattern(hf_config) -> list[int]:
    """1 for each decoder layer with a sparse MoE block, 0 for a dense MLP (Qwen-MoE's decoder_sparse_step
    and mlp_only_layers, as transformers' Qwen2MoeDecoderLayer/Qwen3MoeDecoderLayer decide)."""
    n = hf_config.num_hidden_layers
    if not is_moe(hf_config):
        return [0] * n
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    return [int(i not in dense and (i + 1) % step == 0) for i in range(n)]


def qk_layernorm(hf_config) -> bool:
    """Qwen3's per-head RMSNorm of queries and keys before RoPE (q_norm/k_norm), megatron's qk_layernorm."""
    return hf_config.model_type in ("qwen3", "qwen3_moe")


def qkv_bias(hf_config) -> bool:
    """Biases on the query, key and value projections: Qwen2's always, others' with attention_bias."""
    return hf_config.model_type in ("qwen2", "qwen2_moe") or bool(getattr(hf_config, "attention_bias", False))


def head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
