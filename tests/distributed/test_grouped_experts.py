"""Grouped-GEMM experts (``moe_grouped_gemm``: megatron's GroupedMLP where Transformer Engine is absent, its GEMM
torch's grouped_mm here, patches/megatron_core.py) equal megatron's SequentialMLP on the tiny Qwen3-MoE and
Qwen2-MoE (shared expert) at EP 1 and 2, in bf16 (the grouped experts' precision): the same HF weights load into
the grouped tensors and export back bit for bit (megatron/convert.py grouped_expert_views), the log-probs are the
same, and so are one update's loss, gradient norm and weights."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.batched import batched_worlds, one_case
from tests.distributed.test_layouts import _settings, rollout_batch
from tests.numerics import assert_close

pytestmark = pytest.mark.distributed

ARCHS = ("qwen3_moe", "qwen2_moe")
EPS = (1, 2)


def _rank_fn(rank, world, root, ep):
    from megatron.core import parallel_state as ps

    from hybridflow.megatron import parallel
    from hybridflow.megatron.role import MegatronRole, ModelBuild, OptimSettings
    from hybridflow.workers import role_ops
    from hybridflow.workers.common import open_hf_folder

    parallel.init_model_parallel(1, 1, seed=1, ep=ep, etp=1 if ep > 1 else None)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    actor_cfg, _ = _settings()
    shard = rollout_batch().chunk(dp)[dp_rank]
    out = {}
    for arch in ARCHS:
        cfg, weights = open_hf_folder(f"{root}/{arch}")
        for grouped in (False, True):
            role = MegatronRole(cfg, weights,
                                ModelBuild(dtype=torch.bfloat16, transformer_overrides={"moe_grouped_gemm": grouped}),
                                optim=OptimSettings(lr=1e-3, eps=1e-3, use_distributed_optimizer=dp > 1))
            experts = type(role.module.decoder.layers[0].mlp.experts).__name__
            loaded = role.hf_state_dict()
            log_probs = role_ops.log_probs(role, shard, 2)["log_probs"]
            m = role_ops.update_policy(role, shard, actor_cfg, dp)
            out[arch, grouped] = dict(experts=experts, loaded=loaded, log_probs=log_probs, loss=m["actor/pg_loss"],
                                      grad_norm=m["actor/grad_norm"], updated=role.hf_state_dict())
    return {"dp_rank": dp_rank, **out}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from hybridflow.models.tiny_arch import build_tiny_folders

    return build_tiny_folders(tmp_path_factory.mktemp("grouped"), ARCHS, seed=12)


@pytest.fixture(scope="module")
def results(root):
    return batched_worlds(one_case, {f"ep{e}": (e, (_rank_fn, root, e)) for e in EPS})


@pytest.mark.parametrize("ep", EPS)
def test_grouped_experts_equal_sequential_ones(results, ep):
    ranks = results(f"ep{ep}")
    first = ranks[0]
    for arch in ARCHS:
        seq, grp = first[arch, False], first[arch, True]
        assert (seq["experts"], grp["experts"]) == ("SequentialMLP", "GroupedMLP"), arch
        assert set(grp["loaded"]) == set(seq["loaded"]), f"{arch}: exported names differ"
        assert all(torch.equal(grp["loaded"][k], seq["loaded"][k]) for k in seq["loaded"]), \
            f"{arch}: the grouped experts do not hold the loaded weights"
        for r in ranks:
            assert_close(r[arch, True]["log_probs"], r[arch, False]["log_probs"], dtype=torch.bfloat16,
                         what=f"{arch} log-probs (rank {r['dp_rank']})")
        assert_close(grp["loss"], seq["loss"], dtype=torch.bfloat16, what=f"{arch} policy loss")
        assert_close(grp["grad_norm"], seq["grad_norm"], dtype=torch.bfloat16, what=f"{arch} gradient norm")
        assert_close(grp["updated"], seq["updated"], dtype=torch.bfloat16, what=f"{arch} weights after one update")
        moved = max((grp["updated"][k].float() - grp["loaded"][k].float()).abs().max().item() for k in grp["loaded"])
        assert moved > 0, f"{arch}: the update moved nothing"
