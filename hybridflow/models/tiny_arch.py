"""Tiny random-init models of the other supported architectures (Qwen3, Mistral, Qwen3-MoE, Qwen2-MoE, GLM-4.5,
gpt-oss, DeepSeek-V3 and Moonlight), saved
as HF folders: what conversion, resharding and ``check-model`` are tested on, and the MoE quickstart's model."""

from __future__ import annotations

from pathlib import Path

from hybridflow.models.char_tokenizer import build_char_tokenizer
from hybridflow.models.tiny_qwen2 import padded_vocab, save_random_model, special_tokens

ARCHS = ("qwen3", "mistral", "qwen3_moe", "qwen2_moe", "glm4_moe", "gpt_oss", "deepseek_v3", "moonlight")


def build_tiny(out_dir: str | Path, tokenizer, arch: str, *, hidden_size: int = 64, num_layers: int = 2,
               num_heads: int = 4, num_kv_heads: int = 2, head_dim: int | None = None, intermediate_size: int = 128,
               num_experts: int = 8, top_k: int = 2, moe_intermediate_size: int = 64,
               max_position_embeddings: int = 64, vocab_multiple: int = 16, seed: int = 0,
               tie_word_embeddings: bool = False, norm_noise: float = 0.1, sliding_window: int | None = None):
    """Write config + safetensors weights of a random-init ``arch`` model; returns the model. Qwen3 (-MoE) get
    an explicit ``head_dim`` different from hidden/heads when none is given (as Qwen3's own configs), and
    every norm weight gets ``norm_noise`` so that a swapped or missing norm changes the logits (and GLM-4.5's
    expert bias a tenth of it: a lost bias changes the routing). ``sliding_window``: Mistral's, on every layer
    (None: full attention). GLM-4.5: its first layer dense, q/k norms, half-rotary heads, a shared expert and a
    routed_scaling_factor of 2.5 (one expert group, as GLM-4.5's own configs). gpt-oss: head_dim 64 (vLLM-CPU's
    smallest for sinks), a window of 4 on every other layer, YaRN, and ``norm_noise`` on every bias and sink
    (transformers starts the expert biases at zero, where a lost one would not show). DeepSeek-V3: multi-latent
    attention with the one latent width vLLM-CPU's MLA runs (kv_lora_rank 512 + qk_rope_head_dim 64), a q latent,
    YaRN with mscale and mscale_all_dim (as DeepSeek-V3's own), GLM-4.5's MoE in two expert groups (one where top_k
    is odd); Moonlight: the same without a q latent or YaRN."""
    import torch
    import transformers

    common = dict(vocab_size=padded_vocab(tokenizer, vocab_multiple), hidden_size=hidden_size,
                  intermediate_size=intermediate_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
                  rms_norm_eps=1e-6, tie_word_embeddings=tie_word_embeddings, torch_dtype="float32",
                  **special_tokens(tokenizer))
    head = head_dim or 2 * hidden_size // num_heads  # Qwen3's and GLM-4.5's own
    config, cls = _arch_config(arch, common, head, num_experts, top_k, moe_intermediate_size, sliding_window)
    config.architectures = [cls]
    model_cls = getattr(transformers, cls)

    def with_noisy_norms(cfg):
        return _noisy(model_cls(cfg), torch.Generator().manual_seed(seed + 1), norm_noise, biases=arch == "gpt_oss")

    return save_random_model(with_noisy_norms, config, out_dir, tokenizer, seed)


def _arch_config(arch: str, common: dict, head_dim: int, num_experts: int, top_k: int, moe_intermediate_size: int,
                 sliding_window: int | None):
    """(transformers config, architecture) of a tiny ``arch`` (build_tiny's docstring)."""
    import transformers

    moe = dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_intermediate_size)
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=head_dim, **common), "Qwen3ForCausalLM"
    if arch == "mistral":
        return transformers.MistralConfig(sliding_window=sliding_window, **common), "MistralForCausalLM"
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(head_dim=head_dim, norm_topk_prob=True, **moe, **common), "Qwen3MoeForCausalLM"
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(shared_expert_intermediate_size=common["intermediate_size"],
                                           norm_topk_prob=False, use_sliding_window=False, **moe,
                                           **common), "Qwen2MoeForCausalLM"
    if arch == "glm4_moe":
        return transformers.Glm4MoeConfig(
            head_dim=head_dim, n_routed_experts=num_experts, num_experts_per_tok=top_k,
            moe_intermediate_size=moe_intermediate_size, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
            topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True,
            partial_rotary_factor=0.5, **common), "Glm4MoeForCausalLM"
    if arch == "gpt_oss":
        return transformers.GptOssConfig(
            **{**common, "intermediate_size": moe_intermediate_size}, head_dim=head_dim if head_dim >= 64 else 64,
            num_local_experts=num_experts, num_experts_per_tok=top_k, sliding_window=sliding_window or 4), "GptOssForCausalLM"
    if arch in ("deepseek_v3", "moonlight"):
        return _latent_config(arch, common, num_experts, top_k, moe_intermediate_size), "DeepseekV3ForCausalLM"
    raise ValueError(f"unknown tiny architecture {arch!r} (known: {', '.join(ARCHS)})")


def _latent_config(arch: str, common: dict, num_experts: int, top_k: int, moe_intermediate_size: int):
    import transformers

    theta = 10000.0
    # DeepSeek-V3's group-limited routing where megatron ranks the groups as transformers does (top 2 of each)
    groups = 2 if arch == "deepseek_v3" and top_k % 2 == 0 else 1
    rope = (dict(rope_type="yarn", rope_theta=theta, factor=4.0, original_max_position_embeddings=16, mscale=1.0,
                 mscale_all_dim=1.0) if arch == "deepseek_v3" else dict(rope_type="default", rope_theta=theta))
    return transformers.DeepseekV3Config(
        **{**common, "num_key_value_heads": common["num_attention_heads"]}, n_routed_experts=num_experts,
        num_experts_per_tok=top_k, moe_intermediate_size=moe_intermediate_size, n_shared_experts=1,
        first_k_dense_replace=1, n_group=groups, topk_group=max(top_k // 2, 1), norm_topk_prob=True,
        routed_scaling_factor=2.5, q_lora_rank=32 if arch == "deepseek_v3" else None, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=16, v_head_dim=16, rope_parameters=rope, rope_interleave=True,
        num_nextn_predict_layers=0, scoring_func="sigmoid", topk_method="noaux_tc")  # as DeepSeek-V3's config.json


def _noisy(model, g, norm_noise: float, biases: bool = False):
    """``model`` with ``norm_noise`` added to every norm weight (``biases``: every bias and sink too) and a tenth of
    it to every expert bias."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or (biases and (name.endswith("bias") or name.endswith("sinks"))):
                p.add_(norm_noise * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(norm_noise / 10 * torch.randn(b.shape, generator=g))
    return model


def build_tiny_folders(root: str | Path, archs, seed: int = 0) -> str:
    """One tiny model per architecture in ``root/<arch>`` (each with its own char tokenizer, seeds seed,
    seed + 1, ...); returns ``root`` as a string."""
    for i, arch in enumerate(archs):
        build_tiny(Path(root) / arch, build_char_tokenizer(Path(root) / arch), arch, seed=seed + i)
    return str(root)
