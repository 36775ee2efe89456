"""Where metrics go (``trainer.logger``): the console, metrics.jsonl, TensorBoard, wandb. Every logger gets
the same rows; validation samples (prompt, response, score) go to samples.jsonl, TensorBoard text and a
wandb table. The metrics PNG is drawn from the rows at the end of every run."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from tqdm import tqdm

from hybridflow.trainer.metrics import MetricsLog


class Tracker:
    def __init__(self, trainer_cfg, config_dict: dict, *, resume_step: int | None):
        t = trainer_cfg
        self.out = Path(t.output_dir)
        self.loggers = list(t.logger)
        self.metrics = MetricsLog(t.output_dir, resume_step=resume_step, write="jsonl" in self.loggers)
        self.tensorboard = self.wandb = None
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events an interrupted run wrote after the checkpoint it resumes from
            self.tensorboard = SummaryWriter(str(self.out / "tensorboard"),
                                             purge_step=None if resume_step is None else resume_step + 1)
        if "wandb" in self.loggers:
            self.wandb = _start_wandb(t, config_dict, self.out)

    @property
    def rows(self) -> list[dict]:
        return self.metrics.rows

    def log(self, step: int, metrics: dict) -> None:
        row = self.metrics.log(step, metrics)
        scalars = {k: v for k, v in row.items() if k != "step" and isinstance(v, float)}
        if "console" in self.loggers:
            tqdm.write(MetricsLog.console_line(row))
        if self.tensorboard is not None:
            for k, v in scalars.items():
                self.tensorboard.add_scalar(k, v, step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def log_samples(self, step: int, samples: list[dict]) -> None:
        if not samples:
            return
        if "jsonl" in self.loggers:
            with (self.out / "samples.jsonl").open("a") as f:
                f.writelines(json.dumps({"step": step, **s}) + "\n" for s in samples)
        if self.tensorboard is not None:
            table = "\n".join(f"| {_md(s['prompt'])} | {_md(s['response'])} | {s['score']:.3f} |" for s in samples)
            self.tensorboard.add_text("val/samples", "| prompt | response | score |\n|---|---|---|\n" + table, step)
        if self.wandb is not None:
            import wandb

            rows = [[s["prompt"], s["response"], s["score"]] for s in samples]
            self.wandb.log({"val/samples": wandb.Table(columns=["prompt", "response", "score"], data=rows)}, step=step)

    def close(self) -> None:
        if self.rows:
            self.metrics.plot()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.tensorboard = self.wandb = None


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _start_wandb(t, config_dict: dict, out: Path):
    """One wandb run per output_dir: its id is kept there, so a resumed run continues the same wandb run.
    WANDB_MODE=offline, or no credentials (``wandb_falls_back_offline``), writes under <output_dir>/wandb
    for a later ``wandb sync``."""
    import wandb

    id_file = out / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
    id_file.write_text(run_id)
    # The mode is given, not left to wandb: its settings singleton keeps the mode of the process's first
    # wandb.init, and a later Trainer in the same process (the Python API) would go online without credentials.
    mode = "offline" if wandb_falls_back_offline() else _WANDB_MODES.get(os.environ.get("WANDB_MODE", "").lower())
    return wandb.init(project=t.project_name, name=t.experiment_name, id=run_id, resume="allow", dir=str(out),
                      config=config_dict, mode=mode)


# WANDB_MODE's values -> wandb.init's mode ("dryrun" is wandb's old name for offline); unset: wandb's default
_WANDB_MODES = {"online": "online", "offline": "offline", "dryrun": "offline", "disabled": "disabled"}


def wandb_falls_back_offline() -> bool:
    """True when wandb would go online without credentials: it raises then (or prompts in a terminal), so
    the run logs offline instead (the preflight says so in one line)."""
    offline = os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled")
    return not offline and not _wandb_credentials_found()


def _wandb_credentials_found() -> bool:
    """Where wandb itself looks (wandb/sdk/lib/wbauth): WANDB_API_KEY or WANDB_IDENTITY_TOKEN_FILE, then a
    .netrc entry (NETRC, else ~/.netrc) for the host of WANDB_BASE_URL."""
    import netrc
    from urllib.parse import urlsplit

    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    path = Path(os.environ.get("NETRC") or "~/.netrc").expanduser()
    try:
        return path.is_file() and netrc.netrc(str(path)).authenticators(host) is not None
    except (netrc.NetrcParseError, OSError):  # an unreadable .netrc holds no usable key either
        return False
