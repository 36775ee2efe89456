"""aggregate_loss modes on a mask with a gap, an empty row, and an empty mask."""

import pytest
import torch

from hybridflow.algorithms import UnknownNameError, aggregate_loss

LOSS = torch.tensor(
    [[1.0, 2.0, 3.0, 10.0], [4.0, 5.0, 6.0, 10.0], [7.0, 8.0, 9.0, 10.0]], dtype=torch.float64
)
# row 0 has a gap, row 2 is fully padded; selected losses: 1, 3 | 4 | -
MASK = torch.tensor([[1, 0, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)

EXPECTED = {
    "token-mean": 8 / 3,
    "token-sum": 8.0,
    "seq-mean-token-sum": (4 + 4) / 2,  # empty row excluded
    "seq-mean-token-mean": (2 + 4) / 2,  # empty row excluded
    "seq-mean-token-sum-norm": 8 / 4,  # divided by padded length
}


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_modes(mode):
    assert aggregate_loss(LOSS, MASK, mode).item() == pytest.approx(EXPECTED[mode])
    assert aggregate_loss(LOSS, MASK.bool(), mode).item() == pytest.approx(EXPECTED[mode])


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_all_zero_mask_gives_zero(mode):
    out = aggregate_loss(LOSS, torch.zeros_like(MASK), mode)
    assert out.item() == 0.0


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_inf_in_padding_gives_finite_loss_and_grad(mode):
    loss = LOSS.clone()
    loss[2, :] = float("inf")
    loss[0, 1] = float("nan")
    loss.requires_grad_(True)
    out = aggregate_loss(loss, MASK, mode)
    out.backward()
    assert out.item() == pytest.approx(EXPECTED[mode])
    assert torch.isfinite(loss.grad).all()
    assert (loss.grad[MASK == 0] == 0).all()


def test_default_mode_is_token_mean():
    assert aggregate_loss(LOSS, MASK).item() == pytest.approx(8 / 3)


def test_unknown_mode_lists_known_modes():
    with pytest.raises(UnknownNameError, match="seq-mean-token-mean"):
        aggregate_loss(LOSS, MASK, "seq-sum")


def test_shape_mismatch():
    with pytest.raises(ValueError, match="shape"):
        aggregate_loss(LOSS, MASK[:, :2], "token-mean")
