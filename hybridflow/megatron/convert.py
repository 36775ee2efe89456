"""Hugging Face (Qwen2/Llama) <-> megatron-core weight conversion with tensor/pipeline sharding.

Layout facts (checked against HF logits): megatron's fused ``linear_qkv`` is ordered per query group g as
[the q heads of g, k_g, v_g]; ``linear_fc1`` is [gate; up] per TP rank; row-parallel layers
(``linear_proj``, ``linear_fc2``) split the input dim, column-parallel ones the output dim.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hybridflow.megatron.hf_weights import tp_chunk


@dataclass(frozen=True)
class Shard:
    """Where this rank sits: tensor-parallel rank/size and pipeline stage/size."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

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
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight", 1),
}


def hf_to_megatron(hf_sd: Mapping, cfg, shard: Shard = Shard(), *, value_head: bool = False) -> dict:
    """This rank's megatron state dict (local layer numbering) from a HF state dict: a dict of full
    tensors, or an ``HFWeights`` from which only this rank's stage and TP chunks are read."""
    out = {}
    tie = bool(getattr(cfg, "tie_word_embeddings", False))

    def part(name: str, dim: int | None) -> torch.Tensor:
        return tp_chunk(hf_sd, name, dim, shard.tp_size, shard.tp_rank)

    if shard.first_stage:
        out["embedding.word_embeddings.weight"] = part("model.embed_tokens.weight", 0)
    for local, layer in enumerate(shard.layer_range(cfg.num_hidden_layers)):
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{local}."
        for mkey, (hkey, dim) in _LAYER_SIMPLE.items():
            out[dst + mkey] = part(src + hkey, dim)
        for kind in ("weight", "bias"):
            if src + f"self_attn.q_proj.{kind}" not in hf_sd:
                continue
            qkv = [part(src + f"self_attn.{p}_proj.{kind}", 0) for p in "qkv"]
            out[dst + f"self_attention.linear_qkv.{kind}"] = fuse_qkv(*qkv, cfg, shard.tp_size)
        gate, up = part(src + "mlp.gate_proj.weight", 0), part(src + "mlp.up_proj.weight", 0)
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
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
    """Local-spec names -> the names of the model at hand (TE's when it was built with the TE spec)."""
    if not uses_te_names(model_keys):
        return sd
    return {_rename(k, _te_norm_renames()): v for k, v in sd.items()}


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
        if src + "mlp.linear_fc1.weight" not in full_sd:  # converting a subset of the layers (streamed export)
            continue
        for mkey, (hkey, _) in _LAYER_SIMPLE.items():
            out[dst + hkey] = full_sd[src + mkey]
        for kind in ("weight", "bias"):
            key = src + f"self_attention.linear_qkv.{kind}"
            if key in full_sd:
                for p, t in zip("qkv", split_qkv(full_sd[key], cfg)):
                    out[dst + f"self_attn.{p}_proj.{kind}"] = t
        blocks = [torch.chunk(b, 2, dim=0) for b in torch.chunk(full_sd[src + "mlp.linear_fc1.weight"], tp, dim=0)]
        out[dst + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in blocks], dim=0)
        out[dst + "mlp.up_proj.weight"] = torch.cat([u for _, u in blocks], dim=0)
    if "decoder.final_layernorm.weight" in full_sd:
        out["model.norm.weight"] = full_sd["decoder.final_layernorm.weight"]
        # A tied policy's last-stage output layer is megatron's copy of the embedding: not exported.
        tied = not value_head and getattr(cfg, "tie_word_embeddings", False)
        if "output_layer.weight" in full_sd and not tied:
            out["score.weight" if value_head else "lm_head.weight"] = full_sd["output_layer.weight"]
    return out


# TP split dim of each megatron param (by suffix, local-spec names); None = replicated across TP.
def tp_split_dim(name: str, value_head: bool = False) -> int | None:
    if name.endswith(("layernorm.weight", "layer_norm_weight")):
        return None
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    if name == "output_layer.weight" and value_head:
        return None
    return 0
