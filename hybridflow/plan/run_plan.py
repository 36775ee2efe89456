"""``resolve(cfg, model, n_train) -> RunPlan``: every fact derived from the config — each role's layout, the
generation layout, pools and bundle shares, what the run needs, total steps — computed and checked once.
Session, placement, the driver, preflight and the memory-plan tool read the plan instead of deriving
these again."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hybridflow.plan.layout import GenerationLayout, ParallelLayout
from hybridflow.plan.needs import Needs, run_needs
from hybridflow.plan.pools import Pool, plan_pools, pool_of
from hybridflow.plan.rules import (check_agent, check_algorithm, check_context_parallel, check_lora, check_names,
                                   check_routing_replay, check_schedule, check_token_budgets, check_virtual_stages)
from hybridflow.plan.specs import ActorSpec, CriticSpec, RewardModelSpec, RolloutSpec, role_specs


@dataclass(frozen=True)
class RunPlan:
    actor: ParallelLayout
    critic: ParallelLayout | None  # None: the run trains no critic
    generation: GenerationLayout
    needs: Needs
    pools: tuple[Pool, ...]
    longest_row: int  # tokens: data.max_prompt_length + data.max_response_length
    total_steps: int | None  # None until the number of training prompts is known (unless trainer.total_steps)
    actor_spec: ActorSpec  # what each worker group is given
    critic_spec: CriticSpec | None
    reward_model_spec: RewardModelSpec | None
    rollout_spec: RolloutSpec | None  # the standalone rollout pool's (separate_async)
    cfg: object = field(default=None, repr=False, compare=False)  # the config it was resolved from
    on_gpu: bool = False

    def with_model(self, model=None, n_train: int | None = None) -> RunPlan:
        """This plan for the run's model and data: each layout checked against the model's HF config (heads, layers,
        experts), routing replay and adapters on it (``ValueError`` naming the keys), and the run's steps counted
        from the ``n_train`` training prompts (the workers' learning-rate schedules span them). The config's own
        rules are not checked again."""
        cfg = self.cfg
        if model is not None:
            check_routing_replay(cfg, model)
            check_lora(cfg, model)
            for layout in (self.actor, self.critic):
                if layout is not None:
                    layout.check_model(model, cfg.model.path, self.on_gpu)
        steps = total_steps(cfg, n_train)
        specs = role_specs(cfg, self.needs, steps, self.actor, self.critic, self.generation)
        return dataclasses.replace(self, total_steps=steps, actor_spec=specs[0], critic_spec=specs[1],
                                   reward_model_spec=specs[2], rollout_spec=specs[3])

    def pool(self, group: str) -> Pool:
        """The pool a worker group runs in."""
        return pool_of(self.pools, group)

    def required_resources(self, resources) -> dict:
        """What the pools ask of Ray: {"CPU": n, "GPU": n}."""
        bundles = sum(p.size for p in self.pools)
        return {"CPU": bundles * resources.cpus_per_worker, "GPU": bundles * resources.gpus_per_worker}

    @property
    def trained_roles(self) -> tuple[str, ...]:
        return ("actor", "critic") if self.critic is not None else ("actor",)


def total_steps(cfg, n_train: int | None) -> int | None:
    """verl's rule: trainer.total_steps (total_training_steps) wins when set; else total_epochs passes over
    the training prompts, each of n_train // batch_size steps (the last partial batch is dropped, as verl's
    loader does); None when that count is needed and unknown."""
    t = cfg.trainer
    if t.total_steps is not None:
        return t.total_steps
    return None if n_train is None else t.total_epochs * (n_train // cfg.data.batch_size)


def resolve(cfg, model=None, n_train: int | None = None, *, on_gpu: bool = False) -> RunPlan:
    """The run plan of ``cfg`` (raises ``ValueError`` naming the keys of the first rule broken). ``model``:
    the HF config, whose heads, layers and experts each layout must divide (unchecked when None);
    ``n_train``: the number of training prompts (total steps); ``on_gpu``: whether the workers run on GPUs."""
    check_names(cfg)
    needs = run_needs(cfg)
    n, pools = cfg.rollout.n, plan_pools(cfg, needs.critic)

    def layout_of(role: str, group: str) -> ParallelLayout:
        pool = pool_of(pools, group)
        return ParallelLayout.of(role, getattr(cfg, role).megatron, pool.size, pool.size_key)

    actor = layout_of("actor", "actor_rollout_ref")
    critic = layout_of("critic", "critic") if needs.critic else None
    for layout, section in ((actor, cfg.actor), (critic, cfg.critic)):
        if layout is not None:
            layout.check()
            micro = 1 if section.use_dynamic_bsz else section.ppo_micro_batch_size_per_gpu  # token budgets instead
            layout.check_batches(section.ppo_mini_batch_size, cfg.data.batch_size, n, micro)
    check_token_budgets(cfg, needs.critic)
    check_schedule(cfg, on_gpu)
    separate = cfg.schedule.mode == "separate_async"
    gen_pool = pool_of(pools, "rollout" if separate else "actor_rollout_ref")
    generation = GenerationLayout(cfg.rollout.tensor_model_parallel_size, gen_pool.size, gen_pool.size_key, not separate)
    generation.check(actor.tp, cfg.trainer.seed, cfg.data.batch_size * n)
    check_algorithm(cfg, needs, generation.replicas)
    check_agent(cfg, needs)
    check_routing_replay(cfg, None)
    check_context_parallel(cfg)
    check_virtual_stages(cfg)
    check_lora(cfg, None)
    steps = total_steps(cfg, None)
    plan = RunPlan(actor, critic, generation, needs, pools, cfg.data.max_prompt_length + cfg.data.max_response_length,
                   steps, *role_specs(cfg, needs, steps, actor, critic, generation), cfg=cfg, on_gpu=on_gpu)
    return plan.with_model(model, n_train) if model is not None or n_train is not None else plan
