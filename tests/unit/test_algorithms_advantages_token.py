"""GAE, REINFORCE++ and ReMax on hand-computed cases (including masks with gaps)."""

import math

import torch

from hybridflow.algorithms import (
    compute_advantage,
    compute_gae_advantage_return,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
)


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def test_gae_skips_gap_tokens():
    # gamma = lam = 0.5; position 1 and 3 are masked out.  Hand recurrence:
    # t3 (m=0): adv 0, nextv 0             t2: delta = 1 + 0 - 0.2 = 0.8 -> 0.8
    # t1 (m=0): carries 0.8, nextv 0.2     t0: delta = 0 + 0.5*0.2 - 0.5 = -0.4
    #                                          -> -0.4 + 0.25*0.8 = -0.2
    rewards = t([[0.0, 0.0, 1.0, 0.0]])
    values = t([[0.5, 9.0, 0.2, 7.0]])
    mask = t([[1, 0, 1, 0]])
    adv, ret = compute_gae_advantage_return(rewards, mask, values=values, gamma=0.5, lam=0.5)
    raw = [-0.2, 0.8, 0.8, 0.0]
    torch.testing.assert_close(ret, t([[r + v for r, v in zip(raw, values[0].tolist())]]))
    # whitening over masked raw advantages {-0.2, 0.8}: mean 0.3, unbiased var 0.5
    s = math.sqrt(0.5 + 1e-8)
    torch.testing.assert_close(adv, t([[(r - 0.3) / s for r in raw]]))  # not re-masked


def test_gae_batch_whitening_gamma_lam_one():
    # with gamma = lam = 1, raw GAE = reward-to-go - value
    rewards = t([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = t([[0.1, 0.2, 0.3], [0.5, 0.5, 0.9]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_advantage("gae", rewards, mask, values=values, gamma=1.0, lam=1.0)
    raw = [[0.9, 0.8, 0.7], [1.5, 1.5, 0.0]]
    torch.testing.assert_close(ret, t([[1.0, 1.0, 1.0], [2.0, 2.0, 0.9]]))
    # masked raw: 0.9, 0.8, 0.7, 1.5, 1.5 -> mean 1.08, unbiased var 0.608 / 4
    s = math.sqrt(0.152 + 1e-8)
    torch.testing.assert_close(adv, t([[(r - 1.08) / s for r in row] for row in raw]))


def test_gae_bool_mask():
    rewards = t([[0.0, 0.0, 1.0, 0.0]])
    values = t([[0.5, 9.0, 0.2, 7.0]])
    mask = t([[1, 0, 1, 0]])
    a1, r1 = compute_gae_advantage_return(rewards, mask, values=values, gamma=0.5, lam=0.5)
    a2, r2 = compute_gae_advantage_return(rewards, mask.bool(), values=values, gamma=0.5, lam=0.5)
    torch.testing.assert_close(a1, a2)
    torch.testing.assert_close(r1, r2)


def test_reinforce_plus_plus_return_runs_through_two_gaps():
    # Multi-turn: turn 1 (t0, t1), tool tokens (t2), turn 2 (t3), user tokens (t4, t5), turn 3 (t6).
    # gamma 0.5, walking back: t6: 1 -> running 1; t5, t4 (mask 0): return 0, running stays 1 (the 5.0
    # on a gap token is not an action's reward); t3: 0 + 0.5*1 = 0.5; t2: 0, running 0.5;
    # t1: 0.5 + 0.5*0.5 = 0.75; t0: 0 + 0.5*0.75 = 0.375 (the final reward reaches the first turn).
    rewards = t([[0.0, 0.5, 0.0, 0.0, 5.0, 0.0, 1.0]])
    mask = t([[1, 1, 0, 1, 0, 0, 1]])
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    torch.testing.assert_close(ret, t([[0.375, 0.75, 0.0, 0.5, 0.0, 0.0, 1.0]]))
    # whitened over the valid returns {0.375, 0.75, 0.5, 1}: mean 0.65625, squared deviations sum to
    # 0.23046875, unbiased var 0.23046875 / 3; then masked
    s = math.sqrt(0.23046875 / 3 + 1e-8)
    expected = [[-0.28125 / s, 0.09375 / s, 0.0, -0.15625 / s, 0.0, 0.0, 0.34375 / s]]
    torch.testing.assert_close(adv, t(expected))


def test_reinforce_plus_plus_batch():
    rewards = t([[0.0, 0.0, 1.0], [0.0, 3.0, 0.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_advantage("reinforce_plus_plus", rewards, mask, gamma=1.0)
    torch.testing.assert_close(ret, t([[1.0, 1.0, 1.0], [3.0, 3.0, 0.0]]))
    # masked {1,1,1,3,3}: mean 1.8, unbiased var 4.8 / 4 = 1.2
    s = math.sqrt(1.2 + 1e-8)
    expected = [[(1 - 1.8) / s] * 3, [(3 - 1.8) / s, (3 - 1.8) / s, 0.0]]
    torch.testing.assert_close(adv, t(expected))


def test_remax():
    rewards = t([[0.0, 0.0, 1.0, 5.0], [1.0, 2.0, 3.0, 4.0]])
    mask = t([[1, 1, 1, 0], [1, 0, 1, 1]])
    baselines = t([0.4, 2.0])
    adv, ret = compute_remax_outcome_advantage(rewards, mask, reward_baselines=baselines)
    # masked rewards [0,0,1,0] / [1,0,3,4], reverse cumsum:
    torch.testing.assert_close(ret, t([[1.0, 1.0, 1.0, 0.0], [8.0, 7.0, 7.0, 4.0]]))
    # baseline subtracted only on mask-1 tokens, no whitening
    torch.testing.assert_close(adv, t([[0.6, 0.6, 0.6, 0.0], [6.0, 7.0, 5.0, 2.0]]))
    adv2, _ = compute_advantage("remax", rewards, mask, reward_baselines=baselines)
    torch.testing.assert_close(adv2, adv)


def test_estimators_do_not_track_grad():
    rewards = t([[0.0, 1.0]]).requires_grad_(True)
    values = t([[0.1, 0.2]]).requires_grad_(True)
    mask = t([[1, 1]])
    adv, ret = compute_advantage("gae", rewards, mask, values=values)
    assert not adv.requires_grad and not ret.requires_grad
