"""The tolerance policy (tests/numerics.py) passes rounding and fails real differences."""

from __future__ import annotations

import pytest
import torch

from tests.numerics import assert_close, used_fraction


@pytest.fixture(autouse=True)
def _no_report(monkeypatch):
    """These comparisons exceed their tolerance on purpose: keep them out of the sweep's report."""
    monkeypatch.delenv("HYBRIDFLOW_TOL_REPORT", raising=False)


def test_relative_to_magnitude_not_absolute():
    assert_close(224.0 * (1 + 5e-8), 224.0)  # the cross-CPU difference a bare 1e-5 rejected
    with pytest.raises(AssertionError, match="differs by"):
        assert_close(224.0 * (1 + 1e-4), 224.0)
    with pytest.raises(AssertionError):
        assert_close(1e-3 * (1 + 1e-3), 1e-3)  # a small value is held to its own scale


def test_a_dict_is_one_quantity():
    """A bias near zero in a model of O(1) weights is held to the model's scale."""
    weights = {"w": torch.tensor([1.0, -0.5]), "bias": torch.tensor([1e-3])}
    moved = {"w": torch.tensor([1.0, -0.5]), "bias": torch.tensor([1e-3 + 5e-6])}
    assert_close(moved, weights)
    with pytest.raises(AssertionError, match=r"\[bias\]"):
        assert_close({**moved, "w": weights["w"] * 1e-3}, {**weights, "w": weights["w"] * 1e-3})
    with pytest.raises(AssertionError, match="keys differ"):
        assert_close({"w": weights["w"]}, weights)


def test_dtype_and_slack_scale_the_tolerance():
    x = torch.tensor([1.0, 2.0, 4.0])
    assert_close(x * (1 + 1e-2), x, dtype=torch.bfloat16)
    with pytest.raises(AssertionError):
        assert_close(x * (1 + 1e-2), x)
    assert_close(x * (1 + 1e-4), x, slack=10)
    assert used_fraction(x * (1 + 1e-5), x) == pytest.approx(0.5, rel=1e-2)  # x*1e-5 of 1e-5*(x + 4)


def test_non_finite_values_must_match_exactly():
    assert_close(torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), 1.0]))
    with pytest.raises(AssertionError):
        assert_close(torch.tensor([float("nan")]), torch.tensor([1.0]))
    with pytest.raises(AssertionError):
        assert_close(torch.tensor([float("inf")]), torch.tensor([-float("inf")]))
    with pytest.raises(AssertionError, match="shapes differ"):
        assert_close(torch.zeros(2), torch.zeros(3))
