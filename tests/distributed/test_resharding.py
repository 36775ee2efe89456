"""The 3D-HybridEngine transition on real gloo ranks: every rank's vLLM-layout generation shard is
bit-identical to a single-rank HF->vLLM conversion, contains the rank's own training shard (zero
redundancy; with t_g a multiple of t it is a slice of it), and the bytes each rank receives are exactly
what the plan says (and the paper's formula: none at all when t_g is a multiple of t and p = 1).

All cases of one world size run in one spawned world (starting processes dominates these tests), one
after another: each sets up megatron's groups for its layout and tears them down after."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.batched import batched_worlds

pytestmark = pytest.mark.distributed

CASES = [((1, 2, 1), 1), ((1, 2, 2), 1), ((1, 4, 1), 2), ((2, 2, 1), 1), ((2, 2, 1), 2), ((2, 1, 2), 1),
         ((1, 2, 2), 2),
         # t_g a multiple of t: sliced locally (2 KV heads at t_g = 4: vLLM replicates each on 2 ranks),
         # and with p = 2 after the pipeline gather
         ((1, 1, 2), 2), ((1, 2, 2), 4), ((2, 1, 2), 2),
         # context parallel 2: its ranks hold the same weights, numbered inside the planner's d (= dp x cp)
         ((1, 2, 2), 1, 2), ((2, 1, 2), 2, 2),
         # virtual pipeline stages (4 layers): stage s holds layers s and 2 + s, each stage's in a chunk of its own
         ((2, 1, 1), 1, 1, 2), ((2, 2, 1), 1, 1, 2),
         # uneven stages (3 layers: num_layers_in_last_pipeline_stage=1): bytes per stage from bytes_formula
         ((2, 2, 1), 2, 1, 1, 1)]  # ((p, t, d), t_g[, cp[, vpp[, last]]])
KV_HEADS = {((1, 2, 2), 4): 2}  # else 4
IDS = ["p{}t{}d{}_to_tg{}".format(*c[0], c[1]) + (f"_cp{c[2]}" if len(c) > 2 and c[2] > 1 else "")
       + (f"_vpp{c[3]}" if len(c) > 3 and c[3] > 1 else "") + (f"_last{c[4]}" if len(c) > 4 else "") for c in CASES]


def _vpp(case) -> int:
    return case[3] if len(case) > 3 else 1


def _stages(case):
    from hybridflow.plan.stages import StageSplit

    return StageSplit(case[0][0], _vpp(case), None, case[4] if len(case) > 4 else None)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """A tiny Qwen2 folder per number of KV heads and layers, built on first use."""
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2
    from hybridflow.models.char_tokenizer import build_char_tokenizer

    built = {}

    def get(kv_heads: int, layers: int = 2) -> str:
        if (kv_heads, layers) not in built:
            root = tmp_path_factory.mktemp(f"reshard_kv{kv_heads}_l{layers}")
            build_tiny_qwen2(root, build_char_tokenizer(root), hidden_size=128, num_layers=layers,
                             num_kv_heads=kv_heads, vocab_multiple=128, seed=7)
            built[kv_heads, layers] = str(root)
        return built[kv_heads, layers]

    return get


@pytest.fixture(scope="module")
def case_results(hf_dirs):
    """case id -> per-rank results; on first use of a world size, every case of that size in one world."""
    return batched_worlds(_rank_fn, {i: (_world(c), (_hf_dir(hf_dirs, c), c[0][0], c[0][1], *c[1:]))
                                     for i, c in zip(IDS, CASES)})


def _hf_dir(hf_dirs, case) -> str:
    return hf_dirs(KV_HEADS.get(case, 4), 3 if _stages(case).uneven else 2 * _vpp(case))


def _world(case) -> int:
    p, t, d = case[0]
    return p * t * d


class _TENamed:
    """The model's parameters as Transformer Engine's layer spec names them (norms fused into the next
    linear layer, plus TE's ``_extra_state`` entries), which is what a GPU run with TE hands the resharder."""

    def __init__(self, module):
        self.module = module

    def state_dict(self):
        from hybridflow.megatron import convert

        local = self.module.state_dict()
        te_keys = [convert._rename(k, convert._te_norm_renames()) for k in local]  # a TE-built model's names
        sd = convert.model_names(local, te_keys)
        assert any(k.endswith("linear_qkv.layer_norm_weight") for k in sd) and not any("layernorm." in k and
                                                                                       "final" not in k for k in sd)
        return {**sd, "decoder.layers.0.self_attention.linear_qkv._extra_state": torch.zeros(3)}

    def named_modules(self):
        return self.module.named_modules()


def _rank_fn(rank, world, hf_dir, p, t, t_g, cp=1, vpp=1, last=None):
    from megatron.core import parallel_state as ps

    from hybridflow.megatron import parallel

    parallel.init_model_parallel(t, p, seed=1, cp=cp, vpp=vpp)
    try:
        return _transition(rank, hf_dir, p, t, t_g, last)
    finally:
        # Ready for the next case's layout: megatron's groups (and global buffers) dropped, so that a second
        # initialize_model_parallel is allowed; init_model_parallel reseeds the RNG tracker itself. The
        # dropped groups and the Resharder's stay registered with torch.distributed until the process ends:
        # harmless, every rank creates them in the same order.
        ps.destroy_model_parallel()


def _transition(rank, hf_dir, p, t, t_g, last):
    from megatron.core import parallel_state as ps

    from hybridflow.megatron.role import MegatronRole, ModelBuild
    from hybridflow.resharding.transition import Resharder
    from hybridflow.resharding.plan import HybridPlan, Layout
    from hybridflow.workers.common import load_hf_folder

    cfg, state = load_hf_folder(hf_dir)
    role = MegatronRole(cfg, state, ModelBuild(transformer_overrides={"num_layers_in_last_pipeline_stage": last}
                                               if last else None))
    layout = Layout(p, t, ps.get_data_parallel_world_size() * ps.get_context_parallel_world_size())
    out = {"rank": rank}
    for scheme in ("hybrid", "gather_all"):
        shard, stats = Resharder(role.module, cfg, HybridPlan(layout, 1, t_g), scheme, role.shard.stages).to_generation()
        out[scheme] = (shard, stats)
    out["hybrid_te"] = Resharder(_TENamed(role.module), cfg, HybridPlan(layout, 1, t_g), "hybrid",
                                 role.shard.stages).to_generation()
    local = {k: v.clone() for k, v in role.module.state_dict().items() if not k.endswith("_extra_state")}
    out["local"] = local
    return out


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_transition(hf_dirs, case_results, case):
    from hybridflow.megatron.convert import tp_split_dim
    from hybridflow.resharding.bytes_formula import expected_bytes_received
    from hybridflow.resharding.plan import HybridPlan, Layout
    from hybridflow.resharding.vllm_layout import hf_to_vllm_shard
    from hybridflow.workers.common import load_hf_folder

    layout, t_g = case[:2]
    p, t, d = layout
    hf_dir = _hf_dir(hf_dirs, case)
    cfg, hf = load_hf_folder(hf_dir)
    results = case_results(IDS[CASES.index(case)])
    plan = HybridPlan(Layout(p, t, d), 1, t_g)
    model_bytes = sum(v.numel() * v.element_size() for v in hf.values())
    for res in results:
        me = plan.ranks[res["rank"]]
        expected = hf_to_vllm_shard(hf, cfg, me.gen_tp_rank, t_g)
        for scheme in ("hybrid", "gather_all", "hybrid_te"):
            shard, stats = res[scheme]
            assert set(shard) == set(expected), scheme
            for name, tensor in expected.items():
                assert torch.equal(shard[name], tensor), f"{scheme} rank {res['rank']}: {name} differs"
        # Bytes: exactly the other members' sent tensors (replicated norms once per stage) ...
        hybrid = res["hybrid"][1]
        assert res["hybrid_te"][1].bytes_received == hybrid.bytes_received  # TE names: the same transition
        planned = 0
        lay = Layout(p, t, d)
        for other in me.micro_dp_group:
            if other == me.rank:
                continue
            o = next(r for r in results if r["rank"] == other)["local"]
            same_offset = lay.coords(other)[0] % plan.tp_block == lay.coords(me.rank)[0] % plan.tp_block
            # TP-split tensors from every member; replicated norms from the other stages' same-offset member
            planned += sum(v.numel() * 4 for k, v in o.items() if tp_split_dim(k) is not None or same_offset)
        assert hybrid.bytes_received == planned
        if plan.tp_split > 1 and p == 1:  # generation TP a multiple of training TP: nothing moves
            assert hybrid.bytes_received == hybrid.bytes_sent == 0
        # ... which is the planner's count for the rank's stage, and, with even stages, the paper's
        # (t*p - t_g*p_g)/(t_g*p_g*t*p) * M up to the TP-replicated norms.
        stage = Layout(p, t, d).coords(res["rank"])[2]
        assert hybrid.bytes_received == expected_bytes_received(hf, cfg, Layout(p, t, d), 1, t_g, stage=stage,
                                                                stages=_stages(case))
        formula = float(plan.formula_bytes()) * model_bytes
        assert _stages(case).uneven or abs(hybrid.bytes_received - formula) <= 0.01 * model_bytes
        gather_all = res["gather_all"][1]
        # With t_g = 1 (or t = 1: the pipeline gather alone) both schemes move (t*p - 1)/(t*p) * M; with
        # t_g > 1 hybrid moves less.
        assert hybrid.bytes_received <= gather_all.bytes_received
        if t_g > 1 and t > 1:
            assert hybrid.bytes_received < gather_all.bytes_received
        # Zero redundancy: the rank's own training shard lies inside its generation shard (t_g <= t), or
        # the generation shard is a slice of it (t_g a multiple of t).
        shard = res["hybrid"][0]
        tp_rank = Layout(p, t, d).coords(res["rank"])[0]
        for name, own in res["local"].items():
            if name == "embedding.word_embeddings.weight":
                gen, dim = shard["model.embed_tokens.weight"], 0
            elif name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
                layer = _stages(case).layers(cfg.num_hidden_layers, stage)[int(name.split(".")[2])]
                suffix = "self_attn.o_proj.weight" if "linear_proj" in name else "mlp.down_proj.weight"
                gen, dim = shard[f"model.layers.{layer}.{suffix}"], 1
            else:
                continue
            if plan.tp_split > 1:
                assert torch.equal(torch.chunk(own, plan.tp_split, dim=dim)[me.gen_tp_rank % plan.tp_split], gen), name
                continue
            pos = tp_rank % plan.tp_block
            assert torch.equal(torch.chunk(gen, plan.tp_block, dim=dim)[pos], own), name
