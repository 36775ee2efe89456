"""The critic worker: a megatron-core value model (GPT trunk + scalar head) initialized from the policy."""

from __future__ import annotations

from hybridflow.algorithms import value_loss
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.megatron import parallel
from hybridflow.megatron.engine import MegatronRole
from hybridflow.protocol import Batch
from hybridflow.workers.actor_rollout_ref import optim_settings
from hybridflow.workers.common import concat_outputs, load_hf_folder, mean_metrics, micro_batches, response_part


class CriticWorker(Worker):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.init_distributed()
        mp = cfg.critic.megatron
        parallel.init_model_parallel(mp.tensor_model_parallel_size, mp.pipeline_model_parallel_size,
                                     seed=cfg.trainer.seed)
        hf_config, state = load_hf_folder(cfg.model.path)
        self.critic = MegatronRole(hf_config, state, value_head=True, optim=optim_settings(cfg.critic.optim, mp))

    def dispatch_info(self) -> dict:
        return parallel.dispatch_info()

    @register(Dispatch.DP_COMPUTE_PROTO_3D)
    def compute_values(self, batch: Batch) -> Batch:
        R = batch.tensors["responses"].shape[1]
        outs = self.critic.forward(micro_batches(batch, self.cfg.critic.log_prob_micro_batch_size),
                                   lambda mb, v: {"values": response_part(v[..., 0], R)})
        return Batch.from_dict(tensors={"values": concat_outputs(outs, "values")})

    @register(Dispatch.DP_COMPUTE_PROTO_3D)
    def update_critic(self, batch: Batch) -> dict:
        c = self.cfg.critic
        R = batch.tensors["responses"].shape[1]
        mini_size = c.ppo_mini_batch_size // parallel.dispatch_info()["dp_size"]

        def loss_fn(mb, v):
            vpreds = response_part(v[..., 0], R)
            loss, clipfrac = value_loss(vpreds, mb["returns"], mb["values"], mb["response_mask"],
                                        cliprange_value=c.cliprange_value, loss_agg_mode=c.loss_agg_mode)
            return loss, {"critic/vf_loss": loss.detach(), "critic/vf_clipfrac": clipfrac.detach()}

        all_metrics = []
        for _ in range(c.ppo_epochs):
            for mini in batch.split(mini_size):
                mbs = micro_batches(mini, c.ppo_micro_batch_size, extra_keys=["values", "returns", "response_mask"])
                all_metrics.append(self.critic.train_mini_batch(mbs, loss_fn))
        metrics = mean_metrics(all_metrics)
        metrics["critic/grad_norm"] = metrics.pop("grad_norm")
        metrics.pop("update_skipped", None)
        return metrics
