"""Entropy of categorical distributions given as logits."""

from __future__ import annotations

import torch


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy over the last dim: ``logsumexp(z) - sum(softmax(z) * z)``.

    This form avoids materialising ``log_softmax`` (one fewer [.., V] tensor),
    which matters at vocabulary size.

    Shapes: ``logits`` [..., vocab] -> [...].
    """
    pd = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)
