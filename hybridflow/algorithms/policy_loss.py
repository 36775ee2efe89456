"""The PPO clipped policy loss (verl's ``vanilla``), with asymmetric and dual clipping; the settings every
registered policy loss reads.

Every loss in ``registry.POLICY_LOSSES`` has one signature, so the actor calls whichever
``actor.policy_loss.loss_mode`` names::

    loss, metrics = POLICY_LOSSES.get(mode)(old_log_prob, log_prob, advantages, response_mask,
                                            loss_agg_mode=..., config=actor_cfg, global_batch=whole,
                                            rollout_is_weights=None)

``config`` is the actor config section (``schema.Actor``: ``clip_ratio_low/high/c`` and ``policy_loss.*``;
anything with those attribute names; None: the schema's defaults). A setting that is None takes verl
0.9.1's in-code fallback, as verl's ``x if x is not None else default`` does. ``global_batch`` holds the
mini-batch's counts when the tensors are one micro-batch of it (:class:`~.aggregation.GlobalBatch`).
``rollout_is_weights``: rollout correction's detached IS weights [B, T] (algorithms/rollout_correction.py), or
None; each loss applies them where verl 0.9.1's does.
Losses return ``(loss, metrics)``: a 0-dim loss of the inputs' dtype and verl's metrics (without the
``actor/`` prefix) as detached 0-dim tensors.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from hybridflow.config.schema import Actor

from .aggregation import GlobalBatch, aggregate_loss
from .masked import masked_mean
from .registry import register_policy_loss

Tensor = torch.Tensor


def actor_settings(config: Any) -> Any:
    """The actor config the losses read: ``config``, or the schema's defaults when None."""
    if config is None:
        return Actor()
    return config


def setting(config: Any, name: str, default: Any) -> Any:
    """``config.name``, or ``default`` when it is missing or None (verl's fallback)."""
    value = getattr(config, name, None)
    return default if value is None else value


def policy_loss_setting(config: Any, name: str, default: Any) -> Any:
    """``config.policy_loss.name``, or ``default`` when missing or None."""
    return setting(getattr(config, "policy_loss", None), name, default)


def clip_range(config: Any) -> Tuple[float, float]:
    """``(clip_ratio_low, clip_ratio_high)``; verl falls back to ``clip_ratio`` (0.2), which is set through
    both here."""
    return setting(config, "clip_ratio_low", 0.2), setting(config, "clip_ratio_high", 0.2)


def clamped_log_ratio(old_log_prob: Tensor, log_prob: Tensor) -> Tensor:
    # clamp before exp: a log-ratio of +-20 is already far outside any clip range and keeps ratio finite
    return torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)


def zero_metric(like: Tensor) -> Tensor:
    """verl's placeholder 0 for a metric a loss does not have, in the inputs' dtype."""
    return torch.zeros((), dtype=like.dtype, device=like.device)


def weighted(pg_losses: Tensor, rollout_is_weights: Tensor | None) -> Tensor:
    """The per-token losses times rollout correction's (detached) IS weights, before aggregation, as every verl
    0.9.1 loss but ``geo_mean`` applies them (``pg_losses = pg_losses * rollout_is_weights``)."""
    return pg_losses if rollout_is_weights is None else pg_losses * rollout_is_weights


def _clip_ratios(config: Any, low: float | None, high: float | None, c: float | None) -> Tuple[float, float, float]:
    """``(clip_ratio_low, clip_ratio_high, clip_ratio_c)``: each as given, else ``config``'s; ``c`` must be > 1."""
    config_low, config_high = clip_range(config)
    low = config_low if low is None else low
    high = config_high if high is None else high
    c = setting(config, "clip_ratio_c", 3.0) if c is None else c
    assert c > 1.0, (
        f"clip_ratio_c (dual-clip lower bound) must be > 1.0, got {c}"
    )
    return low, high, c


def _dual_clip(advantages: Tensor, clip_pg_losses1: Tensor, clip_ratio_c: float, response_mask: Tensor,
               dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """Bound the clipped losses of negative-advantage tokens by ``-A * clip_ratio_c``.

    Returns ``(pg_losses, pg_clipfrac_lower)``: the per-token losses and the masked fraction of tokens the
    dual clip bounded."""
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    negative = advantages < 0
    pg_clipfrac_lower = masked_mean(
        (torch.gt(clip_pg_losses1, pg_losses3) & negative).to(dtype), response_mask
    )
    return torch.where(negative, clip_pg_losses2, clip_pg_losses1), pg_clipfrac_lower


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, *,
    loss_agg_mode: str = "token-mean", config: Any = None, global_batch: GlobalBatch | None = None,
    clip_ratio_low: float | None = None, clip_ratio_high: float | None = None, clip_ratio_c: float | None = None,
    rollout_is_weights: Tensor | None = None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """PPO clipped surrogate with asymmetric clip and dual clip.

    Dual clip (https://arxiv.org/abs/1912.09729) bounds the loss of
    negative-advantage tokens by ``-A * clip_ratio_c``, so a token whose ratio
    exploded cannot dominate the update.

    Args:
        old_log_prob, log_prob, advantages, response_mask: [B, T].
        loss_agg_mode: see :func:`aggregate_loss`.
        config: the actor config (module docstring); its ``clip_ratio_low/high/c``.
        global_batch: the mini-batch's counts when this is one micro-batch of it.
        clip_ratio_low, clip_ratio_high: ratio clipped to ``[1 - low, 1 + high]``; given, they win over
            ``config``'s.
        clip_ratio_c: dual-clip bound, must be > 1; given, it wins over ``config``'s.
        rollout_is_weights: rollout correction's truncated IS weights [B, T] (None: none), multiplying each
            token's loss before aggregation, as verl.

    Returns:
        ``(loss, metrics)``: 0-dim loss; metrics ``pg_clipfrac``, ``ppo_kl``,
        ``pg_clipfrac_lower`` as detached 0-dim tensors.
    """
    clip_ratio_low, clip_ratio_high, clip_ratio_c = _clip_ratios(
        actor_settings(config), clip_ratio_low, clip_ratio_high, clip_ratio_c)
    negative_approx_kl = clamped_log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).to(ratio.dtype), response_mask)

    pg_losses, pg_clipfrac_lower = _dual_clip(advantages, clip_pg_losses1, clip_ratio_c, response_mask, ratio.dtype)
    pg_losses = weighted(pg_losses, rollout_is_weights)
    loss = aggregate_loss(pg_losses, response_mask, loss_agg_mode, global_batch)
    return loss, {"pg_clipfrac": pg_clipfrac.detach(), "ppo_kl": ppo_kl.detach(),
                  "pg_clipfrac_lower": pg_clipfrac_lower.detach()}
