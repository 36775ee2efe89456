"""On-policy distillation's losses (algorithms/distillation.py) against verl 0.9.1: the forward top-k KL equals
verl's own function (tests/fixtures/verl/make_distillation.py ran its source) in values, diagnostics and gradient
with respect to the student's logits, with and without the log-prob clamp, from float32 and float64 inputs; the
estimator losses, the clamp at +-loss_max_clamp, the policy-gradient and supervised forms and their combination
with the task's loss by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridflow.algorithms.distillation import (combined_loss, distillation_loss, estimator_losses,
                                                forward_kl_topk)
from tests.numerics import assert_close

VERL = json.loads((Path(__file__).parents[1] / "fixtures" / "verl" / "distillation.json").read_text())
DTYPES = (torch.float32, torch.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", VERL["cases"], ids=lambda c: f"clamp_{c['log_prob_min_clamp']}")
def test_forward_kl_topk_equals_verls_values_and_gradient(case, dtype):
    logits = torch.tensor(VERL["student_logits"], dtype=dtype, requires_grad=True)
    out = forward_kl_topk(logits, torch.tensor(VERL["teacher_topk_log_probs"], dtype=dtype),
                          torch.tensor(VERL["teacher_topk_ids"]), case["log_prob_min_clamp"])
    out["losses"].sum().backward()
    # verl's kl_divergence works in float32 whatever the input: its float32 rounding bounds the comparison
    for key in ("losses", "student_mass", "teacher_mass", "overlap_token_advantage"):
        assert_close(out[key], torch.tensor(case[key], dtype=out[key].dtype), dtype=torch.float32, what=key)
    assert out["overlap_count"].tolist() == case["overlap_count"]
    assert_close(logits.grad, torch.tensor(case["grad_logits"], dtype=dtype), dtype=torch.float32, what="gradient")
    assert logits.grad.abs().max() > 0.01


@pytest.mark.parametrize("dtype", DTYPES)
def test_estimators_are_the_reference_kls(dtype):
    student, teacher = torch.tensor([[-1.0, -0.5]], dtype=dtype), torch.tensor([[-2.0, -0.25]], dtype=dtype)
    assert_close(estimator_losses(student, teacher, "k1"), student - teacher, dtype=dtype, what="k1")
    d = teacher - student
    assert_close(estimator_losses(student, teacher, "k3"), d.exp() - d - 1, dtype=dtype, what="k3")
    assert_close(estimator_losses(student, teacher, "k2"), 0.5 * (student - teacher) ** 2, dtype=dtype, what="k2")
    with pytest.raises(ValueError, match="'forward_kl_topk' is not a single-sample estimator"):
        estimator_losses(student, teacher, "forward_kl_topk")


MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
LOSSES = torch.tensor([[0.5, 12.0, 99.0], [-0.25, -15.0, 1.0]], dtype=torch.float64)  # 12, -15 clamped at 10


@pytest.mark.parametrize("dtype", DTYPES)
def test_supervised_form_is_the_clamped_losses_token_mean(dtype):
    losses = LOSSES.to(dtype).clone().requires_grad_(True)
    loss, metrics = distillation_loss(losses, MASK.to(dtype), use_policy_gradient=False, loss_max_clamp=10.0)
    assert_close(loss, torch.tensor((0.5 + 10.0 - 0.25 - 10.0 + 1.0) / 5, dtype=dtype), dtype=dtype, what="loss")
    assert (metrics["distillation/loss_min"].item(), metrics["distillation/loss_max"].item()) == (-15.0, 12.0)
    loss.backward()  # clamped tokens pass no gradient; the masked one neither
    assert_close(losses.grad, torch.tensor([[0.2, 0.0, 0.0], [0.2, 0.0, 0.2]], dtype=dtype), dtype=dtype, what="grad")


@pytest.mark.parametrize("dtype", DTYPES)
def test_policy_gradient_form_takes_minus_the_loss_as_advantage(dtype):
    """On policy (ratio 1) the vanilla loss is mean(-A) = mean(clamped loss), and d/d log_prob = clamped loss / n:
    a token whose loss (KL to the teacher) is high has its log-prob pushed down; the loss itself passes no gradient."""
    losses = LOSSES.to(dtype).clone().requires_grad_(True)
    log_prob = torch.full((2, 3), -1.0, dtype=dtype, requires_grad=True)
    loss, metrics = distillation_loss(losses, MASK.to(dtype), use_policy_gradient=True, loss_max_clamp=10.0,
                                      log_prob=log_prob, old_log_prob=log_prob.detach())
    assert_close(loss, torch.tensor(1.25 / 5, dtype=dtype), dtype=dtype, what="loss")
    loss.backward()
    assert_close(log_prob.grad, torch.tensor([[0.5, 10.0, 0.0], [-0.25, -10.0, 1.0]], dtype=dtype) / 5, dtype=dtype,
                 what="gradient")
    assert losses.grad is None and "distillation/pg_clipfrac" in metrics


def test_combination_with_the_task_loss():
    policy, distill = torch.tensor(2.0), torch.tensor(0.5)
    assert combined_loss(policy, distill, use_task_rewards=True, distillation_loss_coef=0.1).item() == pytest.approx(2.05)
    assert combined_loss(policy, distill, use_task_rewards=False, distillation_loss_coef=0.1).item() == 0.5
