"""The sample sources of an agent program (``agent.entrypoint``): each step's rows are the episodes the program ran
against the policy's OpenAI-compatible endpoint (agent/service.py), ``rollout.n`` per prompt (a GRPO group).

- ``AgentEpisodes`` (schedule.mode sync): served by the hybrid engine's colocated vLLM engines with the weights
  just pushed; the trainer waits for the step's episodes.
- ``AgentPool`` (separate_async): served by the standalone rollout pool, fed by the checkpoint engine; the next
  steps' episodes run while the trainer trains (``schedule.num_warmup_batches`` batches ahead, capped by the
  staleness bound), every batch in flight at once, so slow tools keep neither the trainer nor the engines idle. An episode goes on across a push:
  its tokens carry the version of the weights that sampled each turn. A pool whose worker died ends the run (the
  episodes talking to it cannot be replayed): the pool rebuild of separate_async without agents is not done here.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

from hybridflow.agent.service import AgentService
from hybridflow.protocol import Batch
from hybridflow.trainer.placement import WorkerGroups
from hybridflow.trainer.pool_lookahead import PoolLookahead, look_ahead, push_weights
from hybridflow.trainer.sources import HybridEngine
from hybridflow.workers.generation import sampling_settings


def agent_source(cfg, plan, workers: WorkerGroups, prepare, tokenizer):
    """The agent program's source for ``schedule.mode``: its episodes served by the rollout pool (separate_async)
    or by the hybrid engine (sync; the run plan refuses colocate_async with an agent)."""
    sc = cfg.schedule
    if sc.mode == "separate_async":
        service = AgentService(cfg, tokenizer, lambda: workers.rollout, plan.generation.replicas)
        return AgentPool(workers, prepare, service, plan.rollout_spec,
                         look_ahead(sc.num_warmup_batches, sc.max_off_policy_threshold))
    service = AgentService(cfg, tokenizer, lambda: workers.actor_rollout, plan.generation.replicas)
    return AgentEpisodes(workers, prepare, service, plan.actor_spec)


class AgentEpisodes(HybridEngine):
    """The hybrid engine's push and generator; its samples are the agent program's episodes."""

    def __init__(self, workers: WorkerGroups, prepare, service: AgentService, spec):
        """``spec``: the generating workers' spec (its rollout section and response length: the sampling)."""
        super().__init__(workers, prepare)
        self.service, self.spec = service, spec

    def take(self, prompts: Batch, label, stream) -> tuple[Batch, dict]:
        return self.service.run(self.prepare(prompts, label), sampling_settings(self.spec, {}), label)

    def push(self, version: int) -> dict:
        self.service.backend.version = version  # the hybrid engine's vLLM stamps no version on its tokens
        return super().push(version)

    def validation(self, prompts: Batch) -> Batch:
        """The validation prompts' episodes, sampled with rollout.val_kwargs (``prompts.meta``)."""
        batch, _ = self.service.run(prompts, sampling_settings(self.spec, prompts.meta), "val")
        return batch

    def close(self) -> None:
        self.service.close()


class EpisodeBatches:
    """PoolLookahead's generator for an agent program: ``submit("generate", rows)`` runs the rows' episodes on a
    thread of their own, so every batch in flight runs at once (up to ``in_flight``): while one batch's episodes
    wait on their tools, another's requests fill the engines. ``get`` on what it returns waits for the batch's
    training rows (the episodes' metrics in ``meta["agent"]``)."""

    def __init__(self, service: AgentService, spec, in_flight: int):
        self.service, self.spec = service, spec
        self._thread = ThreadPoolExecutor(in_flight, thread_name_prefix="hybridflow-episodes")
        self._names = itertools.count()

    def submit(self, method: str, rows: Batch) -> _Running:
        if method != "generate":
            raise ValueError(f"agent episodes are generated whole, not by {method!r}")
        sampling = sampling_settings(self.spec, {})
        label = f"b{next(self._names)}"
        return _Running(self._thread.submit(self._run, rows, sampling, label))

    def _run(self, rows: Batch, sampling, label) -> Batch:
        batch, metrics = self.service.run(rows, sampling, label)
        return batch.replace(meta={"agent": metrics})

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


class _Running:
    def __init__(self, future):
        self.future = future

    def get(self) -> Batch:
        return self.future.result()


class AgentPool:
    off_policy = True

    def __init__(self, workers: WorkerGroups, prepare, service: AgentService, spec, depth: int):
        self.workers, self.service, self.version = workers, service, 0
        self.episodes = EpisodeBatches(service, spec, depth + 1)  # the step's batch and those ahead
        self.lookahead = PoolLookahead(self.episodes, depth, prepare, self._recover)

    @property
    def generator(self):
        return self.workers.rollout

    @staticmethod
    def _recover(error) -> None:
        raise error

    def take(self, prompts: Batch, label, stream) -> tuple[Batch, dict]:
        batch, metrics = self.lookahead.take(prompts, label, stream())
        metrics.update(batch.meta.pop("agent"))
        return batch, metrics

    def push(self, version: int) -> dict:
        """The checkpoint engine's push, between two engine calls of the episodes running (calls reach the pool's
        ranks in one order: controller's RayWorkerGroup)."""
        metrics = push_weights(self.workers.actor_rollout, self.workers.rollout, version)
        self.version = version
        return metrics

    def in_flight(self) -> int:
        return self.lookahead.in_flight_count()

    def drop_in_flight(self) -> int:
        return self.lookahead.drop_in_flight()

    def validation(self, prompts: Batch) -> Batch:
        """The validation prompts' episodes (rollout.val_kwargs), beside the batches in flight."""
        batch, _ = self.service.run(prompts, sampling_settings(self.episodes.spec, prompts.meta), "val")
        return batch

    def close(self) -> None:
        self.episodes.close()
        self.service.close()
