"""sync vs separate_async (and TRL) on the same two cores, side by side in one run.

    python benchmarks/async_vs_sync.py [--steps 30] [--workloads 0.8M-long,20M-short] [--no-trl]

Each workload (benchmarks/workloads.py) is trained the same number of steps, hence on the same number of samples,
from the same SFT weights and prompts:
  sync            the hybrid engine: one worker holding actor, reference and vLLM, with both cores;
  separate_async  one trainer worker (actor, reference) and one standalone vLLM rollout worker, one core each,
                  the rollout serving the next step's batch continuously while the trainer trains (schedule.mode
                  separate_async, num_warmup_batches 1, partial rollouts: a push stops the running requests and
                  resumes them under the new weights), the checkpoint engine pushing the weights after every step;
  separate_async_per_call  the same without partial rollouts: the pool generates one batch a call;
  colocate_async  the hybrid engine with partial rollouts: a step's generation stops at its batch of complete
                  groups, unfinished responses carried into the next step (num_warmup_batches 1 in flight);
  trl             TRL's GRPOTrainer with both cores (benchmarks/e2e_vs_trl.py's runner, its pinned venv).
0.8M-long is the long-tail workload: the model before its warm start writes up to 64 tokens, most far fewer.
Reported per mode: generated tokens per second of step time (steps after ``--warmup``), s/step, held-out greedy
accuracy before and after, and ratios to sync and to TRL. Writes benchmarks/results/async_vs_sync.json and .md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_vs_trl import RESULTS, run_hybridflow, run_trl, summarize  # noqa: E402
from workloads import WORKLOADS, prepare, write_json, write_report  # noqa: E402

COLOCATE = {"schedule": {"mode": "colocate_async", "num_warmup_batches": 1}}
SEPARATE = {"schedule": {"mode": "separate_async", "num_warmup_batches": 1, "parameter_sync_step": 1},
            "resources": {"rollout_n_workers": 1, "cpus_per_worker": 1}}
# the pool generating one batch a call (each sample under one version) instead of serving continuously
SEPARATE_PER_CALL = {**SEPARATE, "schedule": {**SEPARATE["schedule"], "partial_rollout": False}}


def markdown(report: dict) -> str:
    lines = [f"# sync vs colocate_async vs separate_async vs TRL (GRPO, 16 prompts x 4, {report['steps']} steps, "
             "2 cores)", "",
             "| workload | mode | s/step | gen tok/s | vs sync | vs TRL | val acc before -> after |", "|---|---|---|---|---|---|---|"]
    for name, entry in report["workloads"].items():
        for mode, s in entry["modes"].items():
            if "gen_tok_s" not in s:
                lines.append(f"| {name} | {mode} | - | - | - | - | {s.get('note', '')} |")
                continue
            vs_trl = f"{s['ratio_vs_trl']:.2f}x" if "ratio_vs_trl" in s else "-"
            lines.append(f"| {name} | {mode} | {s['s_per_step']:.3f} | {s['gen_tok_s']:.0f} | {s['ratio_vs_sync']:.2f}x | "
                         f"{vs_trl} | {s['val_acc_before']:.3f} -> {s['val_acc_after']:.3f} |")
    lines += ["", "Seconds per step by stage (mean after warm-up; separate_async's `gen` is the wait for the pool):", ""]
    for name, entry in report["workloads"].items():
        for mode, s in entry["modes"].items():
            if "stages_s" in s:
                stages = ", ".join(f"{k} {v:.3f}" for k, v in sorted(s["stages_s"].items()) if v >= 0.001)
                lines.append(f"- {name} {mode}: {stages}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3, help="first steps left out of the means")
    ap.add_argument("--workloads", default="0.8M-long,20M-short")
    ap.add_argument("--no-trl", action="store_true", help="skip TRL (its venv is built on first use)")
    ap.add_argument("--out", default=str(RESULTS / "async_vs_sync.json"))
    a = ap.parse_args(argv)
    python = None
    if not a.no_trl:
        from trl_env import trl_python

        python = trl_python()
    report = {"steps": a.steps, "warmup": a.warmup, "threads": 2, "workloads": {}}
    if python is not None:
        report["trl_version"] = subprocess.run([str(python), "-c", "import trl; print(trl.__version__)"],
                                               capture_output=True, text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="hf_async_") as tmp:
        work = Path(tmp)
        for name in a.workloads.split(","):
            w = WORKLOADS[name]
            prepare(w)
            runs = {"sync": lambda: run_hybridflow(w, a.steps, 2, work, "float32"),
                    "colocate_async": lambda: run_hybridflow(w, a.steps, 2, work, "float32", extra=COLOCATE, tag="_col"),
                    "separate_async": lambda: run_hybridflow(w, a.steps, 2, work, "float32", extra=SEPARATE, tag="_sep"),
                    "separate_async_per_call": lambda: run_hybridflow(w, a.steps, 2, work, "float32",
                                                                      extra=SEPARATE_PER_CALL, tag="_sepc")}
            if python is not None:
                runs["trl"] = lambda: run_trl(w, a.steps, 2, work, python, "float32")
            modes = {}
            for mode, run in runs.items():
                print(f"[{name}] {mode}: {a.steps} steps", flush=True)
                raw = run()
                modes[mode] = summarize(raw, a.warmup)
                if "stages_s" in raw:  # where a step's time goes (trainer stages; gen: waiting for the rollout)
                    modes[mode]["stages_s"] = {k.removeprefix("time/").removesuffix("_s"): round(v, 4)
                                               for k, v in raw["stages_s"].items()}
                print(f"[{name}] {mode}: {modes[mode]['gen_tok_s']:.0f} gen tok/s, acc {modes[mode]['val_acc_before']:.3f}"
                      f" -> {modes[mode]['val_acc_after']:.3f}", flush=True)
            for s in modes.values():
                s["ratio_vs_sync"] = s["gen_tok_s"] / modes["sync"]["gen_tok_s"]
                if "trl" in modes:
                    s["ratio_vs_trl"] = s["gen_tok_s"] / modes["trl"]["gen_tok_s"]
            report["workloads"][name] = {"modes": modes,
                                         "separate_over_sync": modes["separate_async"]["ratio_vs_sync"],
                                         "serving_over_per_call": (modes["separate_async"]["gen_tok_s"]
                                                                   / modes["separate_async_per_call"]["gen_tok_s"]),
                                         "colocate_over_sync": modes["colocate_async"]["ratio_vs_sync"],
                                         "accuracy_gap": modes["separate_async"]["val_acc_after"] - modes["sync"]["val_acc_after"]}
            write_json(Path(a.out), report)
    write_report(Path(a.out), report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
