"""PPO 'vanilla' policy loss: asymmetric clip, dual clip, extreme log-ratios."""

import math

import pytest
import torch

from hybridflow.algorithms import compute_policy_loss_vanilla

# Per token (old_log_prob = 0, so log_prob = log ratio); clip low 0.2, high 0.28, c 3:
#  1: A=+1, r=1.5  -> l1=-1.5,  l2=-1.28 -> -1.28   (clipped)
#  2: A=+1, r=0.5  -> l1=-0.5,  l2=-0.8  -> -0.5
#  3: A=-1, r=0.5  -> l1=0.5,   l2=0.8   -> 0.8     (clipped), l3=3 not hit
#  4: A=-1, r=5    -> l1=5,     l2=1.28  -> 5 -> min(3, 5) = 3   (dual clip)
#  5: A=-2, logr=+50 -> clamped to 20: l1=2e^20 -> min(6, .) = 6 (dual clip)
#  6: A=+1, logr=-50 -> clamped to -20: l1=-e^-20, l2=-0.8 -> -e^-20
#  two padding tokens (mask 0, A=+5) that must not count anywhere
LOG_RATIO = [[math.log(1.5), math.log(0.5), math.log(0.5), math.log(5.0)], [50.0, 3.0, -50.0, 1.0]]
ADV = [[1.0, 1.0, -1.0, -1.0], [-2.0, 5.0, 1.0, 5.0]]
MASK = [[1, 1, 1, 1], [1, 0, 1, 0]]
TOKEN_LOSSES = [-1.28, -0.5, 0.8, 3.0, 6.0, -math.exp(-20)]
KW = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)


def inputs(mask_dtype=torch.float64):
    log_prob = torch.tensor(LOG_RATIO, dtype=torch.float64, requires_grad=True)
    old = torch.zeros(2, 4, dtype=torch.float64)
    return old, log_prob, torch.tensor(ADV, dtype=torch.float64), torch.tensor(MASK, dtype=mask_dtype)


def test_vanilla_loss_and_metrics():
    old, log_prob, adv, mask = inputs()
    loss, metrics = compute_policy_loss_vanilla(old, log_prob, adv, mask, **KW)
    assert loss.item() == pytest.approx(sum(TOKEN_LOSSES) / 6)
    assert float(metrics["pg_clipfrac"]) == pytest.approx(2 / 6)  # tokens 1, 3
    assert float(metrics["pg_clipfrac_lower"]) == pytest.approx(2 / 6)  # tokens 4, 5
    # ppo_kl = mean of -(clamped log ratio) over valid tokens
    logr = [math.log(1.5), math.log(0.5), math.log(0.5), math.log(5.0), 20.0, -20.0]
    assert float(metrics["ppo_kl"]) == pytest.approx(-sum(logr) / 6)
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())


def test_vanilla_gradient_only_through_unclipped_tokens():
    old, log_prob, adv, mask = inputs()
    loss, _ = compute_policy_loss_vanilla(old, log_prob, adv, mask, **KW)
    loss.backward()
    # only token 2 is unclipped inside the clamp range: d(-A r)/dlogp = -A r = -0.5
    expected = torch.zeros(2, 4, dtype=torch.float64)
    expected[0, 1] = -0.5 / 6
    torch.testing.assert_close(log_prob.grad, expected)


def test_vanilla_seq_mode_and_bool_mask():
    old, log_prob, adv, mask = inputs(torch.bool)
    loss, _ = compute_policy_loss_vanilla(old, log_prob, adv, mask, loss_agg_mode="seq-mean-token-sum", **KW)
    row0 = sum(TOKEN_LOSSES[:4])
    row1 = sum(TOKEN_LOSSES[4:])
    assert loss.item() == pytest.approx((row0 + row1) / 2)


def test_symmetric_default_clip():
    old = torch.zeros(1, 2)
    log_prob = torch.log(torch.tensor([[1.5, 1.1]]))
    adv = torch.ones(1, 2)
    loss, metrics = compute_policy_loss_vanilla(old, log_prob, adv, torch.ones(1, 2))
    assert loss.item() == pytest.approx((-1.2 - 1.1) / 2, abs=1e-6)
    assert float(metrics["pg_clipfrac"]) == pytest.approx(0.5)
    assert float(metrics["pg_clipfrac_lower"]) == 0.0


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_dual_clip_constant_must_exceed_one(c):
    old, log_prob, adv, mask = inputs()
    with pytest.raises(AssertionError, match="clip_ratio_c"):
        compute_policy_loss_vanilla(old, log_prob, adv, mask, clip_ratio_c=c)
