"""separate_async's sample source and weight push: the rollout pool generates the prompts of the next steps
while the trainer trains, and receives the actor's weights from the checkpoint engine after every update.

Policy versions: version v is the actor after v updates (0: the starting weights). Step k trains with version
k - 1 and pushes version k when it ends. The batch of step k is submitted ``depth`` steps ahead, so it is sampled
by version k - 1 - depth at the oldest: its lag. The rollout pool runs its calls in order, so a push waits for
the generation submitted before it, and a generation submitted after a push samples with the pushed weights.

The staleness bound (schedule.max_off_policy_threshold, verl's span: lag + 1) holds by construction here: the
look-ahead is min(num_warmup_batches, threshold - 1), so no batch is generated too early to be trained on, and
with partial rollouts the rollout pool restarts a carried response before its age plus the look-ahead reaches
the bound; a sample beyond the bound is a defect and ends the run (``check_lag``).

With partial rollouts the pool serves continuously (workers/serving.py): a batch is admitted when submitted and
served at once, and a step takes its quota of complete groups from what the pool holds; a push stops the running
requests and resumes them under the new weights, restarting those whose oldest token lags it by the bound (the
trainer trains the next batch with that version). Without, the pool generates one submitted batch a call.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator

import torch

from hybridflow.controller import WorkerGroupError, get_together
from hybridflow.protocol import Batch

MAX_RECOVERIES = 3  # rollout pool rebuilds in a row (no step finished between them) before the run ends


def look_ahead(num_warmup_batches: float, threshold: int | None) -> int:
    """Whole prompt batches generated ahead of the trainer: num_warmup_batches (rounded down: a step's batch is
    submitted whole), capped so that no sample lags by ``threshold`` versions or more."""
    depth = math.floor(num_warmup_batches)
    return depth if threshold is None else min(depth, threshold - 1)


def version_lags(token_versions: torch.Tensor, trainer_version: int) -> torch.Tensor:
    """Per row: how many versions the row's oldest sampled token is behind ``trainer_version`` (the weights its
    update starts from). ``token_versions``: [b, R], -1 on padding."""
    sampled = token_versions >= 0
    oldest = torch.where(sampled, token_versions, torch.iinfo(token_versions.dtype).max).amin(-1)
    return torch.where(sampled.any(-1), trainer_version - oldest, torch.zeros_like(oldest))


def lag_metrics(batch: Batch, version: int, threshold: int | None, step) -> dict:
    """The trained batch's lag behind the trainer's policy ``version`` (mean, max; past the staleness
    ``threshold`` a defect that ends the run) and, with carried responses (partial rollouts), the fraction of
    responses sampled under more than one version and the samples restarted for staleness."""
    versions = batch.tensors["token_policy_versions"]
    lags = version_lags(versions, version)
    check_lag(lags, threshold, step)
    out = {"async/version_lag_mean": lags.float().mean().item(), "async/version_lag_max": float(lags.max())}
    if "stale_restarts" in batch.tensors:
        sampled = versions >= 0
        newest = torch.where(sampled, versions, -1).amax(-1)
        oldest = torch.where(sampled, versions, torch.iinfo(versions.dtype).max).amin(-1)
        out["async/partial_fraction"] = (sampled.any(-1) & (newest > oldest)).float().mean().item()
        out["async/dropped_stale_samples"] = float(batch.tensors["stale_restarts"].sum())
    return out


def check_lag(lags: torch.Tensor, threshold: int | None, step) -> None:
    if threshold is not None and len(lags) and int(lags.max()) >= threshold:
        raise RuntimeError(f"step {step}: a sample lags {int(lags.max())} policy versions behind the trainer, "
                           f"beyond schedule.max_off_policy_threshold ({threshold})")


class PoolLookahead:
    """Prompt batches in flight on the rollout pool, oldest first; ``take`` returns the batch of this step."""

    def __init__(self, rollout, depth: int, prepare: Callable[[Batch, int], Batch],
                 recover: Callable[[WorkerGroupError], object], serving: bool = False):
        """``prepare(prompts, step)``: the rows to generate for a step's prompts (group ids, seeds, rollout.n; with
        ``serving``, the groups each replica returns: ``meta["groups_to_finish"]``); ``recover(error)``: rebuild
        the rollout pool after one of its worker processes died, give it the current weights and ``reissue`` what
        is in flight; ``serving``: the pool serves admitted rows continuously (partial rollouts)."""
        self.rollout, self.depth, self.prepare, self.recover, self.serving = rollout, depth, prepare, recover, serving
        self.in_flight: deque = deque()  # (label, rows, future)
        self._last_busy = self._last_wall = None

    def submit(self, prompts: Batch, label) -> None:
        rows = self.prepare(prompts, label)
        self.in_flight.append((label, rows, self._start(rows)))

    def _start(self, rows: Batch):
        return self.rollout.submit("admit" if self.serving else "generate", rows)

    def _wait_first(self) -> Batch:
        """The oldest in-flight batch; when a rollout worker died, ``recover`` rebuilds the pool (which re-issues
        every batch in flight: ``reissue``), up to MAX_RECOVERIES times in a row."""
        for attempt in range(MAX_RECOVERIES + 1):
            try:
                _, rows, started = self.in_flight[0]
                if not self.serving:
                    return started.get()
                started.get()  # admitted (a refusal surfaces here)
                return self.rollout.submit("take", rows.meta["groups_to_finish"]).get()
            except WorkerGroupError as error:
                if not error.died or attempt == MAX_RECOVERIES:
                    raise
                self.recover(error)
        raise AssertionError("unreachable")

    def reissue(self, rollout) -> None:
        """Submit every batch in flight again, in order, to ``rollout`` (a rebuilt pool holding the current weights)."""
        self.rollout = rollout
        self.in_flight = deque((s, rows, self._start(rows)) for s, rows, _ in self.in_flight)

    def take(self, prompts: Batch, label, more_prompts: Iterator[Batch]) -> tuple[Batch, dict]:
        """Submit ``prompts`` behind the batches in flight (at the first call, with the next ``depth`` batches of
        ``more_prompts`` behind them) and return the oldest generated batch, with the seconds waited for it and
        the pool's idle fraction (the trained batch's lag: ``lag_metrics``). ``label``: the generation's name in
        group ids (the step, or DAPO's "step.gen"); a batch submitted ``i`` generations ahead is named ``label + i``.
        A serving pool admits the batches behind after the take, so its engine serves what is taken first."""
        start = time.perf_counter()
        if not self.in_flight:
            self.submit(prompts, label)
            behind = [(next(more_prompts), _ahead(label, ahead)) for ahead in range(1, self.depth + 1)]
        else:
            behind = [(prompts, _ahead(label, self.depth))]
        if not self.serving:  # queued behind the batches in flight: the pool goes on with them at once
            for batch_prompts, name in behind:
                self.submit(batch_prompts, name)
        batch = self._wait_first()
        self.in_flight.popleft()
        if self.serving:  # admitted after the take, so the engine serves what is taken first
            for batch_prompts, name in behind:
                self.submit(batch_prompts, name)
        metrics = {"async/wait_rollout_s": time.perf_counter() - start, "async/in_flight_batches": float(len(self.in_flight))}
        metrics.update(self._idle(batch.meta.pop("rollout/busy_s", None)))
        return batch, metrics

    def _idle(self, busy_s: float | None) -> dict:
        """The rollout pool's idle fraction since the last batch (its first replica's generating seconds)."""
        now, out = time.perf_counter(), {}
        if busy_s is not None and self._last_busy is not None:
            wall = now - self._last_wall
            out["async/rollout_idle_fraction"] = max(0.0, 1.0 - (busy_s - self._last_busy) / wall) if wall > 0 else 0.0
        if busy_s is not None:
            self._last_busy, self._last_wall = busy_s, now
        return out

    def in_flight_count(self) -> int:
        return len(self.in_flight)

    def drop_in_flight(self) -> int:
        """Forget the batches in flight (a checkpoint does not keep them: the resumed run generates them again
        from their prompts, which its data position has not passed); returns how many."""
        n = len(self.in_flight)
        self.in_flight.clear()
        return n


def _ahead(label, i: int):
    """The name of the generation ``i`` ahead of ``label``: the step ``label + i``, or ``"label+i"``."""
    return label + i if isinstance(label, int) else f"{label}+{i}"


def push_weights(actor, rollout, version: int) -> dict:
    """The checkpoint engine's push of policy ``version``: the actor's send and the rollout pool's receive run
    together (resharding/checkpoint_engine.py); the metrics sum what moved and time the push."""
    start = time.perf_counter()
    sent, received = get_together(actor.send_weights(), rollout.receive_weights(version))
    per_rank = [r["weight_sync/bytes_received"] for r in received]
    return {"weight_sync/seconds": time.perf_counter() - start,
            "weight_sync/bytes_sent": sum(s["weight_sync/bytes_sent"] for s in sent),
            "weight_sync/bytes_received_per_rank": max(per_rank),
            "weight_sync/trainer_reshard_bytes": max(s["weight_sync/trainer_reshard/bytes_received"] for s in sent),
            "weight_sync/staging_bytes": max(r["weight_sync/staging_bytes"] for r in received),
            "weight_sync/version": float(version)}
