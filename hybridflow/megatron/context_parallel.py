"""Context parallelism (CP): a micro-batch's sequence split over the ranks of the CP group.

The split is megatron's load-balanced one (Megatron-LM ``get_batch_on_this_cp_rank``, megatron-core
``rope_utils.get_pos_emb_on_this_cp_rank``): the sequence is cut into 2 x cp chunks and CP rank r holds chunks
r and 2cp-1-r, so every rank does the same share of causal attention; a packed-sequence (THD) row is cut so
per sequence (Transformer Engine's ``thd_get_partitioned_indices``; row_layout.split_for_context_parallel). The ranks hold the same weights (like
data-parallel ranks: megatron's DDP reduces gradients over the data x context group).

Attention crosses ranks. On GPU Transformer Engine's attention does it (megatron's TE spec hands it the CP
group and ``cp_comm_type``; causal rows, megatron slicing the rotary table per rank). megatron's local
``DotProductAttention`` asserts ``context_parallel_size == 1`` (transformer/dot_product_attention.py), so on
CPU ``patches.megatron_layers.gathered_kv_attention`` stands in (a declared patch): it all-gathers K and V over the CP group and
applies an explicit mask of this rank's queries against every key in gathered order
(workers/row_layout.split_for_context_parallel builds it, from the causal mask or a packed one), so shared
prompts and token-budget packing work under CP too.

Outputs: each rank picks the response tokens whose predicting position it holds and the per-token results
are summed over the CP group (``sum_over_ranks``: forward all-reduce, backward identity, every rank then
holding the same loss). Each rank's gradient is that of its own computations, so the gradients summed over
CP are the whole sequence's: megatron's DDP averages over data x context ranks, and its schedule multiplies
each micro-batch's loss by the CP size to undo that (pipeline_parallel/schedules.py ``forward_step``:
``output_tensor *= cp_group_size`` for a loss function returning two values, as ours do).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def chunk_positions(seq_len: int, size: int, rank: int) -> torch.Tensor:
    """The positions CP rank ``rank`` of ``size`` holds: chunks rank and 2*size-1-rank of 2*size."""
    if seq_len % (2 * size):
        raise ValueError(f"a sequence of {seq_len} tokens does not split into {2 * size} equal chunks")
    chunk = seq_len // (2 * size)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk)])


def positions_held(bounds: list[int], size: int, rank: int) -> torch.Tensor:
    """The positions CP rank ``rank`` holds of a row whose sequences lie between ``bounds`` ([0, s] for a row of
    one): its chunks of each sequence (a packed THD row is split per sequence, as TE partitions it)."""
    return torch.cat([a + chunk_positions(b - a, size, rank) for a, b in zip(bounds, bounds[1:])])


def gathered_order(bounds: list[int], size: int) -> torch.Tensor:
    """The row positions of an all-gather over the CP group of each rank's positions, in rank order."""
    return torch.cat([positions_held(bounds, size, r) for r in range(size)])


def _group():
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group()


class _SumOverRanks(torch.autograd.Function):
    """Sum over the CP group; backward identity (every rank computes the same loss of the sum)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def gathered_kv_attention():
    """The local spec's core attention under CP (patches/megatron_layers.py), on this process's CP group."""
    from hybridflow.patches import megatron_layers

    return megatron_layers.gathered_kv_attention(_group)


def sum_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """Per-token results, each held by one CP rank (zeros elsewhere), made whole on every rank."""
    return _SumOverRanks.apply(x, _group())
