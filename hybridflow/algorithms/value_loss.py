"""Clipped critic (value-function) loss."""

from __future__ import annotations

from typing import Tuple

import torch

from .aggregation import GlobalBatch, aggregate_loss
from .masked import masked_mean

Tensor = torch.Tensor


def value_loss(
    vpreds: Tensor,
    returns: Tensor,
    values: Tensor,
    response_mask: Tensor,
    *,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    global_batch: GlobalBatch | None = None,
) -> Tuple[Tensor, Tensor]:
    """PPO value loss with the prediction clipped around the rollout values.

    ``0.5 * agg(max((v - R)^2, (clip(v, old - c, old + c) - R)^2))``; the max
    makes clipping pessimistic, so the critic cannot move far from the values
    the advantages were computed with in one update.

    Args:
        vpreds: [B, T] current critic predictions.
        returns: [B, T] targets.
        values: [B, T] critic values at rollout time.
        response_mask: [B, T].
        cliprange_value: clip half-width ``c``.
        loss_agg_mode: see :func:`aggregate_loss`.
        global_batch: the mini-batch's counts when this is one micro-batch of it.

    Returns:
        ``(loss, clipfrac)``: 0-dim loss and the detached 0-dim fraction of
        valid tokens where the clipped error is strictly larger.
    """
    vpredclipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    clipped_vf_losses = torch.maximum(vf_losses1, vf_losses2)
    loss = 0.5 * aggregate_loss(clipped_vf_losses, response_mask, loss_agg_mode, global_batch)
    clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).to(vf_losses1.dtype), response_mask)
    return loss, clipfrac.detach()
