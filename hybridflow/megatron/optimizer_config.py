"""megatron-core's OptimizerConfig for a role: hybridflow's settings plus a role's ``optim.override_optimizer_config``
(verl 0.9.1's key: fields of OptimizerConfig set as given, verl's utils/megatron/optimizer.py
``init_megatron_optim_config``), e.g. the distributed optimizer's CPU offload (``optimizer_cpu_offload``,
``optimizer_offload_fraction``, ``overlap_cpu_optimizer_d2h_h2d``: megatron's HybridDeviceOptimizer, which keeps that
fraction of the Adam state in host memory and steps it there) or ``use_precision_aware_optimizer`` (TE's FusedAdam).

The offload moves state off a GPU: HybridDeviceOptimizer copies only CUDA parameters to host and steps the copies
with torch's AdamW (megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py ``_get_sub_optimizer_param_groups``),
and it needs CUDA streams; on CPU workers the state is in host memory already and the key is refused in one line.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from types import SimpleNamespace

# OptimizerConfig fields hybridflow sets itself -> where they come from
OWN_FIELDS = {"optimizer": None, "lr": "optim.lr", "min_lr": "optim.min_lr", "weight_decay": "optim.weight_decay",
              "adam_beta1": "optim.betas", "adam_beta2": "optim.betas", "adam_eps": None,
              "clip_grad": "optim.clip_grad", "use_distributed_optimizer": "megatron.use_distributed_optimizer",
              "params_dtype": "megatron.dtype", "bf16": "megatron.dtype", "fp16": "megatron.dtype", "timers": None}
OFFLOAD = "optimizer_cpu_offload"


def optimizer_config(settings, params_dtype, overrides: dict | None = None):
    """The OptimizerConfig of ``settings`` (role.OptimSettings) for parameters of ``params_dtype``: Adam with
    decoupled weight decay, fp32 main params and grads for 16-bit models, then ``overrides``."""
    import torch
    from megatron.core.optimizer import OptimizerConfig

    from hybridflow.megatron import lr_schedule

    schedule = settings.schedule or lr_schedule.LRSchedule.constant(settings.lr)
    return OptimizerConfig(
        optimizer="adam", lr=schedule.max_lr, min_lr=schedule.min_lr,
        weight_decay=settings.weight_decay, adam_beta1=settings.betas[0], adam_beta2=settings.betas[1],
        adam_eps=settings.eps, clip_grad=settings.clip_grad, use_distributed_optimizer=settings.use_distributed_optimizer,
        params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        **(overrides or {}))


def check_optimizer_overrides(overrides: dict, key: str, *, dtype, use_distributed_optimizer: bool,
                              on_gpu: bool) -> dict:
    """``overrides`` (found at ``key``) as OptimizerConfig keyword arguments: each a field hybridflow does not set,
    and the whole config as megatron-core's own checks accept it (e.g. the precision-aware optimizer needs TE's
    FusedAdam and the distributed optimizer); one-line ValueError naming the key otherwise."""
    if not isinstance(overrides, dict):
        raise ValueError(f"{key} must be a mapping of OptimizerConfig fields, got {type(overrides).__name__}")
    if not overrides:  # the usual start-up stays off megatron's import
        return {}
    from megatron.core.optimizer import OptimizerConfig

    fields = {f.name for f in dataclasses.fields(OptimizerConfig) if f.init}
    for name in overrides:
        if name not in fields:
            raise ValueError(f"{key}.{name}: megatron-core's OptimizerConfig has no field {name!r}")
        if name in OWN_FIELDS:
            source = OWN_FIELDS[name]
            raise ValueError(f"{key}.{name}: set by hybridflow" + (f" from {source}" if source else "") + ", not overridable")
    if overrides.get(OFFLOAD) and not on_gpu:
        raise ValueError(f"{key}.{OFFLOAD}: megatron's HybridDeviceOptimizer offloads a GPU's optimizer state; CPU "
                         "workers hold it in host memory already (remove it, or run on GPUs)")
    if overrides.get(OFFLOAD):  # what megatron asserts only when it builds the optimizer (optimizer/__init__.py)
        if not use_distributed_optimizer:
            raise ValueError(f"{key}.{OFFLOAD} needs megatron.use_distributed_optimizer")
        if not overrides.get("decoupled_weight_decay", True):
            raise ValueError(f"{key}.{OFFLOAD} needs decoupled_weight_decay (AdamW)")
        fraction = overrides.get("optimizer_offload_fraction", 0.0)
        if not isinstance(fraction, int | float) or not 0 <= fraction <= 1:
            raise ValueError(f"{key}.optimizer_offload_fraction must be in [0, 1], got {fraction!r}")
    if overrides.get("use_precision_aware_optimizer") and importlib.util.find_spec("transformer_engine") is None:
        # megatron-core 0.16 asks TE's version (optimizer_config.py __post_init__) and its FusedAdam
        raise ValueError(f"{key}.use_precision_aware_optimizer needs Transformer Engine (its FusedAdam), not installed "
                         "here")
    defaults = SimpleNamespace(lr=1e-6, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, clip_grad=1.0, schedule=None,
                               use_distributed_optimizer=use_distributed_optimizer)  # role.OptimSettings' fields
    try:
        optimizer_config(defaults, dtype, overrides)
    except (AssertionError, ValueError, RuntimeError, TypeError) as e:
        raise ValueError(f"{key}: megatron-core refuses it: {' '.join(str(e).split()) or type(e).__name__}") from None
    return dict(overrides)
