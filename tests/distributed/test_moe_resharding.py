"""The hybrid transition of MoE models (Qwen3-MoE, Qwen2-MoE, GLM-4.5, gpt-oss: its experts' biases, sinks and the
checkpoint's interleaved expert form) at training layouts with expert parallelism:
every rank's generation shard is bit-identical to the single-rank conversion of the same weights
(vllm_layout.hf_to_vllm_shard), and the bytes each rank receives equal the planner's formula
(bytes_formula.expected_bytes_received: GLM-4.5's stages differ, its first layer dense). GLM-4.5 also in
bfloat16: its expert bias stays float32 through the transition.

All layouts of one world size run in one spawned world (starting processes dominates these tests), one
after another: each sets up megatron's groups for its layout and tears them down after."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.batched import batched_worlds
from tests.distributed.moe_archs import runs_at

pytestmark = pytest.mark.distributed

ARCHS = ("qwen3_moe", "qwen2_moe", "glm4_moe", "gpt_oss", "deepseek_v3")
BF16 = "glm4_moe"  # also built in bfloat16 (key "glm4_moe_bf16")
# (t, p, e, t_g): EP with generation TP above training TP, TP 2 x EP 2 (expert TP 1), TP-split
# experts (EP 1, expert TP = TP) into a smaller generation TP, and two pipeline stages gathered.
LAYOUTS = [(1, 1, 2, 2), (2, 1, 2, 2), (2, 1, 1, 1), (1, 2, 2, 1)]
IDS = [f"t{t}p{p}e{e}_to_tg{g}" for t, p, e, g in LAYOUTS]


def archs_at(t: int, e: int) -> tuple[str, ...]:
    return tuple(a for a in ARCHS if runs_at(a, t, e))


def _rank_fn(rank, world, root, t, p, e, t_g):
    from megatron.core import parallel_state as ps

    from hybridflow.megatron import parallel

    parallel.init_model_parallel(t, p, seed=1, ep=e, etp=1 if e > 1 else None)
    try:
        return _transition(rank, root, t, p, t_g)
    finally:
        # Ready for the next layout: megatron's groups (and global buffers) dropped, so that a second
        # initialize_model_parallel is allowed; init_model_parallel reseeds the RNG tracker itself. The
        # dropped groups and the Resharder's stay registered with torch.distributed until the process ends:
        # harmless, every rank creates them in the same order.
        ps.destroy_model_parallel()


def _transition(rank, root, t, p, t_g):
    from megatron.core import parallel_state as ps

    from hybridflow.megatron.role import MegatronRole, ModelBuild
    from hybridflow.resharding.plan import HybridPlan, Layout
    from hybridflow.resharding.transition import Resharder
    from hybridflow.workers.common import open_hf_folder

    plan = HybridPlan(Layout(p, t, ps.get_data_parallel_world_size()), 1, t_g)
    out = {"k": plan.ranks[rank].gen_tp_rank}
    for arch, dtype in [*((a, torch.float32) for a in archs_at(t, ps.get_expert_model_parallel_world_size())),
                        (BF16, torch.bfloat16)]:
        cfg, weights = open_hf_folder(f"{root}/{arch}")
        role = MegatronRole(cfg, weights, ModelBuild(dtype=dtype))
        shard, stats = Resharder(role.module, cfg, plan).to_generation()
        key = arch if dtype == torch.float32 else f"{arch}_bf16"
        out[key] = {"shard": {k: v.clone() for k, v in shard.items()}, "bytes": stats.bytes_received}
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from hybridflow.models.tiny_arch import build_tiny_folders

    return build_tiny_folders(tmp_path_factory.mktemp("moe"), ARCHS, seed=20)


@pytest.fixture(scope="module")
def layout_results(root):
    """layout id -> per-rank results; on first use of a world size, every layout of that size in one world."""
    return batched_worlds(_rank_fn, {i: (_world(lay), (root, *lay)) for i, lay in zip(IDS, LAYOUTS)})


def _world(layout) -> int:
    t, p, e, _ = layout
    return t * p * e


@pytest.mark.parametrize("t,p,e,t_g", LAYOUTS, ids=IDS)
def test_generation_shards_equal_single_rank_conversion_and_bytes_the_formula(root, layout_results, t, p, e, t_g):
    from hybridflow.families.weights import EXPERT_BIAS
    from hybridflow.resharding.bytes_formula import expected_bytes_received
    from hybridflow.resharding.plan import Layout
    from hybridflow.resharding.vllm_layout import hf_to_vllm_shard
    from hybridflow.workers.common import load_hf_folder

    world = t * p * e
    results = layout_results(IDS[LAYOUTS.index((t, p, e, t_g))])
    for arch in (*archs_at(t, e), f"{BF16}_bf16"):
        cfg, state = load_hf_folder(f"{root}/{arch.removesuffix('_bf16')}")
        if arch.endswith("_bf16"):  # the model's weights in bfloat16, its expert bias float32 (as megatron keeps it)
            state = {k: v if k.endswith(EXPERT_BIAS[0].hf[0]) else v.bfloat16() for k, v in state.items()}
        # at EP 1 (expert TP = TP) experts are TP-split like the dense MLP (plan.py)
        for rank, res in enumerate(results):
            stage = rank // (world // p)  # megatron's order: pp outermost
            formula = expected_bytes_received(state, cfg, Layout(p, t, world // (t * p)), e, t_g, stage=stage)
            want = hf_to_vllm_shard(state, cfg, res["k"], t_g)
            got = res[arch]["shard"]
            assert set(got) == set(want), f"{arch} rank {rank}: names differ: {sorted(set(got) ^ set(want))[:4]}"
            bad = [n for n in want if not torch.equal(got[n], want[n]) or got[n].dtype != want[n].dtype]
            assert not bad, f"{arch} rank {rank}: generation tensors differ from the single-rank conversion: {bad[:4]}"
            moved = res[arch]["bytes"]
            assert moved == formula, (
                f"{arch} rank {rank}: received {moved} bytes, formula {formula:.0f}")
