"""Does the CPU quickstart show RL learning on this machine? PPO and GRPO from the warm start, per seed.

    python benchmarks/quickstart_seeds.py [--seeds 1 2 3] [--out benchmarks/results/quickstart_seeds.json]

For each seed it builds the quickstart's data, tiny model and warm start under outputs/seeds/<seed>/ (as
`make run` does, once per seed), then runs the PPO quickstart and the GRPO overlay from the same warm
start (and, with ``--algos ... async``, the GRPO overlay in separate_async), and reports held-out greedy
accuracy at step 0 (the warm start) and after the last step, and the gain in points. The target: a gain of at
least 20 points for each, for every seed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CONFIGS = {"ppo": "configs/quickstart_cpu.yaml", "grpo": "configs/quickstart_grpo_cpu.yaml",
           "async": "configs/quickstart_async_cpu.yaml"}  # GRPO, separate_async: one trainer + one rollout worker


def run(seed: int, algo: str, root: Path, extra: list[str]) -> dict:
    d = root / str(seed)
    out = d / algo
    cmd = [sys.executable, "-m", "hybridflow.trainer.main", "--config", CONFIGS[algo], f"trainer.seed={seed}",
           f"prepare.data_dir={d}/data", f"prepare.base_model_dir={d}/base", f"model.path={d}/sft_model",
           f"data.train_files=[{d}/data/train.parquet]", f"data.val_files=[{d}/data/val.parquet]",
           f"trainer.output_dir={out}", "trainer.save_hf_at_end=false", *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    acc = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    start, end = acc[0][1], acc[-1][1]
    return {"warm_start": start, "final": end, "best": max(a for _, a in acc), "gain_points": 100 * (end - start),
            "steps": acc[-1][0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--algos", nargs="+", default=["ppo", "grpo"], choices=list(CONFIGS))
    ap.add_argument("--root", default="outputs/seeds")
    ap.add_argument("--out", default="benchmarks/results/quickstart_seeds.json")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    a = ap.parse_args(argv)
    results = {}
    for seed in a.seeds:
        for algo in a.algos:
            r = run(seed, algo, Path(a.root), a.overrides)
            results[f"{algo}_seed{seed}"] = r
            print(f"{algo:5s} seed {seed}: warm start {r['warm_start']:.3f} -> {r['final']:.3f} "
                  f"(best {r['best']:.3f}) = {r['gain_points']:+.1f} points", flush=True)
    ok = all(r["gain_points"] >= 20 for r in results.values())
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"results": results, "all_gain_at_least_20_points": ok}, indent=2))
    print(f"every run gained >= 20 points: {ok}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
