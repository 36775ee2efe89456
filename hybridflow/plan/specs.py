"""What each worker group is given: its role's spec, cut from the config and the plan, instead of the whole
ExperimentConfig. A worker reads nothing else of the run."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.config.model import LoRA, config_overrides
from hybridflow.config.schema import Actor, Critic, DistillationLoss, RewardModel, Rollout, RolloutCorrection
from hybridflow.plan.layout import ParallelLayout
from hybridflow.plan.needs import Needs


@dataclass(frozen=True)
class ProcessSpec:
    """What every process of a megatron role needs to join its world and open the weights it starts from."""

    model_path: str
    seed: int
    dist_timeout_s: float
    total_steps: int | None  # the learning-rate schedules span it (None: the run's length is not known yet)
    trust_remote_code: bool = False  # model.trust_remote_code: the folder's own Python in transformers and vLLM
    max_position_embeddings: int | None = None  # model.max_position_embeddings

    @property
    def config_overrides(self) -> dict:
        """What replaces the folder's config.json values wherever the policy's config is read: transformers'
        ``AutoConfig.from_pretrained(path, **overrides)`` and vLLM's ``hf_overrides``."""
        return config_overrides(self.max_position_embeddings)


@dataclass(frozen=True)
class ActorSpec:
    """The actor, its reference and its rollout engine (one process per device)."""

    process: ProcessSpec
    layout: ParallelLayout  # the actor's (and its reference's) megatron groups
    actor: Actor  # layout, optimizer, batching, losses
    rollout: Rollout  # the engine, sampling, multi-turn
    rollout_correction: RolloutCorrection
    needs: Needs
    max_prompt_length: int
    max_response_length: int
    chat_template_kwargs: dict
    # the actor's and reference's log-probs divide the logits by it: the rollout's temperature, so the trainer's
    # policy is the one vLLM sampled from (verl 0.9.1: ``logits.div_(temperature)`` in
    # workers/engine/megatron/transformer_impl.py); greedy rollouts (0) have no sampled distribution: 1
    logit_temperature: float
    # separate_async: the standalone rollout pool's size (0: the rollout engine is colocated in these processes)
    rollout_pool: int = 0
    # colocate_async: carry unfinished responses into the next step, restarting those that would lag by
    # max_off_policy_threshold versions or more (None: no bound)
    carry_unfinished: bool = False
    max_off_policy_threshold: int | None = None
    lora: LoRA | None = None  # model.lora when it trains adapters (rank > 0)
    # on-policy distillation (config/distillation.py): its loss settings, the teachers (routing key -> model path; key
    # None: the one teacher) and the data column that routes rows to them
    distillation: DistillationLoss | None = None
    teachers: dict = field(default_factory=dict)
    teacher_key: str = "data_source"


@dataclass(frozen=True)
class RolloutSpec:
    """The standalone rollout pool of separate_async: vLLM engines fed by the checkpoint engine."""

    process: ProcessSpec
    rollout: Rollout
    max_prompt_length: int
    max_response_length: int
    chat_template_kwargs: dict
    train_layout: tuple[int, int, int]  # the actor's (p, t, d): which training rank feeds which rollout rank
    # schedule.partial_rollout: serve the admitted samples continuously, carrying unfinished ones across pushes
    # and restarting those whose oldest token lags the pushed version by staleness_threshold
    # (schedule.max_off_policy_threshold; None: no bound) or more: the trainer trains the next batch with it
    partial_rollout: bool = False
    staleness_threshold: int | None = None


@dataclass(frozen=True)
class CriticSpec:
    process: ProcessSpec
    layout: ParallelLayout
    critic: Critic
    responses_per_prompt: int  # rollout.n: the mini-batch's prompts x this are its sequences


@dataclass(frozen=True)
class RewardModelSpec:
    reward_model: RewardModel
    policy_path: str  # the policy's tokenizer decodes the responses the reward model re-tokenizes
    trust_remote_code: bool = False  # model.trust_remote_code, for the policy's tokenizer


def _distillation(d) -> tuple:
    """ActorSpec's distillation fields: the loss settings, the teachers by routing key, the routing column."""
    return (d.distillation_loss, d.teachers(), d.teacher_key) if d.enabled else (None, {}, d.teacher_key)


def role_specs(cfg, needs: Needs, total_steps: int | None, actor_layout, critic_layout, generation) -> tuple[
        ActorSpec, CriticSpec | None, RewardModelSpec | None, RolloutSpec | None]:
    process = ProcessSpec(cfg.model.path, cfg.trainer.seed, cfg.trainer.dist_timeout_s, total_steps,
                          cfg.model.trust_remote_code, cfg.model.max_position_embeddings)
    r, d = cfg.rollout, cfg.data
    separate = not generation.colocated
    actor = ActorSpec(process, actor_layout, cfg.actor, r, cfg.algorithm.rollout_correction, needs, d.max_prompt_length,
                      d.max_response_length, d.apply_chat_template_kwargs, r.temperature if r.temperature > 0 else 1.0,
                      generation.world if separate else 0, cfg.schedule.mode == "colocate_async",
                      cfg.schedule.max_off_policy_threshold, cfg.model.lora if cfg.model.lora.rank else None,
                      *_distillation(cfg.distillation))
    # an agent program's episodes go on across pushes by themselves (each turn is an engine call of its own): its
    # pool generates call by call instead of serving admitted rows
    serving = cfg.schedule.partial_rollout and not cfg.agent.enable
    rollout = (RolloutSpec(process, r, d.max_prompt_length, d.max_response_length, d.apply_chat_template_kwargs,
                           (actor_layout.pp, actor_layout.tp, actor_layout.weight_replicas), serving,
                           cfg.schedule.max_off_policy_threshold) if separate else None)
    critic = CriticSpec(process, critic_layout, cfg.critic, r.n) if needs.critic else None
    reward_model = (RewardModelSpec(cfg.reward_model, cfg.model.path, cfg.model.trust_remote_code)
                    if cfg.reward_model.enable else None)
    return actor, critic, reward_model, rollout
