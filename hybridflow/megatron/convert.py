"""Hugging Face (Qwen2/Qwen3/Llama/Mistral, Qwen3-MoE/Qwen2-MoE) <-> megatron-core weight conversion with
tensor, pipeline and expert sharding.

Layout facts (checked against HF logits): megatron's fused ``linear_qkv`` is ordered per query group g as
[the q heads of g, k_g, v_g]; ``linear_fc1`` is [gate; up] per TP rank; row-parallel layers
(``linear_proj``, ``linear_fc2``) split the input dim, column-parallel ones the output dim. Qwen3's
q_norm/k_norm are megatron's ``q_layernorm``/``k_layernorm`` (per head, replicated).

MoE layers (HF checkpoint names, the per-expert form transformers writes to disk): ``mlp.gate`` is the
router (``mlp.router.weight``, replicated); expert e's gate/up/down projections are local expert
e - ep_rank*E/ep of EP rank e // (E/ep) (``mlp.experts.local_experts.{i}.linear_fc1/fc2``), split over the
expert-TP group like a dense MLP; Qwen2-MoE's shared expert is ``mlp.shared_experts.linear_fc1/fc2``
(split over TP) with its sigmoid gate ``mlp.shared_experts.gate_weight`` (replicated).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hybridflow import families
from hybridflow.megatron.hf_weights import tp_chunk


@dataclass(frozen=True)
class Shard:
    """Where this rank sits: tensor-parallel rank/size, pipeline stage/size, and for experts the
    expert-parallel rank/size and expert-tensor-parallel rank/size (None: as TP, megatron's default)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int | None = None
    etp_size: int | None = None

    @property
    def expert_tp(self) -> tuple[int, int]:
        """(rank, size) in the expert-tensor-parallel group."""
        if self.etp_size is None:
            return self.tp_rank, self.tp_size
        return self.etp_rank, self.etp_size

    def expert_range(self, num_experts: int) -> range:
        per_rank = num_experts // self.ep_size
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)

    def layer_range(self, num_layers: int) -> range:
        per_stage = num_layers // self.pp_size
        return range(self.pp_rank * per_stage, (self.pp_rank + 1) * per_stage)

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def _heads(cfg):
    nh, ng = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // nh
    return nh, ng, hd


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg, tp_size: int = 1) -> torch.Tensor:
    """HF q/k/v (weights [out, in] or biases [out]) -> megatron's per-group interleaved linear_qkv. Given
    each one's TP chunk r of ``tp_size`` (query groups [r*g/t, (r+1)*g/t) of q, k and v alike), this is
    chunk r of the fused tensor: megatron requires the query groups to divide evenly among TP ranks."""
    nh, ng, hd = _heads(cfg)
    tail = q.shape[1:]
    groups = ng // tp_size
    q = q.reshape(groups, nh // ng * hd, *tail)
    k = k.reshape(groups, hd, *tail)
    v = v.reshape(groups, hd, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of fuse_qkv for the full (TP-gathered) tensor."""
    nh, ng, hd = _heads(cfg)
    tail = qkv.shape[1:]
    grouped = qkv.reshape(ng, (nh // ng + 2) * hd, *tail)
    q, k, v = torch.split(grouped, [nh // ng * hd, hd, hd], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


# Per-layer params: megatron suffix -> (HF suffix, TP split dim or None for replicated).
_LAYER_SIMPLE = {
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", None),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", 1),
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight", None),  # Qwen3
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight", None),
    "mlp.router.weight": ("mlp.gate.weight", None),  # MoE
    "mlp.shared_experts.gate_weight": ("mlp.shared_expert_gate.weight", None),  # Qwen2-MoE
}
# Gated MLPs: megatron prefix (linear_fc1 = [gate; up], linear_fc2 = down) -> HF prefix. Experts are
# listed per layer (moe_mlps); these are the dense MLP and Qwen2-MoE's shared expert.
_DENSE_MLPS = {"mlp.": "mlp.", "mlp.shared_experts.": "mlp.shared_expert."}


def expert_prefix(local: int) -> str:
    return f"mlp.experts.local_experts.{local}."


def is_expert_param(name: str) -> bool:
    """A routed expert's weight: sharded over the expert-parallel and expert-TP groups, not TP/DP."""
    return ".mlp.experts." in name or name.startswith("mlp.experts.")


def _gated_mlp_to_megatron(part, src: str) -> dict:
    gate, up = part(src + "gate_proj.weight", 0), part(src + "up_proj.weight", 0)
    return {"linear_fc1.weight": torch.cat([gate, up], dim=0), "linear_fc2.weight": part(src + "down_proj.weight", 1)}


def _gated_mlp_to_hf(fc1: torch.Tensor, fc2: torch.Tensor, parts: int) -> dict:
    """HF gate/up/down from a gathered linear_fc1 (``parts`` concatenated [gate_r; up_r] blocks) and fc2."""
    blocks = [torch.chunk(b, 2, dim=0) for b in torch.chunk(fc1, parts, dim=0)]
    return {"gate_proj.weight": torch.cat([g for g, _ in blocks], dim=0),
            "up_proj.weight": torch.cat([u for _, u in blocks], dim=0), "down_proj.weight": fc2}


def hf_to_megatron(hf_sd: Mapping, cfg, shard: Shard = Shard(), *, value_head: bool = False) -> dict:
    """This rank's megatron state dict (local layer numbering) from a HF state dict: a dict of full
    tensors, or an ``HFWeights`` from which only this rank's stage and TP chunks are read."""
    out = {}
    tie = bool(getattr(cfg, "tie_word_embeddings", False))

    def part(name: str, dim: int | None) -> torch.Tensor:
        return tp_chunk(hf_sd, name, dim, shard.tp_size, shard.tp_rank)

    etp_rank, etp_size = shard.expert_tp

    def expert_part(name: str, dim: int) -> torch.Tensor:
        return tp_chunk(hf_sd, name, dim, etp_size, etp_rank)

    if shard.first_stage:
        out["embedding.word_embeddings.weight"] = part("model.embed_tokens.weight", 0)
    for local, layer in enumerate(shard.layer_range(cfg.num_hidden_layers)):
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{local}."
        for mkey, (hkey, dim) in _LAYER_SIMPLE.items():
            if src + hkey in hf_sd:
                out[dst + mkey] = part(src + hkey, dim)
        for kind in ("weight", "bias"):
            if src + f"self_attn.q_proj.{kind}" not in hf_sd:
                continue
            qkv = [part(src + f"self_attn.{p}_proj.{kind}", 0) for p in "qkv"]
            out[dst + f"self_attention.linear_qkv.{kind}"] = fuse_qkv(*qkv, cfg, shard.tp_size)
        for mpre, hpre in _DENSE_MLPS.items():
            if src + hpre + "gate_proj.weight" in hf_sd:
                out.update({dst + mpre + k: v for k, v in _gated_mlp_to_megatron(part, src + hpre).items()})
        if src + "mlp.gate.weight" in hf_sd:  # a MoE layer: this rank's experts
            for i, e in enumerate(shard.expert_range(cfg.num_experts)):
                mlp = _gated_mlp_to_megatron(expert_part, f"{src}mlp.experts.{e}.")
                out.update({dst + expert_prefix(i) + k: v for k, v in mlp.items()})
    if shard.last_stage:
        out["decoder.final_layernorm.weight"] = part("model.norm.weight", None)
        if value_head:
            if "score.weight" in hf_sd:  # a critic checkpoint: keep its trained head
                out["output_layer.weight"] = part("score.weight", None)
        elif tie:
            if not shard.first_stage:  # megatron keeps a copy of the tied embedding on the last stage
                out["output_layer.weight"] = part("model.embed_tokens.weight", 0)
        else:
            out["output_layer.weight"] = part("lm_head.weight", 0)
    return out


@functools.lru_cache(maxsize=1)
def _te_norm_renames() -> tuple[tuple[str, str], ...]:
    """(local-spec prefix, Transformer Engine prefix) inside a decoder layer. TE's spec fuses each norm
    into the linear layer after it (``self_attention.linear_qkv.layer_norm_weight``,
    ``mlp.linear_fc1.layer_norm_weight``); megatron-core records this map in its local spec
    (gpt_layer_specs.get_gpt_layer_local_spec, ``sharded_state_dict_keys_map``), so we read it there."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return tuple(get_gpt_layer_local_spec(normalization="RMSNorm").submodules.sharded_state_dict_keys_map.items())


_LAYER = re.compile(r"^((?:.*\.)?decoder\.layers\.\d+\.)(.*)$")


def _rename(name: str, pairs) -> str:
    m = _LAYER.match(name)
    if m:
        for old, new in pairs:
            if m[2].startswith(old):
                return m[1] + new + m[2][len(old):]
    return name


def canonical_names(sd: dict) -> dict:
    """A megatron state dict in the local spec's names (what conversion and resharding work in), whichever
    spec built the model; TE's ``_extra_state`` entries (fp8 metadata, not weights) are dropped."""
    inverse = tuple((new, old) for old, new in _te_norm_renames())
    return {_rename(k, inverse): v for k, v in sd.items() if not k.endswith("_extra_state")}


def uses_te_names(model_keys) -> bool:
    return any(new in k for k in model_keys for _, new in _te_norm_renames())


def model_names(sd: dict, model_keys) -> dict:
    """Local-spec names -> the names of the model at hand (TE's when it was built with the TE spec). A name
    is renamed only where the model has the renamed one: TE's MoE layers keep a separate
    ``pre_mlp_layernorm`` (no fused fc1 to hold it)."""
    keys = set(model_keys)
    if not uses_te_names(keys):
        return sd
    renamed = {k: _rename(k, _te_norm_renames()) for k in sd}
    return {(renamed[k] if renamed[k] in keys else k): v for k, v in sd.items()}


def local_state_dict(module: torch.nn.Module) -> dict:
    """This rank's parameters of a megatron GPTModel, detached, in the local spec's names."""
    return {k: v.detach() for k, v in canonical_names(module.state_dict()).items()}


def load_into(model: torch.nn.Module, local_sd: dict) -> None:
    """Copy a converted state dict (local-spec names) into the model, whichever spec built it, failing on
    any parameter left unset or unknown. Tensors are copied onto the model's device and dtype."""
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    local_sd = model_names(local_sd, own)
    missing = sorted(set(own) - set(local_sd) - {"output_layer.weight"})
    unknown = sorted(set(local_sd) - set(own))
    if missing or unknown:
        raise KeyError(f"weight conversion mismatch: missing {missing[:5]}, unexpected {unknown[:5]}")
    with torch.no_grad():
        for k, v in local_sd.items():
            if own[k].shape != v.shape:
                raise ValueError(f"{k}: converted shape {tuple(v.shape)} != model shape {tuple(own[k].shape)}")
            own[k].copy_(v)


def megatron_to_hf(full_sd: dict, cfg, shard: Shard, *, value_head: bool = False) -> dict:
    """HF tensors for the layers of one pipeline stage, from that stage's TP-gathered megatron tensors.

    ``full_sd`` holds full (unsharded along TP) tensors; for linear_fc1 the gather is expected to
    have concatenated per-rank [gate_r; up_r] blocks, which is undone here.
    """
    out = {}
    tp = shard.tp_size
    if "embedding.word_embeddings.weight" in full_sd:
        out["model.embed_tokens.weight"] = full_sd["embedding.word_embeddings.weight"]
    for local, layer in enumerate(shard.layer_range(cfg.num_hidden_layers)):
        src, dst = f"decoder.layers.{local}.", f"model.layers.{layer}."
        if src + "input_layernorm.weight" not in full_sd:  # converting a subset of the layers (streamed export)
            continue
        for mkey, (hkey, _) in _LAYER_SIMPLE.items():
            if src + mkey in full_sd:
                out[dst + hkey] = full_sd[src + mkey]
        for kind in ("weight", "bias"):
            key = src + f"self_attention.linear_qkv.{kind}"
            if key in full_sd:
                for p, t in zip("qkv", split_qkv(full_sd[key], cfg)):
                    out[dst + f"self_attn.{p}_proj.{kind}"] = t
        for mpre, hpre in _DENSE_MLPS.items():
            if src + mpre + "linear_fc1.weight" in full_sd:
                mlp = _gated_mlp_to_hf(full_sd[src + mpre + "linear_fc1.weight"], full_sd[src + mpre + "linear_fc2.weight"], tp)
                out.update({dst + hpre + k: v for k, v in mlp.items()})
        # Experts: full_sd holds every expert under its global index, fc1 gathered over expert TP.
        for e in range(families.num_experts(cfg)):
            fc1 = full_sd.get(src + expert_prefix(e) + "linear_fc1.weight")
            if fc1 is not None:
                mlp = _gated_mlp_to_hf(fc1, full_sd[src + expert_prefix(e) + "linear_fc2.weight"], shard.expert_tp[1])
                out.update({f"{dst}mlp.experts.{e}.{k}": v for k, v in mlp.items()})
    if "decoder.final_layernorm.weight" in full_sd:
        out["model.norm.weight"] = full_sd["decoder.final_layernorm.weight"]
        # A tied policy's last-stage output layer is megatron's copy of the embedding: not exported.
        tied = not value_head and getattr(cfg, "tie_word_embeddings", False)
        if "output_layer.weight" in full_sd and not tied:
            out["score.weight" if value_head else "lm_head.weight"] = full_sd["output_layer.weight"]
    return out


# TP split dim of each megatron param (by suffix, local-spec names); None = replicated across TP.
def tp_split_dim(name: str, value_head: bool = False) -> int | None:
    """For experts the dim split over the expert-TP group (is_expert_param)."""
    if name.endswith(("layernorm.weight", "layer_norm_weight", "router.weight", "gate_weight")):
        return None
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    if name == "output_layer.weight" and value_head:
        return None
    return 0
