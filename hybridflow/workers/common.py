"""Helpers shared by the model workers."""

from __future__ import annotations

from pathlib import Path


def load_hf_folder(path: str) -> tuple:
    """(HF config, full state dict) of a HF model folder with safetensors weights."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model folder {path}")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    return AutoConfig.from_pretrained(path), state


def optim_settings(optim, megatron_cfg):
    """The engine's optimizer settings from a role's ``optim`` and ``megatron`` config sections."""
    from hybridflow.megatron.role import OptimSettings

    return OptimSettings(lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas),
                         clip_grad=optim.clip_grad, use_distributed_optimizer=megatron_cfg.use_distributed_optimizer)


def offload_settings(megatron_cfg, params_only: bool = False):
    """The engine's offload settings from a role's ``megatron`` config section."""
    from hybridflow.megatron.role import OffloadSettings

    m = megatron_cfg
    if params_only:
        return OffloadSettings(params=m.param_offload)
    return OffloadSettings(params=m.param_offload, grads=m.grad_offload, optimizer=m.optimizer_offload)


def init_megatron_worker(worker, megatron_cfg, seed: int, model_path: str, timeout_s: float) -> tuple:
    """Join the group's torch.distributed world, create megatron's groups for the role's layout, and
    load the HF weights the role starts from: (HF config, full state dict)."""
    from hybridflow.megatron import parallel

    worker.init_distributed(timeout_s=timeout_s)
    parallel.init_model_parallel(megatron_cfg.tensor_model_parallel_size, megatron_cfg.pipeline_model_parallel_size,
                                 seed=seed, timeout_s=timeout_s)
    return load_hf_folder(model_path)


def save_role_checkpoint(worker, role, name: str, path: str) -> None:
    """The role's model and optimizer into ``<path>/<name>`` (dist_checkpointing, any layout can load
    it) and this rank's random streams into ``<path>/rng/<name>_rank<r>.pt``."""
    import os

    from hybridflow import rng
    from hybridflow.megatron.checkpoint import save_role

    save_role(role, f"{path}/{name}")
    os.makedirs(f"{path}/rng", exist_ok=True)
    rng.save(f"{path}/rng/{name}_rank{worker.rank}.pt")


def load_role_checkpoint(worker, role, name: str, path: str, restore_rng: bool) -> None:
    """Inverse of ``save_role_checkpoint``; the random streams only at the saved layout (``restore_rng``):
    at another layout the ranks draw differently anyway."""
    from hybridflow import rng
    from hybridflow.megatron.checkpoint import load_role

    load_role(role, f"{path}/{name}")
    if restore_rng:
        rng.load(f"{path}/rng/{name}_rank{worker.rank}.pt")
