"""Train -> generation weight transition: hybrid (3D-HybridEngine) vs gather-all, measured side by side.

    python benchmarks/resharding.py [--out benchmarks/results/resharding.json] [--repeats 3]

Runs both schemes for real on 4 gloo ranks for train (p,t,d) = (1,4,1) -> t_g=2, (2,2,1) -> t_g=2 and
(1,2,2) -> t_g=4 (generation TP above training TP: hybrid moves nothing) with a Qwen2-architecture model
of >= 50M parameters (fp32), and writes per scheme: bytes received per rank, peak extra parameter bytes, seconds per transition (median over repeats, slowest rank), the ratios
hybrid / gather-all, and the paper's formula for the hybrid bytes (bytes/formula is null where the formula
is 0; the hybrid bytes are then checked to be 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from hybridflow.spawn import run_ranks

CASES = [((1, 4, 1), 2), ((2, 2, 1), 2), ((1, 2, 2), 4)]  # ((p, t, d), t_g)


def build_model(out_dir: str) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=16384, hidden_size=512, intermediate_size=1536, num_hidden_layers=12,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def _rank(rank, world, hf_dir, p, t, t_g, repeats):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hybridflow.megatron import parallel
    from hybridflow.megatron.role import MegatronRole
    from hybridflow.resharding.plan import HybridPlan, Layout
    from hybridflow.resharding.transition import Resharder
    from hybridflow.workers.common import load_hf_folder

    parallel.init_model_parallel(t, p, seed=1)
    cfg, state = load_hf_folder(hf_dir)
    role = MegatronRole(cfg, state)
    del state
    layout = Layout(p, t, ps.get_data_parallel_world_size())
    out = {}
    for scheme in ("gather_all", "hybrid"):
        resharder = Resharder(role.module, cfg, HybridPlan(layout, 1, t_g), scheme)
        runs = []
        for _ in range(repeats + 1):  # first run warms up
            dist.barrier()
            shard, stats = resharder.to_generation()
            del shard
            runs.append(stats)
        out[scheme] = {"seconds": [s.seconds for s in runs[1:]], "bytes_received": runs[-1].bytes_received,
                       "peak_extra_bytes": runs[-1].peak_extra_bytes, "own_shard_bytes": runs[-1].own_shard_bytes}
    return out


def _ratio(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)  # None: both sides move nothing


def main(argv=None) -> int:
    from hybridflow.resharding.plan import HybridPlan, Layout

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/resharding.json")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    report = {"cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        n_params = build_model(tmp)
        model_bytes = n_params * 4
        report["model"] = {"params": n_params, "bytes": model_bytes, "dtype": "float32"}
        for (p, t, d), t_g in CASES:
            per_rank = run_ranks(_rank, p * t * d, tmp, p, t, t_g, a.repeats)
            case = {"train": [p, t, d], "t_g": t_g}
            for scheme in ("gather_all", "hybrid"):
                seconds = statistics.median(max(r[scheme]["seconds"][i] for r in per_rank) for i in range(a.repeats))
                case[scheme] = {
                    "seconds": seconds,
                    "bytes_received_per_rank": [r[scheme]["bytes_received"] for r in per_rank],
                    "peak_extra_bytes_per_rank": [r[scheme]["peak_extra_bytes"] for r in per_rank],
                }
            plan = HybridPlan(Layout(p, t, d), 1, t_g)
            case["formula_hybrid_bytes"] = float(plan.formula_bytes()) * model_bytes
            case["formula_gather_all_bytes"] = float(plan.gather_all_bytes_received()) * model_bytes
            h, g = case["hybrid"], case["gather_all"]
            case["ratios"] = {
                "time_hybrid_over_gather_all": h["seconds"] / g["seconds"],
                "bytes_hybrid_over_gather_all": (max(h["bytes_received_per_rank"]) / max(g["bytes_received_per_rank"])
                                                 if max(g["bytes_received_per_rank"]) else None),
                "peak_hybrid_over_gather_all": max(h["peak_extra_bytes_per_rank"]) / max(g["peak_extra_bytes_per_rank"]),
                "bytes_hybrid_over_formula": (max(h["bytes_received_per_rank"]) / case["formula_hybrid_bytes"]
                                              if case["formula_hybrid_bytes"] else None),
            }
            if not case["formula_hybrid_bytes"] and max(h["bytes_received_per_rank"]):
                raise SystemExit(f"{case['train']} -> t_g={t_g}: the formula says 0 bytes, hybrid moved "
                                 f"{max(h['bytes_received_per_rank'])}")
            report["cases"].append(case)
            r = case["ratios"]
            print(f"train (p,t,d)=({p},{t},{d}) -> t_g={t_g}: "
                  f"gather-all {g['seconds']:.3f}s {max(g['bytes_received_per_rank']) / 2**20:.1f} MiB | "
                  f"hybrid {h['seconds']:.3f}s {max(h['bytes_received_per_rank']) / 2**20:.1f} MiB | "
                  f"time x{r['time_hybrid_over_gather_all']:.2f}, "
                  f"bytes x{_ratio(r['bytes_hybrid_over_gather_all'], '.3f')}, "
                  f"peak x{r['peak_hybrid_over_gather_all']:.2f}, bytes/formula "
                  f"{_ratio(r['bytes_hybrid_over_formula'], '.4f')}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2))
    print(f"model {n_params / 1e6:.1f}M params; wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
