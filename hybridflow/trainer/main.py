"""Entry point: ``python -m hybridflow.trainer.main --config configs/quickstart_cpu.yaml key.sub=value ...``.

The config is loaded and checked before Ray or any worker starts, so a bad key fails in a second.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from hybridflow.config import ConfigError, load_config
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
    """Input files must exist before workers start (quickstart files are built by prepare)."""
    for key, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        for f in files:
            if not os.path.exists(f):
                raise ConfigError(f"{key}: file not found: {f}")
    if not os.path.isdir(cfg.model.path):
        raise ConfigError(f"model.path: not a model folder: {cfg.model.path}")
    if cfg.reward_model.enable and not os.path.isdir(cfg.reward_model.path):
        raise ConfigError(f"reward_model.path: not a model folder: {cfg.reward_model.path}")
    if not cfg.data.train_files:
        raise ConfigError("data.train_files: at least one parquet file is required")
    check_layouts(cfg)


def check_layouts(cfg: ExperimentConfig) -> None:
    """Each role's TP must divide the model's heads, KV groups and vocab; its PP the layers."""
    from transformers import AutoConfig

    model = AutoConfig.from_pretrained(cfg.model.path)
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
