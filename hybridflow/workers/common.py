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


def init_megatron_worker(worker, megatron_cfg, seed: int, model_path: str) -> tuple:
    """Join the group's torch.distributed world, create megatron's groups for the role's layout, and
    load the HF weights the role starts from: (HF config, full state dict)."""
    from hybridflow.megatron import parallel

    worker.init_distributed()
    parallel.init_model_parallel(megatron_cfg.tensor_model_parallel_size, megatron_cfg.pipeline_model_parallel_size,
                                 seed=seed)
    return load_hf_folder(model_path)
