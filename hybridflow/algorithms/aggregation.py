"""Reduction of a per-token loss matrix to a scalar (``loss_agg_mode``).

The mode decides how much weight each token / sequence gets in the gradient,
so it must match verl's ``agg_loss`` exactly:

* ``token-mean``: every valid token weighs the same (masked mean).
* ``token-sum``: plain sum over valid tokens.
* ``seq-mean-token-sum``: sum within a sequence, mean over sequences.
* ``seq-mean-token-mean``: mean within a sequence, mean over sequences.
* ``seq-mean-token-sum-norm``: total sum divided by the padded length
  (Dr. GRPO), a constant that does not depend on response lengths.

Sequence-level means only count rows with at least one valid token, so an
empty (fully padded) row does not dilute the mean, and an all-zero mask gives
0 rather than NaN.
"""

from __future__ import annotations

import torch

from .masked import _as_mask, masked_mean, masked_sum
from .registry import LOSS_AGG_MODES, register_loss_agg


def _mean_over_valid_rows(seq_losses: torch.Tensor, row_valid: torch.Tensor) -> torch.Tensor:
    """Mean of ``seq_losses`` [B] over rows where ``row_valid`` [B] is true; 0 if none."""
    n = row_valid.sum()
    total = torch.where(row_valid, seq_losses, torch.zeros_like(seq_losses)).sum()
    return total / n.clamp(min=1).to(seq_losses.dtype)


@register_loss_agg("token-mean")
def _token_mean(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(loss_mat, mask)


@register_loss_agg("token-sum")
def _token_sum(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_sum(loss_mat, mask)


@register_loss_agg("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = _as_mask(mask, loss_mat)
    seq_losses = masked_sum(loss_mat, m, dim=-1)
    return _mean_over_valid_rows(seq_losses, m.sum(dim=-1) > 0)


@register_loss_agg("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = _as_mask(mask, loss_mat)
    counts = m.sum(dim=-1)
    # clamp only guards the empty rows, which _mean_over_valid_rows drops anyway
    seq_losses = masked_sum(loss_mat, m, dim=-1) / counts.clamp(min=1)
    return _mean_over_valid_rows(seq_losses, counts > 0)


@register_loss_agg("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    seq_losses = masked_sum(loss_mat, mask, dim=-1)
    return seq_losses.sum() / mask.shape[-1]


def aggregate_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """Aggregate a per-token loss to a 0-dim tensor.

    Args:
        loss_mat: [batch, response_len] per-token losses.
        mask: [batch, response_len] {0,1} (float or bool) valid-token mask.
        mode: one of :data:`LOSS_AGG_MODES` names (see module docstring).

    Returns:
        0-dim tensor.

    Raises:
        UnknownNameError: on an unknown ``mode``.
    """
    if loss_mat.shape != mask.shape:
        raise ValueError(f"loss_mat shape {tuple(loss_mat.shape)} != mask shape {tuple(mask.shape)}")
    return LOSS_AGG_MODES.get(mode)(loss_mat, mask)
