"""The weights a decoder-only family is made of, each declared once with its three names (megatron-core's local
spec, the Hugging Face checkpoint's, vLLM's) and how tensor parallelism splits it. The family modules
(qwen2.py, llama.py, ...) assemble these blocks; conversion (megatron/convert.py) and resharding
(resharding/vllm_layout.py, transition.py) read the declarations instead of matching names.

Names inside a decoder layer are suffixes (megatron prefixes ``decoder.layers.{local}.``, HF and vLLM
``model.layers.{layer}.``); a routed expert's names hold ``{e}``: its local index in megatron
(``mlp.experts.local_experts.{e}.``), its global index in HF and vLLM (``mlp.experts.{e}.``).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class Split(enum.Enum):
    """How a weight is cut over tensor-parallel ranks, in megatron and in vLLM alike."""

    REPLICATED = None  # norms, the router, the shared expert's gate: whole on every rank
    ROW = 1  # row-parallel (linear_proj, linear_fc2 / o_proj, down_proj): the input dim
    VOCAB = 0  # embedding and output rows
    QKV = "qkv"  # fused [q heads; k heads; v heads] of each rank's query groups (HF: q_proj, k_proj, v_proj)
    GATED = "gated"  # fused [gate rows; up rows] of each rank (HF: gate_proj, up_proj)

    @property
    def dim(self) -> int | None:
        """The dim TP splits (megatron's and vLLM's shards alike)."""
        return None if self is Split.REPLICATED else (1 if self is Split.ROW else 0)


@dataclass(frozen=True)
class Weight:
    megatron: str
    hf: tuple[str, ...]  # the HF tensors it is made of, in their fused order
    vllm: str
    split: Split
    # Kept in float32 by megatron, transformers and vLLM whatever the model's dtype (the router's expert bias):
    # sent to the rollout as is, never cast to its dtype.
    float32: bool = False

    def expert(self, local: int, global_: int) -> Weight:
        """This expert template's names for the expert at local (megatron) and global (HF, vLLM) index."""
        return Weight(self.megatron.format(e=local), tuple(h.format(e=global_) for h in self.hf),
                      self.vllm.format(e=global_), self.split, self.float32)


def _same(name: str, split: Split) -> Weight:
    return Weight(name, (name,), name, split)


def gated_mlp(megatron: str, hf: str) -> tuple[Weight, ...]:
    """A SwiGLU MLP: megatron's linear_fc1 = [gate; up] and linear_fc2 = down, under the given prefixes."""
    return (Weight(megatron + "linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight"),
                   hf + "gate_up_proj.weight", Split.GATED),
            Weight(megatron + "linear_fc2.weight", (hf + "down_proj.weight",), hf + "down_proj.weight", Split.ROW))


# --- the blocks families are assembled from ---------------------------------------------------------------
EMBEDDING = Weight("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "model.embed_tokens.weight",
                   Split.VOCAB)
FINAL_NORM = Weight("decoder.final_layernorm.weight", ("model.norm.weight",), "model.norm.weight", Split.REPLICATED)
LM_HEAD = Weight("output_layer.weight", ("lm_head.weight",), "lm_head.weight", Split.VOCAB)
VALUE_HEAD = Weight("output_layer.weight", ("score.weight",), "score.weight", Split.REPLICATED)  # a critic's

NORMS = (_same("input_layernorm.weight", Split.REPLICATED),
         Weight("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), "post_attention_layernorm.weight",
                Split.REPLICATED))
ATTENTION = (Weight("self_attention.linear_qkv.weight", tuple(f"self_attn.{p}_proj.weight" for p in "qkv"),
                    "self_attn.qkv_proj.weight", Split.QKV),
             Weight("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), "self_attn.o_proj.weight",
                    Split.ROW))
QKV_BIAS = (Weight("self_attention.linear_qkv.bias", tuple(f"self_attn.{p}_proj.bias" for p in "qkv"),
                   "self_attn.qkv_proj.bias", Split.QKV),)
QK_NORM = tuple(Weight(f"self_attention.{p}_layernorm.weight", (f"self_attn.{p}_norm.weight",),
                       f"self_attn.{p}_norm.weight", Split.REPLICATED) for p in "qk")  # Qwen3's per-head norms
DENSE_MLP = gated_mlp("mlp.", "mlp.")
ROUTER = (Weight("mlp.router.weight", ("mlp.gate.weight",), "mlp.gate.weight", Split.REPLICATED),)
SHARED_EXPERT = (*gated_mlp("mlp.shared_experts.", "mlp.shared_expert."),  # Qwen2-MoE's, with its sigmoid gate
                 Weight("mlp.shared_experts.gate_weight", ("mlp.shared_expert_gate.weight",),
                        "mlp.shared_expert_gate.weight", Split.REPLICATED))
# DeepSeek-V3's and GLM-4.5's shared experts (HF: plural), n_shared_experts x moe_intermediate_size wide, ungated
SHARED_EXPERTS = gated_mlp("mlp.shared_experts.", "mlp.shared_experts.")
# DeepSeek-V3's aux-loss-free balancing bias: added to the sigmoid scores to choose the experts, not to weigh them;
# a float32 buffer in megatron (router.py) and transformers (e_score_correction_bias), a float32 parameter in vLLM
EXPERT_BIAS = (Weight("mlp.router.expert_bias", ("mlp.gate.e_score_correction_bias",),
                      "mlp.gate.e_score_correction_bias", Split.REPLICATED, float32=True),)
EXPERT = gated_mlp("mlp.experts.local_experts.{e}.", "mlp.experts.{e}.")


# --- from a full name back to its declaration -------------------------------------------------------------
_MEGATRON_LAYER = re.compile(r"^(?:.*\.)?decoder\.layers\.\d+\.")
_VLLM_LAYER = re.compile(r"^model\.layers\.\d+\.")
_LOCAL_EXPERT = re.compile(r"^(.*\bmlp\.experts\.)local_experts\.(\d+)\.(.*)$")
_EXPERT_INDEX = re.compile(r"\bmlp\.experts\.(local_experts\.)?(\d+)\.")

_ALL = (EMBEDDING, FINAL_NORM, LM_HEAD, *NORMS, *ATTENTION, *QKV_BIAS, *QK_NORM, *DENSE_MLP, *ROUTER,
        *SHARED_EXPERT, *SHARED_EXPERTS, *EXPERT_BIAS, *EXPERT)
# Qwen2-MoE's shared expert and DeepSeek-V3's shared experts are the same megatron weights (same split): the
# first declaration answers for the megatron name
_BY_MEGATRON = {w.megatron: w for w in reversed(_ALL)}
_BY_VLLM = {w.vllm: w for w in _ALL}
_BY_HF = {h: w for w in (*_ALL, VALUE_HEAD) for h in w.hf}


def _template(name: str, layer: re.Pattern) -> str:
    return _EXPERT_INDEX.sub(lambda m: "mlp.experts." + (m[1] or "") + "{e}.", layer.sub("", name))


def megatron_weight(name: str) -> Weight:
    """The declaration of a megatron parameter (local-spec name, any layer or expert)."""
    try:
        return _BY_MEGATRON[_template(name, _MEGATRON_LAYER)]
    except KeyError:
        raise KeyError(f"{name} is not a weight any model family declares (hybridflow/families)") from None


def vllm_weight(name: str) -> tuple[str, Weight]:
    """(layer prefix, declaration) of a vLLM parameter (``model.layers.{i}.``-prefixed or global); an expert's
    declaration carries its index, so ``prefix + hf`` are the checkpoint names it is made of."""
    layer = _VLLM_LAYER.match(name)
    prefix = layer[0] if layer else ""
    expert = _EXPERT_INDEX.search(name)
    try:
        weight = _BY_VLLM[_template(name, _VLLM_LAYER)]
    except KeyError:
        raise KeyError(f"{name} is not a weight any model family declares (hybridflow/families)") from None
    if expert:
        weight = weight.expert(int(expert[2]), int(expert[2]))
    return prefix, weight


def keeps_float32(vllm_name: str) -> bool:
    """A vLLM parameter declared float32 (Weight.float32): sent as is, never cast to the rollout's dtype."""
    weight = _BY_VLLM.get(_template(vllm_name, _VLLM_LAYER))
    return bool(weight and weight.float32)


def hf_weight(name: str) -> Weight:
    """The declaration a HF checkpoint tensor belongs to (its fused megatron/vLLM weight, for the fused ones)."""
    try:
        return _BY_HF[_template(name, _VLLM_LAYER)]
    except KeyError:
        raise KeyError(f"{name} is not a weight any model family declares (hybridflow/families)") from None


def is_expert(name: str) -> bool:
    """A routed expert's weight (any of its names): sharded over the expert-parallel and expert-TP groups."""
    return _EXPERT_INDEX.search(name) is not None


def local_expert(name: str) -> tuple[str, int, str] | None:
    """(``...mlp.experts.``, local index i, the rest) of a megatron expert name
    ``...mlp.experts.local_experts.{i}.{rest}``; None for any other name."""
    m = _LOCAL_EXPERT.match(name)
    return (m[1], int(m[2]), m[3]) if m else None
