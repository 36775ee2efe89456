"""megatron-core's OptimizerConfig and optimizer for a role: hybridflow's settings plus a role's
``optim.override_optimizer_config`` (verl 0.9.1's key: fields of OptimizerConfig set as given, verl's
utils/megatron/optimizer.py ``init_megatron_optim_config``), e.g. the distributed optimizer's CPU offload
(``optimizer_cpu_offload``, ``optimizer_offload_fraction``, ``overlap_cpu_optimizer_d2h_h2d``: megatron's
HybridDeviceOptimizer, which keeps that fraction of the Adam state in host memory and steps it there) or
``use_precision_aware_optimizer`` (TE's FusedAdam).

The offload moves state off a GPU: HybridDeviceOptimizer copies only CUDA parameters to host and steps the copies
with torch's AdamW (megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py ``_get_sub_optimizer_param_groups``),
and it needs CUDA streams; on CPU workers the state is in host memory already and the key is refused in one line.

Muon (``optim.optimizer=muon``, verl 0.9.1's key): megatron-core 0.16.1's ``get_megatron_muon_optimizer``
(optimizer/muon.py), a ChainedOptimizer of its TensorParallelMuon over the 2D weights (momentum SGD whose update is
orthogonalized by a Newton-Schulz iteration) and Adam over the embeddings, the output layer, norms and biases. It keeps
its state on every data-parallel rank: megatron-core refuses it with the distributed optimizer and with fp16 (its
LayerWiseDistributedOptimizer, verl's ``use_layer_wise_distributed_optimizer``, is not built here). It runs
emerging_optimizers 0.1.0 (third_party/README.md). verl 0.9.1 hands ``optimizer="muon"`` to megatron-core's
``get_megatron_optimizer``, which (its utils/megatron/optimizer.py says) routes any optimizer but adam and sgd to the
emerging-optimizers path; 0.16.1's has no such route (it reads adam or sgd only), so ``build_optimizer`` calls
0.16.1's Muon builder itself.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from types import SimpleNamespace

# OptimizerConfig fields hybridflow sets itself -> where they come from
OWN_FIELDS = {"optimizer": None, "lr": "optim.lr", "min_lr": "optim.min_lr", "weight_decay": "optim.weight_decay",
              "adam_beta1": "optim.betas", "adam_beta2": "optim.betas", "adam_eps": None,
              "clip_grad": "optim.clip_grad", "use_distributed_optimizer": "megatron.use_distributed_optimizer",
              "params_dtype": "megatron.dtype", "bf16": "megatron.dtype", "fp16": "megatron.dtype", "timers": None,
              **{f"muon_{name}": "optim.muon_*" for name in ("momentum", "split_qkv", "use_nesterov", "scale_mode",
                                                              "fp32_matmul_prec", "num_ns_steps", "tp_mode",
                                                              "extra_scale_factor")}}
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
        **(settings.muon or {}), **(overrides or {}))


def muon_fields(optim) -> dict | None:
    """OptimizerConfig's Muon fields from a role's optim section (config/training.Optim; verl's names), None for
    Adam. ``muon_match_adamw_update_rms`` sets the extra scale factor to sqrt((1 - beta1) / (1 + beta1)), verl 0.9.1's
    utils/megatron/optimizer.py ``adamw_rms_match_scale_factor``."""
    if optim.optimizer != "muon":
        return None
    beta1 = optim.betas[0]
    scale = math.sqrt((1 - beta1) / (1 + beta1)) if optim.muon_match_adamw_update_rms else optim.muon_extra_scale_factor
    return dict(muon_momentum=optim.muon_momentum, muon_use_nesterov=optim.muon_nesterov,
                muon_split_qkv=optim.muon_split_qkv, muon_scale_mode=optim.muon_scale_mode,
                muon_fp32_matmul_prec=optim.muon_fp32_matmul_prec, muon_num_ns_steps=optim.muon_num_ns_steps,
                muon_tp_mode=optim.muon_tp_mode, muon_extra_scale_factor=scale)


def build_optimizer(settings, params_dtype, model_chunks: list):
    """megatron-core's optimizer of ``settings`` (role.OptimSettings) over the DDP-wrapped ``model_chunks``: Adam, or
    Muon when ``settings.muon`` holds ``muon_fields`` (the module docstring)."""
    from megatron.core.optimizer import get_megatron_optimizer

    config = optimizer_config(settings, params_dtype, settings.overrides)
    if settings.muon is None:
        return get_megatron_optimizer(config, model_chunks)
    from hybridflow.patches import emerging_optimizers

    emerging_optimizers.importable()
    from megatron.core.optimizer.muon import get_megatron_muon_optimizer

    return get_megatron_muon_optimizer(config, model_chunks)


def check_muon(optim, megatron_cfg, role: str) -> None:
    """What megatron-core's Muon refuses only when it builds the optimizer (optimizer/muon.py), and its package, in one
    line naming the key."""
    if optim.optimizer != "muon":
        return
    if megatron_cfg.use_distributed_optimizer:
        raise ValueError(f"{role}.optim.optimizer=muon keeps its state on every data-parallel rank (megatron-core 0.16.1 "
                         f"builds Muon without the distributed optimizer): set {role}.megatron.use_distributed_optimizer"
                         "=false")
    if megatron_cfg.dtype == "float16":
        raise ValueError(f"{role}.optim.optimizer=muon: megatron-core 0.16.1's Muon has no fp16 loss scaling; use "
                         f"{role}.megatron.dtype=bfloat16")
    from hybridflow.patches import emerging_optimizers

    if not emerging_optimizers.importable():
        raise ValueError(f"{role}.optim.optimizer=muon needs emerging_optimizers 0.1.0, not installed: pip install "
                         "--no-deps third_party/emerging_optimizers-0.1.0-py3-none-any.whl (make install does)")


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
                               use_distributed_optimizer=use_distributed_optimizer, muon=None)  # role.OptimSettings
    try:
        optimizer_config(defaults, dtype, overrides)
    except (AssertionError, ValueError, RuntimeError, TypeError) as e:
        raise ValueError(f"{key}: megatron-core refuses it: {' '.join(str(e).split()) or type(e).__name__}") from None
    return dict(overrides)
