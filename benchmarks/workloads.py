"""The GRPO workloads the speed benchmarks share, their cached models, and how to measure a process tree.

A workload is the quickstart's GRPO task (configs/quickstart_grpo_cpu.yaml: 2-digit addition, 16 prompts x 4
samples per step, one optimizer step per rollout, lr 1e-4, KL loss 1e-3) at a model size and a response
length. Its tokenizer, data, base model and SFT warm start are built once by the quickstart's own
preparation (hybridflow/trainer/prepare.py) under benchmarks/.cache/<name>/ and reused by later runs.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from hybridflow.util import write_atomically

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CACHE = HERE / ".cache"
PROMPTS, GROUP = 16, 4  # prompts per step, samples per prompt


@dataclass(frozen=True)
class Workload:
    name: str
    hidden_size: int
    num_layers: int
    max_response_length: int
    sft_steps: int  # cap of the warm start (it stops earlier at prepare.sft_target_accuracy)
    same_model_as: str | None = None  # reuse that workload's data and model, with room for longer responses
    before_warm_start: bool = False  # with same_model_as: its base model (responses run long, ~40 tokens)

    @property
    def root(self) -> Path:
        return CACHE / self.name

    @property
    def model(self) -> Path:
        return self.root / "sft_model"

    @property
    def train(self) -> Path:
        return self.root / "data" / "train.parquet"

    @property
    def val(self) -> Path:
        return self.root / "data" / "val.parquet"

    def overrides(self, token_budget: int = 0) -> dict:
        """hybridflow config of this workload (on top of configs/quickstart_grpo_cpu.yaml). ``token_budget``
        > 0: micro-batches by that many tokens per rank (actor.use_dynamic_bsz, rows packed end to end);
        0: the whole rollout in one micro-batch (a GRPO group's rows share one packed prompt)."""
        batching = ({"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": token_budget} if token_budget else
                    {"ppo_micro_batch_size_per_gpu": PROMPTS * GROUP, "log_prob_micro_batch_size_per_gpu": PROMPTS * GROUP})
        return {
            "model": {"path": str(self.model)},
            "data": {"train_files": [str(self.train)], "val_files": [str(self.val)], "batch_size": PROMPTS,
                     "max_response_length": self.max_response_length},
            "actor": {"ppo_mini_batch_size": PROMPTS, **batching},
            "rollout": {"n": GROUP},
            "prepare": {"enable": False, "data_dir": str(self.root / "data"),
                        "base_model_dir": str(self.root / "base_model"), "hidden_size": self.hidden_size,
                        "num_layers": self.num_layers, "sft_steps": self.sft_steps},
        }


# The three: the quickstart model with short responses, a ~20M model with short responses (its warm
# start is capped: a 20M SFT step costs ~0.4 s here), and the quickstart model with responses up to 64 tokens
# (before its warm start: the warm-started model answers in ~4 tokens and stops, which is no long workload).
WORKLOADS = {w.name: w for w in (
    Workload("0.8M-short", 128, 4, 6, 1500),
    Workload("20M-short", 512, 6, 6, 150),
    Workload("0.8M-long", 128, 4, 64, 1500, same_model_as="0.8M-short", before_warm_start=True),
)}


def prepare(w: Workload) -> None:
    """Build the workload's data, base model and SFT warm start when absent (in a subprocess: the warm
    start holds a megatron-free torch model and the caller's process stays small)."""
    if (w.model / "model.safetensors").exists():
        return
    if w.same_model_as is not None:
        src = WORKLOADS[w.same_model_as]
        prepare(src)
        _copy_with_positions(src, w)
        return
    code = ("import json, sys\n"
            "from hybridflow import load_config\n"
            "from hybridflow.trainer.prepare import prepare_quickstart\n"
            "o = json.loads(sys.argv[1]); o['prepare']['enable'] = True\n"
            "prepare_quickstart(load_config(['configs/quickstart_grpo_cpu.yaml', o]))\n")
    print(f"[{w.name}] preparing data, base model and warm start under {w.root} (once)", flush=True)
    subprocess.run([sys.executable, "-c", code, json.dumps(w.overrides())], cwd=REPO, check=True)


def _copy_with_positions(src: Workload, w: Workload) -> None:
    """``src``'s data and SFT (or base) model, the model's position limit raised to prompt + ``w``'s response
    length (RoPE has no learned positions: the weights are the same model)."""
    from hybridflow.config.schema import Data

    tmp = w.root.with_name(f".{w.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src.root / "data", tmp / "data")
    shutil.copytree(src.root / "base_model" if w.before_warm_start else src.model, tmp / "sft_model")
    config = json.loads((tmp / "sft_model/config.json").read_text())
    config["max_position_embeddings"] = Data().max_prompt_length + w.max_response_length
    (tmp / "sft_model/config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(w.root, ignore_errors=True)
    os.replace(tmp, w.root)


def n_params(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


class TreeMemory:
    """Peak resident memory of a process and all its descendants together, sampled every ``period`` s."""

    def __init__(self, pid: int, period: float = 0.25):
        self.peak, self._pid, self._period = 0, pid, period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                root = psutil.Process(self._pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            total = 0
            for p in procs:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            self._stop.wait(self._period)

    def stop(self) -> float:
        """Stop sampling; the peak in GiB."""
        self._stop.set()
        self._thread.join()
        return self.peak / 2**30


def run_measured(cmd: list[str], log_path: Path, env: dict | None = None) -> tuple[float, float]:
    """Run ``cmd`` (output to ``log_path``); returns (wall seconds, peak tree RSS GiB). Raises with the log's
    tail when it fails."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        mem = TreeMemory(proc.pid)
        code = proc.wait()
    peak = mem.stop()
    if code != 0:
        tail = log_path.read_text().splitlines()[-15:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {code}; log {log_path}:\n" + "\n".join(tail))
    return time.perf_counter() - start, peak


def write_json(path: Path, data) -> None:
    write_atomically(path, json.dumps(data, indent=1))


def write_report(path: Path, report: dict, md: str) -> None:
    """The report as JSON at ``path`` and its table as Markdown beside it (.md), printed too."""
    write_json(path, report)
    write_atomically(path.with_suffix(".md"), md)
    print(md)
