"""Starting from a megatron dist checkpoint (actor/critic.megatron.use_dist_checkpointing, dist_checkpointing_path):
a Megatron-LM-style save folder (latest_checkpointed_iteration.txt naming iter_0000007, megatron's sharded keys,
written as verl's converter_hf_to_mcore writes them: the model's sharded_state_dict, no wrapper) saved at TP 2 loads
at TP 1 x PP 2 into the policy bit for bit, and into a critic whose value head keeps its initialization; with a key
prefix (dist_checkpointing_prefix) too."""

from __future__ import annotations

import pytest
import torch

from hybridflow.spawn import run_ranks
from tests.distributed.test_padding_free_and_offload import write_policy_and_critic

pytestmark = pytest.mark.distributed
PREFIX = "module."


def _rank_fn(rank, world, hf_dir, ckpt, save):
    import os
    from types import SimpleNamespace

    from megatron.core import dist_checkpointing

    from hybridflow.megatron import parallel
    from hybridflow.megatron.role import MegatronRole
    from hybridflow.patches import megatron_core
    from hybridflow.workers.common import load_hf_folder, start_from_dist_checkpoint

    parallel.init_model_parallel(*((2, 1) if save else (1, 2)), seed=1)
    cfg, state = load_hf_folder(hf_dir)
    if save:
        role = MegatronRole(cfg, state)
        for folder in ("plain/iter_0000007", "prefixed"):
            os.makedirs(f"{ckpt}/{folder}", exist_ok=True)
        torch.distributed.barrier()
        with megatron_core.cpu_scope():
            dist_checkpointing.save(role.module.sharded_state_dict(), f"{ckpt}/plain/iter_0000007")
            dist_checkpointing.save(role.module.sharded_state_dict(prefix=PREFIX), f"{ckpt}/prefixed")
        if rank == 0:
            open(f"{ckpt}/plain/latest_checkpointed_iteration.txt", "w").write("7\n")
        return None
    out = {}
    for folder, prefix in (("plain", ""), ("prefixed", PREFIX)):
        m = SimpleNamespace(use_dist_checkpointing=True, dist_checkpointing_path=f"{ckpt}/{folder}",
                            dist_checkpointing_prefix=prefix)
        actor, critic = MegatronRole(cfg, None), MegatronRole(cfg, None, value_head=True)
        start_from_dist_checkpoint(actor, m, "actor")
        start_from_dist_checkpoint(critic, m, "critic")
        out[folder] = {"actor": actor.hf_state_dict(), "critic": critic.hf_state_dict()}
    return out


def test_a_dist_checkpoint_saved_at_tp2_starts_the_roles_at_pp2(tmp_path):
    from hybridflow.workers.common import load_hf_folder

    root = write_policy_and_critic(tmp_path)
    args = (str(root / "policy"), str(tmp_path / "ckpt"))
    run_ranks(_rank_fn, 2, *args, True)
    loaded = run_ranks(_rank_fn, 2, *args, False)[0]
    _, want = load_hf_folder(str(root / "policy"))
    for folder, roles in loaded.items():
        actor, critic = roles["actor"], roles["critic"]
        assert actor.keys() == want.keys(), sorted(actor.keys() ^ want.keys())
        for k, v in want.items():
            assert torch.equal(actor[k], v), f"{folder}: {k} differs from the checkpoint's"
            if k != "lm_head.weight":
                assert torch.equal(critic[k], v), f"{folder}: the critic's {k} differs from the checkpoint's"
        assert critic["score.weight"].shape == (1, want["model.embed_tokens.weight"].shape[1])
