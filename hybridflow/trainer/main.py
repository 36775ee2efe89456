"""Entry point: ``python -m hybridflow.trainer.main --config configs/quickstart_cpu.yaml key.sub=value ...``.

The config is loaded and checked before Ray or any worker starts, so a bad key fails in a second.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from hybridflow.config import ConfigError, dump_yaml, load_config
from hybridflow.config.schema import ExperimentConfig


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="hybridflow", description=__doc__.splitlines()[0])
    ap.add_argument("--config", action="append", required=True, help="YAML file(s); later ones override")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    ap.add_argument("--verl-overrides", nargs="+", default=[], metavar="VERL_KEY=VALUE",
                    help="a verl command line's overrides (actor_rollout_ref.*, data.*, ...), applied last")
    return ap.parse_args(argv)


def load(argv=None) -> ExperimentConfig:
    from hybridflow.config.verl import check_agreement, translate

    args = parse_args(argv)
    from_verl, agree = translate(args.verl_overrides)
    cfg = load_config(ExperimentConfig, args.config, [*args.overrides, *from_verl])
    check_agreement(cfg, agree)
    return cfg


def check_files(cfg: ExperimentConfig) -> None:
    """Everything a run reads or writes, checked before Ray or any worker starts: one-line errors that
    name the key, file or row (quickstart files are built by prepare first)."""
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
    check_layouts(cfg, model)


def check_model_folder(cfg: ExperimentConfig):
    """model.path holds a readable config, safetensors weights and a tokenizer, and the model's context
    fits the longest prompt plus response; returns (HF config, tokenizer)."""
    from pathlib import Path

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


def run(cfg: ExperimentConfig) -> list[dict]:
    from transformers import AutoTokenizer

    from hybridflow.controller import start_ray
    from hybridflow.trainer.ppo import PPOTrainer, build_worker_groups

    if cfg.prepare.enable:
        from hybridflow.trainer.prepare import prepare_quickstart

        prepare_quickstart(cfg)
    check_files(cfg)
    dump_yaml(cfg, os.path.join(cfg.trainer.output_dir, "config.yaml"))  # the resolved config of this run
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    with start_ray(cfg.ray.address, num_cpus=cfg.ray.num_cpus, temp_dir=cfg.ray.temp_dir):
        workers = build_worker_groups(cfg)
        try:
            return PPOTrainer(cfg, tokenizer, workers).fit()
        finally:
            workers.shutdown()


def _exit_on_signals() -> None:
    """SIGTERM (scancel, kill) and SIGINT unwind through ``finally`` so Ray and workers are stopped.

    Background jobs of a non-interactive shell start with SIGINT ignored: install handlers explicitly.
    """
    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def main(argv=None) -> int:
    import torch

    from hybridflow.versions import check_stack

    try:
        cfg = load(argv)
        # Before the quickstart preparation (an SFT warm start) and before Ray: a wrong vLLM, TE or
        # transformers fails here in one line, not at the first weight sync.
        check_stack(torch.cuda.is_available())
        if not cfg.prepare.enable:
            check_files(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    _exit_on_signals()
    try:
        run(cfg)
    except ConfigError as e:  # input files checked after the quickstart preparation built them
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
