"""Name -> function registries for the algorithm building blocks.

Trainer configs refer to estimators and losses by string (``"gae"``,
``"token-mean"``, ...).  Each kind of building block has one :class:`Registry`;
modules register their functions with a decorator at import time, and the
dispatchers (``compute_advantage``, ``policy_loss``, ...) look names up here so
a typo in a config fails loudly with the list of valid choices.
"""

from __future__ import annotations

from hybridflow.registry import Registry, UnknownNameError

__all__ = ["ADVANTAGE_ESTIMATORS", "KL_CONTROLLERS", "KL_PENALTIES", "LOSS_AGG_MODES", "POLICY_LOSSES", "Registry",
           "UnknownNameError", "register_advantage", "register_kl_controller", "register_kl_penalty",
           "register_loss_agg", "register_policy_loss"]


ADVANTAGE_ESTIMATORS = Registry("advantage estimator")
KL_PENALTIES = Registry("kl penalty kind")
LOSS_AGG_MODES = Registry("loss aggregation mode")
KL_CONTROLLERS = Registry("kl controller")
POLICY_LOSSES = Registry("policy loss")

register_advantage = ADVANTAGE_ESTIMATORS.register
register_kl_penalty = KL_PENALTIES.register
register_loss_agg = LOSS_AGG_MODES.register
register_kl_controller = KL_CONTROLLERS.register
register_policy_loss = POLICY_LOSSES.register
