"""MoE routing replay: the train/rollout log-prob mismatch with and without it, side by side in one run.

    python benchmarks/routing_replay.py [--steps 3]

The CPU quickstart's tiny Qwen3-MoE (configs/quickstart_moe_cpu.yaml, EP 2), built once under
benchmarks/.cache/moe/. vLLM samples in bf16 while the trainer computes in fp32, so router scores that nearly tie
pick other experts in the two, as vLLM's and megatron's kernels do on GPUs. The same steps run three ways from the
same weights and seed: vLLM in fp32 without replay (the baseline: the same numbers up to kernel rounding), vLLM in
bf16 without replay, and vLLM in bf16 with R3 (every trainer forward routes each token to vLLM's experts). Reported
per run, averaged over the steps: the mismatch of the trainer's old log-probs to vLLM's (mean |p_train - p_vllm|
and its max, verl's training/rollout_probs_diff_*; the k1 KL, rollout_corr/kl) and, with R3, the share of vLLM's
routes the trainer's routers would have chosen otherwise (actor/routing_replay/differing_fraction). Writes
benchmarks/results/routing_replay.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import CACHE, REPO, write_report  # noqa: E402

RUNS = {  # name -> overrides
    "fp32 vLLM, no replay": ["rollout.dtype=float32", "actor.megatron.router_replay.mode=disabled",
                             "rollout.enable_rollout_routing_replay=false"],
    "bf16 vLLM, no replay": ["rollout.dtype=bfloat16", "actor.megatron.router_replay.mode=disabled",
                             "rollout.enable_rollout_routing_replay=false"],
    "bf16 vLLM, R3": ["rollout.dtype=bfloat16"],  # the overlay's R3
}
METRICS = ("training/rollout_probs_diff_mean", "training/rollout_probs_diff_max", "rollout_corr/kl",
           "actor/routing_replay/differing_fraction", "reward/score_mean")


def prepare(root: Path) -> list[str]:
    """The MoE quickstart's data and warm-started model under ``root`` (built once); the overrides that use them."""
    paths = [f"prepare.data_dir={root}/data", f"prepare.base_model_dir={root}/base", f"model.path={root}/sft"]
    if not (root / "sft" / "config.json").exists():  # the quickstart's own preparation (data, base model, warm start)
        from hybridflow.plan import load_experiment
        from hybridflow.trainer.prepare import prepare_quickstart

        prepare_quickstart(load_experiment([str(REPO / "configs/quickstart_moe_cpu.yaml")], paths))
    return [*paths, "prepare.enable=false", f"data.train_files=[{root}/data/train.parquet]",
            f"data.val_files=[{root}/data/val.parquet]"]


def run(name: str, overrides: list[str], shared: list[str], steps: int, work: Path) -> dict:
    out = work / name.replace(" ", "_").replace(",", "")
    cmd = [sys.executable, "-m", "hybridflow.trainer.main", "--config", "configs/quickstart_moe_cpu.yaml", *shared,
           f"trainer.total_steps={steps}", f"trainer.output_dir={out}", "trainer.val_before_train=false",
           "trainer.val_every=0", "trainer.save_every=0", "trainer.save_hf_at_end=false", "trainer.logger=[jsonl]",
           "actor.reuse_on_policy_log_prob=false", *overrides]  # the old-log-prob forward measures the mismatch
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("step", 0) >= 1]
    return {k: statistics.mean(r[k] for r in rows) for k in METRICS if all(k in r for r in rows)}


def markdown(report: dict) -> str:
    lines = [f"# MoE routing replay: train/rollout mismatch ({report['steps']} GRPO steps, tiny Qwen3-MoE, EP 2)", "",
             "| run | mean abs prob diff | max abs prob diff | KL (k1) | routes differing | reward |",
             "|---|---|---|---|---|---|"]
    for name, m in report["runs"].items():
        differ = m.get("actor/routing_replay/differing_fraction")
        lines.append(f"| {name} | {m['training/rollout_probs_diff_mean']:.2e} | "
                     f"{m['training/rollout_probs_diff_max']:.2e} | {m['rollout_corr/kl']:.2e} | "
                     f"{'-' if differ is None else f'{differ:.3f}'} | {m['reward/score_mean']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/routing_replay.json"))
    args = ap.parse_args(argv)
    root = CACHE / "moe"
    shared = prepare(root)
    runs = {name: run(name, overrides, shared, args.steps, root / "runs") for name, overrides in RUNS.items()}
    write_report(Path(args.out), {"steps": args.steps, "runs": runs}, markdown({"steps": args.steps, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
