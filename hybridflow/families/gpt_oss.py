"""gpt-oss (GptOssForCausalLM: gpt-oss-20b, gpt-oss-120b): GQA attention with biases on every projection and a
learned sink logit per head (``sinks``: a softmax over the keys and the sink), a sliding window on the layers
``layer_types`` names (every other one), YaRN RoPE; every layer a MoE block: a biased router whose top-k logits
are softmaxed, experts with biases and a clamped SwiGLU (``(up + 1) * gate * sigmoid(1.702 gate)``, gate and up
clamped at ``swiglu_limit``), held fused over the experts in the checkpoint (families/stacked_experts.py)."""

from hybridflow.families import weights as w
from hybridflow.families.family import Family

FAMILY = Family("GptOssForCausalLM", "gpt_oss",
                attention=w.NORMS + w.ATTENTION + w.QKV_BIAS + w.OUT_BIAS + w.SINKS,
                sparse_mlp=w.BIASED_ROUTER, expert=w.FUSED_EXPERT, experts_fused=True, layer_windows=True,
                yarn=True, clamped_swiglu=True, norm_topk_by_default=True, sliding_window_by_default=True)
