"""The experiment config's on-policy distillation section, verl 0.9.1's ``distillation`` group with its keys and
meanings (verl/workers/config/distillation.py): the student samples, each row's teacher scores the sampled tokens,
and the student's loss moves it toward the teacher (algorithms/distillation.py).

A deliberate difference: verl serves each teacher from a vLLM pool of its own (``num_replicas`` x its inference
layout on ``n_gpus_per_node`` x ``nnodes`` devices) that scores the rows as they are sampled. Here a teacher is a
megatron-core forward-only role in the actor's processes at the actor's layout, as the reference is: it scores a
step's rows after sampling (in every trainer mode, so in the async modes too, against the rows the step trains
on), and needs no devices of its own. Its memory is in the memory plan's (tools/memory_plan.py), its parameters
go to host with the reference's. So verl's pool keys (n_gpus_per_node, nnodes, a teacher's num_replicas and
inference.*) change nothing here (config/verl_keys.py). Another: verl drops its default entry ``teacher_model`` once
another entry is added; here every entry given is a teacher."""

from __future__ import annotations

from dataclasses import dataclass, field
from hybridflow.config.checks import check_numbers

# verl's registry of distillation losses (losses.py register_distillation_loss): the single-sample estimators of
# the reverse KL at the sampled tokens
ESTIMATOR_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
TOPK_MODES = ("forward_kl_topk",)


@dataclass
class DistillationLoss:
    """verl's distillation.distillation_loss: which loss, in which form, with which clamps. The defaults are verl's
    YAML's (what its command lines get), not its dataclass's (topk 128, clamps 10 and -10, policy gradient on)."""

    loss_mode: str = "k3"  # ESTIMATOR_MODES (the reverse KL estimated at the sampled token) or forward_kl_topk
    topk: int | None = 32  # forward_kl_topk: the teacher's k most likely tokens at each position
    use_task_rewards: bool = True  # the task's policy loss too, the distillation term times distillation_loss_coef
    distillation_loss_coef: float = 1.0
    loss_max_clamp: float | None = None  # each token's loss clamped to +-this (k1 can be negative)
    log_prob_min_clamp: float | None = None  # forward_kl_topk: both models' log-probs clamped below
    # True: minus each token's loss is its advantage in the vanilla PPO clip loss (the reverse KL as a reward, as
    # Thinking Machines' write-up); False: the loss itself, aggregated with actor.loss_agg_mode and backpropagated
    use_policy_gradient: bool = False  # its loss is the vanilla PPO clip loss (verl's only policy_loss_mode here)
    clip_ratio_low: float = 0.2  # that loss's own clip range
    clip_ratio_high: float = 0.2

    @property
    def uses_topk(self) -> bool:
        """The teachers give their top-k at each position, not their log-prob of the sampled token."""
        return self.loss_mode in TOPK_MODES

    def validate(self):
        if self.loss_mode not in ESTIMATOR_MODES + TOPK_MODES:
            raise ValueError(f"distillation.distillation_loss.loss_mode {self.loss_mode!r} is not one of "
                             f"{', '.join(ESTIMATOR_MODES + TOPK_MODES)}")
        if self.uses_topk and self.topk is None:
            raise ValueError("distillation.distillation_loss.loss_mode=forward_kl_topk needs topk")
        if not self.use_policy_gradient and self.loss_mode in ("kl", "k1"):
            raise ValueError(f"distillation.distillation_loss: loss_mode {self.loss_mode} as a supervised loss "
                             "(use_policy_gradient false) has a gradient that does not depend on the teacher (as "
                             "verl refuses it); use k3, or use_policy_gradient true")
        check_numbers(self, distillation_loss_coef=dict(ge=0), loss_max_clamp=dict(gt=0), log_prob_min_clamp=dict(lt=0),
                      clip_ratio_low=dict(ge=0), clip_ratio_high=dict(ge=0), topk=dict(ge=1))


@dataclass
class Teacher:
    """One teacher (verl's distillation.teacher_models.<name>)."""

    key: str | None = None  # the value of distillation.teacher_key whose rows it scores (one teacher: every row)
    model_path: str | None = None  # a HF folder with the student's tokenizer and vocabulary


@dataclass
class Distillation:
    """verl's distillation: ``teacher_models`` keyed by an entry name; one teacher scores every row, several each
    score the rows whose ``teacher_key`` column (a data column such as data_source) equals their ``key``."""

    enabled: bool = False
    teacher_models: dict[str, Teacher] = field(default_factory=dict)
    teacher_key: str = "data_source"
    distillation_loss: DistillationLoss = field(default_factory=DistillationLoss)

    def validate(self):
        if not self.enabled:
            return
        if not self.teacher_models:
            raise ValueError("distillation.enabled needs distillation.teacher_models.<name>.model_path")
        for name, t in self.teacher_models.items():
            if not t.model_path:
                raise ValueError(f"distillation.teacher_models.{name}.model_path is not set")
            if len(self.teacher_models) > 1 and t.key is None:
                raise ValueError(f"distillation.teacher_models.{name}.key is not set: with several teachers each "
                                 f"scores the rows whose {self.teacher_key} equals its key")
        keys = [t.key for t in self.teacher_models.values()]
        if len(self.teacher_models) > 1 and len(set(keys)) < len(keys):
            raise ValueError(f"distillation.teacher_models: duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")

    def teachers(self) -> dict[str | None, str]:
        """Routing key -> teacher model path (key None: the one teacher, for every row)."""
        if not self.enabled:
            return {}
        if len(self.teacher_models) == 1:
            return {None: next(iter(self.teacher_models.values())).model_path}
        return {t.key: t.model_path for t in self.teacher_models.values()}


def routing_keys(values) -> list[str]:
    """A data column's values as teacher routing keys: their text, since teacher_models.<name>.key is a string in
    YAML while a column (data_source, or an int-valued one) may hold other types."""
    return [str(v) for v in values]
