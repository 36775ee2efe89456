"""LoRA adapters between megatron's layout (megatron/lora.py) and peft's format on the Hugging Face model.

peft keeps one adapter per HF projection, ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``
[r, in] and ``lora_B.weight`` [out, r]. A fused megatron linear (linear_qkv = q, k, v; linear_fc1 = gate, up) has one
A for all its projections (Megatron-Bridge's ``lora``) and B in the fused weight's row order, so B converts exactly
as the weight does (convert.weight_to_megatron / weight_to_hf) and A is the same under each projection. A row-parallel
linear's A converts as its weight's columns, its B is whole.
"""

from __future__ import annotations

import re

import torch

from hybridflow import device, families
from hybridflow.families.weights import Split
from hybridflow.megatron import convert, lora
from hybridflow.megatron.hf_weights import tp_chunk

PREFIX = "base_model.model."
_LIVE = re.compile(r"\.lora_([AB])\.[^.]+\.weight$")  # a live peft model's ``lora_A.<adapter name>.weight``


def peft_names(sd: dict) -> dict:
    """A peft state dict (saved or a live model's) under the saved names, adapters only."""
    out = {}
    for k, v in sd.items():
        if ".lora_" not in k:
            continue
        k = _LIVE.sub(r".lora_\1.weight", k)
        out[k if k.startswith(PREFIX) else PREFIX + k] = v
    return out


def _adapted(cfg, shard, layer: int, targets: set[str]):
    """(local prefix, family weight, TP size, TP rank) of each adapted linear of a layer held on ``shard``: the
    dense ones split over TP, the routed experts held here (their local index; expert TP 1) whole."""
    local = shard.layers(cfg.num_hidden_layers).index(layer)
    family = families.of(cfg)
    held = list(enumerate(shard.expert_range(family.num_experts(cfg))))
    weights = [(w, shard.tp_size, shard.tp_rank) for w in family.layer_weights(cfg, layer)]
    weights += [(w, 1, 0) for w in family.layer_experts(cfg, layer, held)]
    for w, tp, tp_rank in weights:
        module = w.megatron.removesuffix(".weight")
        if w.megatron.endswith(".weight") and f"decoder.layers.{local}.{module}" in targets:
            yield f"decoder.layers.{local}.{module}", w, tp, tp_rank


def from_peft(peft_sd: dict, cfg, shard, targets: set[str]) -> dict:
    """{local adapter parameter name: this rank's part} for the adapted linears ``targets`` (their module
    names, megatron/lora.adapters) from a peft state dict. A fused linear needs one A for its projections."""
    sd = peft_names(peft_sd)
    out = {}
    for layer in shard.layers(cfg.num_hidden_layers):
        for prefix, w, tp, tp_rank in _adapted(cfg, shard, layer, targets):
            src = f"model.layers.{layer}."
            a = [_get(sd, f"{PREFIX}{src}{h.removesuffix('.weight')}.lora_A.weight") for h in w.hf]
            b = {src + h: _get(sd, f"{PREFIX}{src}{h.removesuffix('.weight')}.lora_B.weight") for h in w.hf}
            if any(not torch.equal(a[0], x) for x in a[1:]):
                raise ValueError(f"LoRA adapter: {', '.join(w.hf)} of layer {layer} have different lora_A; the fused "
                                 f"{w.megatron} takes one A for all (Megatron-Bridge's lora type)")
            if w.split is Split.ROW:
                out[f"{prefix}.adapter.lora_a"] = tp_chunk({"a": a[0]}, "a", 1, tp, tp_rank)
                out[f"{prefix}.adapter.lora_b"] = next(iter(b.values()))
            else:
                part = lambda name, dim: tp_chunk(b, name, dim, tp, tp_rank)  # noqa: E731
                out[f"{prefix}.adapter.lora_a"] = a[0]
                out[f"{prefix}.adapter.lora_b"] = convert.weight_to_megatron(w, src, part, cfg, tp)
    return out


def to_peft(full: dict, cfg, shard) -> dict:
    """peft's tensors of one pipeline stage from its TP-gathered adapters ({local adapter parameter name:
    tensor}: column B gathered along its rows, row A along its columns) and the routed experts ``shard`` holds
    (peft's per-expert names, ``mlp.experts.{e}.gate_proj``, as vLLM's and transformers 4's checkpoints name them)."""
    targets = {k.rsplit(".adapter.", 1)[0] for k in full}
    out = {}
    for layer in shard.layers(cfg.num_hidden_layers):
        for prefix, w, tp, _ in _adapted(cfg, shard, layer, targets):
            dst = f"model.layers.{layer}."
            a, b = full[f"{prefix}.adapter.lora_a"], full[f"{prefix}.adapter.lora_b"]
            bs = {dst + w.hf[0]: b} if w.split is Split.ROW else convert.weight_to_hf(w, b, dst, cfg, tp)
            for name, tensor in bs.items():
                stem = PREFIX + name.removesuffix(".weight")
                out[f"{stem}.lora_A.weight"], out[f"{stem}.lora_B.weight"] = a, tensor
    return out


def gathered(module: torch.nn.Module, cfg, shard) -> dict:
    """The whole model's adapters in peft's format (``to_peft``) on every rank, for vLLM's LoRA: each split factor
    all-gathered over TP (column B along its rows, row A along its columns), then every pipeline stage's tensors
    gathered over PP (as host tensors). Data-parallel replicas hold the same adapters. Call on every rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    full = {}
    tp_group = ps.get_tensor_model_parallel_group()
    for name, p in module.named_parameters():
        if not lora.is_adapter(name):
            continue
        if getattr(p, "tensor_model_parallel", False) and shard.tp_size > 1:
            parts = [torch.empty_like(p) for _ in range(shard.tp_size)]
            dist.all_gather(parts, p.detach().contiguous(), group=tp_group)
            full[name] = torch.cat(parts, p.partition_dim)
        else:
            full[name] = p.detach()
    stage = {k: device.to_host(v) for k, v in to_peft(full, cfg, shard).items()}
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return stage
    stages = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, stage, group=ps.get_pipeline_model_parallel_group())
    return {k: v for s in stages for k, v in s.items()}


def _get(sd: dict, key: str) -> torch.Tensor:
    if key not in sd:
        raise KeyError(f"LoRA adapter: no {key}")
    return sd[key]


def load(module: torch.nn.Module, parts: dict) -> None:
    """Copy ``from_peft``'s parts into the model's adapters (every one, shapes checked)."""
    own = {k: v for k, v in module.state_dict(keep_vars=True).items() if lora.is_adapter(k)}
    convert.copy_checked(own, parts, "LoRA adapter")


def adapter_config(peft_sd: dict, rank: int, alpha: float, dropout: float, base_model: str) -> dict:
    """peft's ``adapter_config.json`` for the tensors of ``to_peft`` (peft fills in the keys it leaves out)."""
    targets = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in peft_sd})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": dropout,
            "target_modules": targets, "bias": "none", "base_model_name_or_path": base_model,
            "inference_mode": True, "fan_in_fan_out": False}
