"""The PPO-family driver: a single controller that holds the algorithm while workers hold the models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm import tqdm

from hybridflow.algorithms import make_kl_controller
from hybridflow.controller import RayWorkerGroup, ResourcePool
from hybridflow.data.dataset import PromptDataset
from hybridflow.protocol import Batch
from hybridflow.trainer.advantage import (add_advantages, apply_kl_in_reward, as_group_ids, rollout_metrics,
                                          score_responses)
from hybridflow.trainer.metrics import MetricsLog, Timer


def build_worker_groups(cfg):
    """Placement: actor/rollout/ref share one pool; the critic shares it or gets its own."""
    from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker
    from hybridflow.workers.critic import CriticWorker

    res = cfg.resources
    pool = ResourcePool("actor_rollout_ref", res.n_workers, cpus_per_bundle=res.cpus_per_worker,
                        gpus_per_bundle=res.gpus_per_worker)
    colocated = cfg.use_critic and cfg.critic.placement == "colocated"
    actor_share = 0.5 if colocated else 1.0
    needs_ref = cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss
    actor = RayWorkerGroup(pool, ActorRolloutRefWorker, cfg, needs_ref, name_prefix="actor_rollout_ref",
                           share=actor_share)
    critic, pools = None, [pool]
    if cfg.use_critic:
        critic_pool = pool if colocated else ResourcePool(
            "critic", res.critic_n_workers, cpus_per_bundle=res.cpus_per_worker, gpus_per_bundle=res.gpus_per_worker)
        if critic_pool is not pool:
            pools.append(critic_pool)
        critic = RayWorkerGroup(critic_pool, CriticWorker, cfg, name_prefix="critic", share=1.0 - actor_share if colocated else 1.0)
    return actor, critic, pools


def _mean(dicts: list[dict]) -> dict:
    keys = {k for d in dicts for k in d}
    return {k: float(np.mean([d[k] for d in dicts if k in d])) for k in keys}


class PPOTrainer:
    def __init__(self, cfg, tokenizer, actor_rollout, critic=None):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.actor_rollout, self.critic = actor_rollout, critic
        d = cfg.data
        kw = dict(prompt_key=d.prompt_key, answer_key=d.answer_key, max_prompt_length=d.max_prompt_length)
        self.train_data = PromptDataset(d.train_files, tokenizer, **kw)
        self.val_data = PromptDataset(d.val_files, tokenizer, **kw) if d.val_files else None
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = make_kl_controller(kl.type, kl_coef=kl.kl_coef, target_kl=kl.target_kl, horizon=kl.horizon)
        self.timer = Timer()
        self.log = MetricsLog(cfg.trainer.output_dir)

    # The paper's few-line PPO: generate, score, prepare experience, update critic and actor.
    def step(self, prompts: Batch, step: int) -> dict:
        cfg, t = self.cfg, self.timer
        n = cfg.rollout.n
        prompts.non_tensors["uid"] = as_group_ids(len(prompts), 1, step)
        batch = prompts.repeat(n, interleave=True)
        with t("gen"):
            batch = self.actor_rollout.generate(batch)
        metrics = dict(batch.meta.pop("reshard", {}))
        with t("reward"):
            batch = score_responses(batch, self.tokenizer, cfg.reward.name)
        with t("old_log_prob"):
            batch = batch.union(self.actor_rollout.compute_log_prob(batch))
        if "ref_log_prob" in self._needs():
            with t("ref"):
                batch = batch.union(self.actor_rollout.compute_ref_log_prob(batch))
        if self.critic is not None:
            with t("values"):
                batch = batch.union(self.critic.compute_values(batch))
        with t("adv"):
            if cfg.algorithm.use_kl_in_reward:
                batch, kl = apply_kl_in_reward(batch, self.kl_ctrl.value, cfg.algorithm.kl_penalty)
                self.kl_ctrl.update(kl, n_steps=len(batch))
                metrics.update({"actor/ref_kl": kl, "actor/kl_coef": self.kl_ctrl.value})
            else:
                batch = batch.union(Batch.from_dict(tensors={"token_level_rewards": batch.tensors["token_level_scores"]}))
            batch = add_advantages(batch, cfg.algorithm)
        if self.critic is not None:
            with t("update_critic"):
                metrics.update(_mean(self.critic.update_critic(batch)))
        with t("update_actor"):
            metrics.update(_mean(self.actor_rollout.update_actor(batch)))
        metrics.update(rollout_metrics(batch))
        n_tokens = int(batch.tensors["attention_mask"].sum())
        return metrics, n_tokens

    def _needs(self) -> set:
        a = self.cfg
        return {"ref_log_prob"} if (a.algorithm.use_kl_in_reward or a.actor.use_kl_loss) else set()

    def validate(self) -> dict:
        """Greedy accuracy on the held-out prompts (the same evaluation at every step)."""
        if self.val_data is None:
            return {}
        scores = []
        for start in range(0, len(self.val_data), self.cfg.data.val_batch_size):
            rows = list(range(start, min(start + self.cfg.data.val_batch_size, len(self.val_data))))
            prompts = self.val_data.batch(rows)
            prompts, pad = prompts.pad_to_divisor(self._dp_size())
            prompts.meta["temperature"] = 0.0
            out = self.actor_rollout.generate(prompts).unpad(pad)
            scores.append(score_responses(out, self.tokenizer, self.cfg.reward.name).tensors["scores"])
        import torch

        return {"val/accuracy": torch.cat(scores).mean().item()}

    def _dp_size(self) -> int:
        return self.actor_rollout.dispatch_infos("rollout")[0]["dp_size"]

    def fit(self) -> list[dict]:
        cfg = self.cfg.trainer
        data = self.train_data.iterate(self.cfg.data.batch_size, shuffle=self.cfg.data.shuffle, seed=cfg.seed)
        line = self.log.log(0, self.validate())
        tqdm.write(line)
        for step in tqdm(range(1, cfg.total_steps + 1), desc="ppo", dynamic_ncols=True):
            with self.timer("step"):
                metrics, n_tokens = self.step(next(data), step)
            if step % cfg.val_every == 0 or step == cfg.total_steps:
                with self.timer("val"):
                    metrics.update(self.validate())
            metrics.update(self.timer.pop())
            metrics["perf/tokens_per_s"] = n_tokens / metrics["time/step_s"]
            tqdm.write(self.log.log(step, metrics))
        self.log.plot()
        if cfg.save_hf_at_end:
            self.actor_rollout.save_hf(str(Path(cfg.output_dir) / "actor_hf"))
        return self.log.rows
