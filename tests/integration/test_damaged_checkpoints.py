"""``resume: auto`` past a damaged newest checkpoint: a real run whose latest checkpoint lost bytes of a
shard continues from the checkpoint before it (kept by trainer.max_checkpoints=2), says so in one
warning, repeats the lost step exactly and writes that checkpoint again, whole."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from hybridflow.trainer import checkpoint
from tests.integration.cli_run import LIGHT
from tests.integration.conftest import make_cfg

pytestmark = pytest.mark.integration

# no critic, reference or validation: the checkpoints' damage and resume are the subject, not the roles
RUN = [*LIGHT, "trainer.save_every=1", "trainer.val_every=-1", "reward.name=arithmetic"]
VARYING = ("time/", "perf/", "memory/")  # wall-clock and memory readings differ run to run


def fit(cfg) -> list[dict]:
    from hybridflow import Trainer

    with Trainer(cfg) as trainer:
        return trainer.fit()


@pytest.fixture(scope="module")
def two_steps(assets, tmp_path_factory, ray_cluster):
    """A run of 2 steps with a checkpoint after each (the default max_checkpoints keeps both)."""
    cfg = make_cfg(assets, tmp_path_factory.mktemp("two_steps"), *RUN, "trainer.total_steps=2")
    return Path(cfg.trainer.output_dir), fit(cfg)


def test_auto_resume_continues_from_the_checkpoint_before_a_damaged_newest_one(two_steps, assets, tmp_path, caplog):
    out, rows = two_steps
    assert [p.name for p in checkpoint.complete_checkpoints(str(out))] == ["step_1", "step_2"]
    shutil.copytree(out, tmp_path / "run")
    run = tmp_path / "run"
    newest = run / "checkpoints" / "step_2"
    shard = max((newest / "actor").glob("*.distcp"), key=os.path.getsize)
    os.truncate(shard, os.path.getsize(shard) // 2)  # a copy or a disk cut short
    cfg = make_cfg(assets, tmp_path, *RUN, "trainer.total_steps=2")  # output_dir: tmp_path/run
    with caplog.at_level(logging.WARNING):
        resumed = fit(cfg)
    messages = [r.getMessage() for r in caplog.records]
    warnings = [m for m in messages if "is damaged" in m]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"checkpoint {newest} is damaged (actor/{shard.name} is cut short: "), warnings
    assert warnings[0].endswith(f"resuming from {run}/checkpoints/step_1 instead")
    assert f"resumed from {run}/checkpoints/step_1 (step 1)" in messages
    assert [r["step"] for r in resumed] == [1, 2], "rows to step 1 kept from metrics.jsonl, step 2 run again"
    want = {k: v for k, v in rows[-1].items() if not (k.startswith(VARYING) or k.endswith("seconds"))}
    got = {k: v for k, v in resumed[-1].items() if not (k.startswith(VARYING) or k.endswith("seconds"))}
    assert got == want, "step 2 again, exactly as the first time"
    assert checkpoint.latest(str(run)) == newest and checkpoint.find_damage(newest) is None, "written again, whole"
