"""Data-parallel sequence-length balancing (verl 0.9.1's ``trainer.balance_batch``, ray_trainer ``_balance_batch``).

The driver reorders a rollout batch before dispatching it so that each data-parallel rank's contiguous
shard holds a similar number of tokens: the slowest rank sets the pace of every step.

Where we differ from verl: verl partitions single rows unless its prefix grouper is on. Here a GRPO
group (rows with the same ``uid``, consecutive) stays whole and contiguous whenever the groups split evenly
across the ranks, because the CPU layout computes a group's prompt once only when its rows are neighbours
(workers/row_layout.py, shared prompts); otherwise rows are balanced one by one, as verl does. Rows keep
their order within a rank (verl orders them by workload for its micro-batches; our token-budget
micro-batches are formed on the worker) and tokens are balanced rather than verl's attention-weighted
workload.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridflow.protocol import Batch
from hybridflow.workers.row_layout import balanced_partitions


def balance_batch(batch: Batch, cfg, dp_size: int, metrics: dict, prefix: str = "global_seqlen") -> Batch:
    """``batch`` reordered so its ``dp_size`` equal contiguous shards have near-equal token totals (when
    trainer.balance_batch, default true); adds verl's ``global_seqlen/*`` metrics (token totals of the
    shards before: min, max, minmax_diff; after: balanced_min, balanced_max; their mean)."""
    if not cfg.trainer.balance_batch or dp_size <= 1 or len(batch) % dp_size:
        return batch
    lengths = batch.tensors["attention_mask"].sum(-1).tolist()
    order = balanced_order(lengths, dp_size, batch.non_tensors.get("uid"))
    before = [int(c.sum()) for c in np.array_split(lengths, dp_size)]
    after = [int(c.sum()) for c in np.array_split([lengths[i] for i in order], dp_size)]
    metrics.update({f"{prefix}/min": min(before), f"{prefix}/max": max(before),
                    f"{prefix}/minmax_diff": max(before) - min(before), f"{prefix}/balanced_min": min(after),
                    f"{prefix}/balanced_max": max(after), f"{prefix}/mean": sum(lengths) / dp_size})
    return batch[torch.tensor(order)]


def balanced_order(lengths: list[int], k: int, uids=None) -> list[int]:
    """A permutation of the rows whose ``k`` equal contiguous shards have near-equal sums of ``lengths``:
    whole groups of consecutive equal ``uids`` when they are equal in size and their count divides by
    ``k``, else single rows (``len(lengths)`` must divide by ``k``). Rows keep their order within a shard."""
    groups = _runs(uids) if uids is not None else None
    if not groups or len({e - s for s, e in groups}) != 1 or len(groups) % k:
        groups = [(i, i + 1) for i in range(len(lengths))]
    parts = balanced_partitions([sum(lengths[s:e]) for s, e in groups], k, equal_size=True)
    return [i for part in parts for g in part for i in range(*groups[g])]


def _runs(uids) -> list[tuple[int, int]]:
    """(start, end) of each run of consecutive equal values."""
    starts = [0] + [i for i in range(1, len(uids)) if uids[i] != uids[i - 1]]
    return list(zip(starts, starts[1:] + [len(uids)]))
