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
        HybridPlan(Layout(1, 2, 1), 1, 4)


def test_cli_prints_plan_and_table(capsys):
    assert main(["--train", "2,2,1", "--gen", "1,2", "--params", "7e9", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "d_g=2" in out and "formula 1/4 M" in out and "[0, 1] [2, 3]" in out
    assert "70B" in table() and "duplicated -> 0" in table()
