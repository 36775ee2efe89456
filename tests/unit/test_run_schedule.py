"""verl's meanings of the run's length and periodic actions: total_training_steps wins over total_epochs;
test_freq / save_freq <= 0 never validate / save (and save_freq <= 0 exports nothing either)."""

from __future__ import annotations

import pytest

from hybridflow.plan import load_experiment, total_steps
from hybridflow.trainer.session import due


def cfg(*overrides):
    return load_experiment([{}], ["data.batch_size=16", "actor.ppo_mini_batch_size=16", *overrides])


@pytest.mark.parametrize("overrides, n_train, want", [
    ([], 100, 30 * 6),  # verl's default: 30 epochs of 100 // 16 = 6 steps
    (["trainer.total_epochs=2"], 100, 12),
    (["trainer.total_epochs=2", "trainer.total_steps=5"], 100, 5),  # steps win
    (["trainer.total_steps=500", "trainer.total_epochs=1"], 100, 500),  # even beyond one epoch
])
def test_steps_win_over_epochs(overrides, n_train, want):
    assert total_steps(cfg(*overrides), n_train) == want


@pytest.mark.parametrize("every, last, want", [
    (5, 12, [5, 10, 12]),
    (1, 3, [1, 2, 3]),
    (-1, 12, []),  # verl's -1: never
    (0, 12, []),
])
def test_periodic_actions(every, last, want):
    assert [k for k in range(1, last + 1) if due(every, k, last)] == want


def test_export_follows_saving_unless_set():
    assert cfg().trainer.save_hf_at_end is False  # verl's save_freq -1: nothing written
    assert cfg("trainer.save_every=10").trainer.save_hf_at_end is True
    assert cfg("trainer.save_every=-1", "trainer.save_hf_at_end=true").trainer.save_hf_at_end is True
