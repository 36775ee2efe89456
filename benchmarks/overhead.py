"""A training step's time split into worker compute and the controller's cost, per workload.

    python benchmarks/overhead.py [--steps 12] [--workloads 0.8M-short,20M-short] [--threads 2]

Runs the GRPO workloads of benchmarks/workloads.py through the Python API (``hybridflow.Trainer``). Each
worker times every registered method it runs (``Worker.compute_seconds``); after each step the driver
collects those (outside the step's timer). A step's worker compute is the sum over its stages of the
slowest rank's seconds; everything else in ``time/step_s`` is the controller's cost: dispatch (splitting
and concatenating batches), serialization, Ray's transport and scheduling, and the driver's own work
(reward scoring, advantages). Writes benchmarks/results/overhead.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import REPO, WORKLOADS, Workload, prepare, write_json  # noqa: E402

DRIVER_STAGES = ("reward", "adv")  # computed by the driver itself: controller cost by this measure


def measure(w: Workload, steps: int, warmup: int, threads: int, out_dir: str) -> dict:
    from hybridflow import Trainer

    overrides = w.overrides()
    # one step more than run: the end-of-training checkpoint is no part of a step's cost
    overrides["trainer"] = {"output_dir": out_dir, "total_steps": steps + warmup + 1, "val_every": 10**6,
                            "save_every": 0, "logger": ["jsonl"], "save_hf_at_end": False}
    overrides["resources"] = {"cpus_per_worker": threads}
    overrides["ray"] = {"num_cpus": threads}
    rows = []
    with Trainer([str(REPO / "configs/quickstart_grpo_cpu.yaml"), overrides]) as trainer:
        for k in range(steps + warmup):
            metrics = trainer.step()
            compute = trainer.worker_seconds()
            if k >= warmup:
                rows.append((metrics, compute))
    step = [m["time/step_s"] for m, _ in rows]
    compute = [sum(c.values()) for _, c in rows]
    driver = [sum(m.get(f"time/{s}_s", 0.0) for s in DRIVER_STAGES) for m, _ in rows]
    per_method = {k: statistics.mean(c.get(k, 0.0) for _, c in rows) for k in rows[-1][1]}
    mean_step, mean_compute = statistics.mean(step), statistics.mean(compute)
    return {
        "steps": len(rows), "s_per_step": mean_step, "worker_compute_s": mean_compute,
        "controller_s": mean_step - mean_compute, "controller_fraction": 1 - mean_compute / mean_step,
        "of_which_driver_compute_s": statistics.mean(driver),
        "worker_compute_by_method_s": per_method,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workloads", default="0.8M-short,20M-short")
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/overhead.json"))
    a = ap.parse_args(argv)
    report = {"threads": a.threads, "workloads": {}}
    for name in a.workloads.split(","):
        w = WORKLOADS[name]
        prepare(w)
        with tempfile.TemporaryDirectory(prefix="hf_overhead_") as tmp:
            r = measure(w, a.steps, a.warmup, a.threads, tmp)
        report["workloads"][name] = r
        print(f"[{name}] {r['s_per_step']:.3f} s/step: workers {r['worker_compute_s']:.3f} s, controller "
              f"{r['controller_s'] * 1e3:.1f} ms ({r['controller_fraction']:.1%}; driver's reward+advantages "
              f"{r['of_which_driver_compute_s'] * 1e3:.1f} ms)", flush=True)
        write_json(Path(a.out), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
