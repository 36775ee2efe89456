"""A role's model and optimizer saved and loaded with megatron-core's dist_checkpointing.

Checkpoints hold layout-independent (global) tensors: one saved at any TP/PP/DP layout loads at another.
Two sharp edges of megatron-core on this path:
- the distributed optimizer's default sharding type cannot reshard (and fails outright with the torch
  optimizer fallback): ``fully_reshardable`` is used for save and load;
- dist_checkpointing's writer needs psutil (a dependency of ours through Ray).
Adam's per-parameter ``step`` is saved once and restored as separate tensors per parameter
(``_restore_common_per_param_step`` in megatron-core 0.16); the checkpoint test checks that.
The learning-rate schedule's state (OptimizerParamScheduler.state_dict, plain numbers) travels in the
checkpoint's common part (``common.pt``, written by rank 0 and read by every rank), as Megatron-LM keeps
its ``opt_param_scheduler``.
"""

from __future__ import annotations

import torch

from hybridflow.megatron import checkpoint_files, lora
from hybridflow.patches import megatron_core, megatron_save

_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
_SCHEDULER = "lr_scheduler"


def _sharded_state_dict(role, loading: bool) -> dict:
    model_sd = role.module.sharded_state_dict()
    if lora.adapters(role.module):  # LoRA: the adapters only; the frozen base comes from model.path
        model_sd = {k: v for k, v in model_sd.items() if lora.is_adapter(k)}
    state = {"model": model_sd}
    if role.optimizer is not None:
        state["optimizer"] = role.optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=_METADATA)
        state[_SCHEDULER] = role.scheduler.state_dict()
    return state


def save_role(role, path: str) -> None:
    """Write the role's weights (and optimizer state when it trains) into the folder ``path``; every rank
    of the role calls it together."""
    import os

    from megatron.core import dist_checkpointing

    os.makedirs(path, exist_ok=True)  # every rank: the folder must exist before any rank writes
    megatron_save.in_process_results_queue()  # not megatron's spawned Manager: ~2 s off the first save
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
        if training:
            _adam_state_to_load_into(role.optimizer)
        template = _sharded_state_dict(role, loading=True)
        if not training:
            template.pop("optimizer", None)
            template.pop(_SCHEDULER, None)
        try:
            loaded = dist_checkpointing.load(template, path)
        # A damaged file surfaces as EOFError, FileNotFoundError, pickle errors..., most of them wrapped in
        # torch's CheckpointException, which derives from BaseException (torch/distributed/checkpoint/api.py).
        except (Exception, CheckpointException) as e:
            raise checkpoint_files.load_error(path, e) from e
        _load_model(role.module, loaded["model"])
        if training:
            # Loads the fp32 main params of 16-bit models too (the model's copies came with "model").
            _load_optimizer(role.optimizer, loaded["optimizer"])
            if _SCHEDULER not in loaded:
                raise checkpoint_files.DamagedCheckpoint(
                    f"checkpoint {path} holds no learning-rate schedule state (saved before schedules were kept)")
            _load_scheduler(role.scheduler, loaded[_SCHEDULER])


def load_weights(module, path: str, prefix: str = "", value_head: bool = False) -> None:
    """A role's weights (``module``: its GPTModel, resident, before the optimizer copies it: role.MegatronRole's
    ``start_weights``) from a megatron dist checkpoint (``checkpoint_files.resolve_dist_checkpoint``) at any layout,
    as verl's ``load_mcore_dist_weights`` loads one: megatron's own sharded keys, which the local spec maps to TE's
    (its ``sharded_state_dict_keys_map``: the norms under linear_qkv/linear_fc1), so a checkpoint of either spec
    loads into either. A critic's value head (``value_head``) is not in a policy's checkpoint and keeps its
    initialization (verl drops output_layer for a value model too); LoRA adapters keep theirs. Entries the role
    does not have (a Megatron-LM checkpoint's optimizer state) are not read (StrictHandling.ASSUME_OK_UNEXPECTED,
    as verl). ``prefix``: what the checkpoint's keys start with (verl's dist_checkpointing_prefix, megatron's
    sharded_state_dict prefix)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import StrictHandling
    from torch.distributed.checkpoint.api import CheckpointException

    head = "output_layer."
    with megatron_core.cpu_scope():
        template = {k: v for k, v in module.sharded_state_dict(prefix=prefix).items()
                    if not lora.is_adapter(k) and not (value_head and k.startswith(prefix + head))}
        try:
            loaded = dist_checkpointing.load(template, path, strict=StrictHandling.ASSUME_OK_UNEXPECTED)
        except (Exception, CheckpointException) as e:  # see load_role
            raise checkpoint_files.load_error(path, e) from e
        loaded = {k.removeprefix(prefix): v for k, v in loaded.items()}
        missing, _ = module.load_state_dict(loaded, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state") and not lora.is_adapter(k)
                   and not (value_head and k.startswith(head))]
        if missing:
            raise checkpoint_files.DamagedCheckpoint(f"dist checkpoint {path}: no weights for {missing[:3]}")


def _load_model(module, state: dict) -> None:
    """The loaded weights into ``module``: all of them, or with LoRA its adapters (every one, nothing else)."""
    if not lora.adapters(module):
        module.load_state_dict(state, strict=True)
        return
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if lora.is_adapter(k)]
    if missing or unexpected:
        raise checkpoint_files.DamagedCheckpoint(f"LoRA checkpoint: adapters missing {missing[:3]}, "
                                                 f"unexpected entries {unexpected[:3]}")


def _distributed_torch_adam(optimizer):
    """The DistributedOptimizer over torch's Adam (megatron's fallback without Apex/TE) that ``optimizer``
    is or chains alone; None otherwise."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(chained) == 1 and isinstance(chained[0], DistributedOptimizer) and \
            isinstance(chained[0].optimizer, torch.optim.Adam | torch.optim.AdamW):
        return chained[0]
    return None


def _load_optimizer(optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)``, except for a distributed optimizer over torch's Adam, whose
    load megatron-core 0.16.1 cannot finish: it first gives every param's Adam state the checkpoint's
    ``step`` (one tensor shared by all params, which torch's Adam then advances once per param), then
    copies the sharded param state into *every* key of that state while the source skips ``step``
    (distrib_optimizer.py ``load_state_dict`` and ``_set_main_param_and_optimizer_states``: KeyError).
    Here the same two stages run apart, with ``step`` set aside during the second and given back as a
    tensor per param."""
    dist_opt = _distributed_torch_adam(optimizer)
    if dist_opt is None or state.get("param_state_sharding_type") != _METADATA["distrib_optim_sharding_type"]:
        optimizer.load_state_dict(state)
        return
    dist_opt.load_state_dict({k: v for k, v in state.items() if k not in ("param_state", "param_state_sharding_type")})
    inner = dist_opt.optimizer
    steps = {p: s.pop("step") for p, s in inner.state.items() if "step" in s}
    dist_opt.load_parameter_state_from_fully_reshardable(state["param_state"])
    for p, step in steps.items():
        inner.state[p]["step"] = step.clone()


def _adam_state_to_load_into(optimizer) -> None:
    """Give a distributed optimizer that never stepped Adam's state (zeros, step 0) for the load to replace.
    megatron-core 0.16.1's DistributedOptimizer builds its load template from ``state_dict()``, which with
    torch's Adam (no Apex/TE) reads the single ``step`` of the torch optimizer's state and asserts there is
    exactly one (distrib_optimizer.py ``state_dict``): a fresh role has none. The other optimizers allocate
    their state for a load themselves (``init_state_fn``). The shapes and the CPU ``step`` are those torch's
    Adam creates at its first step."""
    dist_opt = _distributed_torch_adam(optimizer)
    if dist_opt is None:
        return
    inner = dist_opt.optimizer
    for group in inner.param_groups:
        for p in group["params"]:
            if not inner.state[p]:
                inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}


def _load_scheduler(scheduler, state: dict) -> None:
    """OptimizerParamScheduler.load_state_dict advances by the saved step count from wherever the scheduler
    stands: rewind a scheduler that already stepped first, so a load is exact whatever came before."""
    scheduler.step(-scheduler.num_steps)
    scheduler.load_state_dict(state)
