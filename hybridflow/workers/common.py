"""Helpers shared by the model workers."""

from __future__ import annotations

import os

from hybridflow import rng
from hybridflow.families import stacked_experts
from hybridflow.megatron import lr_schedule, parallel, quantized
from hybridflow.megatron.checkpoint import load_role, load_weights, save_role
from hybridflow.megatron.checkpoint_files import resolve_dist_checkpoint
from hybridflow.megatron.hf_weights import HFWeights
from hybridflow.megatron.lora import LoRASettings
from hybridflow.megatron.optimizer_config import muon_fields
from hybridflow.megatron.role import ModelBuild, OffloadSettings, OptimSettings


def open_hf_folder(path: str, trust_remote_code: bool = False, config_overrides: dict | None = None) -> tuple:
    """(HF config, ``HFWeights``) of a HF model folder with safetensors weights: nothing is read until
    asked for, so a rank converting its shard reads only that (megatron/hf_weights.py); a quantized checkpoint's
    tensors are read dequantized (megatron/quantized.py), experts fused in one tensor one by one
    (families/stacked_experts.py). ``config_overrides``: ``ProcessSpec.config_overrides``."""
    from transformers import AutoConfig

    weights = HFWeights(path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **(config_overrides or {}))
    return config, stacked_experts.readable(quantized.readable(weights, config), config)


def load_hf_folder(path: str) -> tuple:
    """(HF config, full state dict in host memory), for tools and tests that want every tensor."""
    config, weights = open_hf_folder(path)
    return config, dict(weights.items())


def megatron_process_env(megatron_cfg, on_gpu: bool) -> dict[str, str]:
    """Environment variables a megatron role's worker processes need from their start (Ray's runtime_env).

    With tensor parallelism on GPU, megatron-core overlaps its TP communication (the sequence-parallel
    gathers and reduce-scatters, the async all-reduce of input gradients) with compute only if the device
    runs kernels in the order they were issued, through one hardware queue: CUDA_DEVICE_MAX_CONNECTIONS=1
    (megatron-core 0.16.1 tensor_parallel/layers.py, ``linear_with_grad_accumulation_and_async_allreduce``,
    warns without it; TE's TP comm overlap relies on it too). CUDA reads it when it creates the process's
    context, so it has to be in the environment before anything touches the GPU. A value set in the
    driver's environment is passed on instead."""
    if not on_gpu or not (megatron_cfg.tensor_model_parallel_size > 1 or megatron_cfg.sequence_parallel):
        return {}
    return {"CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "1")}


def optim_settings(optim, megatron_cfg, total_steps: int, key: str = "optim"):
    """The engine's optimizer settings from a role's ``optim`` and ``megatron`` config sections, with the
    learning-rate schedule over the run's ``total_steps`` PPO steps (``key``: the optim section's name in
    errors, e.g. ``actor.optim``)."""
    return OptimSettings(lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas),
                         clip_grad=optim.clip_grad, use_distributed_optimizer=megatron_cfg.use_distributed_optimizer,
                         schedule=lr_schedule.resolve(optim, total_steps, key), overrides=optim.override_optimizer_config,
                         muon=muon_fields(optim))


def lora_settings(lora_cfg, seed: int):
    """The adapters' settings from ``model.lora`` (None without LoRA); an empty target_modules means every
    linear but exclude_modules (verl's meaning)."""
    if lora_cfg is None:
        return None
    c = lora_cfg
    return LoRASettings(rank=c.rank, alpha=c.alpha, dropout=c.dropout,
                        target_modules=c.targets, exclude_modules=tuple(c.exclude_modules),
                        a_init=c.lora_A_init_method, b_init=c.lora_B_init_method, seed=seed)


def load_lora_adapter(role, path: str) -> None:
    """Start the role's adapters from a peft adapter folder (``adapter_model.safetensors``; model.lora.adapter_path)."""
    from safetensors.torch import load_file

    from hybridflow.megatron import lora, lora_peft

    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.exists(file):
        raise FileNotFoundError(f"model.lora.adapter_path: no adapter_model.safetensors in {path}")
    parts = lora_peft.from_peft(load_file(file), role.hf_config, role.shard, set(lora.adapters(role.module)))
    lora_peft.load(role.module, parts)


def model_build(megatron_cfg, **kw) -> ModelBuild:
    """A role's model build from its megatron section (dtype, sequence parallelism, transformer overrides); ``kw``
    adds the role's own (value head, routing replay, adapters)."""
    from hybridflow import device

    return ModelBuild(dtype=device.torch_dtype(megatron_cfg.dtype), sequence_parallel=megatron_cfg.sequence_parallel,
                      transformer_overrides=megatron_cfg.override_transformer_config, **kw)


def offload_settings(megatron_cfg):
    """The engine's offload settings from a role's ``megatron`` config section."""
    m = megatron_cfg
    return OffloadSettings(params=m.param_offload, grads=m.grad_offload, optimizer=m.optimizer_offload)


def ref_offload_settings(actor_cfg):
    """The reference role's offload settings: only parameters (it has no grads or optimizer), as
    ``actor.ref_param_offload`` says (verl's actor_rollout_ref.ref.megatron.param_offload); None: as the
    actor's ``megatron.param_offload`` (``Actor.ref_offloads_params``)."""
    return OffloadSettings(params=actor_cfg.ref_offloads_params)


def init_megatron_worker(worker, spec, megatron_cfg) -> tuple:
    """Join the group's torch.distributed world, create megatron's groups for the role's layout (the run plan's,
    in ``spec``), and open the HF weights the role starts from: (HF config, ``HFWeights``, read lazily; None where
    the role starts from a megatron dist checkpoint)."""
    p = spec.process
    worker.init_distributed(timeout_s=p.dist_timeout_s)
    parallel.init_layout(spec.layout, p.seed, p.dist_timeout_s)
    config, weights = open_hf_folder(p.model_path, p.trust_remote_code, p.config_overrides)
    return config, None if megatron_cfg.use_dist_checkpointing else weights  # start_weights loads them instead


def start_weights(megatron_cfg, section: str, adapter_path: str | None = None):
    """MegatronRole's ``start_weights`` for a role (None when it starts from its HF weights alone): with
    ``<section>.megatron.use_dist_checkpointing`` the weights of that megatron dist checkpoint (megatron/checkpoint.
    load_weights; the role was built without HF weights: ``init_megatron_worker``), then the peft adapter at
    ``adapter_path`` (model.lora.adapter_path)."""
    m = megatron_cfg
    if not m.use_dist_checkpointing and not adapter_path:
        return None

    def load(role) -> None:
        if m.use_dist_checkpointing:
            path = resolve_dist_checkpoint(m.dist_checkpointing_path, f"{section}.megatron.dist_checkpointing_path")
            load_weights(role.module, path, m.dist_checkpointing_prefix, role.value_head)
        if adapter_path:
            load_lora_adapter(role, adapter_path)
    return load


def save_role_checkpoint(worker, role, name: str, path: str) -> None:
    """The role's model and optimizer into ``<path>/<name>`` (dist_checkpointing, any layout can load
    it) and this rank's random streams into ``<path>/rng/<name>_rank<r>.pt``."""
    import os

    save_role(role, f"{path}/{name}")
    os.makedirs(f"{path}/rng", exist_ok=True)
    rng.save(f"{path}/rng/{name}_rank{worker.rank}.pt")


def load_role_checkpoint(worker, role, name: str, path: str, restore_rng: bool) -> None:
    """Inverse of ``save_role_checkpoint``; the random streams only at the saved layout (``restore_rng``):
    at another layout the ranks draw differently anyway."""
    load_role(role, f"{path}/{name}")
    if restore_rng:
        rng.load(f"{path}/rng/{name}_rank{worker.rank}.pt")
