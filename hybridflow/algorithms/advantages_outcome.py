"""verl 0.9.1's outcome-reward advantage estimators beyond :mod:`.advantages`: ``gpg``, ``opo``,
``grpo_passk``, ``gdpo``, ``grpo_vectorized``, ``rloo_vectorized`` (``trainer/ppo/core_algos.py``).

Conventions as :mod:`.advantages` (row score = sum of its token rewards, ``index`` = group ids, outputs
``(advantages, returns)`` [B, T] in the rewards' dtype). What each receives follows verl's driver
(``ray_trainer.compute_advantage``): for every estimator except ``gae``/``grpo`` verl passes only the
rewards, mask, ``index``, ``reward_baselines`` and the algorithm config, so ``algorithm.gamma/lam`` and
``norm_adv_by_std_in_grpo`` reach an estimator only where it reads them from the config (``grpo_passk``).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .advantages import _float_mask, _group_ids, _group_mean_std, compute_grpo_outcome_advantage
from .masked import masked_whiten
from .registry import register_advantage

Tensor = torch.Tensor


def _broadcast(scores: Tensor, response_mask: Tensor) -> Tuple[Tensor, Tensor]:
    advantages = scores.unsqueeze(-1) * _float_mask(response_mask, scores)
    return advantages, advantages


@register_advantage("gpg")
@torch.no_grad()
def compute_gpg_outcome_advantage(token_level_rewards: Tensor, response_mask: Tensor, *, index: Any,
                                  f_norm: float = 1.0) -> Tuple[Tensor, Tensor]:
    """GPG's advantage: ``alpha * (score - group mean) / f_norm`` with ``alpha = B / max(#rows with a
    nonzero score, 1)`` over the whole batch (GPG's correction for the share of rows that carry signal);
    a group of one keeps ``alpha * score``. No std normalization (verl computes the group std and does not
    use it). ``f_norm``: verl's parameter, never set by its driver (1.0)."""
    scores = token_level_rewards.sum(dim=-1)
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1).to(scores.dtype)
    mean, _, _ = _group_mean_std(scores, index)
    return _broadcast(alpha * (scores - mean) / f_norm, response_mask)


@register_advantage("opo")
@torch.no_grad()
def compute_opo_outcome_advantage(token_level_rewards: Tensor, response_mask: Tensor, *,
                                  index: Any) -> Tuple[Tensor, Tensor]:
    """OPO (https://arxiv.org/abs/2505.23585): score minus the length-weighted group mean
    ``sum(len_j * s_j) / sum(len_j)``, ``len`` = a row's valid tokens (multi-turn gaps not counted); a
    group of one keeps its score. A group whose rows have no valid token gets baseline 0 (verl: 0/0 = NaN)."""
    scores = token_level_rewards.sum(dim=-1)
    lengths = _float_mask(response_mask, scores).sum(dim=-1)
    gid, counts = _group_ids(index, scores.shape[0], scores.device)
    weighted = torch.zeros(len(counts), dtype=scores.dtype, device=scores.device).index_add_(0, gid, lengths * scores)
    total = torch.zeros_like(weighted).index_add_(0, gid, lengths)
    baseline = torch.where((counts > 1) & (total > 0), weighted / total.clamp(min=1), torch.zeros_like(total))
    return _broadcast(scores - baseline[gid], response_mask)


@register_advantage("grpo_passk")
@torch.no_grad()
def compute_grpo_passk_outcome_advantage(token_level_rewards: Tensor, response_mask: Tensor, *, index: Any,
                                         norm_adv_by_std_in_grpo: bool = True,
                                         epsilon: float = 1e-6) -> Tuple[Tensor, Tensor]:
    """Pass@k training (https://arxiv.org/abs/2503.19595): in each group only the best row gets an
    advantage, ``r_max - r_second_max`` (divided by the group's N-1 std + epsilon with
    ``norm_adv_by_std_in_grpo``, which verl reads from the algorithm config); every other row gets 0.

    Raises:
        ValueError: a group with fewer than 2 rows (verl's check).
    """
    scores = token_level_rewards.sum(dim=-1)
    gid, counts = _group_ids(index, scores.shape[0], scores.device)
    advantages = torch.zeros_like(scores)
    for g in range(len(counts)):
        rows = torch.nonzero(gid == g, as_tuple=True)[0]
        rewards = scores[rows]
        if rewards.numel() < 2:
            raise ValueError(f"Pass@k requires at least 2 samples per group. Got {rewards.numel()} for group "
                             f"of row {int(rows[0])}.")
        top, top_idx = torch.topk(rewards, 2)
        advantage = top[0] - top[1]
        if norm_adv_by_std_in_grpo:
            advantage = advantage / (torch.std(rewards) + epsilon)
        advantages[rows[top_idx[0]]] = advantage
    return _broadcast(advantages, response_mask)


@register_advantage("gdpo", needs={"reward_components"})
@torch.no_grad()
def compute_gdpo_outcome_advantage(token_level_rewards: Tensor, response_mask: Tensor, *, index: Any,
                                   reward_components: Optional[Union[Mapping[str, Any], Sequence[Any]]] = None,
                                   reward_weights: Optional[Sequence[float]] = None, epsilon: float = 1e-6,
                                   norm_by_std: bool = True) -> Tuple[Tensor, Tensor]:
    """GDPO (https://arxiv.org/abs/2601.05242): each reward component normalized within its group as GRPO
    does, ``A_k = (r_k - mean_g) / (std_g + eps)``, then ``sum_k w_k A_k`` broadcast to the valid tokens,
    whitened over all valid tokens of the batch (``masked_whiten``) and masked.

    Args:
        reward_components: per-row score of each component ([B] each; a mapping key -> scores in
            ``algorithm.gdpo_reward_keys`` order, or a sequence): the reward function's returned dict
            entries. None: the row scores (``token_level_rewards`` summed) are the one component (verl's
            fallback).
        reward_weights: ``w_k`` (``algorithm.gdpo_reward_weights``); None: all 1.
        norm_by_std: verl's ``norm_adv_by_std_in_grpo`` parameter, which its driver never passes to gdpo:
            ``algorithm.norm_adv_by_std_in_grpo`` does not reach it and std normalization is always on, as
            here (``compute_advantage`` does not offer it either).

    Raises:
        ValueError: weights and components of different lengths.
    """
    dtype, device = token_level_rewards.dtype, token_level_rewards.device
    if reward_components is None:
        components = [token_level_rewards.sum(dim=-1)]
    else:
        values = reward_components.values() if isinstance(reward_components, Mapping) else reward_components
        # numpy object columns (the reward function's values, as the batch keeps them) become numbers first
        components = [torch.as_tensor(v if isinstance(v, torch.Tensor) else np.asarray(v, dtype=np.float64),
                                      dtype=dtype, device=device).reshape(-1) for v in values]
    weights = [1.0] * len(components) if reward_weights is None else list(reward_weights)
    if len(weights) != len(components):
        raise ValueError(f"gdpo: {len(weights)} reward weights for {len(components)} reward components")
    mask = _float_mask(response_mask, token_level_rewards)
    total = torch.zeros_like(token_level_rewards)
    for weight, scores in zip(weights, components):
        # as verl: a component's score on one token of the row, then GRPO (which sums the row)
        normalized, _ = compute_grpo_outcome_advantage(scores.unsqueeze(-1), torch.ones_like(scores.unsqueeze(-1)),
                                                       index=index, norm_adv_by_std_in_grpo=norm_by_std,
                                                       epsilon=epsilon)
        total = total + weight * normalized * mask
    advantages = masked_whiten(total, mask) * mask
    return advantages, advantages


@register_advantage("grpo_vectorized")
@torch.no_grad()
def compute_grpo_vectorized_outcome_advantage(token_level_rewards: Tensor, response_mask: Tensor, *, index: Any,
                                              epsilon: float = 1e-6) -> Tuple[Tensor, Tensor]:
    """verl's ``grpo_vectorized``: ``grpo`` with std normalization always on — verl's driver does not pass
    ``norm_adv_by_std_in_grpo`` to it, so ``algorithm.norm_adv_by_std_in_grpo=false`` has no effect there,
    nor here. Otherwise the same numbers as ``grpo`` (verl computes the group statistics in float32; here
    they stay in the rewards' dtype)."""
    return compute_grpo_outcome_advantage(token_level_rewards, response_mask, index=index,
                                          norm_adv_by_std_in_grpo=True, epsilon=epsilon)


@register_advantage("rloo_vectorized")
@torch.no_grad()
def compute_rloo_vectorized_outcome_advantage(token_level_rewards: Tensor, response_mask: Tensor, *,
                                              index: Any) -> Tuple[Tensor, Tensor]:
    """verl's ``rloo_vectorized``: ``(k * s - group sum) / (k - 1)``, the leave-one-out baseline as
    ``rloo``, except that a group of one gets 0 (``rloo`` keeps its raw score) — so not an alias."""
    scores = token_level_rewards.sum(dim=-1)
    gid, counts = _group_ids(index, scores.shape[0], scores.device)
    k = counts.to(scores.dtype)[gid]
    sums = torch.zeros(len(counts), dtype=scores.dtype, device=scores.device).index_add_(0, gid, scores)[gid]
    adv = (k * scores - sums) / (k - 1).clamp(min=1)
    return _broadcast(torch.where(k > 1, adv, torch.zeros_like(adv)), response_mask)
