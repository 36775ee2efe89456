"""A role's model and optimizer saved and loaded with megatron-core's dist_checkpointing.

Checkpoints hold layout-independent (global) tensors: one saved at any TP/PP/DP layout loads at another.
Two sharp edges of megatron-core on this path (machine-facts.md):
- the distributed optimizer's default sharding type cannot reshard (and fails outright with the torch
  optimizer fallback): ``fully_reshardable`` is used for save and load;
- dist_checkpointing's writer needs psutil (a dependency of ours through Ray).
Adam's per-parameter ``step`` is saved once and restored as separate tensors per parameter
(``_restore_common_per_param_step`` in megatron-core 0.16); the checkpoint test checks that.
"""

from __future__ import annotations

import torch

from hybridflow.megatron import checkpoint_files
from hybridflow.patches import megatron_core

_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def _sharded_state_dict(role, loading: bool) -> dict:
    model_sd = role.module.sharded_state_dict()
    state = {"model": model_sd}
    if role.optimizer is not None:
        state["optimizer"] = role.optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=_METADATA)
    return state


def save_role(role, path: str) -> None:
    """Write the role's weights (and optimizer state when it trains) into the folder ``path``; every rank
    of the role calls it together."""
    import os

    from megatron.core import dist_checkpointing

    os.makedirs(path, exist_ok=True)  # every rank: the folder must exist before any rank writes
    torch.distributed.barrier()
    with role.resident(training=role.optimizer is not None), megatron_core.cpu_scope():
        dist_checkpointing.save(_sharded_state_dict(role, loading=False), path,
                                content_metadata=_METADATA)


def load_role(role, path: str, *, with_optimizer: bool = True) -> None:
    """Load weights (and optimizer state) saved by ``save_role`` at any layout; every rank calls it. A damaged
    checkpoint raises ``checkpoint_files.DamagedCheckpoint`` in one line naming the folder and the file."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    training = role.optimizer is not None and with_optimizer
    with role.resident(training=training), megatron_core.cpu_scope():
        template = _sharded_state_dict(role, loading=True)
        if not training:
            template.pop("optimizer", None)
        try:
            loaded = dist_checkpointing.load(template, path)
        # A damaged file surfaces as EOFError, FileNotFoundError, pickle errors..., most of them wrapped in
        # torch's CheckpointException, which derives from BaseException (torch/distributed/checkpoint/api.py).
        except (Exception, CheckpointException) as e:
            raise checkpoint_files.load_error(path, e) from e
        role.module.load_state_dict(loaded["model"], strict=True)
        if training:
            # Loads the fp32 main params of 16-bit models too (the model's copies came with "model").
            role.optimizer.load_state_dict(loaded["optimizer"])
