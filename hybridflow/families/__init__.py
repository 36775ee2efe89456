"""The supported model families, one module each (llama.py, qwen3_moe.py, ...): a family declares its HF
architecture, the weights of its layers with their megatron, HF and vLLM names (weights.py), and the config
facts that follow (is it MoE, which layers are sparse, q/k norms, q/k/v biases). Everything that converts,
reshards, builds or counts a model asks the family of its config here. Adding an architecture is one module
that declares its ``FAMILY`` (and, for other model_types of the same architecture, ``ALIASES``), listed below.
Torch-free."""

from __future__ import annotations

from hybridflow.families import deepseek_v3, glm4_moe, gpt_oss, llama, mistral, qwen2, qwen2_moe, qwen3, qwen3_moe
from hybridflow.families.family import Family

# a module may also declare ALIASES: its family under other model_types (Kimi-K2's kimi_k2 for DeepSeek-V3's)
FAMILIES: dict[str, Family] = {f.model_type: f for m in (qwen2, qwen3, llama, mistral, qwen3_moe, qwen2_moe, glm4_moe,
                                                         gpt_oss, deepseek_v3)
                               for f in (m.FAMILY, *getattr(m, "ALIASES", ()))}
SUPPORTED_ARCHS = tuple(dict.fromkeys(f.architecture for f in FAMILIES.values()))


def of(hf_config) -> Family:
    """The family of a HF config (a transformers config or a namespace of config.json), by its model_type."""
    kind = getattr(hf_config, "model_type", None)
    if kind not in FAMILIES:
        raise ValueError(f"model_type {kind!r} is not supported (supported: {', '.join(FAMILIES)})")
    return FAMILIES[kind]


def num_experts(hf_config) -> int:
    """Routed experts per sparse layer (0: a dense model)."""
    return of(hf_config).num_experts(hf_config)


def is_moe(hf_config) -> bool:
    """A mixture of experts (Qwen3-MoE, Qwen2-MoE, GLM-4.5, DeepSeek-V3): routed experts in its sparse layers."""
    return num_experts(hf_config) > 0


def moe_layer_pattern(hf_config) -> list[int]:
    return of(hf_config).moe_layer_pattern(hf_config)


def qk_layernorm(hf_config) -> bool:
    return of(hf_config).qk_layernorm(hf_config)


def shared_expert_width(hf_config) -> int:
    return of(hf_config).shared_expert_width(hf_config)


def qkv_bias(hf_config) -> bool:
    return of(hf_config).qkv_bias(hf_config)


def head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
