"""hybridflow vs TRL's GRPOTrainer on the same GRPO workloads, side by side in one run.

    python benchmarks/e2e_vs_trl.py [--steps 30] [--threads 2] [--workloads 0.8M-short,20M-short,0.8M-long]

For each workload (benchmarks/workloads.py: the quickstart task at three model sizes / response lengths) both
systems start from the same SFT weights and train on the same prompts parquet with the same group size (4),
prompts per step (16), max response length, optimizer (Adam, lr 1e-4, no weight decay, grad clip 1.0), KL
loss coefficient (1e-3, low_var_kl = TRL's k3), precision (fp32, or bf16 with ``--dtype bfloat16``), and the
same torch thread count. TRL runs in its own
pinned venv (benchmarks/trl_env.py) through benchmarks/trl_grpo.py; hybridflow runs its CLI with
configs/quickstart_grpo_cpu.yaml. The two run one after the other, never at the same time.

Reported per system and workload (steps after the first ``--warmup`` are measured):
  s_per_step        mean wall seconds of a training step (generation, reward, reference, update, and for
                    hybridflow the weight sync into vLLM); validation and checkpoints are outside it;
  gen_tok_s         generated tokens (EOS included, padding excluded) per second of step time;
  startup_s         process start to the first step, without the validation before training;
  peak_rss_gib      peak resident memory of the whole process tree (hybridflow: driver, Ray, workers);
  val_acc_before/after  greedy held-out accuracy before the first and after the last step;
  roofline          FLOPs the real (unpadded) tokens need per step (generation, reference forward, update
                    forward+backward; both systems skip the old-log-prob forward on-policy) divided by the
                    step time, next to the machine's matmul throughput on the model's own shapes.
and ratios hybridflow / TRL (``ratio_gen_tok_s``: generated tokens/s; > 1 means hybridflow is faster).
Writes benchmarks/results/e2e_vs_trl.json and e2e_vs_trl.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import (GROUP, PROMPTS, REPO, WORKLOADS, Workload, n_params, prepare, run_measured,  # noqa: E402
                       write_json, write_report)


RESULTS = REPO / "benchmarks" / "results"


def run_hybridflow(w: Workload, steps: int, threads: int, work: Path, dtype: str, token_budget: int = 0,
                   extra: dict | None = None, tag: str = "") -> dict:
    """``extra``: config sections merged over the workload's (e.g. benchmarks/async_vs_sync.py's schedule);
    ``tag``: names this run's folder and log beside others of the same workload."""
    out = work / f"hf_{w.name}{tag}"
    overrides = w.overrides(token_budget)
    overrides["trainer"] = {"output_dir": str(out), "total_steps": steps, "val_every": steps, "val_before_train": True,
                            "save_every": 0, "logger": ["jsonl"], "save_hf_at_end": False}
    overrides["resources"] = {"cpus_per_worker": threads}
    overrides["ray"] = {"num_cpus": threads}
    overrides["actor"]["megatron"] = {"dtype": dtype}  # bf16: megatron's bf16 params, fp32 main params
    overrides["rollout"]["dtype"] = dtype
    for section, values in (extra or {}).items():
        overrides[section] = {**overrides.get(section, {}), **values}
    cfg_path = work / f"hf_{w.name}{tag}.yaml"
    cfg_path.write_text(json.dumps(overrides))  # JSON is YAML
    cmd = [sys.executable, "-m", "hybridflow.trainer.main", "--config", "configs/quickstart_grpo_cpu.yaml",
           "--config", str(cfg_path)]
    wall, peak = run_measured(cmd, work / f"hf_{w.name}{tag}.log")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    before, train = rows[0], [r for r in rows if r["step"] >= 1]
    return {
        "step_s": [r["time/step_s"] for r in train],
        "generated_tokens": [r["response/length_mean"] * PROMPTS * GROUP for r in train],
        "startup_s": train[0]["time/to_first_step_s"] - before.get("time/val_s", 0.0),
        "peak_rss_gib": peak, "wall_s": wall,
        "val_acc_before": before["val/accuracy"], "val_acc_after": train[-1]["val/accuracy"],
        "stages_s": {k: statistics.mean(r.get(k, 0.0) for r in train[2:] or train)
                     for k in train[-1] if k.startswith("time/") and k not in ("time/to_first_step_s", "time/val_s")},
    }


def run_trl(w: Workload, steps: int, threads: int, work: Path, python: Path, dtype: str) -> dict:
    out = work / f"trl_{w.name}.json"
    cmd = [str(python), "benchmarks/trl_grpo.py", "--model", str(w.model), "--train", str(w.train), "--val", str(w.val),
           "--steps", str(steps), "--prompts", str(PROMPTS), "--n", str(GROUP), "--max-response",
           str(w.max_response_length), "--lr", "1e-4", "--kl", "1e-3", "--threads", str(threads), "--out", str(out),
           *(["--bf16"] if dtype == "bfloat16" else [])]
    wall, peak = run_measured(cmd, work / f"trl_{w.name}.log")
    r = json.loads(out.read_text())
    return {"step_s": r["step_s"], "generated_tokens": r["generated_tokens"], "startup_s": r["startup_s"],
            "peak_rss_gib": peak, "wall_s": wall, "val_acc_before": r["val_accuracy_before"],
            "val_acc_after": r["val_accuracy_after"]}


def summarize(run: dict, warmup: int) -> dict:
    steps, tokens = run["step_s"][warmup:], run["generated_tokens"][warmup:]
    return {"s_per_step": statistics.mean(steps), "gen_tok_s": sum(tokens) / sum(steps),
            "gen_tokens_per_step": statistics.mean(tokens), "startup_s": run["startup_s"],
            "peak_rss_gib": run["peak_rss_gib"], "val_acc_before": run["val_acc_before"],
            "val_acc_after": run["val_acc_after"], "measured_steps": len(steps)}


# --- roofline ------------------------------------------------------------------------------------------

def model_shapes(model_dir: Path) -> dict:
    cfg = json.loads((model_dir / "config.json").read_text())
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // heads
    return {"hidden": h, "layers": cfg["num_hidden_layers"], "vocab": cfg["vocab_size"],
            "linears": [(h, (heads + 2 * kv) * d), (heads * d, h), (h, 2 * cfg["intermediate_size"]),
                        (cfg["intermediate_size"], h)]}


def forward_flops(shapes: dict, tokens: float, mean_len: float) -> float:
    """FLOPs of one forward over ``tokens`` real tokens of sequences ``mean_len`` long: every linear
    (2 per weight per token, LM head included) and causal attention (QK^T and AV over half the length)."""
    per_token = 2 * shapes["layers"] * sum(i * o for i, o in shapes["linears"]) + 2 * shapes["hidden"] * shapes["vocab"]
    attention = shapes["layers"] * 4 * shapes["hidden"] * mean_len / 2
    return tokens * (per_token + attention)


def matmul_gflops(shapes: dict, rows: int, threads: int, dtype: str, repeats: int = 20) -> float:
    """The machine's matmul throughput in ``dtype`` on the model's own weight shapes (a plain torch.mm loop with
    ``rows`` tokens), FLOP-weighted over the shapes: the physical limit the step is measured against."""
    import torch

    torch.set_num_threads(threads)
    flops = seconds = 0.0
    for i, o in shapes["linears"] + [(shapes["hidden"], shapes["vocab"])]:
        a, b = torch.randn(rows, i, dtype=getattr(torch, dtype)), torch.randn(i, o, dtype=getattr(torch, dtype))
        for _ in range(3):
            torch.mm(a, b)
        start = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, b)
        seconds += time.perf_counter() - start
        flops += 2 * rows * i * o * repeats
    return flops / seconds / 1e9


def roofline(w: Workload, summary: dict, prompt_tokens: float, peak_gflops: float) -> dict:
    shapes = model_shapes(w.model)
    gen = summary["gen_tokens_per_step"]
    total = prompt_tokens + gen
    mean_len = total / (PROMPTS * GROUP)
    # generation processes every token once (KV cache); reference forward; update forward + backward (2x)
    flops = 5 * forward_flops(shapes, total, mean_len)
    achieved = flops / summary["s_per_step"] / 1e9
    return {"gflop_per_step": flops / 1e9, "achieved_gflops": achieved, "matmul_peak_gflops": peak_gflops,
            "efficiency": achieved / peak_gflops}


def mean_prompt_tokens(w: Workload) -> float:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(w.model))
    prompts = pq.read_table(w.train, columns=["prompt"]).column("prompt").to_pylist()
    return statistics.mean(len(ids) for ids in tok(prompts).input_ids)


# --- report --------------------------------------------------------------------------------------------

def markdown(report: dict) -> str:
    lines = [f"# hybridflow vs TRL {report['trl_version']} (GRPO, {PROMPTS} prompts x {GROUP}, "
             f"{report['threads']} torch threads, {report['steps']} steps, {report['dtype']})", "",
             "| workload | params | system | s/step | gen tok/s | start-up s | peak RSS GiB | val acc before -> after "
             "| GFLOP/s (matmul peak) | efficiency |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["workloads"].items():
        for system in ("hybridflow", "trl"):
            s = r[system]
            roof = s["roofline"]
            lines.append(f"| {name} | {r['params'] / 1e6:.1f}M | {system} | {s['s_per_step']:.3f} | {s['gen_tok_s']:.0f} "
                         f"| {s['startup_s']:.1f} | {s['peak_rss_gib']:.2f} | {s['val_acc_before']:.3f} -> "
                         f"{s['val_acc_after']:.3f} | {roof['achieved_gflops']:.1f} ({roof['matmul_peak_gflops']:.0f}) "
                         f"| {roof['efficiency']:.1%} |")
    lines += ["", "| workload | gen tok/s ratio (hybridflow / TRL) | s/step ratio (TRL / hybridflow) | start-up ratio |",
              "|---|---|---|---|"]
    for name, r in report["workloads"].items():
        lines.append(f"| {name} | **{r['ratio_gen_tok_s']:.2f}x** | {r['ratio_step_speed']:.2f}x | "
                     f"{r['ratio_startup']:.2f}x |")
    lines += ["", "hybridflow's stage seconds per step (mean after warm-up):", ""]
    for name, r in report["workloads"].items():
        stages = ", ".join(f"{k[5:-2]} {v:.3f}" for k, v in sorted(r["hybridflow"]["stages_s"].items()))
        lines.append(f"- {name}: {stages}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3, help="first steps left out of the means")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="both systems: fp32, or bf16 (hybridflow: bf16 params with fp32 main params and a bf16 "
                         "vLLM; TRL: its bf16 mixed precision)")
    ap.add_argument("--token-budget", type=int, default=0,
                    help="hybridflow: micro-batches of this many tokens per rank (actor.use_dynamic_bsz); 0: the "
                         "whole rollout in one micro-batch (fastest on CPU: see benchmarks/README.md)")
    ap.add_argument("--out", default=str(RESULTS / "e2e_vs_trl.json"))
    a = ap.parse_args(argv)
    from trl_env import trl_python

    python = trl_python()
    trl_version = subprocess.run([str(python), "-c", "import trl; print(trl.__version__)"],
                                 capture_output=True, text=True, check=True).stdout.strip()
    report = {"token_budget": a.token_budget, "steps": a.steps, "warmup": a.warmup, "threads": a.threads, "dtype": a.dtype, "trl_version": trl_version,
              "workloads": {}}
    with tempfile.TemporaryDirectory(prefix="hf_bench_") as tmp:
        work = Path(tmp)
        for name in a.workloads.split(","):
            w = WORKLOADS[name]
            prepare(w)
            peak = matmul_gflops(model_shapes(w.model), PROMPTS * GROUP * 16, a.threads, a.dtype)
            prompt_tokens = mean_prompt_tokens(w) * PROMPTS * GROUP
            entry = {"params": n_params(w.model), "max_response_length": w.max_response_length}
            for system, run in (("hybridflow", lambda: run_hybridflow(w, a.steps, a.threads, work, a.dtype, a.token_budget)),
                                ("trl", lambda: run_trl(w, a.steps, a.threads, work, python, a.dtype))):
                print(f"[{name}] {system}: {a.steps} steps", flush=True)
                raw = run()
                s = summarize(raw, a.warmup)
                s["roofline"] = roofline(w, s, prompt_tokens, peak)
                if "stages_s" in raw:
                    s["stages_s"] = raw["stages_s"]
                entry[system] = s
                print(f"[{name}] {system}: {s['s_per_step']:.3f} s/step, {s['gen_tok_s']:.0f} gen tok/s, "
                      f"start-up {s['startup_s']:.1f} s, acc {s['val_acc_before']:.3f} -> {s['val_acc_after']:.3f}",
                      flush=True)
            hf, trl = entry["hybridflow"], entry["trl"]
            entry["ratio_gen_tok_s"] = hf["gen_tok_s"] / trl["gen_tok_s"]
            entry["ratio_step_speed"] = trl["s_per_step"] / hf["s_per_step"]
            entry["ratio_startup"] = trl["startup_s"] / hf["startup_s"]
            report["workloads"][name] = entry
            write_json(Path(a.out), report)  # partial results survive a later failure
    for name, entry in report["workloads"].items():  # flat keys for dashboards: ratio_gen_tok_s_20M-short, ...
        report[f"ratio_gen_tok_s_{name}"] = entry["ratio_gen_tok_s"]
    write_report(Path(a.out), report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
