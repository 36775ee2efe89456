"""The sample source of an agent program (``agent.entrypoint``): each step's rows are the episodes the program ran
against the policy's OpenAI-compatible endpoint (agent/service.py), ``rollout.n`` per prompt (a GRPO group),
served by the hybrid engine's colocated vLLM engines with the weights just pushed (schedule.mode sync)."""

from __future__ import annotations

from hybridflow.agent.service import AgentService
from hybridflow.protocol import Batch
from hybridflow.trainer.placement import WorkerGroups
from hybridflow.workers.generation import sampling_settings


class AgentEpisodes:
    off_policy = False

    def __init__(self, workers: WorkerGroups, prepare, service: AgentService, spec):
        """``spec``: the generating workers' spec (its rollout section and response length: the sampling)."""
        self.actor_rollout, self.prepare, self.service, self.spec = workers.actor_rollout, prepare, service, spec
        self.version = 0

    @property
    def generator(self):
        return self.actor_rollout

    def take(self, prompts: Batch, label, stream) -> tuple[Batch, dict]:
        return self.service.run(self.prepare(prompts, label), sampling_settings(self.spec, {}), label)

    def push(self, version: int) -> dict:
        self.version = self.service.backend.version = version
        return self.actor_rollout.sync_weights(version)[0]

    def in_flight(self) -> int:
        return 0

    def drop_in_flight(self) -> int:
        return 0

    def validation(self, prompts: Batch) -> Batch:
        """The validation prompts' episodes, sampled with rollout.val_kwargs (``prompts.meta``)."""
        batch, _ = self.service.run(prompts, sampling_settings(self.spec, prompts.meta), "val")
        return batch

    def close(self) -> None:
        self.service.close()
