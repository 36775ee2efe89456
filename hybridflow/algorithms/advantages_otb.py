"""verl 0.9.1's Optimal Token Baseline estimators ``optimal_token_baseline`` and
``tir_optimal_token_baseline`` (``trainer/ppo/core_algos.py``).

A per-position baseline for each prompt group, ``B_t = sum_i G_i,t W_i,t / (sum_i W_i,t + eps)``, where
``G`` is the return-to-go and ``W_t = sum_{j<=t} w_j`` the cumulative path-variance proxy of a row,
``w_j = 1 - 2 pi_j + sum_v pi_v^2`` (the squared norm of the score function of the sampled token's
softmax), from the old policy's log-prob of the sampled token and ``sum_pi_squared`` (the sum over the
vocabulary of the old policy's squared probabilities, per position; verl's actor computes it with
``actor.calculate_sum_pi_squared``). With rollout-correction weights ``rho``, ``w`` is scaled by ``rho^2``.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from .advantages import _float_mask, _group_ids
from .registry import register_advantage

Tensor = torch.Tensor


def _returns_and_w(token_level_rewards: Tensor, mask: Tensor, old_log_probs: Tensor, sum_pi_squared: Tensor,
                   rollout_is_weights: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    dtype = token_level_rewards.dtype
    returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    w = 1 - 2 * torch.exp(old_log_probs.to(dtype)) + sum_pi_squared.to(dtype)
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.to(dtype) ** 2
    return returns, (w * mask).cumsum(dim=-1)


def _zero_tail(baselines: Tensor, rows: Tensor, lengths: Tensor) -> None:
    """verl's ``handle_zero_tail``: the one longest row of a group gets baseline 0 from the second-longest
    row's length on (positions, which are token counts only without gaps)."""
    sorted_lengths, _ = torch.sort(lengths)
    longest, second = int(sorted_lengths[-1]), int(sorted_lengths[-2])
    at_max = torch.nonzero(lengths == longest, as_tuple=True)[0]
    if at_max.numel() == 1 and longest > second:
        baselines[rows[at_max[0]], second:] = 0.0


@register_advantage("optimal_token_baseline", needs={"old_log_probs", "sum_pi_squared"})
@torch.no_grad()
def compute_optimal_token_baseline_advantage(token_level_rewards: Tensor, response_mask: Tensor, *, index: Any,
                                             old_log_probs: Tensor, sum_pi_squared: Tensor,
                                             rollout_is_weights: Optional[Tensor] = None,
                                             handle_zero_tail: bool = True,
                                             epsilon: float = 1e-8) -> Tuple[Tensor, Tensor]:
    """OTB by position: ``B_t`` over the group's rows at the same position ``t`` (valid ones only); a group
    of one gets no baseline. Returns ``((G - B) * mask, G)`` with ``G`` the return-to-go of the masked
    rewards (not masked itself, as verl). ``handle_zero_tail``/``epsilon``: verl's defaults (its driver
    never sets them)."""
    mask = _float_mask(response_mask, token_level_rewards)
    returns, w_cum = _returns_and_w(token_level_rewards, mask, old_log_probs, sum_pi_squared, rollout_is_weights)
    gid, counts = _group_ids(index, returns.shape[0], returns.device)
    baselines = torch.zeros_like(returns)
    for g in range(len(counts)):
        if counts[g] == 1:
            continue
        rows = torch.nonzero(gid == g, as_tuple=True)[0]
        m, wm = mask[rows], w_cum[rows] * mask[rows]
        baselines[rows] = ((returns[rows] * wm).sum(dim=0) / (wm.sum(dim=0) + epsilon)).expand(len(rows), -1)
        if handle_zero_tail:
            _zero_tail(baselines, rows, m.sum(dim=-1))
    return (returns - baselines) * mask, returns


@register_advantage("tir_optimal_token_baseline", needs={"old_log_probs", "sum_pi_squared"})
@torch.no_grad()
def compute_multi_turn_optimal_token_baseline_advantage(token_level_rewards: Tensor, response_mask: Tensor, *,
                                                        index: Any, old_log_probs: Tensor, sum_pi_squared: Tensor,
                                                        rollout_is_weights: Optional[Tensor] = None,
                                                        handle_zero_tail: bool = True,
                                                        epsilon: float = 1e-8) -> Tuple[Tensor, Tensor]:
    """OTB for multi-turn (tool-integrated) responses: each row's valid tokens are first packed to the
    left (the gaps of tool/user tokens removed), so ``B_t`` compares the rows' t-th generated tokens rather
    than their t-th positions; the advantages are scattered back to the valid positions. Rows without a
    valid token take no part (advantage 0); a group left with one row gets no baseline."""
    mask = _float_mask(response_mask, token_level_rewards)
    returns, w_cum = _returns_and_w(token_level_rewards, mask, old_log_probs, sum_pi_squared, rollout_is_weights)
    valid = mask.bool()
    lengths = valid.sum(dim=-1)
    width = int(lengths.max()) if lengths.numel() else 0
    slot = (valid.cumsum(dim=-1) - 1).clamp(min=0)  # packed column of each valid token
    rows_of, cols_of = torch.nonzero(valid, as_tuple=True)
    packed_w = w_cum.new_zeros(len(lengths), width)
    packed_returns = torch.zeros_like(packed_w)
    packed_w[rows_of, slot[rows_of, cols_of]] = w_cum[rows_of, cols_of]
    packed_returns[rows_of, slot[rows_of, cols_of]] = returns[rows_of, cols_of]

    gid, counts = _group_ids(index, len(lengths), returns.device)
    baselines = torch.zeros_like(packed_returns)
    for g in range(len(counts)):
        rows = torch.nonzero((gid == g) & (lengths > 0), as_tuple=True)[0]
        if len(rows) < 2:
            continue
        b_star = (packed_returns[rows] * packed_w[rows]).sum(dim=0) / (packed_w[rows].sum(dim=0) + epsilon)
        baselines[rows] = b_star.expand(len(rows), -1)
        if handle_zero_tail:
            _zero_tail(baselines, rows, lengths[rows])
    packed_adv = packed_returns - baselines
    advantages = torch.zeros_like(returns)
    advantages[rows_of, cols_of] = packed_adv[rows_of, slot[rows_of, cols_of]]
    return advantages * mask, returns
