"""Clipped value loss."""

import pytest
import torch

from hybridflow.algorithms import UnknownNameError, value_loss

# cliprange 0.5, old values 0:
#  1: v=1.0, R=2 -> clip 0.5: (1-2)^2=1 vs (0.5-2)^2=2.25 -> 2.25 (clipped wins)
#  2: v=1.0, R=0 -> 1 vs 0.25 -> 1
#  3: v=0.2, R=1 -> inside the range: 0.64 vs 0.64 (tie, not counted as clipped)
#  4: padding
VPREDS = [[1.0, 1.0, 0.2, 100.0]]
RETURNS = [[2.0, 0.0, 1.0, -100.0]]
MASK = [[1, 1, 1, 0]]


def inputs():
    v = torch.tensor(VPREDS, dtype=torch.float64, requires_grad=True)
    return v, torch.tensor(RETURNS, dtype=torch.float64), torch.zeros(1, 4, dtype=torch.float64), torch.tensor(MASK)


def test_value_loss_token_mean_and_clipfrac():
    v, r, old, mask = inputs()
    loss, clipfrac = value_loss(v, r, old, mask, cliprange_value=0.5)
    assert loss.item() == pytest.approx(0.5 * (2.25 + 1.0 + 0.64) / 3)
    assert float(clipfrac) == pytest.approx(1 / 3)
    loss.backward()
    # token 1: clipped branch is constant in v -> 0; tokens 2,3: 0.5*2*(v-R)/3
    expected = torch.tensor([[0.0, 1.0 / 3, -0.8 / 3, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(v.grad, expected)


def test_value_loss_token_sum_and_bool_mask():
    v, r, old, mask = inputs()
    loss, _ = value_loss(v, r, old, mask.bool(), cliprange_value=0.5, loss_agg_mode="token-sum")
    assert loss.item() == pytest.approx(0.5 * 3.89)


def test_value_loss_unknown_mode():
    v, r, old, mask = inputs()
    with pytest.raises(UnknownNameError, match="token-mean"):
        value_loss(v, r, old, mask, cliprange_value=0.5, loss_agg_mode="mean")
