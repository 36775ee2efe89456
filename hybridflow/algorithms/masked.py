"""Masked reductions used by every estimator and loss.

Masks are {0,1} tensors (float or bool) broadcastable to ``values``.  Entries
outside the mask are selected away with ``torch.where`` rather than multiplied
by zero, so a ``nan``/``inf`` in padding (e.g. a log-prob of a pad token)
cannot leak into the result.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

Dim = Optional[Union[int, tuple]]


def _as_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``mask`` as a float tensor of ``like``'s dtype (bool masks allowed)."""
    return mask.to(dtype=like.dtype if like.is_floating_point() else torch.float32)


def _pick_dim(dim: Dim, axis: Dim) -> Dim:
    # ``axis`` is accepted because verl call sites spell it that way.
    if dim is not None and axis is not None:
        raise TypeError("pass only one of dim / axis")
    return dim if dim is not None else axis


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: Dim = None, *, axis: Dim = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set.

    Shapes: ``values`` [...], ``mask`` broadcastable to it; returns the
    reduction over ``dim`` (all dims when ``None`` -> 0-dim tensor).
    """
    dim = _pick_dim(dim, axis)
    m = _as_mask(mask, values)
    valid = torch.where(m.bool(), values, torch.zeros_like(values))
    total = valid * m
    return total.sum() if dim is None else total.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: Dim = None, *, axis: Dim = None) -> torch.Tensor:
    """Mean of ``values`` over masked entries (verl: ``sum / (count + 1e-8)``).

    The ``1e-8`` keeps an all-zero mask at 0 instead of NaN.
    Shapes: as :func:`masked_sum`.
    """
    dim = _pick_dim(dim, axis)
    m = _as_mask(mask, values)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return masked_sum(values, m, dim) / (count + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all masked entries (0-dim tensor).

    ``unbiased`` applies Bessel's correction ``n / (n - 1)`` with ``n`` the
    number of masked entries, as verl does.

    Raises:
        ValueError: when ``unbiased`` and fewer than two entries are masked
            (the correction would divide by zero).
    """
    m = _as_mask(mask, values)
    mean = masked_mean(values, m)
    variance = masked_mean((values - mean) ** 2, m)
    if unbiased:
        n = m.sum()
        if n == 0:
            raise ValueError("masked_var: the mask selects no element")
        if n == 1:
            raise ValueError("masked_var: the mask selects one element; unbiased variance is undefined")
        variance = variance * (n / (n - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise ``values`` with mean/unbiased variance over masked entries.

    Returns ``(values - mean) * rsqrt(var + 1e-8)`` with the same shape as
    ``values``.  Masked-out entries are transformed too and NOT re-masked
    (matching verl); callers multiply by the mask when they need zeros there.
    With ``shift_mean=False`` the mean is added back (scale only).
    """
    m = _as_mask(mask, values)
    mean, var = masked_mean(values, m), masked_var(values, m)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened
