"""aggregate_loss modes on a mask with a gap, an empty row, and an empty mask; against verl 0.9.1's agg_loss."""

import json
from pathlib import Path

import pytest
import torch

from hybridflow.algorithms import GlobalBatch, UnknownNameError, aggregate_loss
from tests.numerics import assert_close

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
    "seq-mean-token-sum-norm": (4 + 4) / 2 / 4,  # Dr. GRPO: the seq-mean of token sums / padded length
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


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_micro_batches_sum_to_the_whole_batch(mode):
    """verl 0.9.1's global normalization: each micro-batch divides by the whole mini-batch's counts, so
    the micro-batch losses add up to the whole batch's loss however it is split."""
    whole = GlobalBatch.of(MASK)
    assert (whole.num_tokens, whole.num_seqs) == (3.0, 2.0)
    for split in ([0, 1], [0], [1, 2]):  # row 0 alone / rows 0 and 1 / rows 1 and 2 with the empty one
        rest = [i for i in range(3) if i not in split]
        parts = [aggregate_loss(LOSS[rows], MASK[rows], mode, whole) for rows in (split, rest)]
        assert (parts[0] + parts[1]).item() == pytest.approx(EXPECTED[mode])


def test_global_counts_by_hand():
    # rows 0 and 1 of a mini-batch of 10 valid tokens in 5 sequences: 8 / 10 and (4 + 4) / 5
    batch = GlobalBatch(num_tokens=10, num_seqs=5)
    assert aggregate_loss(LOSS, MASK, "token-mean", batch).item() == pytest.approx(0.8)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum", batch).item() == pytest.approx(1.6)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-mean", batch).item() == pytest.approx((2 + 4) / 5)
    assert aggregate_loss(LOSS, MASK, "token-sum", batch).item() == pytest.approx(8.0)


def test_loss_scale_factor_replaces_the_padded_length():
    batch = GlobalBatch(num_seqs=2, loss_scale_factor=16)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", batch).item() == pytest.approx(4 / 16)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", GlobalBatch(num_seqs=4)).item() == pytest.approx(8 / 4 / 4)


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_dtype_is_kept(mode):
    assert aggregate_loss(LOSS, MASK, mode, GlobalBatch(3, 2, 7)).dtype == torch.float64
    assert aggregate_loss(LOSS.float(), MASK, mode).dtype == torch.float32


# verl 0.9.1's agg_loss on one batch (tests/fixtures/verl/make_rollout_corr_metrics.py ran verl's source)
VERL = json.loads((Path(__file__).parents[1] / "fixtures" / "verl" / "rollout_corr_metrics.json").read_text())


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_divisors_are_verls_actor(mode):
    """Equal to verl's agg_loss as its actor calls it (a bool mask: seq-mean-token-mean's count + 1e-8 is a
    float32, the count itself), with a float or a bool mask here; verl's function given a float mask divides by
    count + 1e-8 in float64 instead, a documented ~1e-8 relative difference (aggregation.py)."""
    x = {k: torch.tensor(v, dtype=torch.float64) for k, v in VERL["inputs"].items()}
    adv, mask = x["advantages"], x["response_mask"]
    batch = GlobalBatch(loss_scale_factor=VERL["losses"]["loss_scale_factor"])
    for m in (mask, mask.bool()):
        assert_close(aggregate_loss(adv, m, mode, batch), VERL["losses"]["agg_loss"][mode], dtype=torch.float64,
                     what=f"{mode} vs verl's actor")
    float_mask = VERL["losses"]["agg_loss_float_mask"][mode]
    ours = aggregate_loss(adv, mask, mode, batch).item()
    assert abs(ours - float_mask) <= 1e-7 * abs(float_mask)
    if mode == "seq-mean-token-mean":  # the +1e-8 shows: far above float64 noise (1e-16)
        assert abs(ours - float_mask) > 1e-10 * abs(float_mask)
