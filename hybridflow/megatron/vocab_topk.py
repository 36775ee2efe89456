"""Top-k over a vocabulary split across the tensor-parallel group (megatron's vocab-parallel logits [..., V/t], rank r
holding ids r V/t .. (r + 1) V/t - 1): what on-policy distillation's forward_kl_topk needs from both models
(algorithms/distillation.py), without gathering the whole vocabulary on any rank.

- ``log_softmax_lse``: the log-normalizer over the whole vocabulary, differentiable (its sum crosses the ranks
  through megatron's ``reduce_from_tensor_model_parallel_region``: forward all-reduce, backward identity, as
  megatron's vocab_parallel_cross_entropy and ``role.vocab_parallel_entropy``).
- ``top_logits``: the k largest logits and their global ids (no gradient; the student's own top ids for the overlap
  diagnostics): each rank's k, all-gathered, the k largest of those. ``topk``: the same as log-probs (the
  teacher's).
- ``at_ids``: the logits at given global ids, differentiable: each rank contributes the ids it holds, summed over
  the group, so each rank's gradient is that of its own shard."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _group():
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_rank())


def log_softmax_lse(logits: torch.Tensor) -> torch.Tensor:
    """[...] logsumexp of fp32 ``logits`` [..., V/t] over the whole vocabulary."""
    from megatron.core import tensor_parallel

    group, t, _ = _group()
    z = logits.float()
    m = z.detach().max(dim=-1, keepdim=True).values
    if t > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    s = (z - m).exp().sum(-1)
    if t > 1:
        s = tensor_parallel.reduce_from_tensor_model_parallel_region(s)
    return s.log() + m[..., 0]


@torch.no_grad()
def top_logits(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([..., k] fp32 logits, [..., k] global ids, int64) of the k largest logits, largest first: each rank's k,
    all-gathered, the k largest of those (no normalizer: the student's own top ids need none)."""
    group, t, rank = _group()
    z = logits.float()
    values, ids = torch.topk(z, k=min(k, z.shape[-1]), dim=-1)
    ids = ids + rank * z.shape[-1]
    if t > 1:
        parts_v, parts_i = [torch.empty_like(values) for _ in range(t)], [torch.empty_like(ids) for _ in range(t)]
        dist.all_gather(parts_v, values.contiguous(), group=group)
        dist.all_gather(parts_i, ids.contiguous(), group=group)
        values, picked = torch.topk(torch.cat(parts_v, -1), k=k, dim=-1)
        ids = torch.gather(torch.cat(parts_i, -1), -1, picked)
    return values, ids


@torch.no_grad()
def topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([..., k] log-probs, [..., k] global ids, int64) of the k most likely tokens, largest first."""
    z = logits.float()  # once: both readers below would otherwise each copy bf16 logits to fp32
    values, ids = top_logits(z, k)
    return values - log_softmax_lse(z)[..., None], ids


def at_ids(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[..., k] fp32 logits at global ``ids`` [..., k], differentiable."""
    from megatron.core import tensor_parallel

    group, t, rank = _group()
    z = logits.float()
    width = z.shape[-1]
    local = ids - rank * width
    held = (local >= 0) & (local < width)
    picked = torch.gather(z, -1, local.clamp(0, width - 1)) * held
    return tensor_parallel.reduce_from_tensor_model_parallel_region(picked) if t > 1 else picked
