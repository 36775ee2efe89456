"""Everything a run reads, writes or asks for, checked before Ray or any worker starts: one-line
``ConfigError``s that name the key, file or row."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hybridflow.config import ConfigError
from hybridflow.config.schema import ExperimentConfig
from hybridflow.trainer import checkpoint


@dataclass
class Checked:
    """What the checks learned on the way: the model's HF config and tokenizer, the number of training
    prompts, and the checkpoint to resume from (None: a fresh run)."""

    model: object
    tokenizer: object
    n_train: int
    resume_from: Path | None


def check_run(cfg: ExperimentConfig) -> Checked:
    """All checks of a run, in the order a user would fix them."""
    model, tokenizer, n_train = check_files(cfg)
    check_resources(cfg)
    return Checked(model, tokenizer, n_train, resume_checkpoint(cfg, model))


def check_files(cfg: ExperimentConfig):
    """Everything a run reads or writes: (HF config, tokenizer, number of training prompts). Quickstart
    files are built by prepare first."""
    d = cfg.data
    if not d.train_files:
        raise ConfigError("data.train_files: at least one parquet file is required")
    for key, files in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
        for f in files:
            if not os.path.exists(f):
                raise ConfigError(f"{key}: file not found: {f}")
    model, tokenizer = check_model_folder(cfg)
    if cfg.reward_model.enable and not os.path.isdir(cfg.reward_model.path):
        raise ConfigError(f"reward_model.path: not a model folder: {cfg.reward_model.path}")
    check_output_dir(cfg.trainer.output_dir)
    from hybridflow.data.dataset import PromptDataset

    for key, files in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
        if not files:
            continue
        try:
            data = PromptDataset(files, tokenizer, prompt_key=d.prompt_key, answer_key=d.answer_key,
                                 max_prompt_length=d.max_prompt_length)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{key}: {e}") from None
        if key == "data.train_files" and len(data) < d.batch_size:
            raise ConfigError(f"data.train_files: {len(data)} prompts cannot fill one batch of "
                              f"data.batch_size={d.batch_size}")
        if key == "data.train_files":
            n_train = len(data)
    check_layouts(cfg, model)
    return model, tokenizer, n_train


def check_model_folder(cfg: ExperimentConfig):
    """model.path holds a readable config, safetensors weights and a tokenizer, and the model's context
    fits the longest prompt plus response; returns (HF config, tokenizer)."""
    from transformers import AutoConfig, AutoTokenizer

    path = cfg.model.path
    if not os.path.isdir(path):
        raise ConfigError(f"model.path: not a model folder: {path}")
    try:
        model = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path: cannot read {path}/config.json ({str(e).splitlines()[0][:120]})") from None
    if not list(Path(path).glob("*.safetensors")):
        raise ConfigError(f"model.path: no *.safetensors weights in {path}")
    # Without its files AutoTokenizer quietly builds an empty tokenizer from config.json alone.
    if not any((Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ConfigError(f"model.path: no tokenizer files (tokenizer.json, tokenizer.model or vocab.json) in {path}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"model.path: no usable tokenizer in {path} ({str(e).splitlines()[0][:120]})") from None
    if len(tokenizer) < 2 or tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
        raise ConfigError(f"model.path: the tokenizer in {path} is empty or lacks pad/eos tokens (tokenizer files missing?)")
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    if longest > model.max_position_embeddings:
        raise ConfigError(f"data.max_prompt_length + data.max_response_length ({longest}) exceeds the model's "
                          f"max_position_embeddings ({model.max_position_embeddings}) in {path}")
    return model, tokenizer


def check_output_dir(path: str) -> None:
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ConfigError(f"trainer.output_dir: cannot write to {path} ({e.strerror or e})") from None


def check_layouts(cfg: ExperimentConfig, model) -> None:
    """Each role's TP must divide the model's (HF config's) heads, KV groups and vocab; its PP the layers."""
    sizes = {"num_attention_heads": model.num_attention_heads, "num_key_value_heads": model.num_key_value_heads,
             "vocab_size": model.vocab_size}
    for role in ("actor", "critic"):
        mp = getattr(cfg, role).megatron
        tp, pp = mp.tensor_model_parallel_size, mp.pipeline_model_parallel_size
        for name, n in sizes.items():
            if n % tp:
                raise ConfigError(f"{role}.megatron.tensor_model_parallel_size ({tp}) does not divide the "
                                  f"model's {name} ({n}) in {cfg.model.path}")
        if model.num_hidden_layers % pp:
            raise ConfigError(f"{role}.megatron.pipeline_model_parallel_size ({pp}) does not divide the "
                              f"model's {model.num_hidden_layers} layers in {cfg.model.path}")
    from hybridflow.resharding.vllm_layout import check_supported

    try:
        check_supported(model, cfg.rollout.tensor_model_parallel_size)
    except ValueError as e:
        raise ConfigError(f"rollout.tensor_model_parallel_size: {e} ({cfg.model.path})") from None


def check_prepare_target(cfg: ExperimentConfig) -> None:
    """With ``prepare.enable`` the warm start is built into model.path only next to the prepared base
    model: a mistyped model.path elsewhere is an error, not a new model trained there."""
    p = cfg.prepare
    model = Path(cfg.model.path)
    if (model / "config.json").exists():
        return
    if model.resolve().parent != Path(p.base_model_dir).resolve().parent:
        raise ConfigError(f"model.path: not a model folder: {cfg.model.path} (prepare.enable builds the warm "
                          f"start only next to prepare.base_model_dir, in {Path(p.base_model_dir).parent})")


def resume_checkpoint(cfg: ExperimentConfig, model) -> Path | None:
    """The checkpoint this run continues from (``trainer.resume``), or None for a fresh run; a fresh run
    never overwrites another run's metrics in the same output_dir."""
    t = cfg.trainer
    metrics = Path(t.output_dir) / "metrics.jsonl"
    ran_before = metrics.is_file() and metrics.stat().st_size > 0
    if t.resume == "disable":
        if ran_before or checkpoint.complete_checkpoints(t.output_dir):
            raise ConfigError(f"trainer.output_dir: {t.output_dir} already holds a run; continue it with "
                              "trainer.resume=auto, choose another output_dir, or delete its metrics.jsonl and "
                              "checkpoints/ to start over there")
        return None
    if t.resume == "auto":
        path = checkpoint.latest(t.output_dir)
        if path is None and ran_before:
            raise ConfigError(f"trainer.output_dir: {t.output_dir} holds a run with no complete checkpoint to "
                              "resume; choose another output_dir, or delete its metrics.jsonl to start over there")
    else:
        path = Path(t.resume)
        if not checkpoint.is_complete(path):
            raise ConfigError(f"trainer.resume: {t.resume} is not a complete checkpoint "
                              f"(no {checkpoint.STATE_FILE}; expected .../checkpoints/step_<k>)")
    if path is not None:
        check_checkpoint_fits(cfg, model, path)
    return path


def check_checkpoint_fits(cfg: ExperimentConfig, model, path: Path) -> None:
    """The checkpoint holds this model's architecture and every role the config trains."""
    from transformers import AutoConfig

    saved = AutoConfig.from_pretrained(str(path / "hf"))
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "intermediate_size"):
        if getattr(saved, key) != getattr(model, key):
            raise ConfigError(f"trainer.resume: {path} holds a model with {key}={getattr(saved, key)}, "
                              f"model.path ({cfg.model.path}) has {getattr(model, key)}")
    if cfg.use_critic and not (path / "critic").is_dir():
        raise ConfigError(f"trainer.resume: {path} has no critic, but this config trains one")


def check_resources(cfg: ExperimentConfig) -> None:
    """An embedded Ray cluster must hold every bundle; asking for more waits for Ray's 120 s timeout."""
    if cfg.ray.address is not None:
        return  # a joined cluster is checked once connected (trainer.session.Trainer.start)
    needed = required_resources(cfg)
    cpus = cfg.ray.num_cpus if cfg.ray.num_cpus is not None else os.cpu_count()
    if needed["CPU"] > cpus:
        raise ConfigError(f"resources: the worker pools need {needed['CPU']:g} CPUs (n_workers x cpus_per_worker), "
                          f"the embedded Ray cluster has {cpus} (ray.num_cpus)")
    if needed["GPU"]:
        import torch

        gpus = torch.cuda.device_count()
        if needed["GPU"] > gpus:
            raise ConfigError(f"resources: the worker pools need {needed['GPU']:g} GPUs (n_workers x "
                              f"gpus_per_worker), this machine has {gpus}")


def required_resources(cfg: ExperimentConfig) -> dict:
    r = cfg.resources
    pools = r.n_workers + (r.critic_n_workers if cfg.use_critic and cfg.critic.placement == "separate" else 0)
    return {"CPU": pools * r.cpus_per_worker, "GPU": pools * r.gpus_per_worker}
