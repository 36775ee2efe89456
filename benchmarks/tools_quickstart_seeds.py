"""Does RL with tools work on this machine? The tools quickstart per seed, with and without the calculator.

    python benchmarks/tools_quickstart_seeds.py [--seeds 1 2 3] [--out benchmarks/results/tools_quickstart_seeds.json]

For each seed it builds the tools quickstart's data, tiny model and warm start under outputs/tools_seeds/<seed>/
(as `make run ARGS="--config configs/quickstart_tools_cpu.yaml"` does), then runs GRPO from that warm start
twice: with the calculator (multi-turn rollouts) and without it (rollout.multi_turn.enable=false: the same model,
single-turn, its tool calls never answered). Reported: held-out greedy accuracy (vLLM, the run's validation) at
step 0 (the warm start) and after the last step, for both.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CONFIG = "configs/quickstart_tools_cpu.yaml"
VARIANTS = {"with_tools": [], "without_tools": ["rollout.multi_turn.enable=false"]}


def run(seed: int, variant: str, root: Path, extra: list[str]) -> dict:
    d = root / str(seed)
    out = d / variant
    cmd = [sys.executable, "-m", "hybridflow.trainer.main", "--config", CONFIG, f"trainer.seed={seed}",
           f"prepare.data_dir={d}/data", f"prepare.base_model_dir={d}/base", f"model.path={d}/sft_model",
           f"data.train_files=[{d}/data/train.parquet]", f"data.val_files=[{d}/data/val.parquet]",
           f"trainer.output_dir={out}", "trainer.save_hf_at_end=false", *VARIANTS[variant], *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    acc = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    turns = [r["agent/assistant_turns_mean"] for r in rows if "agent/assistant_turns_mean" in r]
    return {"warm_start": acc[0][1], "final": acc[-1][1], "best": max(a for _, a in acc),
            "gain_points": 100 * (acc[-1][1] - acc[0][1]), "steps": acc[-1][0],
            "assistant_turns_first_last": [turns[0], turns[-1]] if turns else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--root", default="outputs/tools_seeds")
    ap.add_argument("--out", default="benchmarks/results/tools_quickstart_seeds.json")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    a = ap.parse_args(argv)
    results = {}
    for seed in a.seeds:
        for variant in VARIANTS:
            r = run(seed, variant, Path(a.root), a.overrides)
            results[f"{variant}_seed{seed}"] = r
            print(f"seed {seed} {variant:13s}: warm start {r['warm_start']:.3f} -> {r['final']:.3f} "
                  f"(best {r['best']:.3f}) = {r['gain_points']:+.1f} points", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
