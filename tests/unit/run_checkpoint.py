"""A run folder with real checkpoints, for the tests that damage them or export from them: a tiny actor
saved with dist_checkpointing by one spawned rank, checkpoints written by ``trainer.checkpoint.save`` with
the parts a run writes (roles, random streams, config, HF config and tokenizer, state), and its metrics."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

QUICKSTART = "configs/quickstart_cpu.yaml"
NO_CRITIC = ("algorithm.adv_estimator=grpo", "rollout.n=2")  # the checkpoints hold an actor only


def _save_actor(rank, world, model_dir, out):
    """In the spawned rank: the untrained actor (the model's own weights) and this rank's random streams."""
    import os

    from hybridflow import rng
    from hybridflow.megatron import parallel
    from hybridflow.megatron.checkpoint import save_role
    from hybridflow.megatron.role import MegatronRole
    from hybridflow.workers.common import load_hf_folder

    parallel.init_model_parallel(1, 1, seed=1)
    cfg, state = load_hf_folder(model_dir)
    save_role(MegatronRole(cfg, state), f"{out}/actor")
    os.makedirs(f"{out}/rng")
    rng.save(f"{out}/rng/actor_rank0.pt")


def build_model_and_data(root: Path) -> None:
    """``root/model`` (a tiny Qwen2 with its tokenizer) and ``root/data`` (train/val parquet)."""
    from hybridflow.data.arithmetic import write_arithmetic_parquet
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2

    write_arithmetic_parquet(root / "data", max_operand=20, n_val=16, seed=1)
    build_tiny_qwen2(root / "model", build_char_tokenizer(root / "model"), hidden_size=64, num_layers=1, seed=1,
                     max_position_embeddings=22)


def train_args(root: Path, output_dir: Path, *overrides: str) -> list[str]:
    """``hybridflow train`` arguments for the model and data of ``build_model_and_data``."""
    return ["--config", QUICKSTART, "prepare.enable=false", f"model.path={root}/model",
            f"data.train_files=[{root}/data/train.parquet]", f"data.val_files=[{root}/data/val.parquet]",
            f"trainer.output_dir={output_dir}", *overrides]


def make_run(root: Path, steps=(1, 2)) -> Path:
    """``root/run``: checkpoints at ``steps`` (all with the model's weights) and a metrics line per step."""
    from transformers import AutoConfig, AutoTokenizer

    from hybridflow.config import dump_yaml
    from hybridflow.spawn import run_ranks
    from hybridflow.trainer import checkpoint
    from hybridflow.trainer.main import load
    from hybridflow.trainer.session import _layout

    parts, run = root / "parts", root / "run"
    run_ranks(_save_actor, 1, str(root / "model"), str(parts))
    cfg = load(train_args(root, run, *NO_CRITIC))
    hf_config, tokenizer = AutoConfig.from_pretrained(root / "model"), AutoTokenizer.from_pretrained(root / "model")

    def write_parts(tmp: Path) -> None:
        for part in ("actor", "rng"):
            shutil.copytree(parts / part, tmp / part)
        dump_yaml(cfg, tmp / "config.yaml")
        hf_config.save_pretrained(str(tmp / "hf"))
        tokenizer.save_pretrained(str(tmp / "hf"))

    for step in steps:
        checkpoint.save(str(run), step, write_parts, {"layout": _layout(cfg), "kl_coef": 0.001}, keep=None)
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(steps[-1] + 1)))
    (run / "config.yaml").write_text((run / "checkpoints" / f"step_{steps[-1]}" / "config.yaml").read_text())
    return run


def digest(path: Path) -> dict[str, str]:
    """Every file under ``path`` (or ``path`` itself) by relative name, with its sha256: equal digests,
    equal bytes."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
