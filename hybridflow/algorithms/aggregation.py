"""Reduction of a per-token loss matrix to a scalar (``loss_agg_mode``), as verl 0.9.1's ``agg_loss``.

A step's loss is normalized over its whole mini-batch: a micro-batch's loss is its share of the
mini-batch's loss, divided by counts of the whole mini-batch (all micro-batches and data-parallel ranks;
:class:`GlobalBatch`), so the gradient does not depend on how the mini-batch is split:

* ``token-mean``: sum over valid tokens / valid tokens of the mini-batch.
* ``token-sum``: plain sum over valid tokens.
* ``seq-mean-token-sum``: per-sequence sums, summed / sequences (with a valid token) of the mini-batch.
* ``seq-mean-token-mean``: per-sequence means (token sum / token count), summed / sequences of the mini-batch.
* ``seq-mean-token-sum-norm`` (Dr. GRPO): ``seq-mean-token-sum`` divided by ``loss_scale_factor``
  (default: the padded response length), a constant that does not depend on response lengths.

Without a :class:`GlobalBatch` the micro-batch is the whole batch. Sequences without a valid token never
count. The divisors are verl 0.9.1's (``agg_loss``) as its actor computes them, with one deliberate difference:

* A sequence's mean divides by its token count. verl's ``agg_loss`` writes ``count + 1e-8``, but its actor
  passes a bool mask (workers/utils/losses.py), so ``count`` is int64 and ``count + 1e-8`` a float32, which
  is ``count`` exactly for every non-empty row: these equal verl's actor to the last bit. (Called with a
  float mask, verl's own function divides by ``count + 1e-8`` in float64, ~1e-8 relative away.)
* The mini-batch's token or sequence count has no epsilon in verl either. Here it is clamped at 1: an empty
  mini-batch (all of it rejected by rollout correction, say) gives a loss of 0 and no gradient, where verl's
  ``0 / 0`` is NaN and poisons the step (the deliberate difference; any non-empty count is >= 1).

tests/fixtures/verl/rollout_corr_metrics.json holds verl's ``agg_loss`` outputs the unit tests compare with.

verl also multiplies by the data-parallel size to undo the gradient averaging of its backends; here that
belongs to the engine (workers/role_ops.py), which undoes megatron's averaging over micro-batches and
data-parallel ranks, so these stay pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .masked import _as_mask, masked_sum
from .registry import LOSS_AGG_MODES, register_loss_agg


@dataclass(frozen=True)
class GlobalBatch:
    """Counts of the whole mini-batch a micro-batch's loss is normalized by (verl's global batch info)."""

    num_tokens: float | None = None  # valid tokens
    num_seqs: float | None = None  # sequences with at least one valid token
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm divisor; None: the padded length

    @staticmethod
    def of(mask: torch.Tensor, loss_scale_factor: float | None = None) -> "GlobalBatch":
        """The counts of one (local) batch; sum them over ranks for the global ones."""
        return GlobalBatch(float(mask.sum()), float((mask.sum(-1) > 0).sum()), loss_scale_factor)


def _divide(total: torch.Tensor, count) -> torch.Tensor:
    # the mini-batch's token or sequence count, as verl's; clamped at 1 only so that an empty mini-batch (every
    # token rejected) gives 0 where verl's 0 / 0 is NaN (the deliberate difference, module docstring)
    return total / torch.as_tensor(count, dtype=total.dtype, device=total.device).clamp(min=1)


def _seq_mean(seq_losses: torch.Tensor, row_valid: torch.Tensor, batch: GlobalBatch | None) -> torch.Tensor:
    total = torch.where(row_valid, seq_losses, torch.zeros_like(seq_losses)).sum()
    return _divide(total, row_valid.sum() if batch is None or batch.num_seqs is None else batch.num_seqs)


@register_loss_agg("token-mean")
def _token_mean(loss_mat: torch.Tensor, mask: torch.Tensor, batch: GlobalBatch | None) -> torch.Tensor:
    m = _as_mask(mask, loss_mat)
    return _divide(masked_sum(loss_mat, m), m.sum() if batch is None or batch.num_tokens is None else batch.num_tokens)


@register_loss_agg("token-sum")
def _token_sum(loss_mat: torch.Tensor, mask: torch.Tensor, batch: GlobalBatch | None) -> torch.Tensor:
    return masked_sum(loss_mat, mask)


@register_loss_agg("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat: torch.Tensor, mask: torch.Tensor, batch: GlobalBatch | None) -> torch.Tensor:
    m = _as_mask(mask, loss_mat)
    return _seq_mean(masked_sum(loss_mat, m, dim=-1), m.sum(dim=-1) > 0, batch)


@register_loss_agg("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat: torch.Tensor, mask: torch.Tensor, batch: GlobalBatch | None) -> torch.Tensor:
    m = _as_mask(mask, loss_mat)
    counts = m.sum(dim=-1)
    # the row's token count: verl's count + 1e-8 as its actor computes it (module docstring); the clamp only
    # guards the empty rows, which _seq_mean drops anyway
    return _seq_mean(masked_sum(loss_mat, m, dim=-1) / counts.clamp(min=1), counts > 0, batch)


@register_loss_agg("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss_mat: torch.Tensor, mask: torch.Tensor, batch: GlobalBatch | None) -> torch.Tensor:
    factor = batch.loss_scale_factor if batch is not None and batch.loss_scale_factor is not None else mask.shape[-1]
    return _seq_mean_token_sum(loss_mat, mask, batch) / factor


def aggregate_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
                   batch: GlobalBatch | None = None) -> torch.Tensor:
    """Aggregate a per-token loss to a 0-dim tensor of ``loss_mat``'s dtype.

    Args:
        loss_mat: [batch, response_len] per-token losses.
        mask: [batch, response_len] {0,1} (float or bool) valid-token mask.
        mode: one of :data:`LOSS_AGG_MODES` names (see module docstring).
        batch: the whole mini-batch's counts when ``loss_mat`` is one micro-batch of it.

    Raises:
        UnknownNameError: on an unknown ``mode``.
    """
    if loss_mat.shape != mask.shape:
        raise ValueError(f"loss_mat shape {tuple(loss_mat.shape)} != mask shape {tuple(mask.shape)}")
    return LOSS_AGG_MODES.get(mode)(loss_mat, mask, batch)
