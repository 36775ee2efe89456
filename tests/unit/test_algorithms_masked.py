"""masked_sum / masked_mean / masked_var / masked_whiten / entropy_from_logits."""

import math

import pytest
import torch

from hybridflow.algorithms import (
    entropy_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)


def t(x):
    return torch.tensor(x, dtype=torch.float64)


VALUES = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = t([[1, 1, 0], [1, 0, 0]])  # selected: 1, 2, 4


def test_masked_sum_and_mean():
    assert masked_sum(VALUES, MASK).item() == pytest.approx(7.0)
    assert masked_mean(VALUES, MASK).item() == pytest.approx(7.0 / 3.0)
    torch.testing.assert_close(masked_mean(VALUES, MASK, dim=-1), t([1.5, 4.0]))
    torch.testing.assert_close(masked_mean(VALUES, MASK, axis=-1), t([1.5, 4.0]))


def test_bool_mask_matches_float_mask():
    assert masked_mean(VALUES, MASK.bool()).item() == pytest.approx(7.0 / 3.0)
    torch.testing.assert_close(masked_whiten(VALUES, MASK.bool()), masked_whiten(VALUES, MASK))


def test_nan_in_padding_does_not_leak():
    values = t([[1.0, float("nan"), float("inf")]])
    mask = t([[1, 0, 0]])
    assert masked_mean(values, mask).item() == pytest.approx(1.0)


def test_masked_mean_all_zero_mask_is_zero():
    assert masked_mean(VALUES, torch.zeros_like(MASK)).item() == 0.0


def test_masked_var_unbiased_and_biased():
    # 1, 2, 4: mean 7/3, squared deviations sum 42/9
    assert masked_var(VALUES, MASK).item() == pytest.approx((42 / 9) / 2)
    assert masked_var(VALUES, MASK, unbiased=False).item() == pytest.approx((42 / 9) / 3)


@pytest.mark.parametrize("mask", [[[0, 0, 0], [0, 0, 0]], [[0, 1, 0], [0, 0, 0]]])
def test_masked_var_needs_two_elements(mask):
    with pytest.raises(ValueError, match="mask"):
        masked_var(VALUES, t(mask))


def test_masked_whiten_is_not_remasked():
    out = masked_whiten(VALUES, MASK)
    mean, std = 7 / 3, math.sqrt(7 / 3 + 1e-8)
    expected = [[(v - mean) / std for v in row] for row in VALUES.tolist()]
    torch.testing.assert_close(out, t(expected))
    assert out[0, 2].item() != 0.0  # padding transformed too, like verl


def test_masked_whiten_without_mean_shift():
    out = masked_whiten(VALUES, MASK, shift_mean=False)
    mean, std = 7 / 3, math.sqrt(7 / 3 + 1e-8)
    assert out[0, 0].item() == pytest.approx((1 - mean) / std + mean)


def test_entropy_from_logits():
    uniform = torch.zeros(2, 3, 4, dtype=torch.float64)
    torch.testing.assert_close(entropy_from_logits(uniform), torch.full((2, 3), math.log(4), dtype=torch.float64))
    # p = [1/4, 3/4]
    h = entropy_from_logits(t([0.0, math.log(3.0)])).item()
    assert h == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    # huge logits stay finite
    assert entropy_from_logits(t([1000.0, 1000.0])).item() == pytest.approx(math.log(2))
