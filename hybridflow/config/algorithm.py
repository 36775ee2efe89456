"""The experiment config's algorithm section: advantages, KL, dynamic sampling (filter groups) and rollout correction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hybridflow.config.checks import check_numbers, check_sizes


@dataclass
class KLControl:
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1  # adaptive only
    horizon: int = 10000  # adaptive only: steps over which the coefficient moves towards target_kl

    def validate(self):
        check_numbers(self, kl_coef=dict(ge=0), target_kl=dict(gt=0))
        check_sizes(self, "horizon")


# The values of algorithm.filter_groups.metric besides a custom reward function's returned keys: verl's names for
# the sequence reward before any KL penalty (the recipe's "seq_reward", v1's "reward"), the reward managers'
# entries holding the scorer's own value ("acc" for a float, "score"), and the per-row columns every scored
# batch may hold (the scorer's value, the rule score beside a reward model's, DAPO's overlong penalty).
FILTER_SEQ_REWARD = ("reward", "seq_reward", "seq_final_reward")
FILTER_SCORE = ("score", "acc")
FILTER_METRICS = FILTER_SEQ_REWARD + FILTER_SCORE + ("scores", "rule_scores", "overlong_reward")


@dataclass
class FilterGroups:
    """DAPO's dynamic sampling (verl 0.9.1 algorithm.filter_groups): drop prompt groups whose ``metric`` has zero
    variance across their rollout.n responses and generate further batches until data.batch_size groups remain."""

    enable: bool = False
    metric: str = "reward"  # "reward": the sequence's score; or a key of the reward function's returned dict
    max_num_gen_batches: int = 0  # generation batches per step at most (<= 0: no limit)

    def validate(self):
        if not self.metric:
            raise ValueError("algorithm.filter_groups.metric must name a reward column ('reward' or a returned key)")


@dataclass
class RolloutCorrection:
    """Correction for the mismatch between the rollout engine's and the trainer's probabilities (verl 0.9.1
    algorithm.rollout_correction, same names and defaults; rollout_is null and rollout_rs null: measured only)."""

    rollout_is: str | None = None  # importance weights: token | sequence (truncated at the threshold)
    rollout_is_threshold: float | str = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None  # rejection sampling modes (verl's names)
    rollout_rs_threshold: float | str | None = None
    bypass_mode: bool = False  # the rollout's log-probs are the old ones (no old-log-prob forward)
    loss_type: str = "ppo_clip"  # bypass mode's loss: ppo_clip | reinforce

    def validate(self):
        if self.rollout_is is not None and self.rollout_is not in ("token", "sequence"):
            raise ValueError(f"algorithm.rollout_correction.rollout_is must be token, sequence or null, got "
                             f"{self.rollout_is!r}")
        if self.loss_type not in ("ppo_clip", "reinforce"):
            raise ValueError(f"algorithm.rollout_correction.loss_type must be ppo_clip or reinforce, got {self.loss_type!r}")


@dataclass
class PfPPO:
    """Priority-filtered PPO's resampling (verl 0.9.1 algorithm.pf_ppo; algorithms/pf_ppo.py)."""

    reweight_method: Literal["pow", "max_min", "max_random"] = "pow"
    weight_pow: float = 2.0  # pow: a row's weight is |score|^weight_pow

    def validate(self):
        check_numbers(self, weight_pow=dict(ge=0))


@dataclass
class Algorithm:
    adv_estimator: str = "gae"  # a name in algorithms.registry.ADVANTAGE_ESTIMATORS (verl 0.9.1's names)
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False  # subtract kl_ctrl.kl_coef * KL(actor || ref) from token rewards
    kl_penalty: str = "kl"  # KL estimator used in the reward
    kl_ctrl: KLControl = field(default_factory=KLControl)
    # gdpo: the reward components (keys of the reward function's returned dict) normalized separately,
    # and their weights (None: equal), as verl 0.9.1's AlgoConfig
    gdpo_reward_keys: list[str] | None = None
    gdpo_reward_weights: list[float] | None = None
    filter_groups: FilterGroups = field(default_factory=FilterGroups)
    rollout_correction: RolloutCorrection = field(default_factory=RolloutCorrection)
    # resample each batch by its scores after the advantages (verl applies it after GAE only)
    use_pf_ppo: bool = False
    pf_ppo: PfPPO = field(default_factory=PfPPO)

    def validate(self):
        check_numbers(self, gamma=dict(ge=0, le=1), lam=dict(ge=0, le=1))
        if self.use_pf_ppo and self.adv_estimator != "gae":
            raise ValueError(f"algorithm.use_pf_ppo: verl 0.9.1 resamples after the gae advantages only (it ignores "
                             f"the key with adv_estimator {self.adv_estimator}); use gae or drop the key")
        weights = self.gdpo_reward_weights
        if weights is not None and len(weights) != len(self.gdpo_reward_keys or []):
            raise ValueError(f"algorithm.gdpo_reward_weights has {len(weights)} values for "
                             f"{len(self.gdpo_reward_keys or [])} gdpo_reward_keys")
