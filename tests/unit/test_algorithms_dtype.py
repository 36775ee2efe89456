"""Every algorithm function returns the dtype of its inputs (float64 in, float64 out, no float32 inside)."""

import pytest
import torch

from hybridflow.algorithms import (ADVANTAGE_ESTIMATORS, KL_PENALTIES, compute_advantage, compute_policy_loss_vanilla,
                                   kl_penalty, value_loss)

B, T = 4, 5
g = torch.Generator().manual_seed(0)
# values that float32 cannot hold: a float32 round trip inside would change them
TINY = 1e-12


def _f64(*shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64) + TINY


MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.float64)


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_advantage_estimators_keep_float64(name):
    adv, ret = compute_advantage(name, _f64(B, T), MASK, values=_f64(B, T), index=[0, 0, 1, 1],
                                 reward_baselines=_f64(B), gamma=0.99, lam=0.95, old_log_probs=_f64(B, T),
                                 sum_pi_squared=_f64(B, T))
    assert adv.dtype == ret.dtype == torch.float64


def test_losses_keep_float64():
    loss, metrics = compute_policy_loss_vanilla(_f64(B, T), _f64(B, T), _f64(B, T), MASK)
    assert loss.dtype == torch.float64 and {m.dtype for m in metrics.values()} == {torch.float64}
    vloss, clipfrac = value_loss(_f64(B, T), _f64(B, T), _f64(B, T), MASK, cliprange_value=0.5)
    assert vloss.dtype == clipfrac.dtype == torch.float64


@pytest.mark.parametrize("name", KL_PENALTIES.names())
def test_kl_penalties_keep_float64(name):
    assert kl_penalty(_f64(B, T), _f64(B, T), name).dtype == torch.float64


def test_float64_matches_a_float64_reference():
    # GRPO by hand in float64: a float32 round trip would lose the 1e-12 offsets
    scores = torch.tensor([1.0 + 1e-12, 1.0, 3.0, 5.0], dtype=torch.float64)
    rewards = torch.zeros(4, 2, dtype=torch.float64)
    rewards[:, -1] = scores
    adv, _ = compute_advantage("grpo", rewards, torch.ones(4, 2, dtype=torch.float64), index=[0, 0, 1, 1],
                               norm_adv_by_std_in_grpo=False)
    assert adv[0, 0].item() == pytest.approx(0.5e-12, abs=1e-16) and adv[0, 0].item() != 0.0
