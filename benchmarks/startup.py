"""Time to the first step of the CPU quickstart (``make run``: PPO with a critic), and where it goes.

    python benchmarks/startup.py [--repeats 2]

Runs the quickstart config (configs/quickstart_cpu.yaml) for two steps with its model and data already
prepared (the 0.8M workload's warm start, built once under benchmarks/.cache), as a user's second
``make run`` does. ``time/to_first_step_s`` is logged by the trainer: process start to the first step
(config checks, Ray, the actor/rollout/reference and critic workers with their vLLM engine, the first weight
sync). The first step's own stages are reported too: some carry one-time costs. Writes
benchmarks/results/startup.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import REPO, WORKLOADS, prepare, run_measured, write_json  # noqa: E402


def once(work: Path, k: int) -> dict:
    w = WORKLOADS["0.8M-short"]
    out = work / f"run{k}"
    overrides = {"model": {"path": str(w.model)}, "data": {"train_files": [str(w.train)], "val_files": [str(w.val)]},
                 "prepare": {"enable": False},
                 "trainer": {"output_dir": str(out), "total_steps": 2, "save_every": 0, "logger": ["jsonl"],
                             "save_hf_at_end": False}}
    cfg = work / "overrides.yaml"
    cfg.write_text(json.dumps(overrides))
    wall, peak = run_measured([sys.executable, "-m", "hybridflow.trainer.main", "--config", "configs/quickstart_cpu.yaml",
                               "--config", str(cfg)], work / f"run{k}.log")
    first = next(json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                 if json.loads(line)["step"] == 1)
    return {"to_first_step_s": first["time/to_first_step_s"], "first_step_s": first["time/step_s"],
            "first_step_stages_s": {k: v for k, v in first.items() if k.startswith("time/") and k.endswith("_s")},
            "wall_s": wall, "peak_rss_gib": peak}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/startup.json"))
    a = ap.parse_args(argv)
    prepare(WORKLOADS["0.8M-short"])
    with tempfile.TemporaryDirectory(prefix="hf_startup_") as tmp:
        runs = [once(Path(tmp), k) for k in range(a.repeats)]
    report = {"config": "configs/quickstart_cpu.yaml", "runs": runs,
              "to_first_step_s": statistics.median(r["to_first_step_s"] for r in runs), "target_s": 20.0}
    write_json(Path(a.out), report)
    print(f"quickstart: time to first step {report['to_first_step_s']:.1f} s (median of {a.repeats}; target 20 s), "
          f"first step {runs[-1]['first_step_s']:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
