"""GRPO, RLOO, REINFORCE++-baseline and compute_advantage dispatch."""

import math

import numpy as np
import pytest
import torch

from hybridflow.algorithms import (
    UnknownNameError,
    compute_advantage,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_rloo_outcome_advantage,
)


def t(x):
    return torch.tensor(x, dtype=torch.float64)


# group "a": scores 1, 0, 0 (row 0 spreads its reward over tokens);
# group "b": a single sample with score 0.7; group "c": all-equal 0.5, 0.5.
REWARDS = t(
    [
        [0.5, 0.0, 0.5],
        [0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0],
        [0.0, 0.7, 0.0],
        [0.0, 0.0, 0.5],
        [0.0, 0.0, 0.5],
    ]
)
MASK = t([[1, 1, 1], [1, 0, 1], [1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1]])
INDEX = np.array(["a", "a", "a", "b", "c", "c"], dtype=object)


def broadcast(per_row):
    return t([[s * m for m in row] for s, row in zip(per_row, MASK.tolist())])


def test_grpo_normalised():
    adv, ret = compute_grpo_outcome_advantage(REWARDS, MASK, index=INDEX)
    std_a = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # N-1
    per_row = [
        (2 / 3) / (std_a + 1e-6),
        (-1 / 3) / (std_a + 1e-6),
        (-1 / 3) / (std_a + 1e-6),
        0.7 / (1.0 + 1e-6),  # group of one: mean 0, std 1
        0.0,  # all-equal group: 0 / (0 + eps)
        0.0,
    ]
    torch.testing.assert_close(adv, broadcast(per_row))
    assert ret is adv or torch.equal(ret, adv)


def test_grpo_mean_only():
    adv, ret = compute_advantage("grpo", REWARDS, MASK, index=INDEX, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv, broadcast([2 / 3, -1 / 3, -1 / 3, 0.7, 0.0, 0.0]))
    torch.testing.assert_close(ret, adv)


def test_grpo_integer_and_numpy_index_types():
    index = np.array([10, 10, 10, 3, 7, 7])
    a1, _ = compute_grpo_outcome_advantage(REWARDS, MASK, index=index)
    a2, _ = compute_grpo_outcome_advantage(REWARDS, MASK, index=INDEX)
    a3, _ = compute_grpo_outcome_advantage(REWARDS, MASK.bool(), index=list(INDEX))
    torch.testing.assert_close(a1, a2)
    torch.testing.assert_close(a3, a2)


def test_rloo():
    adv, ret = compute_rloo_outcome_advantage(REWARDS, MASK, index=INDEX)
    # score minus the mean of the others; group of one keeps its score
    per_row = [1 - 0.0, 0 - 0.5, 0 - 0.5, 0.7, 0.0, 0.0]
    torch.testing.assert_close(adv, broadcast(per_row))
    torch.testing.assert_close(ret, adv)


def test_reinforce_plus_plus_baseline():
    rewards = t([[0.0, 1.0], [0.0, 0.0], [0.7, 0.0]])
    mask = t([[1, 1], [1, 0], [1, 1]])
    index = np.array(["a", "a", "b"], dtype=object)
    adv, ret = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, index=index)
    # centred scores 0.5, -0.5, 0.7 (b is alone: mean 0) -> tokens
    # 0.5 0.5 | -0.5 pad | 0.7 0.7 : mean 0.38, unbiased var 1.008 / 4
    s = math.sqrt(0.252 + 1e-8)
    expected = [[(0.5 - 0.38) / s] * 2, [(-0.5 - 0.38) / s, 0.0], [(0.7 - 0.38) / s] * 2]
    torch.testing.assert_close(adv, t(expected))
    torch.testing.assert_close(ret, adv)


def test_dispatch_ignores_extras_not_declared():
    values = torch.zeros_like(REWARDS)
    a1, _ = compute_advantage("rloo", REWARDS, MASK, index=INDEX, values=values, gamma=0.3)
    a2, _ = compute_rloo_outcome_advantage(REWARDS, MASK, index=INDEX)
    torch.testing.assert_close(a1, a2)


@pytest.mark.parametrize(
    "name, missing",
    [
        ("gae", "values"),
        ("grpo", "index"),
        ("rloo", "index"),
        ("reinforce_plus_plus_baseline", "index"),
        ("remax", "reward_baselines"),
    ],
)
def test_dispatch_missing_required_input(name, missing):
    with pytest.raises(ValueError, match=missing):
        compute_advantage(name, REWARDS, MASK)


def test_unknown_estimator_lists_known_names():
    with pytest.raises(UnknownNameError) as err:
        compute_advantage("ppo2", REWARDS, MASK)
    for known in ("gae", "grpo", "rloo", "reinforce_plus_plus", "remax"):
        assert known in str(err.value)
    assert isinstance(err.value, KeyError) and isinstance(err.value, ValueError)


def test_index_length_and_shape_checks():
    with pytest.raises(ValueError, match="index"):
        compute_advantage("grpo", REWARDS, MASK, index=INDEX[:3])
    with pytest.raises(ValueError, match="shape"):
        compute_advantage("grpo", REWARDS, MASK[:, :2], index=INDEX)
