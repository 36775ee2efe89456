"""verl 0.9.1's covariance-based policy losses ``clip_cov`` and ``kl_cov`` (Cui et al., "The Entropy
Mechanism of Reinforcement Learning for Reasoning Language Models", https://arxiv.org/abs/2505.22617).

Both pick tokens by the covariance ``(A - mean A) * (log pi - mean log pi)``, with the means and the number
of picked tokens taken over the batch the function is given. verl calls a policy loss once per
micro-batch, so the selection is per micro-batch, as here: the loss of a token depends on which other
tokens share its micro-batch, and the gradient is not independent of the micro-batch size (the rest of
the loss is normalized over the whole mini-batch through ``global_batch`` as every loss is). Rollout
correction's IS weights multiply the per-token losses before aggregation (after the token selection), as
verl. The signature and settings: :mod:`.policy_loss`.
"""

from __future__ import annotations

from typing import Any

import torch

from .aggregation import GlobalBatch, aggregate_loss
from .masked import masked_mean
from .policy_loss import actor_settings, clip_range, policy_loss_setting, weighted
from .registry import register_policy_loss

Tensor = torch.Tensor


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor,
                                 response_mask: Tensor, *, loss_agg_mode: str = "token-mean", config: Any = None,
                                 global_batch: GlobalBatch | None = None, rollout_is_weights: Tensor | None = None):
    """Clip-Cov: PPO's clipped surrogate (no dual clip, no log-ratio clamp), with the gradient cut (loss
    multiplied by 0) on up to ``max(int(clip_cov_ratio * valid tokens), 1)`` tokens drawn at random
    (``torch.randperm`` on the default CPU generator, as verl) among the valid, not already clipped tokens
    whose covariance lies strictly inside ``(clip_cov_lb, clip_cov_ub)``.

    Settings: ``config.policy_loss.clip_cov_ratio/clip_cov_lb/clip_cov_ub`` (verl's fallbacks 0.0002, 1.0,
    5.0 when None), ``clip_ratio_low/high``. Metrics: ``pg_clipfrac`` (share of cut tokens) and ``ppo_kl``.

    Raises:
        ValueError: ``clip_cov_ratio`` not > 0 (verl asserts it).
    """
    config = actor_settings(config)
    ratio_cut = policy_loss_setting(config, "clip_cov_ratio", 0.0002)
    lb = policy_loss_setting(config, "clip_cov_lb", 1.0)
    ub = policy_loss_setting(config, "clip_cov_ub", 5.0)
    if not ratio_cut > 0:
        raise ValueError(f"actor.policy_loss.clip_cov_ratio must be > 0 for loss_mode clip_cov, got {ratio_cut}")
    low, high = clip_range(config)
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)

    with torch.no_grad():
        valid = response_mask > 0
        clip_by_origin = (pg_losses2 > pg_losses1) & valid
        logp = log_prob.detach()
        cov = (advantages - masked_mean(advantages, response_mask)) * (logp - masked_mean(logp, response_mask))
        cov = cov.masked_fill(~valid | clip_by_origin, -torch.inf)
        clip_num = max(int(ratio_cut * response_mask.sum().item()), 1)
        candidates = torch.nonzero((cov < ub) & (cov > lb) & valid)
        if len(candidates) > 0:
            candidates = candidates[torch.randperm(len(candidates))[: min(clip_num, len(candidates))]]
        corr = torch.ones_like(advantages)
        corr[candidates[:, 0], candidates[:, 1]] = 0

    pg_losses = weighted(torch.maximum(pg_losses1, pg_losses2) * corr, rollout_is_weights)
    loss = aggregate_loss(pg_losses, response_mask, loss_agg_mode, global_batch)
    pg_clipfrac = masked_mean((corr == 0).to(log_prob.dtype), response_mask)
    return loss, {"pg_clipfrac": pg_clipfrac.detach(), "ppo_kl": ppo_kl.detach()}


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor,
                               response_mask: Tensor, *, loss_agg_mode: str = "token-mean", config: Any = None,
                               global_batch: GlobalBatch | None = None, rollout_is_weights: Tensor | None = None):
    """KL-Cov: the unclipped surrogate ``-A * r`` (no clamp), plus ``ppo_kl_coef * |log r|`` on the
    ``max(1, int(n * kl_cov_ratio))`` valid tokens of largest covariance (``torch.topk`` over the ``n``
    valid tokens, on the CPU as verl).

    Settings: ``config.policy_loss.kl_cov_ratio`` (fallback 0.0002) and ``ppo_kl_coef`` (config default 0.1;
    verl's in-code fallback for None is 1.0, kept). Metrics: ``ppo_kl`` — as verl, the mean of ``|log r|``
    here, not of ``-log r``.

    Raises:
        ValueError: ``kl_cov_ratio`` not > 0 (verl asserts it).
    """
    config = actor_settings(config)
    kl_cov_ratio = policy_loss_setting(config, "kl_cov_ratio", 0.0002)
    coef = policy_loss_setting(config, "ppo_kl_coef", 1.0)
    if not kl_cov_ratio > 0:
        raise ValueError(f"actor.policy_loss.kl_cov_ratio must be > 0 for loss_mode kl_cov, got {kl_cov_ratio}")
    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    ppo_kl_abs = masked_mean(abs_kl, response_mask)
    pg_losses = -advantages * ratio

    with torch.no_grad():
        valid_flat = torch.nonzero((response_mask > 0).reshape(-1), as_tuple=True)[0]
        picked = torch.zeros(advantages.numel(), dtype=torch.bool, device=advantages.device)
        if len(valid_flat) > 0:
            adv = advantages.detach().reshape(-1)[valid_flat].cpu()
            logp = log_prob.detach().reshape(-1)[valid_flat].cpu()
            cov = (adv - adv.mean()) * (logp - logp.mean())
            k = max(1, int(len(cov) * kl_cov_ratio))
            picked[valid_flat[torch.topk(cov, k, largest=True).indices.to(valid_flat.device)]] = True
        picked = picked.reshape(advantages.shape)

    pg_losses = weighted(torch.where(picked, pg_losses + coef * abs_kl, pg_losses), rollout_is_weights)
    loss = aggregate_loss(pg_losses, response_mask, loss_agg_mode, global_batch)
    return loss, {"ppo_kl": ppo_kl_abs.detach()}
