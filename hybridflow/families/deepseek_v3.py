"""DeepSeek-V3 / R1 (DeepseekV3ForCausalLM), Kimi-K2 (the same architecture under model_type kimi_k2) and Moonlight:
multi-latent attention (q and kv projected down to latents, RMS-normed, projected up per head; RoPE on a separate
qk_rope_head_dim part, interleaved; without q_lora_rank one q projection, Moonlight's); the first
first_k_dense_replace layers dense, the rest the sigmoid router with an expert bias, group-limited top-k, the chosen
scores renormalized and scaled by routed_scaling_factor, and n_shared_experts ungated shared experts (GLM-4.5's MoE,
glm4_moe.py)."""

from dataclasses import replace

from hybridflow.families import weights as w
from hybridflow.families.family import Family

FAMILY = Family("DeepseekV3ForCausalLM", "deepseek_v3", attention=w.NORMS + w.MLA_Q_LORA + w.MLA_KV,
                sparse_mlp=w.ROUTER + w.EXPERT_BIAS + w.SHARED_EXPERTS, expert=w.EXPERT, yarn=True,
                router_config=(("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")))
# Kimi-K2's config.json names model_type kimi_k2 (unknown to transformers; vLLM reads it as a DeepseekV3Config:
# transformers_utils/config.py _CONFIG_REGISTRY) over the DeepseekV3ForCausalLM architecture
ALIASES = (replace(FAMILY, model_type="kimi_k2"),)
