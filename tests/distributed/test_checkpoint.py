"""dist_checkpointing of a role (model + optimizer): a reload continues training bit-identically at the
saved layout, and at another layout (TP2 -> TP1, CP2 -> CP1, PP2 with virtual stages -> one rank) within float
tolerance."""

from __future__ import annotations

import pytest
import torch

from hybridflow.spawn import run_ranks
from tests.numerics import assert_close
from tests.distributed.test_padding_free_and_offload import _settings, uneven_batch, write_policy_and_critic

pytestmark = pytest.mark.distributed


def _rank_fn(rank, world, hf_dir, critic_dir, ckpt_dir, dtype_name, save, cp=1, vpp=1):
    """save: two updates, checkpoint after the first; else: load the checkpoint, then the second update. The
    world is TP (x ``cp``: context parallel), or with ``vpp`` pipeline stages of that many virtual stages each."""
    from hybridflow.megatron import parallel
    from hybridflow.megatron.checkpoint import load_role, save_role
    from hybridflow.megatron.role import MegatronRole, ModelBuild, OffloadSettings, OptimSettings
    from hybridflow.workers import role_ops
    from hybridflow.workers.common import load_hf_folder

    if vpp > 1:
        parallel.init_model_parallel(1, world, seed=1, vpp=vpp)
    else:
        parallel.init_model_parallel(world // cp, 1, seed=1, cp=cp)
    dtype = getattr(torch, dtype_name)
    cfg, state = load_hf_folder(hf_dir)
    _, critic_state = load_hf_folder(critic_dir)
    batch = uneven_batch()
    actor_cfg, critic_cfg = _settings()
    # Offloaded optimizer state on the saving side: save and load see it resident all the same.
    offload = OffloadSettings(params=save, grads=save, optimizer=save)
    actor = MegatronRole(cfg, state, ModelBuild(dtype=dtype), optim=OptimSettings(lr=1e-3), offload=offload)
    critic = MegatronRole(cfg, critic_state, ModelBuild(value_head=True, dtype=dtype), optim=OptimSettings(lr=1e-3))

    def update():
        return {**role_ops.update_policy(actor, batch, actor_cfg, dp_size=1),
                **role_ops.update_value(critic, batch, critic_cfg, dp_size=1)}

    if save:
        update()
        save_role(actor, f"{ckpt_dir}/actor")
        save_role(critic, f"{ckpt_dir}/critic")
    else:
        load_role(actor, f"{ckpt_dir}/actor")
        load_role(critic, f"{ckpt_dir}/critic")
    opt = actor.optimizer.optimizer
    steps = [] if save else [opt.state[p]["step"] for g in opt.param_groups for p in g["params"]]
    adam_steps = ([float(s) for s in steps], len({id(s) for s in steps}))
    metrics = update()
    return {"metrics": metrics, "actor": actor.hf_state_dict(), "critic": critic.hf_state_dict(),
            "adam_steps": adam_steps}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return write_policy_and_critic(tmp_path_factory.mktemp("ckpt"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_resume_at_same_and_other_layout(models, dtype):
    ckpt = models / f"ckpt_{dtype}"
    args = (str(models / "policy"), str(models / "critic"), str(ckpt), dtype)
    straight = run_ranks(_rank_fn, 2, *args, True)[0]
    same = run_ranks(_rank_fn, 2, *args, False)[0]
    for role in ("actor", "critic"):
        for k, v in straight[role].items():
            assert torch.equal(v, same[role][k]), f"TP2 -> TP2: {role} {k} differs after the resumed update"
    assert straight["metrics"] == same["metrics"]
    # Adam's step came back, one tensor per parameter (a shared one would advance once per parameter).
    steps, distinct = same["adam_steps"]
    assert set(steps) == {2.0} and distinct == len(steps), same["adam_steps"]  # two mini-batches so far
    if dtype != "float32":
        return
    other = run_ranks(_rank_fn, 1, *args, False)[0]
    # Other layout, other reduction order: equal up to fp32 rounding (critic/vf_loss is ~224).
    for key in ("actor/pg_loss", "critic/vf_loss"):
        assert_close(other["metrics"][key], straight["metrics"][key], what=f"TP2 -> TP1: {key}")
    for role in ("actor", "critic"):
        assert_close(other[role], straight[role], what=f"TP2 -> TP1: {role}")
    # saved at context parallel 2 (each rank half of every row; the optimizer state sharded over both), resumed
    # at one rank: the same run
    cp_args = (*args[:2], str(models / "ckpt_cp2"), dtype)
    run_ranks(_rank_fn, 2, *cp_args, True, 2)
    from_cp = run_ranks(_rank_fn, 1, *cp_args, False)[0]
    for key in ("actor/pg_loss", "critic/vf_loss"):
        assert_close(from_cp["metrics"][key], straight["metrics"][key], what=f"CP2 -> CP1: {key}")
    for role in ("actor", "critic"):
        assert_close(from_cp[role], straight[role], what=f"CP2 -> CP1: {role}")


def test_saved_with_virtual_pipeline_stages_resumes_at_one_rank(tmp_path):
    """Two stages of two virtual stages each (4 layers, chunk c of stage s holding layer 2c + s), saved after one
    update, resumed at one rank: the second update equals the run that never stopped."""
    models = write_policy_and_critic(tmp_path, num_layers=4)
    args = (str(models / "policy"), str(models / "critic"), str(tmp_path / "ckpt_vpp"), "float32")
    straight = run_ranks(_rank_fn, 1, *args[:2], str(tmp_path / "ckpt_one"), "float32", True)[0]
    run_ranks(_rank_fn, 2, *args, True, 1, 2)
    resumed = run_ranks(_rank_fn, 1, *args, False)[0]
    for key in ("actor/pg_loss", "critic/vf_loss"):
        assert_close(resumed["metrics"][key], straight["metrics"][key], what=f"PP2 x VPP2 -> 1: {key}")
    for role in ("actor", "critic"):
        assert_close(resumed[role], straight[role], what=f"PP2 x VPP2 -> 1: {role}")


# --- the learning-rate schedule resumes exactly -----------------------------------------------------------

SCHEDULE_STEPS, SAVED_AFTER = 3, 1  # updates in all; the checkpoint is taken mid-warmup


def _schedule():
    from hybridflow.config.schema import Optim
    from hybridflow.megatron import lr_schedule

    # warmup 1e-4 -> 1e-3 over 2 updates, then cosine down to 1e-4 (min_lr_ratio) by update 4
    optim = Optim(lr=1e-3, lr_warmup_steps=2, lr_warmup_init=1e-4, lr_decay_style="cosine", min_lr_ratio=0.1)
    return lr_schedule.resolve(optim, total_steps=4)


def _schedule_rank_fn(rank, world, hf_dir, ckpt_dir, save):
    """save: SCHEDULE_STEPS updates with a checkpoint after SAVED_AFTER; else: load it, then the rest."""
    from hybridflow.megatron import parallel
    from hybridflow.megatron.checkpoint import load_role, save_role
    from hybridflow.megatron.role import MegatronRole, ModelBuild, OptimSettings
    from hybridflow.workers import role_ops
    from hybridflow.workers.common import load_hf_folder

    parallel.init_model_parallel(world, 1, seed=1)
    cfg, state = load_hf_folder(hf_dir)
    batch = uneven_batch()
    actor_cfg, _ = _settings()
    optim = OptimSettings(lr=1e-3, schedule=_schedule(), use_distributed_optimizer=True)
    actor = MegatronRole(cfg, state, ModelBuild(dtype=torch.float32), optim=optim)
    lrs, metrics = [], []
    for step in range(SCHEDULE_STEPS):
        if step == SAVED_AFTER:
            (save_role if save else load_role)(actor, ckpt_dir)
        if step < SAVED_AFTER and not save:
            continue
        lrs.append(actor.lr)
        metrics.append(role_ops.update_policy(actor, batch, actor_cfg, dp_size=1))
    return {"lrs": lrs, "metrics": metrics, "after": actor.lr, "actor": actor.hf_state_dict()}


def test_lr_schedule_resumes_exactly_mid_warmup(models):
    import math

    args = (str(models / "policy"), str(models / "ckpt_schedule"))
    straight = run_ranks(_schedule_rank_fn, 2, *args, True)[0]
    resumed = run_ranks(_schedule_rank_fn, 2, *args, False)[0]
    s = _schedule()
    cosine = s.min_lr + (s.max_lr - s.min_lr) * 0.5 * (1 + math.cos(math.pi * (3 - 2) / (4 - 2)))
    want = [1e-4, 1e-4 + (1e-3 - 1e-4) / 2, 1e-3, cosine]  # the closed form at updates 0..3
    for got, expected in zip(straight["lrs"] + [straight["after"]], want):
        assert got == pytest.approx(expected, rel=1e-12), (straight["lrs"], want)
    # k updates + save + load + N-k updates == N updates: the lr, the metrics and the weights, bit for bit
    assert resumed["lrs"] == straight["lrs"][SAVED_AFTER:] and resumed["after"] == straight["after"]
    assert resumed["metrics"] == straight["metrics"][SAVED_AFTER:]
    assert [m["actor/lr"] for m in resumed["metrics"]] == straight["lrs"][SAVED_AFTER:]  # the lr each update applied
    for k, v in straight["actor"].items():
        assert torch.equal(v, resumed["actor"][k]), f"actor {k} differs after the resumed updates"
