"""What a run needs besides the actor and the rollout, derived once from what the chosen estimator declared
when it registered (``register_advantage(..., needs=...)``) and the config's switches."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.algorithms.registry import ADVANTAGE_ESTIMATORS
from hybridflow.algorithms.rollout_correction import active as rollout_correction_active


@dataclass(frozen=True)
class Needs:
    reference: bool  # reference log-probs: KL in the reward or as a loss
    critic: bool  # values (the estimator needs them, or critic.enable)
    greedy_baseline: bool  # a greedy response's reward per prompt (ReMax)
    sum_pi_squared: bool  # the actor's sum of squared token probabilities (the optimal token baselines)
    reward_components: bool  # the reward function's named components (gdpo)
    # the old log-probs are the update's own (one epoch, one mini-batch, nothing reweighting the batch
    # before the update): the separate old-log-prob forward is skipped
    on_policy_reuse: bool
    rollout_correction: bool  # algorithm.rollout_correction changes the update (weights, rejection, bypass)
    teacher: bool = False  # distillation: the teachers' log-probs of the sampled tokens


def run_needs(cfg) -> Needs:

    algo, actor = cfg.algorithm, cfg.actor
    declared = ADVANTAGE_ESTIMATORS.needs(algo.adv_estimator)
    critic = cfg.critic.enable if cfg.critic.enable is not None else "values" in declared
    correcting = rollout_correction_active(algo.rollout_correction)
    on_policy = (actor.reuse_on_policy_log_prob and actor.ppo_epochs == 1
                 and actor.ppo_mini_batch_size >= cfg.data.batch_size and not algo.use_kl_in_reward
                 and not correcting and "sum_pi_squared" not in declared)
    return Needs(reference=algo.use_kl_in_reward or actor.use_kl_loss, critic=critic,
                 greedy_baseline="reward_baselines" in declared, sum_pi_squared="sum_pi_squared" in declared,
                 reward_components="reward_components" in declared, on_policy_reuse=on_policy,
                 rollout_correction=correcting, teacher=cfg.distillation.enabled)
