"""kl_penalty kinds, straight-through '+' variants, and KL controllers."""

import math

import pytest
import torch

from hybridflow.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    GlobalBatch,
    UnknownNameError,
    kl_loss,
    kl_penalty,
    make_kl_controller,
)
from hybridflow.config.schema import Actor

LOGP = [0.0, -1.0, 0.3, -50.0, 0.0, 0.0, 0.0]
REF = [0.0, -0.5, -0.2, 0.0, -50.0, -3.0, 2.0]
D = [lp - r for lp, r in zip(LOGP, REF)]
K3 = [
    0.0,
    math.exp(0.5) - 0.5 - 1,
    math.exp(-0.5) + 0.5 - 1,
    10.0,  # ref-logp = 50 -> clamped 20 -> e^20 - 21 -> clamped to 10
    10.0,  # ref-logp = -50 -> clamped -20 -> e^-20 + 19 -> clamped to 10
    math.exp(-3.0) + 3 - 1,
    math.exp(2.0) - 2 - 1,
]
EXPECTED = {
    "k1": D,
    "kl": D,
    "abs": [abs(d) for d in D],
    "k2": [0.5 * d * d for d in D],
    "mse": [0.5 * d * d for d in D],
    "k3": K3,
    "low_var_kl": K3,
}


def tensors():
    logp = torch.tensor([LOGP], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([REF], dtype=torch.float64, requires_grad=True)
    return logp, ref


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_forward_values(kind):
    logp, ref = tensors()
    want = torch.tensor([EXPECTED[kind]], dtype=torch.float64)
    torch.testing.assert_close(kl_penalty(logp, ref, kind), want)
    torch.testing.assert_close(kl_penalty(logp, ref, kind + "+"), want)


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_plus_suffix_has_k2_gradient(kind):
    logp, ref = tensors()
    kl_penalty(logp, ref, kind + "+").sum().backward()
    d = torch.tensor([D], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, d)  # d/dlogp 0.5 d^2
    torch.testing.assert_close(ref.grad, -d)


def test_k3_plain_gradient_differs_from_k3_plus():
    logp, ref = tensors()
    kl_penalty(logp, ref, "k3").sum().backward()
    # inside the clamps d k3 / d logp = 1 - exp(ref - logp); element 1: 1 - e^0.5
    assert logp.grad[0, 1].item() == pytest.approx(1 - math.exp(0.5))
    assert logp.grad[0, 3].item() == 0.0  # saturated at the clamp


@pytest.mark.parametrize("kind", ["k4", "k4+", "full", ""])
def test_unknown_kind(kind):
    logp, ref = tensors()
    with pytest.raises(UnknownNameError, match="low_var_kl"):
        kl_penalty(logp, ref, kind)


def test_kl_loss_reports_verls_kl_loss_and_kl_coef():
    """actor.use_kl_loss: the kl_loss_type estimate aggregated with loss_agg_mode over the mini-batch, and
    verl's metrics kl_loss and kl_coef (actor/kl_loss, actor/kl_coef once the actor prefixes them)."""
    logp, ref = tensors()
    mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1]])
    cfg = Actor(use_kl_loss=True, kl_loss_coef=0.25, kl_loss_type="k2", loss_agg_mode="token-mean")
    kl, metrics = kl_loss(logp, ref, mask, cfg, GlobalBatch(num_tokens=10.0))
    want = sum(0.5 * d * d for d, m in zip(D, mask[0].tolist()) if m) / 10
    assert kl.item() == pytest.approx(want) and kl.requires_grad
    assert set(metrics) == {"kl_loss", "kl_coef"}
    assert metrics["kl_coef"] == 0.25 and metrics["kl_loss"].item() == pytest.approx(want)
    assert not metrics["kl_loss"].requires_grad


def test_fixed_controller():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, 1000)
    assert ctl.value == 0.05


def test_adaptive_controller():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctl.update(9.0, 1000)  # error 0.5 clipped to 0.2 -> x(1 + 0.02)
    assert ctl.value == pytest.approx(0.102)
    ctl.update(5.4, 1000)  # error -0.1 -> x(1 - 0.01)
    assert ctl.value == pytest.approx(0.102 * 0.99)
    ctl.update(0.0, 2000)  # error -1 clipped to -0.2 -> x(1 - 0.04)
    assert ctl.value == pytest.approx(0.102 * 0.99 * 0.96)


def test_make_kl_controller():
    assert isinstance(make_kl_controller("fixed", kl_coef=0.1), FixedKLController)
    cfg = dict(kl_coef=0.2, target_kl=6.0, horizon=10000)
    assert make_kl_controller("fixed", **cfg).value == 0.2  # extra keys ignored
    ad = make_kl_controller("adaptive", **cfg)
    assert isinstance(ad, AdaptiveKLController) and ad.value == 0.2
    ad2 = make_kl_controller("adaptive", init_kl_coef=0.3, target_kl=1.0, horizon=10)
    assert ad2.value == 0.3 and ad2.target == 1.0 and ad2.horizon == 10
    with pytest.raises(ValueError, match="target_kl"):
        make_kl_controller("adaptive", kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_coef"):
        make_kl_controller("fixed")
    with pytest.raises(UnknownNameError, match="adaptive"):
        make_kl_controller("pid", kl_coef=0.1)
