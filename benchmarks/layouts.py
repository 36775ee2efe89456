"""Step time per megatron layout (TP x PP x DP) for one fixed small PPO workload, measured side by side.

    python benchmarks/layouts.py [--out benchmarks/results/layouts.json] [--steps 5]

Each layout runs in its own gloo process group (one process per rank) on the same tiny Qwen2 model and
the same rollout-shaped batch: per step one log-prob forward over the batch and one PPO policy update.
Prints seconds per step and the ratio to the single-rank run, and writes them as JSON. On a 2-core
machine layouts with more than 2 ranks oversubscribe the cores: the numbers show overheads, not speedups.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from hybridflow.spawn import run_ranks

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2)]  # (t, p, d)


def workload(rows: int = 32, prompt: int = 16, response: int = 16):
    from hybridflow.protocol import Batch

    g = torch.Generator().manual_seed(0)
    mask = torch.ones(rows, prompt + response, dtype=torch.long)
    return Batch.from_dict(tensors={
        "input_ids": torch.randint(3, 50, (rows, prompt + response), generator=g),
        "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1,
        "responses": torch.zeros(rows, response, dtype=torch.long),
        "response_mask": torch.ones(rows, response, dtype=torch.long),
        "old_log_probs": -torch.rand(rows, response, generator=g), "advantages": torch.randn(rows, response, generator=g),
    })


def _rank(rank, world, hf_dir, tp, pp, steps):
    from megatron.core import parallel_state as ps

    from hybridflow.config.schema import Actor, Optim
    from hybridflow.megatron import parallel
    from hybridflow.megatron.role import MegatronRole, ModelBuild, OptimSettings
    from hybridflow.workers import role_ops
    from hybridflow.workers.common import load_hf_folder

    parallel.init_model_parallel(tp, pp, seed=1)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    cfg, state = load_hf_folder(hf_dir)
    role = MegatronRole(cfg, state, ModelBuild(sequence_parallel=tp > 1), optim=OptimSettings(lr=1e-5))
    batch = workload()
    shard = batch.chunk(dp)[dp_rank]
    actor_cfg = Actor(optim=Optim(lr=1e-5), ppo_mini_batch_size=len(batch), ppo_micro_batch_size_per_gpu=4)
    times = []
    for _ in range(steps + 1):  # the first step warms up
        torch.distributed.barrier()
        start = time.perf_counter()
        role_ops.log_probs(role, shard, micro_batch_size=4)
        role_ops.update_policy(role, shard, actor_cfg, dp)
        torch.distributed.barrier()
        times.append(time.perf_counter() - start)
    return times[1:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/layouts.json")
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args(argv)
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2
    from hybridflow.models.char_tokenizer import build_char_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_qwen2(tmp, build_char_tokenizer(tmp), hidden_size=128, num_layers=4, seed=0)
        results = []
        for t, p, d in LAYOUTS:
            per_rank = run_ranks(_rank, t * p * d, tmp, t, p, a.steps)
            step_s = sorted(max(ts) for ts in zip(*per_rank))[len(per_rank[0]) // 2]  # median of slowest rank
            results.append({"tp": t, "pp": p, "dp": d, "ranks": t * p * d, "step_s": step_s})
    base = results[0]["step_s"]
    print(f"{'layout':<14} {'ranks':>5} {'s/step':>8} {'vs 1 rank':>9}")
    for r in results:
        r["ratio_to_single_rank"] = r["step_s"] / base
        print(f"tp{r['tp']} pp{r['pp']} dp{r['dp']:<5} {r['ranks']:>5} {r['step_s']:>8.3f} {r['ratio_to_single_rank']:>8.2f}x")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"workload": "32 x (16+16) tokens, tiny Qwen2 h128 L4, fwd + PPO update",
                                       "layouts": results}, indent=2))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
