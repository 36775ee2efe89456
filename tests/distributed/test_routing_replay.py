"""MoE routing replay (megatron/routing.py) on the tiny Qwen3-MoE, Qwen2-MoE (shared expert), GLM-4.5 (sigmoid
router with an expert bias) and gpt-oss (a biased router; not at TP 2 with EP 1: tests/distributed/moe_archs.py) at TP 1, TP 2 with
sequence parallel, EP 2 and PP 2 (each stage routes its own layers): the routes the log-prob forward records (R2's
source) replay to the same log-probs in the same and in another micro-batch layout (shared prompts -> token-budget packing) within fp32 rounding;
routes that differ from the routers' own choice change the log-probs and are counted by the routing-difference
metric; and an update replaying the routers' own choice equals the update without replay (the gate's gradient
flows as without it)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.batched import batched_worlds, one_case
from tests.distributed.moe_archs import runs_at
from tests.distributed.test_layouts import P, R, _settings, rollout_batch
from tests.numerics import assert_close

pytestmark = pytest.mark.distributed

ARCHS = ("qwen3_moe", "qwen2_moe", "glm4_moe", "gpt_oss", "deepseek_v3")  # GLM-4.5: sigmoid router with expert bias; gpt-oss: biased
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)]  # (t, e, p); data parallel = e
IDS = [f"tp{t}_ep{e}" + (f"_pp{p}" if p > 1 else "") for t, e, p in LAYOUTS]


def grouped_batch():
    """``rollout_batch`` with rows in pairs sharing a prompt (GRPO groups: the CPU layout shares their prompt)."""
    b = rollout_batch()
    t = {k: v.clone() for k, v in b.tensors.items()}
    for i in range(1, len(b), 2):
        for k in ("input_ids", "attention_mask", "position_ids"):
            t[k][i, :P] = t[k][i - 1, :P]
    t["position_ids"] = (t["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return type(b).from_dict(tensors=t)


def _flip_routes(routes, mask, num_experts, layer):
    """Every real token routed in the first MoE layer ``layer`` to the experts after its own (mod E): not its choice
    (all of them: GLM-4.5's first MoE layer is its last, where one token's experts change no other's log-prob)."""
    flipped = routes.clone()
    flipped[..., layer, :][mask] = (routes[..., layer, :][mask] + routes.shape[-1]) % num_experts
    return flipped


def _rank_fn(rank, world, root, tp, ep, pp):
    from megatron.core import parallel_state as ps

    from hybridflow import families
    from hybridflow.megatron import parallel
    from hybridflow.megatron.role import MegatronRole, ModelBuild, OptimSettings
    from hybridflow.workers import role_ops
    from hybridflow.workers.common import open_hf_folder
    from hybridflow.workers.row_layout import TokenBudget

    parallel.init_model_parallel(tp, pp, seed=1, ep=ep, etp=1 if ep > 1 else None)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    actor_cfg, _ = _settings()
    shard = grouped_batch().chunk(dp)[dp_rank]
    out = {}
    for arch in (a for a in ARCHS if runs_at(a, tp, ep)):
        cfg, weights = open_hf_folder(f"{root}/{arch}")
        optim = OptimSettings(lr=1e-3, eps=1e-3, use_distributed_optimizer=dp > 1)
        actor = MegatronRole(cfg, weights, ModelBuild(sequence_parallel=tp > 1, routing_replay=True), optim=optim)
        pattern = families.moe_layer_pattern(cfg)  # the routed layers count, the dense ones (GLM-4.5's first) not
        sparse_here = any(pattern[i] for i in actor.shard.layers(cfg.num_hidden_layers))  # GLM at PP 2: stage 0 dense
        assert bool(actor.routing.routers) == sparse_here, "no router records or replays"
        own = role_ops.log_probs(actor, shard, 2, record_routes=True)
        routes = [own["routed_experts"]]  # on the last stage; the driver hands the batch to every stage
        if pp > 1:
            group = ps.get_pipeline_model_parallel_group()
            torch.distributed.broadcast_object_list(routes, src=torch.distributed.get_process_group_ranks(group)[-1],
                                                    group=group)
        routes = routes[0]
        with_routes = lambda r: shard.union(type(shard).from_dict(tensors={"routed_experts": r}))  # noqa: E731
        same = role_ops.log_probs(actor, with_routes(routes), 2)
        packed = role_ops.log_probs(actor, with_routes(routes), TokenBudget(3 * (P + R), "k"))
        flipped = _flip_routes(routes, shard.tensors["attention_mask"].bool(), families.num_experts(cfg),
                                     families.moe_layer_pattern(cfg).index(1))
        other = role_ops.log_probs(actor, with_routes(flipped), 2)
        res = dict(own=own, same=same, packed=packed, other=other, layers=sum(pattern), pattern=pattern)
        replayed = role_ops.update_policy(actor, with_routes(routes), actor_cfg, dp)
        res["replayed_update"] = (replayed.get("actor/pg_loss"),  # on the last stage
                                  {k: v.clone() for k, v in actor.hf_state_dict().items()})  # on rank 0
        plain = MegatronRole(cfg, weights, ModelBuild(sequence_parallel=tp > 1), optim=optim)
        m = role_ops.update_policy(plain, shard, actor_cfg, dp)
        res["plain_update"] = (m.get("actor/pg_loss"), {k: v.clone() for k, v in plain.hf_state_dict().items()})
        out[arch] = res
    return {"collect": parallel.dispatch_info()["collect"], "dp_rank": dp_rank, **out}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from hybridflow.models.tiny_arch import build_tiny_folders

    return build_tiny_folders(tmp_path_factory.mktemp("routing"), ARCHS, seed=11)


@pytest.fixture(scope="module")
def results(root):
    return batched_worlds(one_case, {i: (t * e * p, (_rank_fn, root, t, e, p)) for i, (t, e, p) in zip(IDS, LAYOUTS)})


@pytest.mark.parametrize("case", IDS)
def test_recorded_routes_replay_exactly_and_other_routes_are_counted(results, case):
    from hybridflow.megatron.routing import NO_ROUTE

    ranks = results(case)
    for r in ranks:
        if not r["collect"]:
            continue
        shard = grouped_batch().chunk(len([x for x in ranks if x["collect"]]))[r["dp_rank"]]
        mask, valid = shard.tensors["attention_mask"].bool(), shard.tensors["response_mask"].bool()
        for arch in (a for a in ARCHS if a in r):
            res = r[arch]
            sparse = torch.tensor(res["pattern"]).bool()  # GLM-4.5's first layer is dense: nobody routes there
            routes, dense = res["own"]["routed_experts"][..., sparse, :], res["own"]["routed_experts"][..., ~sparse, :]
            assert (routes[mask] >= 0).all() and (routes[~mask] == NO_ROUTE).all(), f"{arch}: cells without routes"
            assert (dense == NO_ROUTE).all(), f"{arch}: routes recorded for a dense layer"
            top = routes[mask].sort(-1).values
            assert (top[..., 1:] != top[..., :-1]).all(), f"{arch}: a recorded top-k repeats an expert"
            # the same routes, the same layout: the same log-probs (bit for bit at TP 1; TP 2's collectives may round
            # Qwen2-MoE's shared expert differently between two forwards)
            assert_close(res["same"]["log_probs"], res["own"]["log_probs"], slack=0.1,
                         what=f"{arch}: replayed in the same layout")
            assert float(res["same"]["routing_differing"].sum()) == 0, f"{arch}: own routes counted as differing"
            assert torch.equal(res["same"]["routing_counted"], mask.sum(1).double() * res["layers"])
            # another layout replays them to the same log-probs, within fp32 rounding
            assert_close(res["packed"]["log_probs"][valid], res["own"]["log_probs"][valid],
                         what=f"{arch}: replayed in a packed layout")
            # routes the routers would not choose: counted, and they change what follows
            assert float(res["other"]["routing_differing"].sum()) >= len(shard), f"{arch}: flipped routes not counted"
            moved = (res["other"]["log_probs"] - res["own"]["log_probs"]).abs()[valid].max()
            assert moved > 1e-4, f"{arch}: replaying other experts changed nothing ({moved})"


@pytest.mark.parametrize("case", IDS)
def test_an_update_replaying_the_own_routes_equals_the_plain_update(results, case):
    ranks = results(case)
    for arch in (a for a in ARCHS if a in ranks[0]):
        (_, hf_a), (_, hf_b) = ranks[0][arch]["replayed_update"], ranks[0][arch]["plain_update"]
        assert_close(hf_a, hf_b, what=f"{arch} weights after one update (router weights included)")
        for r in ranks:
            (loss_a, _), (loss_b, _) = r[arch]["replayed_update"], r[arch]["plain_update"]
            if loss_b is not None:
                assert_close(loss_a, loss_b, what=f"{arch} policy loss")
