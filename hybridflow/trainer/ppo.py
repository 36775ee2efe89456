"""The PPO-family driver: a single controller that holds the algorithm while workers hold the models."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from hybridflow import rng
from hybridflow.agent.loop import agent_metrics
from hybridflow.algorithms import make_kl_controller
from hybridflow.algorithms.pf_ppo import pf_ppo_rows
from hybridflow.algorithms.rollout_correction import correct
from hybridflow.data.dataset import PromptDataset
from hybridflow.protocol import Batch
from hybridflow.rewards import SourceRouter, on_last_token
from hybridflow.rewards.custom import adapt_to_scorer, load_custom_reward_function
from hybridflow.rewards.episode import EpisodeRewards
from hybridflow.rewards.overlong import overlong_penalty
from hybridflow.trainer.pool_lookahead import lag_metrics
from hybridflow.trainer.balance import balance_batch
from hybridflow.trainer.dynamic_sampling import fill_batch
from hybridflow.trainer.experience import (add_advantages, apply_kl_in_reward, as_group_ids, group_prompts,
                                          response_lengths, rollout_metrics, sample_seeds, score_responses,
                                          teacher_metrics)
from hybridflow.trainer.metrics import Timer
from hybridflow.trainer.placement import WorkerGroups
from hybridflow.trainer.source_choice import make_source
from hybridflow.util import mean_by_key


def training_scorer(cfg):
    """The scorer of training rollouts and validation (as verl uses one compute_score for both): the
    user's custom reward function when configured (given each row's data source, ground truth and
    extra_info), else each row's rule scorer by its data source (``SourceRouter``; rows without one use
    ``reward.name``); with an agent program, the reward its episode returned or posted comes first."""
    c, key = cfg.custom_reward_function, cfg.data.reward_fn_key
    if c.path is None:
        scorer = SourceRouter.from_config(cfg.reward, key)
    else:
        scorer = adapt_to_scorer(load_custom_reward_function(c.path, c.name), timeout_s=c.timeout_s, source_key=key)
    return EpisodeRewards(scorer) if cfg.agent.enable else scorer


class PPODriver:
    """The single controller's algorithm: holds the prompts, scorers and KL controller, and calls the worker
    groups, which hold the models, through their typed interfaces (workers/interfaces.py)."""

    def __init__(self, cfg, plan, tokenizer, workers: WorkerGroups, train_data: PromptDataset,
                 val_data: PromptDataset | None):
        """``plan``: the run plan (what the run needs: a reference, a greedy baseline, the old-log-prob forward);
        the prompts as preflight loaded and checked them (every row's source has a scorer)."""
        self.cfg, self.needs, self.tokenizer = cfg, plan.needs, tokenizer
        # how many data-parallel shards a training batch and a generation batch split into
        self.train_dp, self.generation_dp = plan.actor.dp, plan.generation.replicas
        self.actor_rollout, self.critic, self.reward_model = workers.actor_rollout, workers.critic, workers.reward_model
        self.source = make_source(cfg, plan, workers, self.prepare, tokenizer)  # where the samples come from (source_choice.py)
        self.train_data, self.val_data = train_data, val_data
        self.train_scorer = training_scorer(cfg)  # training reward and validation accuracy
        # dynamic sampling's own prompt stream, for a caller of step() that passes none (the Trainer passes its
        # counted data stream, whose position its checkpoints record)
        self._more_prompts = None
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = make_kl_controller(kl.type, kl_coef=kl.kl_coef, target_kl=kl.target_kl, horizon=kl.horizon)
        try:
            self.source.push(0)  # vLLM starts with dummy weights: deliver the actor's
        except BaseException:
            self.source.close()
            raise

    # The paper's few-line PPO: generate, score, prepare experience, update critic and actor, and push
    # the new actor weights into the rollout engine.
    def step(self, prompts: Batch, step: int, t: Timer, more_prompts: Iterator[Batch] | None = None
             ) -> tuple[dict, int]:
        """One step on ``prompts``; DAPO's dynamic sampling draws further prompt batches from ``more_prompts``."""
        cfg, algo = self.cfg, self.cfg.algorithm
        batch, metrics = self.rollout(prompts, step, t, more_prompts)
        batch = balance_batch(batch, cfg, self.train_dp, metrics)
        batch = self.add_old_log_probs(batch, t)
        if self.needs.reference:
            with t("ref"):
                batch = batch.union(self.actor_rollout.compute_ref_log_prob(batch))
        if self.needs.teacher:  # on-policy distillation: each row's teacher scores its sampled tokens
            with t("teacher"):
                batch = batch.union(self.actor_rollout.compute_teacher_log_prob(batch))
            metrics.update(teacher_metrics(batch, cfg.distillation))
        if self.critic is not None:
            with t("values"):
                batch = batch.union(self.critic.compute_values(batch))
        with t("adv"):
            if algo.use_kl_in_reward:
                batch, kl = apply_kl_in_reward(batch, self.kl_ctrl.value, algo.kl_penalty)
                self.kl_ctrl.update(kl, n_steps=len(batch))
                metrics.update({"actor/ref_kl": kl, "actor/kl_coef": self.kl_ctrl.value})
            else:
                batch = batch.replace(tensors={"token_level_rewards": batch.tensors["token_level_scores"]})
            batch = self.correct_rollout(batch, metrics)
            batch = add_advantages(batch, algo)
            batch = self.prioritize(batch, step)
        if self.critic is not None:
            with t("update_critic"):
                metrics.update(mean_by_key(self.critic.update_critic(batch)))
        with t("update_actor"):
            metrics.update(mean_by_key(self.actor_rollout.update_actor(batch)))
        with t("reshard"):
            metrics.update(self.source.push(step))
        metrics.update(rollout_metrics(batch))
        return metrics, int(batch.tensors["attention_mask"].sum())

    def rollout(self, prompts: Batch, step: int, t: Timer, more_prompts: Iterator[Batch] | None) -> tuple[Batch, dict]:
        """rollout.n scored responses per prompt; with algorithm.filter_groups (DAPO's dynamic sampling) only
        groups whose metric varies, generating from ``more_prompts`` until data.batch_size groups are held."""
        cfg, metrics = self.cfg, {}

        def generate(prompts: Batch, gen: int) -> Batch:
            label = step if gen == 0 else f"{step}.{gen}"  # the generation's name in group ids and seeds
            with t("gen"):
                batch, waited = self.source.take(prompts, label, lambda: self._prompt_stream(more_prompts))
                if "async/wait_rollout_s" in waited:  # all of a step's generations
                    waited["async/wait_rollout_s"] += metrics.get("async/wait_rollout_s", 0.0)
                metrics.update(waited)
            metrics.update(batch.meta.pop("memory", {}))
            if cfg.rollout.multi_turn.enable:
                metrics.update(agent_metrics(batch.tensors, batch.non_tensors))
            with t("reward"):  # ReMax's greedy baseline from the rows as generated (their prompts' columns only)
                baseline = self.greedy_baseline(batch) if self.needs.greedy_baseline else None
                batch = self.reward(batch)
                if baseline is not None:
                    batch = batch.union(baseline)
            return batch

        fg = cfg.algorithm.filter_groups
        if not fg.enable:
            batch = generate(prompts, 0)
        else:
            batch, sampling = fill_batch(prompts, self._prompt_stream(more_prompts), generate, n=cfg.rollout.n,
                                         batch_size=cfg.data.batch_size, metric=fg.metric,
                                         max_num_gen_batches=fg.max_num_gen_batches)
            metrics.update(sampling)
        if self.source.off_policy:  # the trained rows' policy versions (dynamic sampling: from several batches)
            metrics.update(lag_metrics(batch, self.source.version, cfg.schedule.max_off_policy_threshold, step))
        return batch, metrics

    def _prompt_stream(self, more_prompts: Iterator[Batch] | None) -> Iterator[Batch]:
        """``more_prompts``, or for a caller without its prompt stream a seeded shuffled stream of our own."""
        if more_prompts is not None:
            return more_prompts
        if self._more_prompts is None:
            self._more_prompts = self.train_data.iterate(self.cfg.data.batch_size, shuffle=True,
                                                         seed=self.cfg.trainer.seed + 1)
        return self._more_prompts

    def prepare(self, prompts: Batch, step) -> Batch:
        """The rows generated for a step's prompts: group ids, rollout.n samples per prompt, a seed for each."""
        n = self.cfg.rollout.n
        prompts.non_tensors["uid"] = as_group_ids(len(prompts), 1, step)
        rows = prompts.repeat(n, interleave=True)
        rows.tensors["sample_seed"] = sample_seeds(self.cfg.trainer.seed, prompts.non_tensors["uid"], n)
        return rows

    def in_flight_batches(self) -> int:
        """Prompt batches drawn but not yet trained on (generating ahead): a checkpoint's data position excludes
        them, so the resumed run generates them again, under the checkpoint's weights."""
        return self.source.in_flight()

    def add_old_log_probs(self, batch: Batch, t: Timer) -> Batch:
        """The old log-probs: vLLM's own in rollout_correction.bypass_mode, none when the update's own are them
        (the run plan's ``on_policy_reuse``), else the actor's forward."""
        if self.cfg.algorithm.rollout_correction.bypass_mode:
            return batch.union(Batch.from_dict(tensors={"old_log_probs": batch.tensors["rollout_log_probs"]}))
        if self.needs.on_policy_reuse:
            return batch
        with t("old_log_prob"):
            return batch.union(self.actor_rollout.compute_log_prob(batch))

    def correct_rollout(self, batch: Batch, metrics: dict) -> Batch:
        """verl's decoupled rollout correction: the trainer's old log-probs against vLLM's, measured, and with
        rollout_is/rollout_rs set, IS weights added and rejected tokens taken out of the response mask. Without
        old log-probs of its own (on-policy reuse) the update measures it; in bypass mode its loss does both."""
        t, rc = batch.tensors, self.cfg.algorithm.rollout_correction
        if rc.bypass_mode or "old_log_probs" not in t or "rollout_log_probs" not in t:
            return batch
        weights, mask, m = correct(t["old_log_probs"], t["rollout_log_probs"], t["response_mask"], rc)
        metrics.update(m)
        weighted = {} if weights is None else {"rollout_is_weights": weights}
        return batch.replace(tensors={"response_mask": mask, **weighted})

    def prioritize(self, batch: Batch, step: int) -> Batch:
        """verl's priority-filtered PPO (algorithm.use_pf_ppo): the batch resampled by its scores, drawn from a
        stream named by the run's seed and the step, so a resumed run draws the same rows."""
        algo = self.cfg.algorithm
        if not algo.use_pf_ppo:
            return batch
        draw = torch.Generator().manual_seed(rng.seed_of(self.cfg.trainer.seed, "pf_ppo", step))
        rows = pf_ppo_rows(batch.tensors["token_level_scores"], algo.pf_ppo.reweight_method, algo.pf_ppo.weight_pow,
                           draw)
        return batch[rows.numpy()]

    def reward(self, batch: Batch) -> Batch:
        """Training reward: the reward model's score when enabled, else the custom function or rule
        scorer with DAPO's overlong shaping when reward.overlong_buffer.enable; the rule accuracy is reported
        either way."""
        batch = score_responses(batch, self.tokenizer, self.train_scorer)
        batch = self.shape_overlong(batch)
        if self.reward_model is None:
            return batch
        rule = batch.tensors["scores"]
        rm = self.reward_model.compute_rm_score(batch).tensors["rm_scores"]
        token = on_last_token(rm, batch.tensors["response_mask"])
        out = Batch.from_dict(tensors={"scores": rm, "token_level_scores": token, "rule_scores": rule})
        return batch.replace(tensors=out.tensors)

    def shape_overlong(self, batch: Batch) -> Batch:
        """``token_level_scores`` + DAPO's overlong penalty (rewards/overlong.py); ``scores`` stay the scorer's
        (validation accuracy, ``reward/score_mean``)."""
        ob = self.cfg.reward.overlong_buffer
        if not ob.enable:
            return batch
        mask = batch.tensors["response_mask"]
        penalty = overlong_penalty(response_lengths(batch), self.cfg.data.max_response_length, ob.len, ob.penalty_factor)
        tensors = {"token_level_scores": batch.tensors["token_level_scores"] + on_last_token(penalty, mask)}
        if ob.log:
            tensors["overlong_reward"] = penalty
        return batch.replace(tensors=tensors)

    def greedy_baseline(self, batch: Batch) -> Batch:
        """ReMax: the reward of a greedy response to each group's prompt, for each of its rows (the batch's own
        prompts: generated ahead or carried, they are not the step's)."""
        prompts, groups = group_prompts(batch)
        greedy = self.generator.generate(prompts.replace(meta={"temperature": 0.0}))
        greedy.meta.pop("memory", None)
        base = self.reward(greedy).tensors["token_level_scores"].sum(-1)
        return Batch.from_dict(tensors={"reward_baselines": base[groups]})

    def validate(self, n_samples: int = 0) -> tuple[dict, list[dict]]:
        """Accuracy on the held-out prompts, each answered rollout.val_kwargs.n times with its sampling
        settings (default: once, greedy: the same evaluation at every step) as verl's ``_validate`` does, and
        the first ``n_samples`` (prompt, response, score) examples."""
        if self.val_data is None:
            return {}, []
        scores, samples, v = [], [], self.cfg.rollout.val_kwargs
        for start in range(0, len(self.val_data), self.cfg.data.val_batch_size):
            rows = list(range(start, min(start + self.cfg.data.val_batch_size, len(self.val_data))))
            prompts = self.val_data.batch(rows).repeat(v.n, interleave=True)
            prompts, pad = prompts.pad_to_divisor(self.generation_dp)
            prompts.meta.update(temperature=v.temperature, top_p=v.top_p, top_k=v.top_k)
            out = score_responses(self.source.validation(prompts).unpad(pad), self.tokenizer, self.train_scorer)
            scores.append(out.tensors["scores"])
            for i in range(min(n_samples - len(samples), len(out))):
                prompt = out.tensors["prompts"][i][out.tensors["attention_mask"][i, :out.tensors["prompts"].shape[1]].bool()]
                samples.append({"prompt": self.tokenizer.decode(prompt.tolist(), skip_special_tokens=True),
                                "response": str(out.non_tensors["response_text"][i]),
                                "score": float(out.tensors["scores"][i])})
        return {"val/accuracy": torch.cat(scores).mean().item()}, samples

    # --- checkpoints: the workers write their roles, the driver its own state -------------------------

    def save_checkpoint(self, path: str) -> dict:
        """Write the trained roles into ``path``; returns the driver's state to keep beside them."""
        self.actor_rollout.save_checkpoint(path)
        if self.critic is not None:
            self.critic.save_checkpoint(path)
        return {"kl_coef": self.kl_ctrl.value}

    def load_checkpoint(self, path: str, state: dict, restore_rng: bool) -> None:
        """Load the roles and driver state saved by ``save_checkpoint``, then push the loaded actor into vLLM."""
        self.actor_rollout.load_checkpoint(path, restore_rng)
        if self.critic is not None:
            self.critic.load_checkpoint(path, restore_rng)
        self.kl_ctrl.value = state["kl_coef"]
        self.source.drop_in_flight()  # generated under weights before the loaded ones (none at start)
        self.source.push(state["step"])

    def close(self) -> None:
        """Stop what the sample source runs besides the worker groups (an agent endpoint and its episodes)."""
        self.source.close()

    @property
    def generator(self):
        """The worker group that generates greedy-baseline rows (the source's)."""
        return self.source.generator
