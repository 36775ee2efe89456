"""The critic worker: a megatron-core value model (GPT trunk + scalar head) initialized from the policy."""

from __future__ import annotations

from hybridflow import device
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.megatron import parallel
from hybridflow.megatron.role import MegatronRole
from hybridflow.protocol import Batch
from hybridflow.workers import role_ops
from hybridflow.workers.common import (init_megatron_worker, load_role_checkpoint, model_build, offload_settings,
                                       optim_settings, save_role_checkpoint, start_weights)


class CriticWorker(Worker):
    def __init__(self, spec):
        """``spec``: the run plan's ``CriticSpec`` (the critic's section and the process settings)."""
        super().__init__()
        self.spec, p = spec, spec.process
        mp = spec.critic.megatron
        hf_config, state = init_megatron_worker(self, spec, mp)
        self.critic = MegatronRole(  # a policy's weights: the value head as built
            hf_config, state, model_build(mp, value_head=True), optim=optim_settings(spec.critic.optim, mp,
                                                                                   p.total_steps, "critic.optim"),
            offload=offload_settings(mp), start_weights=start_weights(mp, "critic"))

    def dispatch_info(self, mesh: str = "train") -> dict:  # noqa: ARG002 (the critic has one mesh)
        return parallel.dispatch_info()

    @register(Dispatch.DP_COMPUTE_3D)
    def compute_values(self, batch: Batch) -> Batch:
        return role_ops.last_stage_batch(
            values=role_ops.values(self.critic, batch, role_ops.value_batching(self.spec.critic)))

    @register(Dispatch.DP_COMPUTE_3D)
    def update_critic(self, batch: Batch) -> dict:
        metrics = role_ops.update_value(self.critic, batch, self.spec.critic, self.spec.layout.dp,
                                        self.spec.responses_per_prompt)
        return {**metrics, **device.memory_stats("memory/update_critic")}

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        save_role_checkpoint(self, self.critic, "critic", path)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str, restore_rng: bool) -> None:
        load_role_checkpoint(self, self.critic, "critic", path, restore_rng)
