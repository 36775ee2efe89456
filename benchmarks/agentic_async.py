"""An agent program with a slow tool, trained sync vs separate_async on the same two cores, side by side in one run.

    python benchmarks/agentic_async.py [--steps 12] [--warmup 2]

Both runs train configs/quickstart_agent_server_cpu.yaml's task (3-digit x 2-digit products with the calculator)
from the same warm start (prepared when absent, the tools quickstart's), on the same prompts, the same number of
steps hence of samples (16 tasks x 8 episodes a step), with examples/agents/remote_tool_agent.py: the plain
openai-client agent whose calculator is a remote tool answered over HTTP after a log-normal latency (median 1.0 s,
sigma 0.5: p10 0.53 s, p90 1.9 s, mean 1.13 s; seeded per session and call, so both runs draw the same):
  sync            the hybrid engine with both cores; each step waits for its episodes, tools included;
  separate_async  a trainer worker and a rollout-pool worker, one core each, the checkpoint engine pushing after
                  every step; the next two steps' episodes run while the trainer trains (num_warmup_batches 2),
                  every batch in flight at once, so one batch's tool waits are another's engine time.
Reported per mode: episodes per second of step time (steps after ``--warmup``), s/step, held-out accuracy before
and after (the agent's own score, greedy), and separate_async's ratio to sync. Writes
benchmarks/results/agentic_async.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import REPO, run_measured, write_report  # noqa: E402

CONFIG = "configs/quickstart_agent_server_cpu.yaml"
AGENT = "examples/agents/remote_tool_agent.py:run_episode"
TASKS, EPISODES = 16, 8  # data.batch_size x rollout.n of the config
MODES = {
    "sync": {},
    "separate_async": {"schedule": {"mode": "separate_async", "num_warmup_batches": 2, "parameter_sync_step": 1},
                       "resources": {"rollout_n_workers": 1, "cpus_per_worker": 1}},
}


def prepare() -> None:
    """The config's data and warm start (shared with the tools quickstart), built by its own preparation."""
    from hybridflow.plan import load_experiment
    from hybridflow.trainer.prepare import prepare_quickstart

    prepare_quickstart(load_experiment([CONFIG], []))


def run(mode: str, steps: int, work: Path) -> dict:
    out = work / mode
    overrides = {"trainer": {"output_dir": str(out), "total_steps": steps, "val_every": steps, "val_before_train": True,
                             "save_every": 0, "logger": ["jsonl"], "save_hf_at_end": False},
                 "agent": {"entrypoint": AGENT}, "prepare": {"enable": False}, "ray": {"num_cpus": 2},
                 "resources": {"cpus_per_worker": 2}}
    for section, values in MODES[mode].items():
        overrides[section] = {**overrides.get(section, {}), **values}
    cfg_path = work / f"{mode}.yaml"
    cfg_path.write_text(json.dumps(overrides))  # JSON is YAML
    cmd = [sys.executable, "-m", "hybridflow.trainer.main", "--config", CONFIG, "--config", str(cfg_path)]
    wall, peak = run_measured(cmd, work / f"{mode}.log")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    before, train = rows[0], [r for r in rows if r["step"] >= 1]
    return {"step_s": [r["time/step_s"] for r in train], "val_acc_before": before["val/accuracy"],
            "val_acc_after": train[-1]["val/accuracy"], "wall_s": wall, "peak_rss_gib": peak,
            "episode_s_mean": statistics.mean(r["agent/episode_s_mean"] for r in train),
            "requests_per_engine_call": statistics.mean(r["agent/requests_per_engine_call"] for r in train),
            "episodes_dropped": sum(r["agent/episodes_failed"] + r["agent/episodes_timeout"] for r in train),
            "stages_s": {k.removeprefix("time/").removesuffix("_s"): round(statistics.mean(r.get(k, 0.0) for r in train), 3)
                         for k in train[-1] if k.startswith("time/") and k not in ("time/to_first_step_s", "time/val_s")}}


def summarize(raw: dict, warmup: int) -> dict:
    steps = raw["step_s"][warmup:]
    return {"s_per_step": statistics.mean(steps), "episodes_per_s": TASKS * EPISODES * len(steps) / sum(steps),
            "measured_steps": len(steps), **{k: v for k, v in raw.items() if k != "step_s"}}


def markdown(report: dict) -> str:
    lines = [f"# An agent with a slow remote tool: sync vs separate_async ({TASKS} tasks x {EPISODES} episodes, "
             f"{report['steps']} steps, 2 cores)", "", report["tool_latency"], "",
             "| mode | s/step | episodes/s | vs sync | val acc before -> after | episode s | requests per engine call |",
             "|---|---|---|---|---|---|---|"]
    for mode, s in report["modes"].items():
        lines.append(f"| {mode} | {s['s_per_step']:.2f} | {s['episodes_per_s']:.2f} | {s['ratio_vs_sync']:.2f}x | "
                     f"{s['val_acc_before']:.3f} -> {s['val_acc_after']:.3f} | {s['episode_s_mean']:.2f} | "
                     f"{s['requests_per_engine_call']:.1f} |")
    lines += ["", "Seconds per step by stage (separate_async's `gen` is the wait for the episodes):", ""]
    lines += [f"- {mode}: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(s["stages_s"].items()) if v >= 0.01)
              for mode, s in report["modes"].items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the means")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "agentic_async.json"))
    a = ap.parse_args(argv)
    prepare()
    report = {"steps": a.steps, "warmup": a.warmup, "threads": 2, "agent": AGENT,
              "tool_latency": "tool latency per call: log-normal, median 1.0 s, sigma 0.5 (p10 0.53 s, p90 1.9 s, "
                              "mean 1.13 s), in the tool server over HTTP", "modes": {}}
    with tempfile.TemporaryDirectory(prefix="hf_agentic_") as tmp:
        for mode in MODES:
            print(f"{mode}: {a.steps} steps", flush=True)
            report["modes"][mode] = summarize(run(mode, a.steps, Path(tmp)), a.warmup)
            print(f"{mode}: {report['modes'][mode]['episodes_per_s']:.2f} episodes/s", flush=True)
    for s in report["modes"].values():
        s["ratio_vs_sync"] = s["episodes_per_s"] / report["modes"]["sync"]["episodes_per_s"]
    m = report["modes"]
    report["separate_over_sync"] = m["separate_async"]["ratio_vs_sync"]
    report["accuracy_gap"] = m["separate_async"]["val_acc_after"] - m["sync"]["val_acc_after"]
    write_report(Path(a.out), report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
