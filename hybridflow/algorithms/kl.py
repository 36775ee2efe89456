"""Per-token KL estimators between the policy and the reference policy.

Kinds (http://joschu.net/blog/kl-approx.html):

* ``k1`` / ``kl``: ``logp - ref``.
* ``abs``: ``|logp - ref|``.
* ``k2`` / ``mse``: ``0.5 * (logp - ref)^2``.
* ``k3`` / ``low_var_kl``: ``exp(ref - logp) - (ref - logp) - 1``, with the
  log-ratio clamped to +-20 and the result to +-10 for numerical safety.

A ``+`` suffix (``k3+``, ``low_var_kl+`` ...) keeps the forward value of the
kind but back-propagates the gradient of k2 (straight-through), because k2's
gradient is an unbiased KL gradient estimate while k1/k3 are not when used as
a loss.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from .aggregation import GlobalBatch, aggregate_loss
from .registry import KL_PENALTIES, UnknownNameError, register_kl_penalty

Tensor = torch.Tensor


@register_kl_penalty("k1", "kl")
def kl_k1(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """``logp - ref``; shapes [B, T] -> [B, T]."""
    return log_prob - ref_log_prob


@register_kl_penalty("abs")
def kl_abs(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """``|logp - ref|``; shapes [B, T] -> [B, T]."""
    return (log_prob - ref_log_prob).abs()


@register_kl_penalty("k2", "mse")
def kl_k2(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """``0.5 * (logp - ref)^2``; shapes [B, T] -> [B, T]."""
    return 0.5 * (log_prob - ref_log_prob).square()


@register_kl_penalty("k3", "low_var_kl")
def kl_k3(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """Low-variance non-negative estimator; shapes [B, T] -> [B, T].

    Clamps (log-ratio to +-20, result to +-10) keep ``exp`` finite when the
    policies diverge.
    """
    kl = torch.clamp(ref_log_prob - log_prob, min=-20.0, max=20.0)
    kld = torch.exp(kl) - kl - 1
    return torch.clamp(kld, min=-10.0, max=10.0)


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate of ``kind`` (see module docstring).

    Args:
        log_prob: [B, T] policy log-probs of the sampled tokens.
        ref_log_prob: [B, T] reference log-probs.
        kind: a registered kind, optionally suffixed with ``+``.

    Returns:
        [B, T] tensor.  For ``kind+`` its value equals ``kind``'s and its
        gradient equals k2's.

    Raises:
        UnknownNameError: on an unknown kind.
    """
    straight_through = isinstance(kind, str) and kind.endswith("+")
    base = kind[:-1] if straight_through else kind
    try:
        fn = KL_PENALTIES.get(base)
    except KeyError:
        # re-raise with the name as given and the '+' variants spelled out
        known = KL_PENALTIES.names()
        raise UnknownNameError(
            f"unknown kl penalty kind {kind!r}; known: {', '.join(known)} "
            f"(each also with a '+' suffix)"
        ) from None
    forward = fn(log_prob, ref_log_prob)
    if not straight_through or fn is kl_k2:
        return forward
    backward = kl_k2(log_prob, ref_log_prob)
    return backward + (forward - backward).detach()


def kl_loss(log_prob: Tensor, ref_log_prob: Tensor, response_mask: Tensor, config: Any,
            global_batch: GlobalBatch | None = None) -> Tuple[Tensor, Dict[str, Any]]:
    """The actor's KL-to-reference loss (``actor.use_kl_loss``), as verl 0.9.1's ``ppo_loss``
    (workers/utils/losses.py): the ``config.kl_loss_type`` estimate aggregated with ``config.loss_agg_mode``
    over the mini-batch; the caller adds ``kl_loss_coef`` times it to the loss. Metrics by verl's names (its
    trainer prefixes ``actor/``): ``kl_loss``, the aggregated term, and ``kl_coef``, ``kl_loss_coef``."""
    kl = aggregate_loss(kl_penalty(log_prob, ref_log_prob, config.kl_loss_type), response_mask, config.loss_agg_mode,
                        global_batch)
    return kl, {"kl_loss": kl.detach(), "kl_coef": float(config.kl_loss_coef)}
