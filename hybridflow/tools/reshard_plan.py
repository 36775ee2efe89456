"""Print the 3D-HybridEngine's plan for a layout, or the paper's Table-2 style comparison.

``python -m hybridflow.tools.reshard_plan --train p,t,d --gen p_g,t_g --params 7e9 --dtype bf16`` prints the
generation groups, micro-DP groups and bytes per rank; ``--table`` compares naive, gather-all and hybrid
transitions for paper-scale layouts. t_g may be a divisor of t or a multiple of it (then each generation
shard is cut from its rank's training shard: only the pipeline gather moves bytes, none at p = 1).
"""

from __future__ import annotations

import argparse
from fractions import Fraction

from hybridflow.resharding.plan import HybridPlan, Layout

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


def _gib(x: float) -> str:
    return f"{x / 2**30:8.2f} GiB"


def describe(plan: HybridPlan, model_bytes: float) -> str:
    tr = plan.train
    lines = [f"train (p={tr.p}, t={tr.t}, d={tr.d}) -> generation (p_g={plan.p_g}, t_g={plan.t_g}), "
             f"d_g={plan.d_g} micro-DP ranks, {len(plan.replicas)} generation replicas, "
             f"M={_gib(model_bytes).strip()}"]
    if plan.tp_split > 1:
        lines.append(f"t_g = {plan.tp_split} x t: each generation shard is 1/{plan.tp_split} of its rank's "
                     "training TP shard after the pipeline gather, cut locally (no TP all-gather)")
    lines.append("generation replicas (TP x PP groups): " + " ".join(str(list(g)) for g in plan.replicas))
    micro = sorted({rp.micro_dp_group for rp in plan.ranks})
    lines.append("micro-DP groups (all-gather inside):   " + " ".join(str(list(g)) for g in micro))
    for rp in plan.ranks:
        lines.append(f"  rank {rp.rank:>3} train(tp={rp.train[0]}, dp={rp.train[1]}, pp={rp.train[2]}) -> "
                     f"gen shard tp={rp.gen_tp_rank} pp={rp.gen_pp_stage} replica {rp.replica}; receives "
                     f"{len(rp.receives)} shards = {_gib(float(plan.hybrid_bytes_received()) * model_bytes)}")
    lines.append(f"per-rank bytes: hybrid {_gib(float(plan.hybrid_bytes_received()) * model_bytes)} "
                 f"(formula {plan.formula_bytes()} M), gather-all "
                 f"{_gib(float(plan.gather_all_bytes_received()) * model_bytes)}; peak generation params "
                 f"{_gib(float(plan.hybrid_peak()) * model_bytes)}")
    return "\n".join(lines)


PAPER_LAYOUTS = [  # (params, GPUs, train (p,t,d), gen (p_g,t_g)) in the spirit of the paper's settings
    (7e9, 16, (1, 4, 4), (1, 2)), (7e9, 16, (2, 4, 2), (1, 2)), (13e9, 32, (2, 4, 4), (1, 4)),
    (13e9, 64, (4, 4, 4), (1, 4)), (70e9, 64, (4, 8, 2), (1, 8)), (70e9, 128, (8, 8, 2), (2, 8)),
    (7e9, 16, (1, 2, 8), (1, 4)),  # generation TP above training TP: cut locally, nothing moves
]


def table(rows=PAPER_LAYOUTS, dtype_bytes: int = 2) -> str:
    head = (f"{'model':>6} {'GPUs':>5} {'train p,t,d':>12} {'gen p_g,t_g':>12} | "
            f"{'comm/rank: naive':>17} {'gather-all':>11} {'hybrid':>9} | "
            f"{'peak: naive':>12} {'gather-all':>11} {'hybrid':>9} | redundancy (gather-all -> hybrid)")
    out = [head, "-" * len(head)]
    for params, gpus, tr, gen in rows:
        plan = HybridPlan(Layout(*tr), *gen)
        M = params * dtype_bytes
        tp = tr[0] * tr[1]
        ga_peak = Fraction(1, tp) + Fraction(1, gen[0] * gen[1])  # own shard + vLLM's separate slice
        out.append(
            f"{params / 1e9:>5.0f}B {gpus:>5} {str(tr):>12} {str(gen):>12} | "
            f"{_gib(float(plan.naive_bytes_received()) * M):>17} {_gib(float(plan.gather_all_bytes_received()) * M):>11}"
            f" {_gib(float(plan.hybrid_bytes_received()) * M):>9} | {_gib(M):>12} {_gib(float(ga_peak) * M):>11} "
            f"{_gib(float(plan.hybrid_peak()) * M):>9} | {_gib(M / tp).strip()} duplicated -> 0")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridflow.tools.reshard_plan", description=__doc__.splitlines()[0])
    ap.add_argument("--train", help="p,t,d")
    ap.add_argument("--gen", help="p_g,t_g")
    ap.add_argument("--params", type=float, default=7e9)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_BYTES))
    ap.add_argument("--table", action="store_true", help="naive vs gather-all vs hybrid for paper-scale layouts")
    a = ap.parse_args(argv)
    if a.table:
        print(table(dtype_bytes=DTYPE_BYTES[a.dtype]))
        return 0
    if not a.train or not a.gen:
        ap.error("--train p,t,d and --gen p_g,t_g are required (or --table)")
    p, t, d = (int(x) for x in a.train.split(","))
    p_g, t_g = (int(x) for x in a.gen.split(","))
    print(describe(HybridPlan(Layout(p, t, d), p_g, t_g), a.params * DTYPE_BYTES[a.dtype]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
