"""DAPO's dynamic sampling (https://arxiv.org/abs/2503.14476): prompt groups whose responses all score alike
carry no group-relative advantage, so they are dropped and further prompts are generated until the step has
``data.batch_size`` groups (``algorithm.filter_groups``).

As verl's DAPO recipe trainer (verl-recipe ``dapo/dapo_ray_trainer.py``, run with verl 0.9.1): a group is kept
when its metric's (population) std is > 0 or it has a single response; whole generation batches of
``data.batch_size`` prompts are generated; once enough groups are kept the batch is cut to ``batch_size x n``
rows (the surplus groups of the last generation batch are dropped); reaching ``max_num_gen_batches`` (> 0)
without a full batch is an error (the recipe raises "Generated too many"), it does not train on a partial
batch. verl 0.9.1's own v1 replay buffer ignores ``max_num_gen_batches``; the recipe's rule is kept here.

Metrics: ``train/num_gen_batches`` (the recipe's name), ``dynamic_sampling/kept_group_fraction`` (kept groups
over generated groups, all generation batches of the step) and ``dynamic_sampling/dropped_groups``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import numpy as np
import torch

from hybridflow.config.schema import FILTER_SCORE as _SCORE
from hybridflow.config.schema import FILTER_SEQ_REWARD as _SEQ_REWARD
from hybridflow.protocol import Batch

log = logging.getLogger(__name__)


class DynamicSamplingError(RuntimeError):
    """Dynamic sampling cannot fill the step's batch (``max_num_gen_batches`` reached) or cannot read its
    metric; one line naming the key to change."""


def group_metric(batch: Batch, metric: str) -> np.ndarray:
    """Each row's value of ``algorithm.filter_groups.metric``: a column of that name (a reward function's
    returned entry), else the sequence reward (``reward``/``seq_reward``: the sum of ``token_level_scores``,
    overlong shaping included; ``seq_final_reward`` is the same here, where it is read before any KL penalty
    enters the reward) or the scorer's value (``score``/``acc``: ``scores``)."""
    columns = {**batch.non_tensors, **batch.tensors}
    if metric in columns:
        value = columns[metric]
    elif metric in _SEQ_REWARD:
        value = batch.tensors["token_level_scores"].sum(-1)
    elif metric in _SCORE:
        value = batch.tensors["scores"]
    else:
        raise DynamicSamplingError(f"algorithm.filter_groups.metric {metric!r}: the reward function returned no such "
                                   f"entry and it is not one of {list(_SEQ_REWARD + _SCORE)}; name one of those or "
                                   "a key of the reward function's returned dict")
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().double().numpy()
    return np.asarray(value, dtype=np.float64)


def informative_groups(batch: Batch, metric: str) -> tuple[np.ndarray, int, int]:
    """(rows of the kept groups, in batch order; kept groups; all groups) by the rows' ``uid``."""
    uids, values = batch.non_tensors["uid"], group_metric(batch, metric)
    by_uid: dict = {}
    for row, uid in enumerate(uids):
        by_uid.setdefault(uid, []).append(row)
    kept = {uid for uid, rows in by_uid.items() if len(rows) == 1 or np.std(values[rows]) > 0}
    return np.array([r for r, uid in enumerate(uids) if uid in kept], dtype=np.int64), len(kept), len(by_uid)


def fill_batch(first: Batch, more: Iterator[Batch] | None, generate: Callable[[Batch, int], Batch], *, n: int,
               batch_size: int, metric: str, max_num_gen_batches: int) -> tuple[Batch, dict]:
    """Generate and score (``generate(prompts, gen_index)``) ``first``, then prompts from ``more``, keeping
    informative groups until ``batch_size`` groups of ``n`` rows are held; returns them and the metrics."""
    kept_parts, n_kept, n_groups, gen = [], 0, 0, 0
    prompts = first
    while True:
        batch = generate(prompts, gen)
        gen += 1
        rows, kept, groups = informative_groups(batch, metric)
        kept_parts.append(batch[rows])
        n_kept, n_groups = n_kept + kept, n_groups + groups
        if n_kept >= batch_size:
            break
        if 0 < max_num_gen_batches <= gen:
            raise DynamicSamplingError(
                f"dynamic sampling: {n_kept} of data.batch_size={batch_size} prompt groups have a non-constant "
                f"{metric!r} after {gen} generation batches (algorithm.filter_groups.max_num_gen_batches="
                f"{max_num_gen_batches}): the data may be too hard or too easy for the model; raise "
                "algorithm.filter_groups.max_num_gen_batches, set it to 0 (no limit) or change the data or reward")
        if more is None:
            raise RuntimeError("dynamic sampling needs further prompt batches, but the caller passed none "
                               "(PPODriver.step's more_prompts)")
        # one line per further batch: without a limit an all-alike reward regenerates for ever, visibly
        limit = f"of at most {max_num_gen_batches} " if max_num_gen_batches > 0 else ""
        unbounded = "" if limit else " (algorithm.filter_groups.max_num_gen_batches=0: no limit)"
        log.warning("dynamic sampling: %d of %d prompt groups kept after %d %sgeneration batches%s; generating "
                    "another", n_kept, batch_size, gen, limit, unbounded)
        prompts = next(more)
    out = Batch.concat(kept_parts)[: batch_size * n]  # whole groups: a group's n rows are consecutive
    metrics = {"train/num_gen_batches": gen, "dynamic_sampling/kept_group_fraction": n_kept / n_groups,
               "dynamic_sampling/dropped_groups": n_groups - n_kept}
    return out, metrics


