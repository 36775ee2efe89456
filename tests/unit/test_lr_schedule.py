"""Learning-rate schedules (megatron/lr_schedule.py): verl's megatron resolution of the optim keys, run by
megatron-core's own OptimizerParamScheduler, equal the closed forms step by step."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.config.schema import Optim
from hybridflow.megatron import lr_schedule
from hybridflow.megatron.checkpoint import _load_scheduler

LR = 1e-3


def _optimizer():
    """A real torch optimizer with megatron's two kinds of param group: decayed, and biases/norms
    (``wd_mult`` 0, as megatron-core's _get_param_groups marks them)."""
    w, b = torch.zeros(2, 2, requires_grad=True), torch.zeros(2, requires_grad=True)
    return torch.optim.AdamW([{"params": [w], "wd_mult": 1.0, "default_config": True},
                              {"params": [b], "wd_mult": 0.0, "default_config": True}], lr=LR)


def _lrs(optim: Optim, total_steps: int, n: int, weight_decay: float = 0.0) -> list[float]:
    """The lr of updates 0..n-1: the scheduler steps once after each update call."""
    opt = _optimizer()
    sched = lr_schedule.build_scheduler(opt, lr_schedule.resolve(optim, total_steps), weight_decay)
    out = []
    for _ in range(n):
        out.append(lr_schedule.current_lr(opt))
        sched.step(1)
    return out


def _assert_lrs(got, want):
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert g == pytest.approx(w, rel=1e-12, abs=0), f"step {k}: {g} != {w}"


def test_warmup_then_constant():
    init, warmup = 1e-4, 4
    got = _lrs(Optim(lr=LR, lr_warmup_steps=warmup, lr_warmup_init=init), total_steps=10, n=8)
    want = [init + (LR - init) * k / warmup for k in range(warmup + 1)] + [LR] * 3
    _assert_lrs(got, want)
    assert got[0] == init  # the first update runs at the warmup's start, as verl's (scheduler built at step 0)


def test_warmup_ratio_then_cosine_to_min_lr_ratio():
    total, ratio = 10, 0.1
    optim = Optim(lr=LR, lr_warmup_steps=-1, lr_warmup_steps_ratio=0.2, lr_decay_style="cosine", min_lr_ratio=ratio)
    s = lr_schedule.resolve(optim, total)
    assert (s.warmup_steps, s.decay_steps, s.min_lr) == (2, 10, pytest.approx(LR * ratio))
    floor = LR * ratio
    want = [LR * k / 2 for k in range(3)]
    want += [floor + (LR - floor) * 0.5 * (1 + math.cos(math.pi * (k - 2) / 8)) for k in range(3, total + 1)]
    want += [floor, floor]  # past the decay: the floor
    _assert_lrs(_lrs(optim, total, total + 3), want)


def test_linear_decay_over_its_own_steps():
    optim = Optim(lr=LR, lr_decay_style="linear", lr_decay_steps=5, min_lr=1e-5)
    want = [1e-5 + (LR - 1e-5) * (1 - k / 5) for k in range(6)] + [1e-5, 1e-5]
    _assert_lrs(_lrs(optim, total_steps=50, n=8), want)


def test_inverse_square_root_after_warmup():
    optim = Optim(lr=LR, lr_warmup_steps=4, lr_decay_style="inverse-square-root")
    got = _lrs(optim, total_steps=20, n=10)
    _assert_lrs(got[4:], [LR * math.sqrt(4) / math.sqrt(k) for k in range(4, 10)])


def test_warmup_steps_zero_takes_the_ratio_as_verl_megatron_does():
    # verl's get_megatron_optimizer_param_scheduler: lr_warmup_steps <= 0 -> int(ratio x decay steps)
    assert lr_schedule.resolve(Optim(lr_warmup_steps=0, lr_warmup_steps_ratio=0.5), 9).warmup_steps == 4
    assert lr_schedule.resolve(Optim(lr_warmup_steps=3, lr_warmup_steps_ratio=0.5), 9).warmup_steps == 3
    # the ratio applies to the decay steps, which default to the run's steps
    assert lr_schedule.resolve(Optim(lr_warmup_steps_ratio=0.5, lr_decay_steps=4), 100).warmup_steps == 2


def test_defaults_are_a_constant_lr():
    _assert_lrs(_lrs(Optim(lr=LR), total_steps=3, n=5), [LR] * 5)


def test_weight_decay_skips_biases_and_norms():
    opt = _optimizer()
    lr_schedule.build_scheduler(opt, lr_schedule.resolve(Optim(lr=LR), 5), weight_decay=0.01)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]


@pytest.mark.parametrize("optim, total, key, words", [
    (Optim(lr_warmup_steps=5), 5, "actor.optim.lr_warmup_steps", "shorter than the decay"),
    (Optim(lr_warmup_steps_ratio=1.0), 4, "actor.optim.lr_warmup_steps", "shorter than the decay"),
    (Optim(lr=1e-6, min_lr=1e-5), 5, "actor.optim.min_lr", "exceeds"),
    (Optim(lr=1e-6, lr_warmup_init=1e-5), 5, "actor.optim.lr_warmup_init", "exceeds"),
    (Optim(lr_decay_style="WSD"), 5, "actor.optim.lr_decay_style", "not one of"),
])
def test_impossible_schedules_are_one_line_errors_naming_the_key(optim, total, key, words):
    with pytest.raises(ValueError) as e:
        lr_schedule.resolve(optim, total, "actor.optim")
    assert str(e.value).startswith(key) and words in str(e.value) and "\n" not in str(e.value)


def test_scheduler_state_restores_exactly_into_a_scheduler_that_already_stepped():
    optim = Optim(lr=LR, lr_warmup_steps=2, lr_decay_style="cosine", min_lr_ratio=0.1)
    schedule = lr_schedule.resolve(optim, 8)
    saved_opt = _optimizer()
    saved = lr_schedule.build_scheduler(saved_opt, schedule, 0.0)
    saved.step(1)  # mid-warmup
    other_opt = _optimizer()
    other = lr_schedule.build_scheduler(other_opt, schedule, 0.0)
    other.step(5)
    _load_scheduler(other, saved.state_dict())
    for _ in range(6):
        assert lr_schedule.current_lr(other_opt) == lr_schedule.current_lr(saved_opt)
        saved.step(1)
        other.step(1)
