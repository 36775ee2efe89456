"""Shared assets for the end-to-end tests: one tiny warm-started model and task data per test run (make test's xdist
workers share them)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from hybridflow.plan import load_experiment, resolve
from hybridflow.rewards import register_scorer

SMALL = ["prepare.sft_steps=150", "prepare.num_layers=2", "prepare.n_val=32", "data.batch_size=16",
         "actor.ppo_mini_batch_size=16", "actor.ppo_micro_batch_size_per_gpu=8", "critic.ppo_mini_batch_size=16",
         "critic.ppo_micro_batch_size_per_gpu=8", "actor.optim.lr=1e-3", "ray.num_cpus=2"]


@register_scorer("test_digit_overlap")
def digit_overlap(response: str, answer: str) -> float:
    """Partial credit, so that even a weak warm start yields non-zero advantages in every step."""
    return sum(c in response for c in set(answer)) / max(len(set(answer)), 1)


def prepared_once(tmp_path_factory, name: str, prepare) -> Path:
    """A folder ``prepare(folder)`` fills once per test run: make test's xdist workers share it (the first to ask
    prepares it under a file lock, the other waits and reads it), where each would otherwise repeat a warm start."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's base temp dir, above each worker's own
    out, done = root / f"shared_{name}", root / f"shared_{name}.done"
    with FileLock(str(root / f"shared_{name}.lock")):
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)  # a half-made one from a worker that failed
            out.mkdir()
            prepare(out)
            done.touch()
    return out


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    def prepare(out: Path):
        cfg = load_experiment(["configs/quickstart_cpu.yaml"], [
            f"prepare.data_dir={out}/data", f"prepare.base_model_dir={out}/base", f"model.path={out}/sft",
            "prepare.vocab_multiple=128", *SMALL])  # vocab 128: vLLM's vocab shards match megatron's at TP 2
        from hybridflow.trainer.prepare import prepare_quickstart

        prepare_quickstart(cfg)

    return prepared_once(tmp_path_factory, "assets", prepare)


@pytest.fixture(scope="session")
def moe_model(assets, tmp_path_factory):
    """A tiny Qwen3-MoE (configs/quickstart_moe_cpu.yaml, but top-3: expert width 3 x 128 / (2 x 3) = 64) on the
    session's task data, briefly warm-started: the tests that use it check mechanics, the closing notes the
    learning. vLLM-CPU pads an expert's per-rank width to a multiple of 32 (cpu_moe.py's alignment) and its
    in-place reload cannot take a padded one: 64 stays unpadded at vLLM TP 1 and 2."""
    def prepare(out: Path):
        cfg = load_experiment(["configs/quickstart_moe_cpu.yaml"], [
            f"prepare.data_dir={assets}/data", f"prepare.base_model_dir={out}/base", f"model.path={out}/sft",
            "prepare.vocab_multiple=128", *SMALL, "prepare.sft_steps=20", "prepare.sft_target_accuracy=null",
            "prepare.moe_top_k=3"])
        from hybridflow.trainer.prepare import prepare_quickstart

        prepare_quickstart(cfg)

    return prepared_once(tmp_path_factory, "moe", prepare) / "sft"


def make_cfg(assets, tmp_path, *overrides, config="configs/quickstart_cpu.yaml"):
    return load_experiment([config], [
        f"model.path={assets}/sft", f"data.train_files=[{assets}/data/train.parquet]",
        f"data.val_files=[{assets}/data/val.parquet]", f"trainer.output_dir={tmp_path}/run", "prepare.enable=false",
        *SMALL, "reward.name=test_digit_overlap", *overrides])


def run_steps(cfg, n_steps: int, check=None) -> list[dict]:
    """n PPO-family steps through the real worker groups; ``check(trainer, step, metrics)`` after each."""
    from transformers import AutoTokenizer

    from hybridflow.trainer.metrics import Timer
    from hybridflow.trainer.placement import build_worker_groups
    from hybridflow.trainer.ppo import PPODriver

    from hybridflow.trainer.preflight import load_prompts

    plan, tokenizer = resolve(cfg), AutoTokenizer.from_pretrained(cfg.model.path)
    workers, trainer = build_worker_groups(cfg, plan), None
    try:
        trainer = PPODriver(cfg, plan, tokenizer, workers, *load_prompts(cfg, tokenizer))
        data = trainer.train_data.iterate(cfg.data.batch_size, shuffle=True, seed=0)
        history = []
        for step in range(1, n_steps + 1):
            metrics, _ = trainer.step(next(data), step, Timer())
            history.append(metrics)
            if check is not None:
                check(trainer, step, metrics)
        return history
    finally:
        if trainer is not None:
            trainer.close()
        workers.shutdown()
