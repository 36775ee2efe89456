"""The experiment config: typed dataclasses, mirrored by configs/*.yaml. ``ExperimentConfig`` holds one section
per key; each section lives in a module of its own (training: actor and critic; rollout; algorithm; data; reward;
run: resources, Ray, prepare, schedule, trainer; model; scoring), where each option is documented. The section
names are imported here, the one place callers take them from."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.config.training import MAX_LR, RouterReplay, Megatron, Optim, PolicyLoss, Actor, Critic
from hybridflow.config.rollout import MultiTurn, CheckpointEngine, Rollout
from hybridflow.config.algorithm import KLControl, FILTER_SEQ_REWARD, FILTER_SCORE, FILTER_METRICS, FilterGroups, RolloutCorrection, Algorithm
from hybridflow.config.data import Data
from hybridflow.config.reward import OverlongBuffer, Reward, CustomReward, RewardModel
from hybridflow.config.run import Resources, RayCfg, Prepare, LOGGERS, SEED_LIMIT, MAX_DIST_TIMEOUT_S, Schedule, TrainerSettings
from hybridflow.config.model import Model
from hybridflow.config.agent import AgentService
from hybridflow.config.distillation import DistillationLoss, Teacher, Distillation
from hybridflow.config.scoring import SandboxFusion, ValKwargs

__all__ = ["ExperimentConfig", "MAX_LR", "RouterReplay", "Megatron", "Optim", "PolicyLoss", "Actor", "Critic", "MultiTurn", "CheckpointEngine", "Rollout", "KLControl", "FILTER_SEQ_REWARD", "FILTER_SCORE", "FILTER_METRICS", "FilterGroups", "RolloutCorrection", "Algorithm", "Data", "OverlongBuffer", "Reward", "CustomReward", "RewardModel", "Resources", "RayCfg", "Prepare", "LOGGERS", "SEED_LIMIT", "MAX_DIST_TIMEOUT_S", "Schedule", "TrainerSettings", "Model", "SandboxFusion", "ValKwargs", "AgentService", "DistillationLoss", "Teacher", "Distillation"]


@dataclass
class ExperimentConfig:
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    data: Data = field(default_factory=Data)
    model: Model = field(default_factory=Model)
    actor: Actor = field(default_factory=Actor)
    critic: Critic = field(default_factory=Critic)
    rollout: Rollout = field(default_factory=Rollout)
    schedule: Schedule = field(default_factory=Schedule)
    algorithm: Algorithm = field(default_factory=Algorithm)
    reward: Reward = field(default_factory=Reward)
    custom_reward_function: CustomReward = field(default_factory=CustomReward)
    reward_model: RewardModel = field(default_factory=RewardModel)
    resources: Resources = field(default_factory=Resources)
    ray: RayCfg = field(default_factory=RayCfg)
    prepare: Prepare = field(default_factory=Prepare)
    agent: AgentService = field(default_factory=AgentService)
    distillation: Distillation = field(default_factory=Distillation)

    def resolve_defaults(self) -> None:
        """Keys whose default is another key's value (verl's ``${oc.select:...}`` defaults), filled in place
        so the resolved config shows them."""
        a, c = self.actor, self.critic
        for section in (a.megatron, c.megatron, a, c):  # each section's own (the loader ran them as it built them)
            section.resolve_defaults()
        for key in ("ppo_mini_batch_size", "ppo_epochs", "use_dynamic_bsz"):
            if getattr(c, key) is None:
                setattr(c, key, getattr(a, key))
        if self.trainer.save_hf_at_end is None:
            self.trainer.save_hf_at_end = self.trainer.save_every > 0
