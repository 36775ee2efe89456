"""RL post-training math: advantage estimators, losses, KL, aggregation.

Pure torch/numpy; nothing here imports model or runtime code.  Estimators and
losses are registered by name (see :mod:`.registry`) so configs can select
them with a string.
"""

from .registry import (
    ADVANTAGE_ESTIMATORS,
    KL_CONTROLLERS,
    KL_PENALTIES,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    Registry,
    UnknownNameError,
    register_advantage,
    register_kl_controller,
    register_kl_penalty,
    register_loss_agg,
    register_policy_loss,
)
from .masked import masked_mean, masked_sum, masked_var, masked_whiten
from .entropy import entropy_from_logits
from .aggregation import GlobalBatch, aggregate_loss
from .advantages import (
    compute_advantage,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
)
from .policy_loss import compute_policy_loss_vanilla
from .policy_losses import (
    compute_policy_loss_cispo,
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_dro,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_reinforce,
    compute_policy_loss_sapo,
)
from .policy_losses_cov import compute_policy_loss_clip_cov, compute_policy_loss_kl_cov
from .rollout_correction import compute_policy_loss_bypass_mode  # registers verl's "bypass_mode"
from .advantages_outcome import (
    compute_gdpo_outcome_advantage,
    compute_gpg_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
)
from .advantages_otb import (
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_optimal_token_baseline_advantage,
)
from .value_loss import value_loss
from .kl import kl_abs, kl_k1, kl_k2, kl_k3, kl_loss, kl_penalty
from .kl_controller import AdaptiveKLController, FixedKLController, make_kl_controller

__all__ = [
    # registries
    "Registry",
    "UnknownNameError",
    "ADVANTAGE_ESTIMATORS",
    "KL_PENALTIES",
    "LOSS_AGG_MODES",
    "KL_CONTROLLERS",
    "POLICY_LOSSES",
    "register_policy_loss",
    "register_advantage",
    "register_kl_penalty",
    "register_loss_agg",
    "register_kl_controller",
    # masked helpers
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "entropy_from_logits",
    # aggregation
    "aggregate_loss",
    "GlobalBatch",
    # advantages
    "compute_advantage",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_gdpo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_optimal_token_baseline_advantage",
    "compute_multi_turn_optimal_token_baseline_advantage",
    # losses
    "compute_policy_loss_vanilla",
    "compute_policy_loss_gspo",
    "compute_policy_loss_sapo",
    "compute_policy_loss_gpg",
    "compute_policy_loss_reinforce",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_dro",
    "compute_policy_loss_cispo",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_bypass_mode",
    "value_loss",
    # kl
    "kl_penalty",
    "kl_loss",
    "kl_k1",
    "kl_abs",
    "kl_k2",
    "kl_k3",
    "FixedKLController",
    "AdaptiveKLController",
    "make_kl_controller",
]
