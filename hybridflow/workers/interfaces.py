"""What the driver calls on each worker group, as typed interfaces.

A ``RayWorkerGroup`` binds its worker class's ``@register``-ed methods by reflection, so neither an IDE nor
a reader could follow ``self.actor_rollout.generate`` from the driver to the worker. The driver holds its
groups as these Protocols instead; each method is the worker method of the same name, with the group-level
result its dispatch mode collects: one Batch for DP_COMPUTE / DP_COMPUTE_3D methods that return a
Batch, a list of per-rank results otherwise (ONE_TO_ALL: every rank; DP_COMPUTE_3D: the collecting
ranks, in data-parallel order). tests/unit/test_worker_interfaces.py checks that every Protocol method is a
registered worker method with the same parameters and that every registered method is listed here.
"""

from __future__ import annotations

from typing import Protocol

from hybridflow.controller import DispatchFuture, WorkerGroupError
from hybridflow.protocol import Batch


class WorkerGroupHandle(Protocol):
    """What every worker group offers besides its workers' methods (controller.RayWorkerGroup)."""

    name: str
    node_names: list[str]
    failed: bool  # a rank died, failed or did not finish a call

    def dispatch_infos(self, mesh: str = "train") -> list[dict]: ...

    def execute_all(self, method: str, *args, **kwargs) -> list: ...

    def submit(self, method: str, *args, **kwargs) -> DispatchFuture: ...

    def shutdown(self) -> None: ...

    def dead_ranks(self, wait_s: float = 2.0) -> list[int]: ...

    def died(self, method: str, ranks: list[int]) -> WorkerGroupError: ...


class ActorRolloutRefGroup(WorkerGroupHandle, Protocol):
    """workers.actor_rollout_ref.ActorRolloutRefWorker: the actor, its vLLM rollout and the reference."""

    def sync_weights(self, version: int = 0) -> list[dict]: ...

    def connect_rollout(self, host: str, port: int, prefix: str, timeout_s: float) -> DispatchFuture: ...

    def send_weights(self) -> DispatchFuture: ...

    def generate(self, prompts: Batch) -> Batch: ...

    def compute_log_prob(self, batch: Batch) -> Batch: ...

    def compute_ref_log_prob(self, batch: Batch) -> Batch: ...

    def compute_teacher_log_prob(self, batch: Batch) -> Batch: ...

    def update_actor(self, batch: Batch) -> list[dict]: ...

    def close(self) -> list[None]: ...

    def save_checkpoint(self, path: str) -> list[None]: ...

    def load_checkpoint(self, path: str, restore_rng: bool) -> list[None]: ...

    def export_hf_state_dict(self) -> list[dict]: ...

    def save_hf(self, out_dir: str) -> list[None]: ...


class CriticGroup(WorkerGroupHandle, Protocol):
    """workers.critic.CriticWorker: the value model."""

    def compute_values(self, batch: Batch) -> Batch: ...

    def update_critic(self, batch: Batch) -> list[dict]: ...

    def save_checkpoint(self, path: str) -> list[None]: ...

    def load_checkpoint(self, path: str, restore_rng: bool) -> list[None]: ...


class RewardModelGroup(WorkerGroupHandle, Protocol):
    """workers.reward_model.RewardModelWorker: a sequence-classification reward model."""

    def compute_rm_score(self, batch: Batch) -> Batch: ...


class RolloutGroup(WorkerGroupHandle, Protocol):
    """workers.rollout.RolloutWorker: the standalone vLLM pool of separate_async."""

    def connect_rollout(self, host: str, port: int, prefix: str, timeout_s: float) -> DispatchFuture: ...

    def receive_weights(self, version: int) -> DispatchFuture: ...

    def generate(self, prompts: Batch) -> Batch: ...

    def admit(self, rows: Batch) -> list[None]: ...

    def take(self, groups: int) -> Batch: ...

    def close(self) -> list[None]: ...
