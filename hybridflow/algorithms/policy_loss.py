"""The PPO clipped policy loss (verl's ``vanilla``), with asymmetric and dual clipping."""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from .aggregation import GlobalBatch, aggregate_loss
from .masked import masked_mean
from .registry import register_policy_loss

Tensor = torch.Tensor


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    global_batch: GlobalBatch | None = None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """PPO clipped surrogate with asymmetric clip and dual clip.

    Dual clip (https://arxiv.org/abs/1912.09729) bounds the loss of
    negative-advantage tokens by ``-A * clip_ratio_c``, so a token whose ratio
    exploded cannot dominate the update.

    Args:
        old_log_prob, log_prob, advantages, response_mask: [B, T].
        loss_agg_mode: see :func:`aggregate_loss`.
        clip_ratio_low, clip_ratio_high: ratio clipped to
            ``[1 - low, 1 + high]``.
        clip_ratio_c: dual-clip bound, must be > 1.
        global_batch: the mini-batch's counts when this is one micro-batch of it.

    Returns:
        ``(loss, metrics)``: 0-dim loss; metrics ``pg_clipfrac``, ``ppo_kl``,
        ``pg_clipfrac_lower`` as detached 0-dim tensors.
    """
    assert clip_ratio_c > 1.0, (
        f"clip_ratio_c (dual-clip lower bound) must be > 1.0, got {clip_ratio_c}"
    )
    # clamp before exp: a log-ratio of +-20 is already far outside any clip
    # range and keeps ratio finite
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).to(ratio.dtype), response_mask)

    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    negative = advantages < 0
    pg_clipfrac_lower = masked_mean(
        (torch.gt(clip_pg_losses1, pg_losses3) & negative).to(ratio.dtype), response_mask
    )

    pg_losses = torch.where(negative, clip_pg_losses2, clip_pg_losses1)
    loss = aggregate_loss(pg_losses, response_mask, loss_agg_mode, global_batch)
    metrics = {
        "pg_clipfrac": pg_clipfrac.detach(),
        "ppo_kl": ppo_kl.detach(),
        "pg_clipfrac_lower": pg_clipfrac_lower.detach(),
    }
    return loss, metrics
