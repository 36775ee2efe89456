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
    HEADS = "heads"  # dim 0 in blocks of whole heads (gpt-oss's sinks, MLA's up-projections)

    @property
    def dim(self) -> int | None:
        """The dim TP splits (megatron's and vLLM's shards alike)."""
        return None if self is Split.REPLICATED else (1 if self is Split.ROW else 0)


class HFForm(enum.Enum):
    """How a checkpoint holds a weight that megatron holds otherwise (gpt-oss's experts, one expert's slice of the
    fused [experts, ...] tensors: modeling_gpt_oss.GptOssExperts computes ``x @ gate_up_proj[e]`` with gate and up
    interleaved, ``gate_up[..., ::2], gate_up[..., 1::2]``). megatron's form is [gate; up] rows of [out, in]
    weights; vLLM's gpt-oss loader takes the checkpoint's form (models/gpt_oss.py GptOssRoutedExperts
    ``_load_unquantized_expert``: rank k narrows the checkpoint's TP dim, ``hf_dim``, then transposes)."""

    INTERLEAVED_T = "interleaved_t"  # [in, 2 x out], gate/up columns interleaved (gate_up_proj)
    INTERLEAVED = "interleaved"  # [2 x out], gate/up interleaved (gate_up_proj_bias)
    TRANSPOSED = "transposed"  # [in, out] (down_proj)

    def hf_dim(self, split: Split) -> int:
        """The checkpoint tensor's dim that the megatron split ``split`` cuts (a TP shard is a block of it)."""
        return {HFForm.INTERLEAVED_T: 1, HFForm.INTERLEAVED: 0}.get(self, 1 - split.dim)

    def to_hf(self, t):
        """megatron's form -> the checkpoint's; a GATED tensor is [gate; up] (whole or one TP shard)."""
        if self is HFForm.TRANSPOSED:
            return t.t()
        gate, up = t.chunk(2)
        fused = _torch().stack((gate, up), dim=1).flatten(0, 1)  # row 2i: gate i, row 2i+1: up i
        return fused.t() if self is HFForm.INTERLEAVED_T else fused

    def to_megatron(self, t):
        """The checkpoint's form (whole or one block along ``hf_dim``) -> megatron's."""
        if self is HFForm.TRANSPOSED:
            return t.t().contiguous()
        fused = t.t() if self is HFForm.INTERLEAVED_T else t
        return _torch().cat((fused[0::2], fused[1::2])).contiguous()


def _torch():
    import torch  # the declarations stay torch-free until a tensor is converted

    return torch


@dataclass(frozen=True)
class Weight:
    megatron: str
    hf: tuple[str, ...]  # the HF tensors it is made of, in their fused order
    vllm: str
    split: Split
    # Kept in float32 by megatron, transformers and vLLM whatever the model's dtype (the router's expert bias):
    # sent to the rollout as is, never cast to its dtype.
    float32: bool = False
    hf_form: HFForm | None = None  # where the checkpoint (and vLLM's loader) holds it otherwise than megatron

    def expert(self, local: int, global_: int) -> Weight:
        """This expert template's names for the expert at local (megatron) and global (HF, vLLM) index."""
        return Weight(self.megatron.format(e=local), tuple(h.format(e=global_) for h in self.hf),
                      self.vllm.format(e=global_), self.split, self.float32, self.hf_form)


def _same(name: str, split: Split) -> Weight:
    return Weight(name, (name,), name, split)


def _renamed(weight: Weight, megatron: str) -> Weight:
    return Weight(megatron, weight.hf, weight.vllm, weight.split, weight.float32, weight.hf_form)


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

# gpt-oss: biases on every linear, attention sinks (one logit per head, megatron's learnable softmax offset), a
# biased router named ``mlp.router``, and experts held fused over the experts in the checkpoint
# ([experts, ...] tensors, families/stacked_experts.py): expert e's names here are its slice ``mlp.experts.{e}.*``,
# which vLLM's gpt-oss loader also takes one expert at a time (GptOssRoutedExperts, ``_try_load_streamed_expert``)
OUT_BIAS = (_renamed(_same("self_attn.o_proj.bias", Split.REPLICATED), "self_attention.linear_proj.bias"),)
SINKS = (_renamed(_same("self_attn.sinks", Split.HEADS), "self_attention.core_attention.softmax_offset"),)
BIASED_ROUTER = tuple(Weight(f"mlp.router.{p}", (f"mlp.router.{p}",), f"mlp.router.{p}", Split.REPLICATED)
                      for p in ("weight", "bias"))
FUSED_EXPERT = (
    Weight("mlp.experts.local_experts.{e}.linear_fc1.weight", ("mlp.experts.{e}.gate_up_proj",),
           "mlp.experts.{e}.gate_up_proj", Split.GATED, hf_form=HFForm.INTERLEAVED_T),
    Weight("mlp.experts.local_experts.{e}.linear_fc1.bias", ("mlp.experts.{e}.gate_up_proj_bias",),
           "mlp.experts.{e}.gate_up_proj_bias", Split.GATED, hf_form=HFForm.INTERLEAVED),
    Weight("mlp.experts.local_experts.{e}.linear_fc2.weight", ("mlp.experts.{e}.down_proj",),
           "mlp.experts.{e}.down_proj", Split.ROW, hf_form=HFForm.TRANSPOSED),
    Weight("mlp.experts.local_experts.{e}.linear_fc2.bias", ("mlp.experts.{e}.down_proj_bias",),
           "mlp.experts.{e}.down_proj_bias", Split.REPLICATED))


# DeepSeek-V3's multi-latent attention (Kimi-K2, Moonlight; the probe's renames, shared/notes model-families-2026):
# q and kv are projected down to latents (whole on every rank: megatron's TE spec and ours, megatron/model.py
# layer_spec, and vLLM's fused_qkv_a_proj / kv_a_proj_with_mqa), normed, and up per head (split by heads in both).
# Without q_lora_rank (Moonlight, DeepSeek-V2-Lite) q is one projection per head.
MLA_KV = (Weight("self_attention.linear_kv_down_proj.weight", ("self_attn.kv_a_proj_with_mqa.weight",),
                 "self_attn.kv_a_proj_with_mqa.weight", Split.REPLICATED),
          Weight("self_attention.kv_layernorm.weight", ("self_attn.kv_a_layernorm.weight",),
                 "self_attn.kv_a_layernorm.weight", Split.REPLICATED),
          Weight("self_attention.linear_kv_up_proj.weight", ("self_attn.kv_b_proj.weight",), "self_attn.kv_b_proj.weight",
                 Split.HEADS),
          ATTENTION[1])
MLA_Q_LORA = (Weight("self_attention.linear_q_down_proj.weight", ("self_attn.q_a_proj.weight",),
                     "self_attn.q_a_proj.weight", Split.REPLICATED),
              Weight("self_attention.q_layernorm.weight", ("self_attn.q_a_layernorm.weight",),
                     "self_attn.q_a_layernorm.weight", Split.REPLICATED),
              Weight("self_attention.linear_q_up_proj.weight", ("self_attn.q_b_proj.weight",), "self_attn.q_b_proj.weight",
                     Split.HEADS))
MLA_Q = (Weight("self_attention.linear_q_proj.weight", ("self_attn.q_proj.weight",), "self_attn.q_proj.weight",
                Split.HEADS),)


# --- from a full name back to its declaration -------------------------------------------------------------
_MEGATRON_LAYER = re.compile(r"^(?:.*\.)?decoder\.layers\.\d+\.")
_VLLM_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"^(.*\bmlp\.experts\.)local_experts\.(\d+)\.(.*)$")
_EXPERT_INDEX = re.compile(r"\bmlp\.experts\.(local_experts\.)?(\d+)\.")

_ALL = (EMBEDDING, FINAL_NORM, LM_HEAD, *NORMS, *ATTENTION, *QKV_BIAS, *QK_NORM, *DENSE_MLP, *ROUTER,
        *SHARED_EXPERT, *SHARED_EXPERTS, *EXPERT_BIAS, *EXPERT, *OUT_BIAS, *SINKS, *BIASED_ROUTER, *FUSED_EXPERT, *MLA_KV, *MLA_Q_LORA, *MLA_Q)
# Qwen2-MoE's shared expert and DeepSeek-V3's shared experts are the same megatron weights (same split), as are the
# routers and routed experts of gpt-oss and the others, Qwen3's q norm and MLA's q-latent norm (replicated both): the
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


def layer_index(name: str) -> int | None:
    """The decoder layer a HF / vLLM name (``model.layers.{i}.``-prefixed) belongs to; None for a global one."""
    m = _VLLM_LAYER.match(name)
    return int(m[1]) if m else None


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


_FUSED_PARAMS = "gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias"
FUSED_TENSOR = re.compile(rf"^(.*\bmlp\.experts\.)({_FUSED_PARAMS})$")  # [experts, ...] (families/stacked_experts.py)
FUSED_SLICE = re.compile(rf"^(.*\bmlp\.experts\.)(\d+)\.({_FUSED_PARAMS})$")  # expert e's slice of it


def fused_name(name: str) -> str:
    """The checkpoint tensor a declared name is in: a fused expert tensor for an expert's slice of one."""
    m = FUSED_SLICE.match(name)
    return m[1] + m[3] if m else name


def is_expert(name: str) -> bool:
    """A routed expert's weight (any of its names): sharded over the expert-parallel and expert-TP groups."""
    return _EXPERT_INDEX.search(name) is not None


def local_expert(name: str) -> tuple[str, int, str] | None:
    """(``...mlp.experts.``, local index i, the rest) of a megatron expert name
    ``...mlp.experts.local_experts.{i}.{rest}``; None for any other name."""
    m = _LOCAL_EXPERT.match(name)
    return (m[1], int(m[2]), m[3]) if m else None
