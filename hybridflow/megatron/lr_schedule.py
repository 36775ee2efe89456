"""A role's learning-rate schedule: verl 0.9.1's megatron one, megatron-core's ``OptimizerParamScheduler``.

As verl's megatron workers (utils/megatron/optimizer.py ``get_megatron_optimizer_param_scheduler``,
workers/engine_workers.py ``update_lr_scheduler``): the schedule advances once per update call (one PPO
step, however many mini-batches and epochs it runs), over ``trainer.total_steps`` PPO steps; an update uses
the lr of the steps before it (``lr(0)`` first: ``lr_warmup_init`` when there is a warmup). Weight decay is
constant and skips biases and 1-D params (megatron's ``wd_mult``). On resume only the step count comes from
the checkpoint; the rest is the config's (verl: ``override_opt_param_scheduler``).

Deliberate differences: ``min_lr_ratio`` (verl's FSDP key, floor = lr x ratio) is honoured here too, and the
``lr`` metric is the lr the update applied (verl logs the one after stepping, the next update's).
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


@dataclass(frozen=True)
class LRSchedule:
    """OptimizerParamScheduler's arguments, resolved; ``constant(lr)`` is a flat lr."""

    max_lr: float
    min_lr: float = 0.0
    init_lr: float = 0.0
    warmup_steps: int = 0
    decay_steps: int = 1
    decay_style: str = "constant"

    @classmethod
    def constant(cls, lr: float) -> LRSchedule:
        return cls(max_lr=lr, min_lr=lr, init_lr=lr)


def resolve(optim, total_steps: int, key: str = "optim") -> LRSchedule:
    """The schedule a role's ``optim`` section (schema.Optim) gives a run of ``total_steps`` PPO steps, with
    verl's rules: decay over ``lr_decay_steps`` (None: the whole run); ``lr_warmup_steps <= 0`` takes
    ``int(lr_warmup_steps_ratio x decay steps)``; ``min_lr_ratio`` (when set) replaces ``min_lr`` with
    ``lr x min_lr_ratio``. Raises a one-line ValueError naming the ``key`` section's field that megatron's
    scheduler would reject (it asserts), so config validation can call it before any worker starts."""
    if optim.lr_decay_style not in DECAY_STYLES:
        raise ValueError(f"{key}.lr_decay_style: {optim.lr_decay_style!r} is not one of {', '.join(DECAY_STYLES)}")
    if total_steps is None or total_steps < 1:
        raise ValueError(f"{key}: the learning-rate schedule needs the run's steps (trainer.total_steps), "
                         f"got {total_steps}")
    decay_steps = optim.lr_decay_steps if optim.lr_decay_steps is not None else total_steps
    if decay_steps < 1:
        raise ValueError(f"{key}.lr_decay_steps must be >= 1, got {decay_steps}")
    warmup = optim.lr_warmup_steps
    if warmup is None or warmup <= 0:
        warmup = int(optim.lr_warmup_steps_ratio * decay_steps)
    if warmup >= decay_steps:
        raise ValueError(f"{key}.lr_warmup_steps: the warmup ({warmup} steps) must be shorter than the decay "
                         f"({decay_steps} steps: {key}.lr_decay_steps, or trainer.total_steps when it is null)")
    min_lr = optim.lr * optim.min_lr_ratio if optim.min_lr_ratio is not None else optim.min_lr
    if min_lr > optim.lr:
        raise ValueError(f"{key}.min_lr ({min_lr}) exceeds {key}.lr ({optim.lr})")
    if optim.lr_warmup_init > optim.lr:
        raise ValueError(f"{key}.lr_warmup_init ({optim.lr_warmup_init}) exceeds {key}.lr ({optim.lr})")
    return LRSchedule(max_lr=optim.lr, min_lr=min_lr, init_lr=optim.lr_warmup_init, warmup_steps=warmup,
                      decay_steps=decay_steps, decay_style=optim.lr_decay_style)


def build_scheduler(optimizer, schedule: LRSchedule, weight_decay: float):
    """megatron-core's OptimizerParamScheduler over ``optimizer``'s param groups, at step 0 (it sets every
    group's lr and weight decay now, as verl builds it)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    s = schedule
    return OptimizerParamScheduler(
        optimizer, init_lr=s.init_lr, max_lr=s.max_lr, min_lr=s.min_lr, lr_warmup_steps=s.warmup_steps,
        lr_decay_steps=s.decay_steps, lr_decay_style=s.decay_style, start_wd=weight_decay, end_wd=weight_decay,
        wd_incr_steps=s.decay_steps, wd_incr_style="constant",
        # verl's defaults: the config's schedule wins over a checkpoint's; only the step count is restored
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)


def current_lr(optimizer) -> float:
    """The lr the optimizer's next step applies (its default-schedule param groups all share it)."""
    from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

    lr = get_canonical_lr_for_logging(optimizer.param_groups)
    return float(lr if lr is not None else optimizer.param_groups[0]["lr"])
