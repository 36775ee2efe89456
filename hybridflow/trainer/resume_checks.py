"""A checkpoint to resume checked before any worker starts: which one (trainer.resume_mode), and that it fits this
run's model, adapters and expert layout (a part of trainer/preflight.py)."""

from __future__ import annotations

from pathlib import Path

from hybridflow import families
from hybridflow.config import ConfigError
from hybridflow.config.schema import ExperimentConfig
from hybridflow.plan import RunPlan
from hybridflow.trainer import checkpoint


def resume_checkpoint(cfg: ExperimentConfig, model, plan: RunPlan) -> Path | None:
    """The checkpoint this run continues from (``trainer.resume_mode``, verl's: auto | disable | resume_path
    with ``resume_from_path``), or None for a fresh run; a fresh run never overwrites another run's metrics
    in the same output_dir (verl would append to them: a deliberate difference)."""
    t = cfg.trainer
    metrics = Path(t.output_dir) / "metrics.jsonl"
    ran_before = metrics.is_file() and metrics.stat().st_size > 0
    if t.resume_mode == "disable":
        if ran_before or checkpoint.complete_checkpoints(t.output_dir):
            raise ConfigError(f"trainer.output_dir: {t.output_dir} already holds a run; continue it with "
                              "trainer.resume_mode=auto, choose another output_dir, or delete its metrics.jsonl and "
                              "checkpoints/ to start over there")
        return None
    if t.resume_mode == "auto":
        path = checkpoint.newest_whole(t.output_dir)  # a damaged newest one is passed over with a warning
        if path is None and ran_before:
            raise ConfigError(f"trainer.output_dir: {t.output_dir} holds a run with no complete checkpoint to "
                              "resume; choose another output_dir, or delete its metrics.jsonl to start over there")
    else:
        path = Path(t.resume_from_path)
        if not checkpoint.is_complete(path):
            raise ConfigError(f"trainer.resume_from_path: {t.resume_from_path} is not a complete checkpoint "
                              f"(no {checkpoint.STATE_FILE}; expected .../checkpoints/step_<k>)")
        if (damage := checkpoint.find_damage(path)) is not None:
            raise ConfigError(f"trainer.resume_from_path: checkpoint {t.resume_from_path} is damaged: {damage}")
    if path is not None:
        check_checkpoint_fits(cfg, model, plan, path)
        for role in ("actor", "critic"):  # megatron-core 0.16's HybridDeviceOptimizer cannot load its state back
            if getattr(cfg, role).optim.override_optimizer_config.get("optimizer_cpu_offload"):
                raise ConfigError(f"{role}.optim.override_optimizer_config.optimizer_cpu_offload: resuming from {path} "
                                  "is not supported with it (megatron-core 0.16's HybridDeviceOptimizer cannot load "
                                  "its Adam state); resume without it")
    return path


def check_checkpoint_fits(cfg: ExperimentConfig, model, plan: RunPlan, path: Path) -> None:
    """The checkpoint holds this model's architecture and every role the config trains."""
    from transformers import AutoConfig

    saved = AutoConfig.from_pretrained(str(path / "hf"))
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "intermediate_size"):
        if getattr(saved, key) != getattr(model, key):
            raise ConfigError(f"trainer.resume_from_path: {path} holds a model with {key}={getattr(saved, key)}, "
                              f"model.path ({cfg.model.path}) has {getattr(model, key)}")
    if plan.critic is not None and not (path / "critic").is_dir():
        raise ConfigError(f"resume: {path} has no critic, but this config trains one")
    import yaml

    saved_cfg = yaml.safe_load((path / checkpoint.CONFIG_FILE).read_text()) or {}  # the run config it was saved by
    check_same_adapters(cfg, saved_cfg, path)
    if families.is_moe(model):
        check_same_expert_layout(plan, saved_cfg, path)


def check_same_expert_layout(plan: RunPlan, saved: dict, path: Path) -> None:
    """A MoE checkpoint's optimizer state resumes only at the expert-parallel size it was saved at: megatron-core
    0.16.1 chains a second optimizer for the experts' parameters where EP > 1 (their ``allreduce`` is False;
    optimizer/__init__.py ``get_megatron_optimizer``), and its load cannot map one chain onto the other (measured
    here EP 2 -> 1: ``KeyError 'pre_wd_mult'``; EP 1 -> 2: ``Expected 2 entries in state dict``). Between two EP
    sizes > 1 it is not verified either, so any change is refused. ``saved``: the checkpoint's run config."""
    for layout in (plan.actor, plan.critic):
        if layout is None:
            continue
        was = int(((saved.get(layout.role) or {}).get("megatron") or {}).get("expert_model_parallel_size") or 1)
        if was != layout.ep:
            raise ConfigError(f"resume: {path} was saved at {layout.role}.megatron.expert_model_parallel_size {was}, "
                              f"this run has {layout.ep}: the experts' optimizer state resumes only at the EP size it "
                              f"was saved at; resume with {layout.role}.megatron.expert_model_parallel_size={was}, or "
                              "start a new output_dir from an export of it (model.path)")


def check_same_adapters(cfg: ExperimentConfig, saved_cfg: dict, path: Path) -> None:
    """A checkpoint resumes only into the parameters it holds: LoRA adapters of its rank, or the full model (the
    load otherwise fails deep in megatron's dist_checkpointing, as if the checkpoint were damaged)."""
    saved = saved_cfg.get("model", {}).get("lora", {}) or {}
    was, now = int(saved.get("rank", 0) or 0), cfg.model.lora.rank
    if was == now:
        return
    kind = {True: "LoRA adapters of rank {}", False: "the full model"}
    raise ConfigError(f"resume: {path} trained {kind[bool(was)].format(was)} (model.lora.rank {was}), this run "
                      f"trains {kind[bool(now)].format(now)} (model.lora.rank {now}): resume with model.lora.rank={was}, "
                      "or start a new output_dir")
