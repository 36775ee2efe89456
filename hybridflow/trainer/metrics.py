"""Metrics: one JSON line per step, a console line, timers, and the reward/accuracy curve PNG."""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from pathlib import Path

from hybridflow.util import write_atomically

CONSOLE_KEYS = [  # (metric, short label, format)
    # The KL to the reference (in the reward, or as a loss term); ppo_kl is 0 for an on-policy update.
    ("reward/score_mean", "reward", ".3f"), ("val/accuracy", "val_acc", ".3f"), ("actor/ref_kl", "ref_kl", ".4f"),
    ("actor/kl_loss", "kl_loss", ".4f"), ("actor/pg_clipfrac", "clip", ".3f"),
    ("response/length_mean", "len", ".2f"), ("perf/tokens_per_s", "tok/s", ".0f"), ("time/step_s", "s/step", ".2f"),
]


class Timer:
    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.stages: list[str] = []  # the stages being timed now, outermost first
        self.failed_in: str | None = None  # the innermost stage an exception left (failures name it)

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        self.stages.append(name)
        try:
            yield
        except BaseException:
            if self.failed_in is None:
                self.failed_in = "/".join(self.stages)
            raise
        finally:
            self.stages.pop()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def pop(self) -> dict:
        out, self.seconds = {f"time/{k}_s": v for k, v in self.seconds.items()}, {}
        return out


class MetricsLog:
    """Every step's metrics in memory and, when ``write``, in ``<out_dir>/metrics.jsonl`` (a resumed run
    keeps the rows up to its checkpoint's step and drops those an interrupted run wrote after it)."""

    def __init__(self, out_dir: str, *, resume_step: int | None = None, write: bool = True):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl" if write else None
        self.rows: list[dict] = []
        if resume_step is not None and (self.dir / "metrics.jsonl").is_file():
            lines = (self.dir / "metrics.jsonl").read_text().splitlines()
            self.rows = [row for row in map(json.loads, filter(None, lines)) if row["step"] <= resume_step]
        if self.path is not None:
            write_atomically(self.path, "".join(json.dumps(row) + "\n" for row in self.rows))

    def log(self, step: int, metrics: dict) -> dict:
        row = {"step": step, **{k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}}
        self.rows.append(row)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        return row

    @staticmethod
    def console_line(row: dict) -> str:
        parts = [f"step {row['step']:>4}"]
        for key, label, fmt in CONSOLE_KEYS:
            v = row.get(key)
            if isinstance(v, float) and not math.isnan(v):
                parts.append(f"{label} {v:{fmt}}")
        stages = [(k[5:-2], v) for k, v in row.items() if k.startswith("time/") and k != "time/step_s"]
        if stages:
            parts.append("[" + " ".join(f"{k} {v:.2f}s" for k, v in stages) + "]")
        return " | ".join(parts)

    def plot(self, name: str = "curve.png") -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for key, label in (("reward/score_mean", "train reward"), ("val/accuracy", "val accuracy (greedy)")):
            pts = [(r["step"], r[key]) for r in self.rows if isinstance(r.get(key), float)]
            if pts:
                ax.plot(*zip(*pts), marker="o" if key.startswith("val") else None, label=label)
        ax.set_xlabel("PPO step")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend()
        path = self.dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
