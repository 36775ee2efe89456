"""Muon (optim.optimizer=muon: megatron-core 0.16.1's TensorParallelMuon on the 2D weights, Adam on the rest;
megatron/optimizer_config.py): two policy updates at TP 2, PP 2 and DP 2 give the single rank's weights, and a role
checkpointed after the first and loaded into a fresh one makes the second bit for bit (its momentum buffers
travel in the checkpoint). The whole-matrix TP mode (``duplicated``) is what makes TP 2 equal one rank: verl's
default ``blockwise`` orthogonalizes each rank's shard alone, another update by design (checked too)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.batched import batched_worlds, one_case
from tests.distributed.test_layouts import _settings, rollout_batch
from tests.numerics import assert_close

pytestmark = pytest.mark.distributed

# id -> (tp, pp, dp, muon_tp_mode)
CASES = {"tp1_pp1_dp1": (1, 1, 1, "duplicated"), "tp2": (2, 1, 1, "duplicated"), "pp2": (1, 2, 1, "duplicated"),
         "dp2": (1, 1, 2, "duplicated"), "tp2_blockwise": (2, 1, 1, "blockwise")}


def _muon(tp_mode: str):
    from hybridflow.config.schema import Optim
    from hybridflow.megatron.optimizer_config import muon_fields
    from hybridflow.megatron.role import OptimSettings

    # "highest": the fp32 iteration as written on every CPU (config/training.Optim.muon_fp32_matmul_prec)
    optim = Optim(optimizer="muon", muon_tp_mode=tp_mode, muon_fp32_matmul_prec="highest", muon_nesterov=True)
    return OptimSettings(lr=1e-2, eps=1e-3, muon=muon_fields(optim))


def _rank_fn(rank, world, hf_dir, tp, pp, tp_mode):
    from megatron.core import parallel_state as ps

    from hybridflow.megatron import checkpoint, parallel
    from hybridflow.megatron.role import MegatronRole, ModelBuild
    from hybridflow.workers import role_ops
    from hybridflow.workers.common import load_hf_folder

    parallel.init_model_parallel(tp, pp, seed=1)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    cfg, state = load_hf_folder(f"{hf_dir}/policy")
    actor_cfg, _ = _settings()
    shard = rollout_batch().chunk(dp)[dp_rank]

    def role():
        return MegatronRole(cfg, state, ModelBuild(sequence_parallel=tp > 1), optim=_muon(tp_mode))

    actor = role()
    muon = actor.optimizer.chained_optimizers[0].optimizer
    out = {"muon": type(muon).__name__}
    role_ops.update_policy(actor, shard, actor_cfg, dp)
    out["momentum"] = all("momentum_buffer" in muon.state[p] for g in muon.param_groups for p in g["params"])
    folder = f"{hf_dir}/ckpt_{tp}{pp}{dp}_{tp_mode}"
    checkpoint.save_role(actor, folder)
    role_ops.update_policy(actor, shard, actor_cfg, dp)
    out["two_steps"] = {k: v.clone() for k, v in actor.hf_state_dict().items()}
    resumed = role()
    checkpoint.load_role(resumed, folder)
    role_ops.update_policy(resumed, shard, actor_cfg, dp)
    again = resumed.hf_state_dict()
    out["resumed_exact"] = all(torch.equal(again[k], v) for k, v in out["two_steps"].items())
    return out


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2

    root = tmp_path_factory.mktemp("muon")
    build_tiny_qwen2(root / "policy", build_char_tokenizer(root / "policy"), hidden_size=64, num_layers=4, seed=5)
    return root


@pytest.fixture(scope="module")
def results(policy):
    return batched_worlds(one_case, {i: (t * p * d, (_rank_fn, str(policy), t, p, mode))
                                     for i, (t, p, d, mode) in CASES.items()})


@pytest.mark.parametrize("case", list(CASES))
def test_muon_updates_and_resumes_exactly(results, case):
    for r in results(case):
        assert r["muon"] == "TensorParallelMuon" and r["momentum"], r["muon"]
        assert r["resumed_exact"], "the resumed second update differs from the uninterrupted one"


@pytest.mark.parametrize("case", ["tp2", "pp2", "dp2"])
def test_muon_layout_reproduces_single_rank(results, case):
    # two Muon steps: five Newton-Schulz matrix products each, on gradients reduced in another order
    assert_close(results(case)[0]["two_steps"], results("tp1_pp1_dp1")[0]["two_steps"], slack=2,
                 what=f"{case} weights after two Muon updates")


def test_muon_moves_the_matrices_and_blockwise_orthogonalizes_each_shard(policy, results):
    from hybridflow.workers.common import load_hf_folder

    _, initial = load_hf_folder(f"{policy}/policy")
    single, blockwise = results("tp1_pp1_dp1")[0]["two_steps"], results("tp2_blockwise")[0]["two_steps"]
    key = "model.layers.0.mlp.down_proj.weight"  # row-parallel: split by its input columns at TP 2
    step = single[key] - initial[key]
    assert step.abs().max() > 1e-3, "Muon did not move the weights"
    # blockwise: each half of the columns orthogonalized alone, the whole matrix's singular directions mixed otherwise
    assert (blockwise[key] - initial[key] - step).abs().max() > 0.1 * step.abs().max()
