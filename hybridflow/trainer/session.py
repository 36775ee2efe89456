"""A training run as a Python object: ``Trainer(config)`` checks everything, then ``fit()`` — or ``step()``
and ``validate()`` from a script or notebook — with checkpoints, resume, preemption, trackers and clean
shutdown. The CLI (``hybridflow train``) is a thin wrapper over it.

    from hybridflow import Trainer
    with Trainer("configs/quickstart_cpu.yaml", ["trainer.total_steps=20"]) as trainer:
        metrics = trainer.step()
        trainer.fit()
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import time
from pathlib import Path

import psutil
from tqdm import tqdm

from hybridflow.config import ConfigError, config_to_dict, dump_yaml
from hybridflow.config.schema import ExperimentConfig
from hybridflow.controller import start_ray
from hybridflow.controller.worker_group import WaitAbandoned, WorkerGroupError, give_up_waiting_when
from hybridflow.megatron.quantized import unquantized_config
from hybridflow.plan import load_experiment
from hybridflow.rewards.custom import RewardFunctionError
from hybridflow.trainer import checkpoint, preflight
from hybridflow.trainer.dynamic_sampling import DynamicSamplingError
from hybridflow.trainer.metrics import Timer
from hybridflow.trainer.placement import build_worker_groups
from hybridflow.trainer.ppo import PPODriver
from hybridflow.trainer.prepare import prepare_quickstart
from hybridflow.trainer.run_lock import RunLock
from hybridflow.trainer.signals import Preempted, StopRequests
from hybridflow.trainer.tracking import Tracker
from hybridflow.util import write_atomically

log = logging.getLogger(__name__)
# Update metrics whose non-finite value means the step's update was skipped (trainer.on_nonfinite).
NONFINITE_KEYS = ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm")


class RunFailed(RuntimeError):
    """The run cannot go on (a worker died, a non-finite loss); the message names what and where, and the
    last good checkpoint."""


def _hf_config(path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


class Trainer:
    def __init__(self, config, overrides=(), *, checked: preflight.Checked | None = None):
        """``config``: YAML path(s), a dict of the same shape, or an ExperimentConfig. Everything is checked
        here, before any process starts (``ConfigError``); Ray and the workers start on first use.
        ``checked``: the result of ``preflight.check_run`` when the caller has just run it."""
        self.cfg = cfg = (config if isinstance(config, ExperimentConfig) and not overrides
                          else load_experiment(config, overrides))
        if checked is None:
            if cfg.prepare.enable:
                preflight.check_prepare_target(cfg)
                prepare_quickstart(cfg, before_warm_start=lambda base: preflight.check_model(cfg, _hf_config(base)))
            checked = preflight.check_run(cfg)
        self.model_config, self.tokenizer, self.resume_from = checked.model, checked.tokenizer, checked.resume_from
        self.plan, self._prompts = checked.plan, (checked.train_data, checked.val_data)
        self.total_steps = self.plan.total_steps  # the workers' LR schedules span it (plan.actor_spec)
        self._resume_state = checkpoint.read_state(self.resume_from) if self.resume_from else None
        self.step_count = self._resume_state["step"] if self._resume_state else 0
        self.stops = StopRequests()
        self.last_checkpoint: Path | None = self.resume_from
        self.timer = Timer()
        self._to_first_step_s: float | None = None
        self._ray = self._workers = self.ppo = self.tracker = self._data = None
        self.lock = RunLock(cfg.trainer.output_dir)  # one run per output_dir (checked above), held until close()
        self.lock.acquire()

    # --- lifecycle ---------------------------------------------------------------------------------

    @property
    def resolved_config(self):
        """The config as this run resolved it, for its config.yaml: the run's steps filled in (a copy: the loaded
        config is never written to)."""
        trainer = dataclasses.replace(self.cfg.trainer, total_steps=self.total_steps)
        return dataclasses.replace(self.cfg, trainer=trainer)

    def start(self) -> Trainer:
        """Start Ray and the worker groups, load the checkpoint to resume from; idempotent."""
        if self.ppo is not None:
            return self

        cfg = self.cfg
        self.lock.acquire()  # again after a close()
        self.stops.install()
        dump_yaml(self.resolved_config, os.path.join(cfg.trainer.output_dir, "config.yaml"))
        try:
            self._ray = _connect_ray(cfg, self.plan)
        except SystemExit as e:  # SIGTERM while Ray starts: Ray's own handler exits (start_ray cleaned up)
            if e.code == signal.SIGTERM:
                raise Preempted(signal.SIGTERM, self.step_count, self.last_checkpoint) from None
            raise
        self.stops.install()  # in case ray.init replaced our SIGTERM handler (start_ray keeps it)
        try:
            if self.stops.requested:  # while Ray started: stop before the workers are built
                raise Preempted(self.stops.signum, self.step_count, self.last_checkpoint)
            with self._failures_named():  # a worker that dies while starting is named too
                self._workers = build_worker_groups(cfg, self.plan)
                self.ppo = PPODriver(cfg, self.plan, self.tokenizer, self._workers, *self._prompts)
            self._record_placement()
            with self._failures_named():  # a SIGTERM while loading gives up too
                state = self._resume() if self.resume_from is not None else None
            self.tracker = Tracker(cfg.trainer, config_to_dict(cfg), resume_step=state and state["step"])
            self._data = data_stream(self.ppo.train_data, cfg, self._resume_state)
            if state is None and cfg.trainer.val_before_train:
                with self.timer("val"):
                    metrics = self.validate()
                self.tracker.log(0, {**metrics, **self.timer.pop()})
        except BaseException:
            self.close()
            raise
        return self

    def _record_placement(self) -> None:
        """Which node each rank of each worker group runs on: <output_dir>/placement.json and one log line."""
        import json

        w = self._workers
        placement = {g.name: g.node_names for g in w.all}
        write_atomically(Path(self.cfg.trainer.output_dir) / "placement.json", json.dumps(placement, indent=1))
        log.warning("placement (node of each rank): %s", placement)

    def close(self) -> None:
        """Stop the workers and the Ray cluster this trainer started; nothing it started keeps running."""
        if self.tracker is not None:
            try:
                self.tracker.close()
            except OSError as e:  # e.g. a full disk: the run's own error is what the user needs to see
                log.warning("could not close the trackers: %s", e)
        if self.ppo is not None:
            self.ppo.close()
        if self._workers is not None:
            self._workers.shutdown()
        if self._ray is not None:
            self._ray.shutdown()
        self._ray = self._workers = self.ppo = self.tracker = None
        self.lock.release()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- training ----------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.step_count >= self.total_steps

    def step(self) -> dict:
        """One PPO-family step (generate, score, experience, updates, weight sync), its validation when due
        and its checkpoint when due; returns the step's metrics."""
        self.start()
        if self.done:
            raise RuntimeError(f"training is complete: step {self.step_count} of {self.total_steps}")
        cfg, k = self.cfg.trainer, self.step_count + 1
        first_in_process = self._to_first_step_s is None
        if first_in_process:  # start-up cost as a user waits for it: process start to the first step
            self._to_first_step_s = time.time() - psutil.Process().create_time()
        with self._failures_named():
            with self.timer("step"):
                # dynamic sampling draws its further prompt batches from the run's own stream (counted)
                metrics, n_tokens = self.ppo.step(next(self._data), k, self.timer, more_prompts=self._data)
            skipped = check_finite(metrics, k, self.cfg.trainer.on_nonfinite, self.last_checkpoint)
            self.step_count = k
            if due(cfg.val_every, k, self.total_steps):
                with self.timer("val"):
                    metrics.update(self.validate())
            metrics.update(self.timer.pop())
            metrics["perf/tokens_per_s"] = n_tokens / metrics["time/step_s"]
            if "async/wait_rollout_s" in metrics:  # separate_async: the trainer waiting for the rollout pool
                metrics["async/trainer_idle_fraction"] = min(1.0, metrics["async/wait_rollout_s"] / metrics["time/step_s"])
            metrics["train/nonfinite_skipped"] = float(skipped)
            if first_in_process:
                metrics["time/to_first_step_s"] = self._to_first_step_s
            self.tracker.log(k, metrics)
            if due(cfg.save_every, k, self.total_steps):
                self.save_checkpoint()
        return metrics

    def worker_seconds(self) -> dict[str, float]:
        """Seconds the workers spent inside each registered method since the last call (the slowest rank of
        each group, as the driver waits for it), keyed ``group.method``: what a step's time is besides the
        controller's own cost (dispatch, serialization, Ray, waiting)."""
        self.start()
        w, out = self._workers, {}
        for group in w.all:
            for rank in group.execute_all("compute_seconds"):
                for method, seconds in rank.items():
                    key = f"{group.name}.{method}"
                    out[key] = max(out.get(key, 0.0), seconds)
        return out

    def fit(self) -> list[dict]:
        """Train to the last step (continuing a resumed run), export the actor when configured; returns
        every step's metrics row. SIGTERM/SIGUSR1 end it at a step boundary with a checkpoint
        (``Preempted``)."""
        self.start()
        bar = tqdm(total=self.total_steps, initial=self.step_count, desc="ppo", dynamic_ncols=True)
        try:
            while not self.done:
                if self.stops.requested:
                    raise Preempted(self.stops.signum, self.step_count, self._checkpoint_now())
                self.step()
                bar.update()
        finally:
            bar.close()
        if self.cfg.trainer.save_hf_at_end:
            self.export(str(Path(self.cfg.trainer.output_dir) / "actor_hf"))
        return list(self.tracker.rows)

    def validate(self) -> dict:
        """Greedy accuracy on the validation prompts (logging ``trainer.val_samples`` examples)."""
        self.start()
        when = f"after step {self.step_count}" if self.step_count else "before training"
        with self._failures_named(f"validation {when}: "):
            metrics, samples = self.ppo.validate(self.cfg.trainer.val_samples)
        self.tracker.log_samples(self.step_count, samples)
        return metrics

    # --- checkpoints and export --------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        """Checkpoint the current step into ``<output_dir>/checkpoints/step_<k>`` (atomically). After SIGTERM it
        is written to the end, not given up like a step still running ``signals.STOP_GRACE_S`` later: the step
        it keeps has ended, and a SIGKILL cutting the write short leaves the previous checkpoint whole."""
        self.start()
        t = self.cfg.trainer
        # batches generating ahead (separate_async) are not kept: the resumed run draws and generates them again
        driver_state = {"layout": _layout(self.cfg),
                        checkpoint.DATA_BATCHES: self._data.consumed - self.ppo.in_flight_batches()}

        def write_parts(tmp: Path) -> None:
            driver_state.update(self.ppo.save_checkpoint(str(tmp)))
            dump_yaml(self.resolved_config, tmp / "config.yaml")
            # what the export needs besides weights (which are not quantized, whatever model.path's were)
            unquantized_config(self.model_config).save_pretrained(str(tmp / "hf"))
            self.tokenizer.save_pretrained(str(tmp / "hf"))

        with self._failures_named(give_up=False), self.timer("save"):
            path = checkpoint.save(t.output_dir, self.step_count, write_parts, driver_state, t.max_checkpoints)
        self.last_checkpoint = path
        return path

    def export(self, out_dir: str) -> None:
        """The current actor as a HF folder (config, tokenizer, sharded safetensors), streamed from rank 0."""
        self.start()
        with self._failures_named():
            self.ppo.actor_rollout.save_hf(out_dir)

    def _checkpoint_now(self) -> Path | None:
        """The checkpoint of the current step, written unless it exists already (none before step 1)."""
        if self.step_count == 0:
            return self.last_checkpoint
        if self.last_checkpoint is not None and self.last_checkpoint.name == f"step_{self.step_count}":
            return self.last_checkpoint
        return self.save_checkpoint()

    def _resume(self) -> dict:
        state = self._resume_state
        same_layout = state.get("layout") == _layout(self.cfg)
        try:
            self.ppo.load_checkpoint(str(self.resume_from), state, restore_rng=same_layout)
        except WorkerGroupError as error:  # damage the checks before start cannot see (garbage of the right size)
            raise RunFailed(f"cannot resume from {self.resume_from}: {error.summary}") from error
        log.warning("resumed from %s (step %d%s)", self.resume_from, self.step_count,
                    "" if same_layout else ", another layout: random streams start afresh")
        return state

    # --- failures ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _failures_named(self, where: str = "", give_up: bool = True):
        """A worker group failure becomes a ``RunFailed`` naming the role, rank, node and last checkpoint; so
        do a user reward function that fails on a row (``where``: e.g. "validation before training: "), dynamic
        sampling that cannot fill its batch and a checkpoint that cannot be written. After SIGTERM/SIGUSR1 a
        worker failure is the same signal having reached the workers (sent to the whole process group):
        ``Preempted``, at once; so is a step still running ``signals.STOP_GRACE_S`` after SIGTERM (every wait
        on the workers gives up then, unless ``give_up`` is false)."""
        self.timer.failed_in = None
        try:
            with give_up_waiting_when(self.stops.give_up_reason if give_up else lambda: None):
                yield
        except WaitAbandoned:
            raise Preempted(self.stops.signum, self.step_count, self.last_checkpoint,
                            abandoned=self.stops.give_up_reason() or "") from None
        except WorkerGroupError as error:
            if self.stops.requested:  # the signal reached the workers too (e.g. the whole process group)
                raise Preempted(self.stops.signum, self.step_count, self.last_checkpoint) from error
            stage = f"stage {self.timer.failed_in}: " if self.timer.failed_in else ""
            raise RunFailed(f"{stage}{error.summary}; {self._last_good}") from error
        except (RewardFunctionError, DynamicSamplingError, checkpoint.CheckpointWriteError) as error:
            raise RunFailed(f"{where}{error}; {self._last_good}") from error

    @property
    def _last_good(self) -> str:
        return f"last good checkpoint: {self.last_checkpoint or 'none'}"


class DataStream:
    """The run's prompt batches, counting those taken: a step takes one, DAPO's dynamic sampling
    (``algorithm.filter_groups``) as many more as it needs. The checkpoint records the count
    (``checkpoint.DATA_BATCHES``) and a resumed run skips exactly that many, so it continues with the batch
    the uninterrupted run would have drawn next."""

    def __init__(self, batches, consumed: int = 0):
        self._batches, self.consumed = iter(batches), consumed

    def __iter__(self) -> DataStream:
        return self

    def __next__(self):
        batch = next(self._batches)
        self.consumed += 1
        return batch


def data_stream(train_data, cfg: ExperimentConfig, resume_state: dict | None) -> DataStream:
    """The training prompts as endless seeded batches, from the position ``resume_state`` (a checkpoint's
    state) records, or from the start."""
    consumed = checkpoint.data_batches(resume_state) if resume_state else 0
    batches = train_data.iterate(cfg.data.batch_size, shuffle=cfg.data.shuffle, seed=cfg.trainer.seed, skip=consumed)
    return DataStream(batches, consumed)


def due(every: int, step: int, last_step: int) -> bool:
    """Whether a periodic action (verl's test_freq / save_freq) runs after ``step``: every ``every`` steps and
    at the last one; never when ``every <= 0``."""
    return every > 0 and (step % every == 0 or step == last_step)


def check_finite(metrics: dict, step: int, policy: str, last_checkpoint: Path | None) -> bool:
    """``trainer.on_nonfinite``: "stop" ends the run naming the step (``RunFailed``); "skip" returns True
    (the update was skipped). The workers never apply an update whose grad norm is not finite, so the
    weights stay the last good ones either way."""
    bad = [k for k in NONFINITE_KEYS if k in metrics and not math.isfinite(metrics[k])]
    if not bad:
        return False
    if policy == "stop":
        raise RunFailed(f"step {step}: non-finite {', '.join(bad)}; stopping (trainer.on_nonfinite=stop); "
                        f"last good checkpoint: {last_checkpoint or 'none'}")
    log.warning("step %d: non-finite %s; update skipped (trainer.on_nonfinite=skip)", step, ", ".join(bad))
    return True


def _layout(cfg: ExperimentConfig) -> dict:
    """What decides which rank draws which random numbers: equal layouts restore per-rank random streams."""
    def of(m) -> list[int]:  # CP listed only when on: checkpoints written before it existed still compare equal
        return [m.tensor_model_parallel_size, m.pipeline_model_parallel_size] + (
            [m.context_parallel_size] if m.context_parallel_size > 1 else [])

    roles = {name: of(getattr(cfg, name).megatron) for name in ("actor", "critic")}
    return {**roles, "n_workers": cfg.resources.n_workers, "critic_n_workers": cfg.resources.critic_n_workers,
            "rollout_tp": cfg.rollout.tensor_model_parallel_size}


def _connect_ray(cfg: ExperimentConfig, plan):
    """An embedded cluster (already checked against the machine), or the joined one — checked here for
    the resources the pools need before any placement group waits for them."""
    import ray

    if ray.is_initialized():  # a notebook or test that started Ray itself keeps it
        return None
    handle = start_ray(cfg.ray.address, num_cpus=cfg.ray.num_cpus, temp_dir=cfg.ray.temp_dir)
    need = plan.required_resources(cfg.resources)
    if cfg.ray.address is not None:
        have = ray.cluster_resources()
        for kind, n in need.items():
            if n > have.get(kind, 0):
                handle.shutdown()
                raise ConfigError(f"resources: the worker pools need {n:g} {kind}s, the Ray cluster at "
                                  f"{cfg.ray.address} has {have.get(kind, 0):g}")
    return handle
