"""The Python API: a trainer from a dict config, stepped and validated from a script, shut down by its
context manager with no process left behind; `import hybridflow` itself stays cheap."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest
import yaml

pytestmark = pytest.mark.integration


def test_import_is_cheap():
    code = "import sys, hybridflow; print(sorted(m for m in ('torch', 'ray', 'vllm') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "[]"


def test_trainer_from_a_dict_steps_validates_and_cleans_up(assets, tmp_path):
    import ray

    from hybridflow import Trainer, load_config
    from tests.integration.conftest import SMALL

    config = yaml.safe_load(open("configs/quickstart_cpu.yaml"))
    config.pop("defaults")  # a dict is one layer: its base file comes along as a path
    cfg = load_config(["configs/ppo_megatron.yaml", config], [
        f"model.path={assets}/sft", f"data.train_files=[{assets}/data/train.parquet]",
        f"data.val_files=[{assets}/data/val.parquet]", f"trainer.output_dir={tmp_path}/run", "prepare.enable=false",
        *SMALL, "trainer.total_steps=2", "trainer.val_before_train=false"])
    assert not ray.is_initialized()
    with Trainer(cfg) as trainer:
        metrics = trainer.step()
        assert trainer.step_count == 1 and {"actor/pg_loss", "critic/vf_loss", "reward/score_mean"} <= metrics.keys()
        assert set(trainer.validate()) == {"val/accuracy"}
        pids = trainer._ray.pids
        rows = trainer.fit()
        assert [r["step"] for r in rows] == [1, 2] and trainer.done
    assert not ray.is_initialized()
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert (tmp_path / "run" / "actor_hf" / "config.json").exists()
    assert (tmp_path / "run" / "checkpoints" / "step_2").is_dir()
