"""Advantage estimators (GAE, GRPO, RLOO, REINFORCE++, ReMax).

Every estimator takes ``token_level_rewards`` and ``response_mask`` (both
[batch, response_len]) positionally, plus the keyword-only extras it needs,
and returns ``(advantages, returns)``, each [batch, response_len].  They run
under ``no_grad``: advantages and returns are regression/policy targets, never
something to differentiate through.

Estimators are registered by name; :func:`compute_advantage` dispatches by
name and passes each estimator only the keyword arguments it declares, so a
trainer can hand over everything it has without knowing which estimator needs
what.  New estimators follow the same convention::

    @register_advantage("my_estimator")
    def my_estimator(token_level_rewards, response_mask, *, index): ...
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np
import torch

from .masked import masked_whiten
from .registry import ADVANTAGE_ESTIMATORS, register_advantage

Tensor = torch.Tensor


def _float_mask(response_mask: Tensor, like: Tensor) -> Tensor:
    # bool masks are allowed by convention; the recurrences need ``1 - mask``.
    return response_mask.to(like.dtype)


def _group_ids(index: Any, bsz: int, device: torch.device) -> Tuple[Tensor, Tensor]:
    """Map arbitrary hashable group ids to dense ints.

    Returns ``(gid, counts)``: ``gid`` [bsz] long, ``counts`` [num_groups] long.
    """
    if index is None:
        raise ValueError("group-based advantage estimators require `index` (one group id per row)")
    # tolist() turns numpy/torch scalars into plain python ones for hashing
    ids: Sequence = index.tolist() if isinstance(index, (np.ndarray, torch.Tensor)) else list(index)
    if len(ids) != bsz:
        raise ValueError(f"index has {len(ids)} entries but the batch has {bsz} rows")
    dense: Dict[Any, int] = {}
    gid = torch.tensor([dense.setdefault(i, len(dense)) for i in ids], dtype=torch.long, device=device)
    counts = torch.bincount(gid, minlength=len(dense))
    return gid, counts


def _group_mean_std(scores: Tensor, index: Any) -> Tuple[Tensor, Tensor, Tensor]:
    """Per-row group statistics of ``scores`` [B].

    Returns ``(mean, std, count)`` each [B], gathered back to rows.  ``std``
    uses N-1 like ``torch.std``.  A group of one gets mean 0 and std 1 (verl:
    a lone sample has no baseline, so its score passes through).
    """
    gid, counts = _group_ids(index, scores.shape[0], scores.device)
    n = counts.to(scores.dtype)
    sums = torch.zeros_like(n).index_add_(0, gid, scores)
    mean = sums / n
    sq_dev = torch.zeros_like(n).index_add_(0, gid, (scores - mean[gid]) ** 2)
    std = torch.sqrt(sq_dev / (n - 1).clamp(min=1))
    single = counts == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[gid], std[gid], counts[gid]


@register_advantage("gae", needs={"values"})
@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    values: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> Tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation (PPO).

    Args:
        token_level_rewards: [B, T].
        response_mask: [B, T]; mask-0 positions inside a response (e.g. tool
            observations) are skipped: the next value and the running GAE
            carry through them unchanged.
        values: [B, T] critic values.

    Returns:
        ``advantages`` [B, T] (masked-whitened, not re-masked) and
        ``returns`` [B, T] = un-whitened advantages + values.
    """
    mask = _float_mask(response_mask, token_level_rewards)
    nextvalues = torch.zeros_like(token_level_rewards[:, 0])
    lastgaelam = torch.zeros_like(nextvalues)
    reversed_adv = []
    for t in reversed(range(token_level_rewards.shape[-1])):
        m = mask[:, t]
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        new_gaelam = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * m + (1 - m) * nextvalues
        lastgaelam = new_gaelam * m + (1 - m) * lastgaelam
        reversed_adv.append(lastgaelam)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    returns = advantages + values
    advantages = masked_whiten(advantages, mask)
    return advantages, returns


@register_advantage("grpo")
@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    index: Any,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> Tuple[Tensor, Tensor]:
    """GRPO: outcome score normalised within its prompt group.

    Args:
        token_level_rewards: [B, T]; the score of a row is its sum.
        response_mask: [B, T].
        index: [B] group ids (numpy array of hashables).
        norm_adv_by_std_in_grpo: divide by ``std + epsilon`` (N-1 std);
            ``False`` gives the Dr. GRPO mean-only baseline.

    Returns:
        ``(advantages, returns)``, both the same [B, T] tensor
        ``score_norm[:, None] * response_mask``.
    """
    scores = token_level_rewards.sum(dim=-1)
    mean, std, _ = _group_mean_std(scores, index)
    if norm_adv_by_std_in_grpo:
        scores = (scores - mean) / (std + epsilon)
    else:
        scores = scores - mean
    advantages = scores.unsqueeze(-1) * _float_mask(response_mask, scores)
    return advantages, advantages


@register_advantage("rloo")
@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    index: Any,
) -> Tuple[Tensor, Tensor]:
    """RLOO: score minus the mean of the other samples of the same prompt.

    For a group of size k > 1 that is ``(s - mean) * k / (k - 1)``; a group of
    one keeps its raw score.

    Args/Returns: as :func:`compute_grpo_outcome_advantage`.
    """
    scores = token_level_rewards.sum(dim=-1)
    mean, _, count = _group_mean_std(scores, index)
    k = count.to(scores.dtype)
    factor = k / (k - 1).clamp(min=1)  # clamp only avoids 1/0 for groups of one
    scores = torch.where(count > 1, scores * factor - mean * factor, scores)
    advantages = scores.unsqueeze(-1) * _float_mask(response_mask, scores)
    return advantages, advantages


@register_advantage("reinforce_plus_plus")
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    gamma: float = 1.0,
) -> Tuple[Tensor, Tensor]:
    """REINFORCE++: discounted return-to-go, whitened over the batch (verl 0.9.1).

    Mask-0 positions inside a response (tool or user tokens between assistant turns) are skipped: the
    running return passes through them unchanged, so a final reward reaches the tokens of earlier turns,
    and their own return is 0.

    Returns:
        ``advantages`` [B, T] = masked_whiten(returns) * mask, ``returns`` [B, T].
    """
    mask = _float_mask(response_mask, token_level_rewards)
    returns = torch.zeros_like(token_level_rewards)
    running_return = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[-1])):
        candidate = token_level_rewards[:, t] + gamma * running_return
        returns[:, t] = candidate * mask[:, t]
        running_return = candidate * mask[:, t] + running_return * (1 - mask[:, t])
    advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


@register_advantage("reinforce_plus_plus_baseline")
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    index: Any,
) -> Tuple[Tensor, Tensor]:
    """REINFORCE++ with a group-mean baseline, then batch whitening.

    score = row sum minus its group mean (group of one: mean 0), broadcast to
    tokens, then ``masked_whiten(., mask) * mask``.

    Returns:
        ``(advantages, returns)``, the same [B, T] tensor.
    """
    mask = _float_mask(response_mask, token_level_rewards)
    scores = token_level_rewards.sum(dim=-1)
    mean, _, _ = _group_mean_std(scores, index)
    scores = (scores - mean).unsqueeze(-1) * mask
    advantages = masked_whiten(scores, mask) * mask
    return advantages, advantages


@register_advantage("remax", needs={"reward_baselines"})
@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    reward_baselines: Tensor,
) -> Tuple[Tensor, Tensor]:
    """ReMax: return-to-go minus the greedy-rollout baseline, no whitening.

    Args:
        token_level_rewards: [B, T].
        response_mask: [B, T].
        reward_baselines: [B] reward of the greedy response per prompt.

    Returns:
        ``advantages`` [B, T] = returns - baseline[:, None] * mask,
        ``returns`` [B, T] = reverse cumsum of ``rewards * mask``.
    """
    mask = _float_mask(response_mask, token_level_rewards)
    returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    advantages = returns - reward_baselines.unsqueeze(-1) * mask
    return advantages, returns


def _check_same_shape(token_level_rewards: Tensor, response_mask: Tensor) -> None:
    if token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_level_rewards shape {tuple(token_level_rewards.shape)} "
            f"!= response_mask shape {tuple(response_mask.shape)}"
        )


def _estimator_kwargs(name: str, fn: Any, offered: Dict[str, Any]) -> Dict[str, Any]:
    """The ``offered`` extras that ``fn`` declares, those given as ``None`` left out; ``ValueError`` when one
    it requires (no default) is ``None``."""
    kwargs = {}
    for pname, param in inspect.signature(fn).parameters.items():
        if pname not in offered:
            continue
        required = param.default is inspect.Parameter.empty
        if offered[pname] is None:
            if required:
                raise ValueError(f"advantage estimator {name!r} requires `{pname}`")
            continue
        kwargs[pname] = offered[pname]
    return kwargs


def compute_advantage(
    name: str, token_level_rewards: Tensor, response_mask: Tensor, *, values: Optional[Tensor] = None,
    index: Any = None, reward_baselines: Optional[Tensor] = None, gamma: float = 1.0, lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True, old_log_probs: Optional[Tensor] = None,
    sum_pi_squared: Optional[Tensor] = None, rollout_is_weights: Optional[Tensor] = None,
    reward_components: Any = None, reward_weights: Optional[Sequence[float]] = None,
) -> Tuple[Tensor, Tensor]:
    """Run the advantage estimator registered as ``name``.

    Extras the estimator does not declare are ignored (e.g. ``values`` for
    GRPO); an extra it requires but that is ``None`` raises ``ValueError``.

    Args:
        name: one of ``gae``, ``grpo``, ``rloo``, ``reinforce_plus_plus``,
            ``reinforce_plus_plus_baseline``, ``remax``, those of :mod:`.advantages_outcome`
            and :mod:`.advantages_otb` (or a user-registered one).
        token_level_rewards: [B, T].
        response_mask: [B, T] {0,1} float or bool.
        values: [B, T] critic values (gae).
        index: [B] group ids (grpo, rloo, reinforce_plus_plus_baseline).
        reward_baselines: [B] (remax).
        gamma, lam: discount and GAE lambda.
        norm_adv_by_std_in_grpo: grpo, grpo_passk (verl passes it to no other).
        old_log_probs, sum_pi_squared: [B, T] (optimal_token_baseline, tir_optimal_token_baseline).
        rollout_is_weights: [B, T] rollout-correction weights (the optimal token baselines).
        reward_components, reward_weights: gdpo's per-row reward components and their weights.

    Returns:
        ``(advantages, returns)``, each [B, T].
    """
    fn = ADVANTAGE_ESTIMATORS.get(name)
    _check_same_shape(token_level_rewards, response_mask)
    offered = dict(values=values, index=index, reward_baselines=reward_baselines, gamma=gamma, lam=lam,
                   norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, old_log_probs=old_log_probs,
                   sum_pi_squared=sum_pi_squared, rollout_is_weights=rollout_is_weights,
                   reward_components=reward_components, reward_weights=reward_weights)
    return fn(token_level_rewards, response_mask, **_estimator_kwargs(name, fn, offered))
