"""Damaged checkpoints are named in one line before anything starts: a truncated state file, a missing
hf/ folder or tokenizer, dist_checkpointing shards deleted or cut short, its metadata gone. An explicit
``trainer.resume`` naming one is refused (exit 2); ``resume: auto`` passes over a damaged newest one to
the checkpoint before it, saying so. Damage the sizes do not show is named when loading."""

from __future__ import annotations

import logging
import os
import shutil

import pytest

from hybridflow.trainer import checkpoint
from tests.unit.run_checkpoint import NO_CRITIC, build_model_and_data, make_run, train_args


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("damaged")
    build_model_and_data(root)
    make_run(root)
    return root


def _cut(path, keep_bytes=None):
    os.truncate(path, keep_bytes if keep_bytes is not None else os.path.getsize(path) // 2)


def _shard(step):
    return max((step / "actor").glob("*.distcp"), key=os.path.getsize)


# What is done to a copy of checkpoint step_2, and the words that name it.
DAMAGE = {
    "state truncated": (lambda s: _cut(s / "trainer_state.json"), "trainer_state.json is not valid JSON"),
    "state not a dict": (lambda s: (s / "trainer_state.json").write_text("[]"), "trainer_state.json holds no step"),
    "config.yaml missing": (lambda s: os.remove(s / "config.yaml"), "config.yaml is missing"),
    "hf/ missing": (lambda s: shutil.rmtree(s / "hf"), "hf/config.json is missing"),
    "tokenizer missing": (lambda s: os.remove(s / "hf" / "tokenizer.json"), "hf/ has no tokenizer"),
    "hf json truncated": (lambda s: _cut(s / "hf" / "tokenizer_config.json"),
                          "hf/tokenizer_config.json is not valid JSON"),
    "actor missing": (lambda s: shutil.rmtree(s / "actor"), "actor/ is missing"),
    "shard truncated": (lambda s: _cut(_shard(s), 1000), "is cut short: 1000 of"),
    "shard empty": (lambda s: _cut(_shard(s), 0), "is cut short: 0 of"),
    "shard deleted": (lambda s: os.remove(_shard(s)), ".distcp is missing"),
    ".metadata deleted": (lambda s: os.remove(s / "actor" / ".metadata"), "actor/.metadata is missing"),
    ".metadata truncated": (lambda s: _cut(s / "actor" / ".metadata"), "actor/.metadata is corrupt"),
    "metadata.json deleted": (lambda s: os.remove(s / "actor" / "metadata.json"), "actor/metadata.json is missing"),
    "common.pt truncated": (lambda s: _cut(s / "actor" / "common.pt"), "actor/common.pt is cut short or corrupt"),
    "rng truncated": (lambda s: _cut(s / "rng" / "actor_rank0.pt"), "rng/actor_rank0.pt is cut short or corrupt"),
    "rng deleted": (lambda s: shutil.rmtree(s / "rng"), "rng/actor_rank0.pt is missing"),
}


def _damaged_run(root, tmp_path, case):
    """A copy of the run whose newest checkpoint (step_2) has the damage ``case``."""
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    DAMAGE[case][0](run / "checkpoints" / "step_2")
    return run


def test_a_whole_checkpoint_has_no_damage(root):
    for step in checkpoint.complete_checkpoints(str(root / "run")):
        assert checkpoint.find_damage(step) is None


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_explicit_resume_from_a_damaged_checkpoint_is_one_line(case, root, tmp_path, capsys):
    import ray

    from hybridflow.trainer.main import main

    step = _damaged_run(root, tmp_path, case) / "checkpoints" / "step_2"
    what = DAMAGE[case][1]
    assert what in checkpoint.find_damage(step)
    assert main(train_args(root, tmp_path / "new", *NO_CRITIC, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={step}")) == 2
    assert not ray.is_initialized()  # nothing started
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"config error: trainer.resume_from_path: checkpoint {step} is damaged: "), err
    assert what in err, err


@pytest.mark.parametrize("case", ["state truncated", "hf/ missing", "shard truncated", "shard deleted"])
def test_auto_resume_passes_over_a_damaged_newest_checkpoint(case, root, tmp_path, caplog):
    from hybridflow.trainer import preflight
    from hybridflow.trainer.main import load

    run = _damaged_run(root, tmp_path, case)
    cfg = load(train_args(root, run, *NO_CRITIC))
    with caplog.at_level(logging.WARNING, logger="hybridflow.trainer.checkpoint"):
        checked = preflight.check_run(cfg)
    assert checked.resume_from == run / "checkpoints" / "step_1"
    newest = run / "checkpoints" / "step_2"
    warnings = [r.getMessage() for r in caplog.records if r.name == "hybridflow.trainer.checkpoint"]
    assert warnings == [f"checkpoint {newest} is damaged ({checkpoint.find_damage(newest)}); "
                        f"resuming from {run}/checkpoints/step_1 instead"]
    assert DAMAGE[case][1] in warnings[0]


def test_auto_resume_with_every_checkpoint_damaged_is_one_line(root, tmp_path, capsys):
    from hybridflow.trainer.main import main

    run = _damaged_run(root, tmp_path, "shard truncated")
    shutil.rmtree(run / "checkpoints" / "step_1" / "hf")
    assert main(train_args(root, run, *NO_CRITIC)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"config error: trainer.resume_mode=auto: every checkpoint in {run}/checkpoints is damaged; "
                          f"the newest, {run}/checkpoints/step_2: actor/"), err


def test_a_later_save_keeps_the_checkpoints_up_to_its_step(tmp_path):
    """Resumed from step_1 past a damaged step_2: saving step_2 replaces it; older ones count first."""
    out = str(tmp_path)
    for step in (1, 2, 3):
        checkpoint.save(out, step, lambda tmp: None, {}, keep=None)
    checkpoint.save(out, 2, lambda tmp: (tmp / "new").touch(), {}, keep=2)  # resumed from step_1
    assert [p.name for p in checkpoint.complete_checkpoints(out)] == ["step_1", "step_2", "step_3"]
    assert (tmp_path / "checkpoints" / "step_2" / "new").exists()
    assert checkpoint.latest(out).name == "step_2", "the marker, not the stale higher step"


def _load_each(rank, world, model_dir, folders):
    """In a spawned rank: each folder's load error (or 'ok')."""
    from hybridflow.megatron import parallel
    from hybridflow.megatron.checkpoint import load_role
    from hybridflow.megatron.checkpoint_files import DamagedCheckpoint
    from hybridflow.megatron.role import MegatronRole
    from hybridflow.workers.common import load_hf_folder

    parallel.init_model_parallel(1, 1, seed=1)
    actor = MegatronRole(load_hf_folder(model_dir)[0], None)
    out = []
    for folder in folders:
        try:
            load_role(actor, folder, with_optimizer=False)
            out.append("ok")
        except DamagedCheckpoint as e:
            out.append(str(e))
    return out


def test_damage_found_only_when_loading_is_named_in_one_line(root, tmp_path):
    """What the sizes cannot show (garbage of the right size), and what they do show when the load is tried
    anyway, come out of ``load_role`` as one line naming the checkpoint and the file or the cause."""
    from hybridflow.spawn import run_ranks

    steps = {}
    for case in ("garbage", "shard truncated", "shard deleted"):
        steps[case] = tmp_path / case
        shutil.copytree(root / "run" / "checkpoints" / "step_2", steps[case])
    with open(_shard(steps["garbage"]), "r+b") as f:
        f.write(b"\xff" * 4096)
    _cut(_shard(steps["shard truncated"]), 1000)
    os.remove(_shard(steps["shard deleted"]))
    assert checkpoint.find_damage(steps["garbage"]) is None  # same size: only the load sees it
    whole = root / "run" / "checkpoints" / "step_1"
    got = run_ranks(_load_each, 1, str(root / "model"), [f"{whole}/actor", *(f"{s}/actor" for s in steps.values())])[0]
    assert got[0] == "ok"
    for message, (case, step) in zip(got[1:], steps.items()):
        assert message.startswith(f"checkpoint {step} cannot be loaded: ") and "\n" not in message, (case, message)
    assert "UnpicklingError" in got[1]
    assert "is cut short: 1000 of" in got[2] and ".distcp is missing" in got[3]


@pytest.mark.parametrize("overrides,was,now", [(["model.lora.rank=8"], "the full model (model.lora.rank 0)",
                                                 "LoRA adapters of rank 8 (model.lora.rank 8)")])
def test_resuming_other_parameters_than_the_checkpoint_holds_is_named_not_called_damage(overrides, was, now, root,
                                                                                          tmp_path, capsys):
    """A full-parameter checkpoint into a LoRA run (and a LoRA checkpoint at another rank, or into a full run: the same
    rule on the saved model.lora.rank) failed in dist_checkpointing as 'Global shape mismatch', named damage."""
    from hybridflow.trainer.main import main

    step = root / "run" / "checkpoints" / "step_2"
    assert main(train_args(root, tmp_path / "new", *NO_CRITIC, *overrides, "trainer.resume_mode=resume_path",
                           f"trainer.resume_from_path={step}")) == 2
    err = capsys.readouterr().err
    assert err == (f"config error: resume: {step} trained {was}, this run trains {now}: resume with "
                   "model.lora.rank=0, or start a new output_dir\n"), err
