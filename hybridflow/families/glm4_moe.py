"""GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM; GLM-4.5-Air): GQA attention with q/k/v biases (attention_bias), per-head
q/k norms where use_qk_norm, RoPE on the first partial_rotary_factor of each head; the first
first_k_dense_replace layers dense, the rest DeepSeek-V3's MoE: a sigmoid router with an expert bias
(aux-loss-free balancing), group-limited top-k, the chosen scores renormalized and scaled by
routed_scaling_factor, and n_shared_experts ungated shared experts."""

from hybridflow.families import weights as w
from hybridflow.families.family import Family

FAMILY = Family("Glm4MoeForCausalLM", "glm4_moe", attention=w.NORMS + w.ATTENTION,
                sparse_mlp=w.ROUTER + w.EXPERT_BIAS + w.SHARED_EXPERTS, expert=w.EXPERT,
                qkv_bias_if="attention_bias", qk_norm_if="use_qk_norm")
