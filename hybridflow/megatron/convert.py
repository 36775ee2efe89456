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
from hybridflow.families import weights
from hybridflow.families.weights import Split
from hybridflow.megatron import lora
from hybridflow.megatron.hf_weights import tp_chunk
from hybridflow.plan.stages import StageSplit


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
    cp_rank: int = 0  # context parallel: the same weights on every CP rank, as on data-parallel ranks
    cp_size: int = 1
    vpp_size: int = 1  # virtual pipeline stages: the stage's layers in that many chunks (megatron/virtual_stages.py)
    # uneven stages: megatron's num_layers_in_first/last_pipeline_stage (None: the even split)
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    @property
    def expert_tp(self) -> tuple[int, int]:
        """(rank, size) in the expert-tensor-parallel group."""
        if self.etp_size is None:
            return self.tp_rank, self.tp_size
        return self.etp_rank, self.etp_size

    def expert_range(self, num_experts: int) -> range:
        per_rank = num_experts // self.ep_size
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)

    def layers(self, num_layers: int) -> list[int]:
        """The global index of each of this stage's layers, in local order (``decoder.layers.{local}``)."""
        return self.stages.layers(num_layers, self.pp_rank)

    @property
    def stages(self) -> StageSplit:
        return StageSplit(self.pp_size, self.vpp_size, self.first_stage_layers, self.last_stage_layers)

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


def is_expert_param(name: str) -> bool:
    """A routed expert's weight: sharded over the expert-parallel and expert-TP groups, not TP/DP."""
    return weights.is_expert(name)


def weight_to_megatron(weight: weights.Weight, src: str, part, cfg, tp_size: int) -> torch.Tensor:
    """One megatron tensor (this rank's TP chunk) from its HF tensors under layer prefix ``src``."""
    if weight.hf_form is not None:  # the checkpoint's TP block of it, in megatron's form
        dim = weight.hf_form.hf_dim(weight.split) if weight.split.dim is not None else None
        return weight.hf_form.to_megatron(part(src + weight.hf[0], dim))
    if weight.split is Split.QKV:
        return fuse_qkv(*(part(src + h, 0) for h in weight.hf), cfg, tp_size)
    if weight.split is Split.GATED:  # [gate_r; up_r]
        return torch.cat([part(src + h, 0) for h in weight.hf], dim=0)
    return part(src + weight.hf[0], weight.split.dim)


def weight_to_hf(weight: weights.Weight, tensor: torch.Tensor, dst: str, cfg, tp_size: int) -> dict:
    """The HF tensors of one TP-gathered megatron tensor, under layer prefix ``dst``. A gathered linear_fc1
    is ``tp_size`` concatenated [gate_r; up_r] blocks."""
    if weight.hf_form is not None:
        if weight.split is Split.GATED:  # the blocks back to [gate; up]
            tensor = torch.cat(_gate_and_up(tensor, tp_size))
        return {dst + weight.hf[0]: weight.hf_form.to_hf(tensor).contiguous()}
    if weight.split is Split.QKV:
        return {dst + h: t for h, t in zip(weight.hf, split_qkv(tensor, cfg))}
    if weight.split is Split.GATED:
        return {dst + h: t for h, t in zip(weight.hf, _gate_and_up(tensor, tp_size))}
    return {dst + weight.hf[0]: tensor}


def _gate_and_up(tensor: torch.Tensor, tp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) of a TP-gathered linear_fc1: ``tp_size`` concatenated [gate_r; up_r] blocks."""
    blocks = [torch.chunk(b, 2, dim=0) for b in torch.chunk(tensor, tp_size, dim=0)]
    return torch.cat([g for g, _ in blocks]), torch.cat([u for _, u in blocks])


def hf_to_megatron(hf_sd: Mapping, cfg, shard: Shard = Shard(), *, value_head: bool = False) -> dict:
    """This rank's megatron state dict (local layer numbering) from a HF state dict: a dict of full
    tensors, or an ``HFWeights`` from which only this rank's stage and TP chunks are read. Which tensors a
    layer has is the model family's declaration (hybridflow/families)."""
    family = families.of(cfg)
    tie = bool(getattr(cfg, "tie_word_embeddings", False))

    def part(name: str, dim: int | None) -> torch.Tensor:
        return tp_chunk(hf_sd, name, dim, shard.tp_size, shard.tp_rank)

    etp_rank, etp_size = shard.expert_tp

    def expert_part(name: str, dim: int | None) -> torch.Tensor:
        return tp_chunk(hf_sd, name, dim, etp_size, etp_rank)

    out = {}
    if shard.first_stage:
        out[weights.EMBEDDING.megatron] = part(weights.EMBEDDING.hf[0], 0)
    held = list(enumerate(shard.expert_range(family.num_experts(cfg))))
    for local, layer in enumerate(shard.layers(cfg.num_hidden_layers)):
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{local}."
        for w in family.layer_weights(cfg, layer):
            out[dst + w.megatron] = weight_to_megatron(w, src, part, cfg, shard.tp_size)
        for w in family.layer_experts(cfg, layer, held):
            out[dst + w.megatron] = weight_to_megatron(w, src, expert_part, cfg, etp_size)
    if shard.last_stage:
        out[weights.FINAL_NORM.megatron] = part(weights.FINAL_NORM.hf[0], None)
        if value_head:
            if weights.VALUE_HEAD.hf[0] in hf_sd:  # a critic checkpoint: keep its trained head
                out[weights.VALUE_HEAD.megatron] = part(weights.VALUE_HEAD.hf[0], None)
        elif tie:
            if not shard.first_stage:  # megatron keeps a copy of the tied embedding on the last stage
                out[weights.LM_HEAD.megatron] = part(weights.EMBEDDING.hf[0], 0)
        else:
            out[weights.LM_HEAD.megatron] = part(weights.LM_HEAD.hf[0], 0)
    return out


@functools.lru_cache(maxsize=1)
def _te_norm_renames() -> tuple[tuple[str, str], ...]:
    """(local-spec prefix, Transformer Engine prefix) inside a decoder layer. TE's spec fuses each norm
    into the linear layer after it (``self_attention.linear_qkv.layer_norm_weight``,
    ``mlp.linear_fc1.layer_norm_weight``); megatron-core records this map in its local spec
    (gpt_layer_specs.get_gpt_layer_local_spec, ``sharded_state_dict_keys_map``), so we read it there."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    # MLA's latent norms: TE's spec fuses them into the up-projections (get_gpt_layer_with_transformer_engine_spec:
    # column_parallel_layer_norm_linear, q_layernorm/kv_layernorm IdentityOp), which its local spec does not record
    latent = (("self_attention.q_layernorm.", "self_attention.linear_q_up_proj.layer_norm_"),
              ("self_attention.kv_layernorm.", "self_attention.linear_kv_up_proj.layer_norm_"))
    return tuple(get_gpt_layer_local_spec(normalization="RMSNorm").submodules.sharded_state_dict_keys_map.items()) + latent


_LAYER = re.compile(r"^((?:.*\.)?decoder\.layers\.\d+\.)(.*)$")


def _rename(name: str, pairs) -> str:
    m = _LAYER.match(name)
    if m:
        for old, new in pairs:
            if m[2].startswith(old):
                return m[1] + new + m[2][len(old):]
    return name


# Grouped-GEMM experts (moe_grouped_gemm) under the names of SequentialMLP's, each expert's [out, in] weight:
# TE's TEGroupedMLP keeps one such weight per local expert (``experts.linear_fc1.weight{i}``: a rename), megatron's
# GroupedMLP one tensor per projection (``experts.weight1`` [h, E x fc1 out], read as [E, h, out];
# ``experts.weight2`` [E x fc2 in, h], read as [E, in, h]: experts.py GroupedMLP.forward): expert i's weight is a
# transposed slice of it.
_TE_GROUPED = re.compile(r"^(.*\bmlp\.experts\.)linear_fc([12])\.weight(\d+)$")
# TE's fp8 metadata, not weights; a grouped linear keeps one per GEMM (``_extra_state{i}``: megatron-core 0.16
# extensions/transformer_engine.py TEGroupedLinear)
_EXTRA_STATE = re.compile(r"_extra_state\d*$")
_SEQUENTIAL = re.compile(r"^(.*\bmlp\.experts\.)local_experts\.(\d+)\.linear_fc([12])\.weight$")


def canonical_names(sd: dict) -> dict:
    """A megatron state dict in the local spec's names (what conversion and resharding work in), whichever
    spec built the model (TE's grouped experts as SequentialMLP's); TE's ``_extra_state`` entries (fp8
    metadata, not weights) are dropped. Megatron's GroupedMLP tensors pass unchanged (``local_state_dict``)."""
    inverse = tuple((new, old) for old, new in _te_norm_renames())
    out = {}
    for k, v in sd.items():
        if _EXTRA_STATE.search(k):
            continue
        m = _TE_GROUPED.match(k)
        out[f"{m[1]}local_experts.{m[3]}.linear_fc{m[2]}.weight" if m else _rename(k, inverse)] = v
    return out


def uses_te_names(model_keys) -> bool:
    return any(new in k for k in model_keys for _, new in _te_norm_renames())


def model_names(sd: dict, model_keys) -> dict:
    """Local-spec names -> the names of the model at hand (TE's when it was built with the TE spec). A name
    is renamed only where the model has the renamed one: TE's MoE layers keep a separate
    ``pre_mlp_layernorm`` (no fused fc1 to hold it)."""
    keys = set(model_keys)
    if not uses_te_names(keys):
        return sd
    renamed = {}
    for k in sd:
        m = _SEQUENTIAL.match(k)
        renamed[k] = f"{m[1]}linear_fc{m[3]}.weight{m[2]}" if m else _rename(k, _te_norm_renames())
    return {(renamed[k] if renamed[k] in keys else k): v for k, v in sd.items()}


def grouped_expert_views(module: torch.nn.Module) -> dict:
    """{SequentialMLP name: view} of the experts of megatron's GroupedMLP layers in ``module`` (none without):
    expert i's fc1 [out, h] and fc2 [h, in] weights, as transposed slices of the grouped tensors."""
    views = {}
    for prefix, m in module.named_modules():
        if type(m).__name__ != "GroupedMLP":
            continue
        n, h = m.num_local_experts, m.config.hidden_size
        w1, w2 = m.weight1.view(n, h, -1), m.weight2.view(n, -1, h)
        for i in range(n):
            views[f"{prefix}.local_experts.{i}.linear_fc1.weight"] = w1[i].t()
            views[f"{prefix}.local_experts.{i}.linear_fc2.weight"] = w2[i].t()
    return views


def local_state_dict(module: torch.nn.Module) -> dict:
    """This rank's parameters of a megatron GPTModel, detached, in the local spec's names (grouped experts
    as SequentialMLP's: copies for megatron's GroupedMLP, whose experts are transposed slices); with LoRA the
    adapted weights merged (megatron/lora.py)."""
    sd = canonical_names(lora.merged(module, module.state_dict()))
    grouped = grouped_expert_views(module)
    if grouped:
        sd = {k: v for k, v in sd.items() if not re.search(r"\bmlp\.experts\.weight[12]$", k)}
        # copies while the storage is there; an offloaded parameter (storage freed) gives its shape only
        sd.update({k: v.contiguous() if v.untyped_storage().size() else v for k, v in grouped.items()})
    return {k: v.detach() for k, v in sd.items()}


def load_into(model: torch.nn.Module, local_sd: dict) -> None:
    """Copy a converted state dict (local-spec names) into the model, whichever spec built it, failing on
    any parameter left unset or unknown. Tensors are copied onto the model's device and dtype."""
    own = {k: v for k, v in model.state_dict().items() if not _EXTRA_STATE.search(k) and not lora.is_adapter(k)}
    grouped = grouped_expert_views(model)
    if grouped:  # each expert's weight lands in its slice of the grouped tensor
        own = {**{k: v for k, v in own.items() if not re.search(r"\bmlp\.experts\.weight[12]$", k)}, **grouped}
    copy_checked(own, model_names(local_sd, own), "weight conversion", optional={"output_layer.weight"})


def copy_checked(own: dict, new: dict, what: str, optional=frozenset()) -> None:
    """Copy ``new``'s tensors into the model's ``own`` (same names; ``optional`` ones may be missing), failing in
    one line on a name left unset or unknown, or on a shape that differs."""
    missing = sorted(set(own) - set(new) - set(optional))
    unknown = sorted(set(new) - set(own))
    if missing or unknown:
        raise KeyError(f"{what} mismatch: missing {missing[:5]}, unexpected {unknown[:5]}")
    with torch.no_grad():
        for k, v in new.items():
            if own[k].shape != v.shape:
                raise ValueError(f"{what}: {k} has shape {tuple(v.shape)}, the model's {tuple(own[k].shape)}")
            own[k].copy_(v)


def megatron_to_hf(full_sd: dict, cfg, shard: Shard, *, value_head: bool = False) -> dict:
    """HF tensors for the layers of one pipeline stage, from that stage's TP-gathered megatron tensors.

    ``full_sd`` holds full (unsharded along TP) tensors, experts under their global index; for linear_fc1
    the gather is expected to have concatenated per-rank [gate_r; up_r] blocks, which is undone here. A
    subset of the layers converts too (streamed export); a tensor the family does not declare is refused.
    """
    family = families.of(cfg)
    out, used = {}, set()
    for local, layer in enumerate(shard.layers(cfg.num_hidden_layers)):
        src, dst = f"decoder.layers.{local}.", f"model.layers.{layer}."
        for w, tp in ([(w, shard.tp_size) for w in family.layer_weights(cfg, layer)]
                      + [(w, shard.expert_tp[1]) for w in family.layer_experts(cfg, layer)]):
            if src + w.megatron in full_sd:
                out.update(weight_to_hf(w, full_sd[src + w.megatron], dst, cfg, tp))
                used.add(src + w.megatron)
    if weights.EMBEDDING.megatron in full_sd:
        out.update(weight_to_hf(weights.EMBEDDING, full_sd[weights.EMBEDDING.megatron], "", cfg, 1))
    if weights.FINAL_NORM.megatron in full_sd:
        out.update(weight_to_hf(weights.FINAL_NORM, full_sd[weights.FINAL_NORM.megatron], "", cfg, 1))
        # A tied policy's last-stage output layer is megatron's copy of the embedding: not exported.
        tied = not value_head and getattr(cfg, "tie_word_embeddings", False)
        if weights.LM_HEAD.megatron in full_sd and not tied:
            head = weights.VALUE_HEAD if value_head else weights.LM_HEAD
            out.update(weight_to_hf(head, full_sd[head.megatron], "", cfg, 1))
    unknown = sorted(k for k in full_sd if k.startswith("decoder.layers.") and k not in used)
    if unknown:
        raise KeyError(f"{family.architecture} declares no weight {unknown[0]} (hybridflow/families)")
    return out


def tp_split_dim(name: str, value_head: bool = False) -> int | None:
    """The dim TP splits a megatron parameter along (local-spec names; None: replicated); for experts the
    dim split over the expert-TP group (is_expert_param)."""
    if name.endswith("layer_norm_weight"):  # TE's norms fused into the next linear: replicated
        return None
    if value_head and name == weights.VALUE_HEAD.megatron:
        return None
    return weights.megatron_weight(name).split.dim
