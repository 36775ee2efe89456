"""Where a step's samples come from, one class per ``schedule.mode``, behind one small interface (``SampleSource``):
the driver asks for a step's batch (``take``), hands over the new weights (``push``) and asks what is in flight, and
names no mode. Chosen once from the run plan (trainer/source_choice.py ``make_source``); a new placement is a new class here plus its pool,
spec and rules in plan/.

- ``HybridEngine`` (sync): the actor's colocated vLLM engines generate the step's prompts; the push is the 3D
  resharding engine's in-place transition.
- ``CarriedGeneration`` (colocate_async): the same engines, stepping their requests a call at a time and carrying
  unfinished responses into the next step (partial rollouts; workers/carried_generation.py).
- ``AgentEpisodes`` / ``AgentPool`` (agent.entrypoint; sync / separate_async): an agent program's episodes, served
  over the OpenAI API by the hybrid engine's engines or by the rollout pool's (trainer/agent_source.py).
- ``RolloutPool`` (separate_async): a standalone vLLM pool generating ahead of the trainer (trainer/pool_lookahead.py),
  fed by the checkpoint engine, rebuilt when one of its worker processes dies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Protocol

from hybridflow.controller import WorkerGroupError
from hybridflow.protocol import Batch
from hybridflow.trainer.pool_lookahead import MAX_RECOVERIES, PoolLookahead, push_weights
from hybridflow.trainer.placement import WorkerGroups

log = logging.getLogger(__name__)

Prepare = Callable[[Batch, object], Batch]  # (prompts, label) -> the rows to generate (group ids, seeds, rollout.n)
Stream = Callable[[], Iterator[Batch]]  # the further prompt batches (warm-up batches, look-ahead)


class SampleSource(Protocol):
    off_policy: bool  # its samples may lag the trainer's policy version (their lag is logged and bounded)
    version: int  # the policy version its engines hold: the actor after this many updates

    @property
    def generator(self):
        """The worker group that generates validation and greedy-baseline rows."""

    def take(self, prompts: Batch, label, stream: Stream) -> tuple[Batch, dict]:
        """The generated rows of a step's ``prompts`` (``label``: the generation's name in group ids) and metrics."""

    def push(self, version: int) -> dict:
        """The actor's weights of policy ``version`` into the engines that generate; returns the sync's metrics."""

    def in_flight(self) -> int:
        """Prompt batches drawn but not yet trained on (a checkpoint's data position excludes them)."""

    def drop_in_flight(self) -> int:
        """Forget those batches (after a checkpoint load: generated under older weights); returns how many."""

    def validation(self, prompts: Batch) -> Batch:
        """Validation's rows of ``prompts`` (their ``meta``: the validation sampling), generated on ``generator``."""

    def close(self) -> None:
        """Stop what the source runs besides the worker groups."""


class HybridEngine:
    """sync: the colocated engines generate each step's prompts with the weights just pushed."""

    off_policy = False

    def __init__(self, workers: WorkerGroups, prepare: Prepare):
        self.actor_rollout, self.prepare, self.version = workers.actor_rollout, prepare, 0

    @property
    def generator(self):
        return self.actor_rollout

    def take(self, prompts: Batch, label, stream: Stream) -> tuple[Batch, dict]:
        return self.actor_rollout.generate(self.prepare(prompts, label)), {}

    def push(self, version: int) -> dict:
        self.version = version
        return self.actor_rollout.sync_weights(version)[0]

    def in_flight(self) -> int:
        return 0

    def drop_in_flight(self) -> int:
        return 0

    def validation(self, prompts: Batch) -> Batch:
        return self.generator.generate(prompts)

    def close(self) -> None:
        pass


class CarriedGeneration(HybridEngine):
    """colocate_async: the colocated engines carry unfinished responses from step to step (partial rollouts)."""

    off_policy = True

    def __init__(self, workers: WorkerGroups, prepare: Prepare, groups_per_replica: Callable[[], int],
                 warmup_batches: int):
        super().__init__(workers, prepare)
        self.groups_per_replica, self.warmup_batches = groups_per_replica, warmup_batches
        self._warmed_up = False  # its warm-up batches are in flight

    def take(self, prompts: Batch, label, stream: Stream) -> tuple[Batch, dict]:
        return self.actor_rollout.generate(self.carried_rows(prompts, label, stream)), {}

    def carried_rows(self, prompts: Batch, label, stream: Stream) -> Batch:
        """This generation's new rows (at the first step, with num_warmup_batches more batches in flight) and how
        many complete groups each generation replica returns: one batch's worth. ``label``: the generation's name
        (a step's further generation batches under dynamic sampling are ``<step>.<k>``), which keeps their group ids
        apart from the groups still carried."""
        batches = [self.prepare(prompts, label)]
        if not self._warmed_up:  # the first step of this process (a resumed run starts with none in flight)
            more = stream()
            batches += [self.prepare(next(more), f"{label}w{i}") for i in range(self.warmup_batches)]
            self._warmed_up = True
        rows = Batch.concat(batches) if len(batches) > 1 else batches[0]
        return rows.replace(meta={"groups_to_finish": self.groups_per_replica()})


class RolloutPool:
    """separate_async: a standalone rollout pool generates ahead and is fed by the checkpoint engine; a pool whose
    worker process died is rebuilt and the run goes on (``rebuild``)."""

    off_policy = True

    def __init__(self, workers: WorkerGroups, prepare: Prepare, groups_per_replica: Callable[[], int], depth: int,
                 serving: bool):
        """``serving``: the pool serves admitted rows continuously (partial rollouts): each batch says how many
        complete groups each replica returns."""
        self.workers, self.prepare, self.groups_per_replica, self.serving = workers, prepare, groups_per_replica, serving
        self.version = 0
        self.lookahead = PoolLookahead(workers.rollout, depth, self._rows, self.rebuild, serving=serving)

    @property
    def generator(self):
        return self.workers.rollout

    def _rows(self, prompts: Batch, label) -> Batch:
        rows = self.prepare(prompts, label)
        return rows.replace(meta={"groups_to_finish": self.groups_per_replica()}) if self.serving else rows

    def take(self, prompts: Batch, label, stream: Stream) -> tuple[Batch, dict]:
        return self.lookahead.take(prompts, label, stream())

    def push(self, version: int) -> dict:
        """The checkpoint engine's push (rebuilt, and the push repeated, when one of the pool's worker processes
        died)."""
        rebuilt = False
        for attempt in range(MAX_RECOVERIES + 1):
            try:
                metrics = push_weights(self.workers.actor_rollout, self.workers.rollout, version)
                self.version = version
                if rebuilt:  # generated under the weights just pushed
                    self.lookahead.reissue(self.workers.rollout)
                return metrics
            except WorkerGroupError:
                # either side may report first: a receiver's death also breaks the sender's broadcast, so the
                # warning names the dead receiver, whichever error surfaced
                dead = self.workers.rollout.dead_ranks()
                if attempt == MAX_RECOVERIES or not dead or self.workers.actor_rollout.dead_ranks():
                    raise
                self.rebuild(self.workers.rollout.died("receive_weights", dead), push=False)
                rebuilt = True
        raise AssertionError("unreachable")

    def rebuild(self, error: WorkerGroupError, push: bool = True) -> None:
        """A standalone rollout worker died: the run goes on. Its group is rebuilt in the same pool and reconnected
        to the checkpoint engine; with ``push`` it is given the current weights and the batches in flight are
        re-issued to it (else the caller pushes and re-issues). One warning line says so."""
        log.warning("%s: the rollout pool is rebuilt, given the actor's current weights and %d in-flight batch(es) "
                    "again", error.summary, self.in_flight())
        self.workers.actor_rollout.failed = False  # its send failed only because its receiver died (checked above)
        self.workers.rebuild_rollout()
        if push:
            push_weights(self.workers.actor_rollout, self.workers.rollout, self.version)
            self.lookahead.reissue(self.workers.rollout)

    def in_flight(self) -> int:
        return self.lookahead.in_flight_count()

    def drop_in_flight(self) -> int:
        return self.lookahead.drop_in_flight()

    def validation(self, prompts: Batch) -> Batch:
        return self.generator.generate(prompts)

    def close(self) -> None:
        pass
