"""The 3D-HybridEngine planner: groups, strides, byte formulas (pure Python)."""

from fractions import Fraction

import pytest

from hybridflow.resharding.plan import HybridPlan, Layout
from hybridflow.tools.reshard_plan import main, table


def test_groups_for_p2_t2_to_tg2():
    plan = HybridPlan(Layout(p=2, t=2, d=1), p_g=1, t_g=2)
    assert plan.d_g == 2
    # generation TP groups take ranks at stride t/t_g = 1 within a stage; micro-DP groups span the stages
    assert plan.replicas == [(0, 1), (2, 3)]
    assert sorted({rp.micro_dp_group for rp in plan.ranks}) == [(0, 2), (1, 3)]
    assert plan.formula_bytes() == Fraction(1, 4) == plan.hybrid_bytes_received()
    assert plan.gather_all_bytes_received() == Fraction(3, 4)  # 3x the hybrid bytes


def test_strided_generation_groups_and_consecutive_micro_dp():
    plan = HybridPlan(Layout(p=1, t=4, d=2), p_g=1, t_g=2)
    assert plan.replicas == [(0, 2), (1, 3), (4, 6), (5, 7)]  # stride t/t_g = 2
    assert sorted({rp.micro_dp_group for rp in plan.ranks}) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    for rp in plan.ranks:  # each rank's generation shard (TP block) contains its own training TP shard
        assert rp.gen_tp_rank == rp.train[0] // 2
        assert rp.rank in rp.micro_dp_group and rp.rank in rp.gen_group
        assert len(rp.receives) == plan.d_g - 1


@pytest.mark.parametrize("p,t,d,p_g,t_g", [(1, 8, 2, 1, 2), (4, 8, 2, 2, 4), (2, 4, 4, 1, 1), (8, 8, 1, 2, 8)])
def test_formula_matches_counted_receives(p, t, d, p_g, t_g):
    plan = HybridPlan(Layout(p, t, d), p_g, t_g)
    assert plan.hybrid_bytes_received() == plan.formula_bytes()
    assert plan.hybrid_bytes_received() == Fraction(len(plan.ranks[0].receives), t * p)
    assert plan.hybrid_peak() == Fraction(1, t_g * p_g)
    info = [plan.dispatch_info(r) for r in range(plan.train.world)]
    assert sorted(i["dp_rank"] for i in info if i["collect"]) == list(range(len(plan.replicas)))


def test_invalid_generation_layout():
    with pytest.raises(ValueError, match="must divide the training layout"):
        HybridPlan(Layout(1, 4, 2), 1, 6)
    with pytest.raises(ValueError, match="do not form generation groups"):
        HybridPlan(Layout(1, 2, 1), 1, 4)  # a multiple of t, but 2 ranks cannot hold a TP-4 engine


def test_generation_tp_above_training_tp_moves_nothing():
    # training TP1/DP2 -> rollout TP2: one engine over both DP ranks, each cutting its half locally
    plan = HybridPlan(Layout(p=1, t=1, d=2), p_g=1, t_g=2)
    assert plan.replicas == [(0, 1)] and [rp.gen_tp_rank for rp in plan.ranks] == [0, 1]
    assert [rp.micro_dp_group for rp in plan.ranks] == [(0,), (1,)]
    assert plan.hybrid_bytes_received() == plan.formula_bytes() == 0
    assert [plan.dispatch_info(r) for r in range(2)] == [dict(dp_rank=0, dp_size=1, collect=True),
                                                          dict(dp_rank=0, dp_size=1, collect=False)]
    # TP2/DP4 -> TP4: a generation group spans the two DP ranks holding each training TP shard
    plan = HybridPlan(Layout(p=1, t=2, d=4), p_g=1, t_g=4)
    assert plan.replicas == [(0, 2, 1, 3), (4, 6, 5, 7)]  # consecutive ranks, in generation TP order
    assert plan.hybrid_bytes_received() == plan.formula_bytes() == 0
    assert plan.gather_all_bytes_received() == Fraction(1, 2)


def test_generation_tp_above_training_tp_with_pipeline_gathers_stages_only():
    plan = HybridPlan(Layout(p=2, t=2, d=2), p_g=1, t_g=4)
    # the micro-DP group is the pipeline group: (p - 1) training shards of M/(t*p) arrive
    assert sorted({rp.micro_dp_group for rp in plan.ranks}) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert plan.hybrid_bytes_received() == plan.formula_bytes() == Fraction(1, 4)
    assert plan.replicas == [(0, 2, 1, 3), (4, 6, 5, 7)]


LAYOUTS = [(1, 8, 2, 1, 2), (4, 8, 2, 2, 4), (2, 4, 4, 1, 1), (8, 8, 1, 2, 8), (1, 1, 2, 1, 2), (1, 2, 4, 1, 4),
           (1, 2, 2, 1, 4), (2, 2, 2, 1, 4), (4, 1, 1, 1, 2), (2, 1, 4, 1, 8), (4, 2, 2, 2, 4), (2, 4, 3, 1, 8)]


@pytest.mark.parametrize("p,t,d,p_g,t_g", LAYOUTS)
def test_generation_groups_partition_the_ranks(p, t, d, p_g, t_g):
    """Every rank is in exactly one generation group, at the generation (stage, TP rank) it holds; the
    training shard it starts from covers its generation shard, or the generation shard covers it."""
    tr = Layout(p, t, d)
    plan = HybridPlan(tr, p_g, t_g)
    assert len(plan.replicas) == tr.world // (t_g * p_g)
    assert sorted(r for g in plan.replicas for r in g) == list(range(tr.world))
    for i, group in enumerate(plan.replicas):
        for pos, member in enumerate(group):
            rp = plan.ranks[member]
            assert (rp.replica, rp.gen_group) == (i, group)
            assert (rp.gen_pp_stage, rp.gen_tp_rank) == divmod(pos, t_g)  # vLLM's TP rank = position in group
            tp, _, pp = rp.train
            assert pp // (p // p_g) == rp.gen_pp_stage
            if t_g >= t:
                assert tp == rp.gen_tp_rank // (t_g // t)
            else:
                assert rp.gen_tp_rank == tp // (t // t_g)
    info = [plan.dispatch_info(r) for r in range(tr.world)]
    assert sorted(i["dp_rank"] for i in info if i["collect"]) == list(range(len(plan.replicas)))
    assert plan.hybrid_bytes_received() == plan.formula_bytes()
    if t_g % t == 0 and p == p_g:
        assert plan.hybrid_bytes_received() == 0


def test_cli_prints_plan_and_table(capsys):
    assert main(["--train", "2,2,1", "--gen", "1,2", "--params", "7e9", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "d_g=2" in out and "formula 1/4 M" in out and "[0, 1] [2, 3]" in out
    assert "70B" in table() and "duplicated -> 0" in table()
    assert main(["--train", "1,1,2", "--gen", "1,2"]) == 0
    out = capsys.readouterr().out
    assert "cut locally" in out and "formula 0 M" in out and "generation replicas (TP x PP groups): [0, 1]" in out
