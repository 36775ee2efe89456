"""The HF weights of a megatron role gathered from its shards, one layer at a time (``hybridflow export``, the
checkpoint engine's feeds, tests comparing layouts): the inverse of ``convert.hf_to_megatron`` over every rank."""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from hybridflow.families import weights
from hybridflow.megatron import convert


def iter_hf_weights(role) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, host tensor) of the whole model, yielded on global rank 0 only, one layer at a time.

    Every rank of the role must exhaust the iterator together. Only data-parallel rank 0 moves dense
    weights: each tensor's TP shards are gathered onto TP rank 0, which converts the layer to HF names;
    other pipeline stages broadcast their converted layers to the first stage. Experts live on the
    expert-parallel ranks (expert-data-parallel rank 0 holds one copy of each): each expert tensor is
    gathered over the expert-TP group, then over the EP group onto data-parallel rank 0. No rank ever
    holds more than its own shard plus one layer.
    """
    from megatron.core import parallel_state as ps

    has_experts = bool(role.tf_config.num_moe_experts)
    expert_only = ps.get_data_parallel_rank() != 0  # joins the expert gathers of its own stage only
    if expert_only and not (has_experts and ps.get_expert_data_parallel_rank() == 0):
        return
    with role.resident():
        local = convert.local_state_dict(role.module)
        chunks = _layer_chunks(local)
        tp_group, pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
        tp_rank, stage = role.shard.tp_rank, role.shard.pp_rank
        pp_ranks = dist.get_process_group_ranks(pp_group)
        if expert_only:
            for names in chunks:
                _gathered_chunk(role, local, names, tp_group, experts_only=True)
            return
        # TP rank 0 of every stage walks all stages' chunks (the pipeline broadcast); the other TP
        # ranks only join the gathers of their own stage.
        counts = {stage: len(chunks)}
        if role.shard.pp_size > 1 and tp_rank == 0:
            every = [None] * role.shard.pp_size
            dist.all_gather_object(every, len(chunks), group=pp_group)
            counts = dict(enumerate(every))
        for s, n in counts.items():
            for i in range(n):
                hf = _gathered_chunk(role, local, chunks[i], tp_group) if s == stage else None
                if tp_rank != 0:
                    continue
                if role.shard.pp_size > 1:
                    box = [hf]
                    dist.broadcast_object_list(box, src=pp_ranks[s], group=pp_group)
                    hf = box[0]
                if dist.get_rank() == 0:
                    yield from hf.items()

def _gather(tensor: torch.Tensor, dim: int, group) -> torch.Tensor | None:
    """``tensor`` of every member of ``group`` concatenated along ``dim`` on the group's first rank."""
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    first = dist.get_rank(group) == 0
    parts = [torch.empty_like(tensor) for _ in range(size)] if first else None
    dist.gather(tensor.contiguous(), parts, dst=dist.get_process_group_ranks(group)[0], group=group)
    return torch.cat(parts, dim=dim) if first else None

def _gathered_chunk(role, local: dict, names: list[str], tp_group, experts_only: bool = False) -> dict | None:
    """The HF tensors (on host) of one chunk of this stage, on TP rank 0 of data-parallel rank 0 (None on
    the others). Expert tensors are renamed to their global expert index (convert.megatron_to_hf)."""
    from megatron.core import parallel_state as ps

    full = {}
    for name in names:
        tensor = local[name]
        if convert.is_expert_param(name):
            tensor = _gather(tensor, convert.tp_split_dim(name), ps.get_expert_tensor_parallel_group())
            if tensor is None:
                continue
            per_rank = role.tf_config.num_moe_experts // role.shard.ep_size
            ep_group = ps.get_expert_model_parallel_group()
            every = _gather(tensor[None], 0, ep_group)  # [ep, ...]: one per EP rank, same local index
            if every is None:
                continue
            pre, i, rest = weights.local_expert(name)
            for r in range(role.shard.ep_size):
                full[f"{pre}local_experts.{r * per_rank + i}.{rest}"] = every[r]
            continue
        if experts_only:
            continue
        dim = convert.tp_split_dim(name, role.value_head)
        if role.shard.tp_size > 1 and dim is not None:
            tensor = _gather(tensor, dim, tp_group)
        full[name] = tensor
    if role.shard.tp_rank != 0 or experts_only:
        return None
    hf = convert.megatron_to_hf(full, role.hf_config, role.shard, value_head=role.value_head)
    # Owned host copies: unsharded tensors are views of the live (maybe soon offloaded) parameters.
    return {k: v.detach().to("cpu", copy=True) for k, v in hf.items()}


def _layer_chunks(local: dict) -> list[list[str]]:
    """This stage's parameter names grouped for a streamed export: embedding, each layer, final parts."""
    layers: dict[int, list[str]] = {}
    head, tail = [], []
    for name in sorted(local):
        if name.startswith("decoder.layers."):
            layers.setdefault(int(name.split(".")[2]), []).append(name)
        elif name.startswith("embedding."):
            head.append(name)
        else:
            tail.append(name)
    return [c for c in (head, *(layers[k] for k in sorted(layers)), tail) if c]
