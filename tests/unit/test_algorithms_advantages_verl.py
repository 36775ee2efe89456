"""verl 0.9.1's estimators gpg, opo, grpo_passk, gdpo, grpo_vectorized, rloo_vectorized, optimal_token_baseline and
tir_optimal_token_baseline: values by hand (or by a few lines of Python from the paper's formula) on rows with
multi-turn gaps and groups of one, in float32 and float64, through ``compute_advantage`` as the driver calls it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hybridflow.algorithms import ADVANTAGE_ESTIMATORS, compute_advantage
from tests.numerics import assert_close

DTYPES = (torch.float32, torch.float64)
# group a: rows 0-2 (row 1 splits its reward over two tokens), b: rows 3-4, c: row 5 alone;
# rows 0 and 3 have a gap (a mask-0 token inside the response)
MASK = [[1, 1, 0, 1], [1, 1, 1, 1], [1, 0, 0, 0], [1, 0, 1, 0], [1, 1, 1, 0], [1, 1, 0, 0]]
REWARDS = [[0, 0, 0, 1.0], [0, 0.5, 0, 0.5], [0, 0, 0, 0], [0, 0, 0.5, 0], [0, 0, 0, 0], [0, 2.0, 0, 0]]
SCORES = [1.0, 1.0, 0.0, 0.5, 0.0, 2.0]
INDEX = np.array(["a", "a", "a", "b", "b", "c"], dtype=object)


def inputs(dtype):
    return torch.tensor(REWARDS, dtype=dtype), torch.tensor(MASK, dtype=dtype)


def per_row(values, dtype):
    return torch.tensor([[v * m for m in row] for v, row in zip(values, MASK)], dtype=dtype)


def check(name, expected_rows, dtype, **kw):
    rewards, mask = inputs(dtype)
    adv, ret = compute_advantage(name, rewards, mask, **kw)
    assert adv.dtype == ret.dtype == dtype
    assert_close(adv, per_row(expected_rows, dtype), dtype=dtype, what=f"{name} advantages")
    return adv, ret


def group_stats(values, index):
    """{group: (mean, N-1 std)}; a group of one: (0, 1), as GRPO."""
    groups = {}
    for v, g in zip(values, index):
        groups.setdefault(g, []).append(v)
    out = {}
    for g, vs in groups.items():
        if len(vs) == 1:
            out[g] = (0.0, 1.0)
        else:
            m = sum(vs) / len(vs)
            out[g] = (m, math.sqrt(sum((v - m) ** 2 for v in vs) / (len(vs) - 1)))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpg(dtype):
    # 4 of 6 rows have a nonzero score: alpha = 6/4; group means a 2/3, b 1/4, c (alone) 0; no std division
    alpha = 1.5
    check("gpg", [alpha * (1 - 2 / 3), alpha * (1 - 2 / 3), alpha * (0 - 2 / 3), alpha * 0.25, -alpha * 0.25,
                  alpha * 2.0], dtype, index=INDEX)


@pytest.mark.parametrize("dtype", DTYPES)
def test_opo_length_weighted_baseline(dtype):
    # valid lengths (gaps not counted): a 3, 4, 1 -> baseline (3*1 + 4*1 + 1*0) / 8; b 2, 3 -> (2*0.5) / 5
    check("opo", [1 - 7 / 8, 1 - 7 / 8, -7 / 8, 0.5 - 0.2, -0.2, 2.0], dtype, index=INDEX)


PASSK_INDEX = np.array(["a", "a", "a", "b", "b", "b"], dtype=object)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_only_the_best_row(dtype, norm):
    # group a: scores 1, 1, 0 (tie at the top: r_max - r_second = 0); group b: 0.5, 0, 2 -> row 5 gets 2 - 0.5
    std_b = group_stats(SCORES[3:], "bbb")["b"][1]
    best = 1.5 / (std_b + 1e-6) if norm else 1.5
    check("grpo_passk", [0, 0, 0, 0, 0, best], dtype, index=PASSK_INDEX, norm_adv_by_std_in_grpo=norm)


def test_grpo_passk_rejects_a_group_of_one():
    with pytest.raises(ValueError, match="at least 2 samples per group"):
        compute_advantage("grpo_passk", *inputs(torch.float64), index=INDEX)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rloo_vectorized_zero_for_a_group_of_one(dtype):
    # (k s - group sum) / (k - 1): a: k 3, sum 2; b: k 2, sum 0.5; c alone: 0 (rloo would keep its score 2)
    check("rloo_vectorized", [0.5, 0.5, -1.0, 0.5, -0.5, 0.0], dtype, index=INDEX)
    rloo, _ = compute_advantage("rloo", *inputs(dtype), index=INDEX)
    assert float(rloo[5, 0]) == 2.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_grpo_vectorized_is_grpo_with_std_always_on(dtype):
    rewards, mask = inputs(dtype)
    grpo, _ = compute_advantage("grpo", rewards, mask, index=INDEX, norm_adv_by_std_in_grpo=True)
    for norm in (True, False):  # verl's driver never passes the flag to grpo_vectorized
        vec, _ = compute_advantage("grpo_vectorized", rewards, mask, index=INDEX, norm_adv_by_std_in_grpo=norm)
        assert torch.equal(vec, grpo)


def _gdpo_reference(components, weights, index):
    """GDPO by its formula: each component GRPO-normalized in its group, weighted sum per row, broadcast to the
    valid tokens and whitened over all of them: verl's masked_whiten, mean = sum / (n + 1e-8), variance the
    same mean of squares times n / (n - 1), then (x - mean) / sqrt(var + 1e-8)."""
    total = [0.0] * len(index)
    for comp, w in zip(components, weights):
        stats = group_stats(comp, index)
        for i, (v, g) in enumerate(zip(comp, index)):
            m, s = stats[g]
            total[i] += w * (v - m) / (s + 1e-6)
    tokens = [total[i] for i, row in enumerate(MASK) for m in row if m]
    n = len(tokens)
    mean = sum(tokens) / (n + 1e-8)
    var = sum((t - mean) ** 2 for t in tokens) / (n + 1e-8) * n / (n - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in total]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gdpo_normalizes_each_component_then_whitens(dtype):
    fmt, acc = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    components = {"fmt": np.array(fmt, dtype=object), "acc": np.array(acc, dtype=object)}  # batch columns
    check("gdpo", _gdpo_reference([fmt, acc], [1.0, 0.5], INDEX), dtype, index=INDEX, reward_components=components,
          reward_weights=[1.0, 0.5])
    check("gdpo", _gdpo_reference([fmt, acc], [1.0, 1.0], INDEX), dtype, index=INDEX, reward_components=components)
    # without components (verl's fallback): the row score is the one component; std normalization always on
    check("gdpo", _gdpo_reference([SCORES], [1.0], INDEX), dtype, index=INDEX, norm_adv_by_std_in_grpo=False)


def test_gdpo_weights_must_match_components():
    with pytest.raises(ValueError, match="2 reward weights for 1 reward components"):
        compute_advantage("gdpo", *inputs(torch.float64), index=INDEX, reward_components={"x": [0.0] * 6},
                          reward_weights=[1.0, 2.0])


# ---- optimal token baselines -------------------------------------------------------------------------


def _otb_reference(rewards, mask, pi, sum_pi2, index, rho=None, zero_tail=True, eps=1e-8):
    """B_t = sum_i G_i,t W_i,t / (sum_i W_i,t + eps) over the valid rows of a group at position t, with
    W_t = sum_{j<=t} (1 - 2 pi_j + sum pi^2) rho_j^2 over valid j; A = (G - B) * mask."""
    B, T = len(rewards), len(rewards[0])
    G = [[sum(rewards[i][k] * mask[i][k] for k in range(t, T)) for t in range(T)] for i in range(B)]
    W = []
    for i in range(B):
        acc, row = 0.0, []
        for t in range(T):
            w = (1 - 2 * pi[i][t] + sum_pi2[i][t]) * (1.0 if rho is None else rho[i][t] ** 2)
            acc += w * mask[i][t]
            row.append(acc)
        W.append(row)
    base = [[0.0] * T for _ in range(B)]
    for g in set(index):
        rows = [i for i in range(B) if index[i] == g]
        if len(rows) == 1:
            continue
        for t in range(T):
            num = sum(G[i][t] * W[i][t] * mask[i][t] for i in rows)
            den = sum(W[i][t] * mask[i][t] for i in rows) + eps
            for i in rows:
                base[i][t] = num / den
        lengths = sorted(sum(mask[i]) for i in rows)
        longest = [i for i in rows if sum(mask[i]) == lengths[-1]]
        if zero_tail and len(longest) == 1 and lengths[-1] > lengths[-2]:
            for t in range(int(lengths[-2]), T):
                base[longest[0]][t] = 0.0
    return [[(G[i][t] - base[i][t]) * mask[i][t] for t in range(T)] for i in range(B)], G


def _otb_inputs(dtype):
    g = torch.Generator().manual_seed(0)
    pi = torch.rand(6, 4, generator=g, dtype=torch.float64) * 0.9 + 0.05
    sum_pi2 = pi ** 2 + torch.rand(6, 4, generator=g, dtype=torch.float64) * 0.1
    rho = torch.rand(6, 4, generator=g, dtype=torch.float64) + 0.5
    return torch.log(pi).to(dtype), sum_pi2.to(dtype), rho.to(dtype)


def test_otb_by_hand():
    """Two rows of one group with equal w = 1 - 2 * 0.5 + 0.5 = 0.5 per token, and a row alone:
    G = (1, 1, 1) and (2, 2, 0); B_0 = (1 * 0.5 + 2 * 0.5) / 1, B_1 = (1 * 1 + 2 * 1) / 2, B_2 = 1 * 1.5 / 1.5
    (row 1 is done); row 0 is the one longest, so its baseline is 0 from position 2 (row 1's length) on."""
    rewards = torch.tensor([[0, 0, 1.0], [0, 2.0, 0], [0, 3.0, 0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0]], dtype=torch.float64)
    old = torch.full((3, 3), math.log(0.5), dtype=torch.float64)
    kw = dict(index=["g", "g", "alone"], old_log_probs=old, sum_pi_squared=torch.full((3, 3), 0.5, dtype=torch.float64))
    adv, ret = compute_advantage("optimal_token_baseline", rewards, mask, **kw)
    eps = 1e-8
    expected = [[1 - 1.5 / (1 + eps), 1 - 3 / (2 + eps), 1.0], [2 - 1.5 / (1 + eps), 2 - 3 / (2 + eps), 0.0],
                [3.0, 3.0, 0.0]]  # the row alone: advantage = return
    assert_close(adv, torch.tensor(expected, dtype=torch.float64), dtype=torch.float64)
    assert_close(ret, torch.tensor([[1.0, 1, 1], [2, 2, 0], [3, 3, 0]], dtype=torch.float64), dtype=torch.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_rho", [False, True])
def test_otb_matches_its_formula(dtype, with_rho):
    rewards, mask = inputs(dtype)
    old, sum_pi2, rho = _otb_inputs(dtype)
    kw = dict(index=INDEX, old_log_probs=old, sum_pi_squared=sum_pi2, rollout_is_weights=rho if with_rho else None)
    adv, ret = compute_advantage("optimal_token_baseline", rewards, mask, **kw)
    exp_adv, exp_ret = _otb_reference(rewards.tolist(), MASK, torch.exp(old).tolist(), sum_pi2.tolist(), list(INDEX),
                                      rho.tolist() if with_rho else None)
    assert adv.dtype == ret.dtype == dtype
    assert_close(adv, torch.tensor(exp_adv, dtype=torch.float64), dtype=dtype, what="OTB advantages")
    assert_close(ret, torch.tensor(exp_ret, dtype=torch.float64), dtype=dtype, what="OTB returns")


@pytest.mark.parametrize("dtype", DTYPES)
def test_tir_otb_is_otb_over_the_generated_tokens(dtype):
    """With the gaps removed (each row's valid tokens packed to the left), the multi-turn estimator is the
    position-wise one; its advantages land back on the valid positions. Row 4 has no valid token: it takes no
    part, so group b is left with one row (no baseline)."""
    mask_rows = [r[:] for r in MASK]
    mask_rows[4] = [0, 0, 0, 0]
    rewards, _ = inputs(dtype)
    mask = torch.tensor(mask_rows, dtype=dtype)
    old, sum_pi2, rho = _otb_inputs(dtype)
    adv, ret = compute_advantage("tir_optimal_token_baseline", rewards, mask, index=INDEX, old_log_probs=old,
                                 sum_pi_squared=sum_pi2, rollout_is_weights=rho)
    # W and G accumulate over the original positions, then are packed: the reference packs them the same way
    exp_adv_full, exp_ret = _otb_reference(rewards.tolist(), mask_rows, torch.exp(old).tolist(), sum_pi2.tolist(),
                                           list(INDEX), rho.tolist(), zero_tail=False)
    assert_close(ret, torch.tensor(exp_ret, dtype=torch.float64), dtype=dtype, what="returns")
    G = [[g_ for g_, m in zip(row, mrow) if m] for row, mrow in zip(exp_ret, mask_rows)]
    W = []
    for i, mrow in enumerate(mask_rows):
        acc, row = 0.0, []
        for t, m in enumerate(mrow):
            acc += (1 - 2 * math.exp(old[i, t].item()) + sum_pi2[i, t].item()) * rho[i, t].item() ** 2 * m
            if m:
                row.append(acc)
        W.append(row)
    width = max(map(len, G))
    live = [i for i in range(6) if G[i]]
    expected = torch.zeros(6, 4, dtype=torch.float64)
    for g in set(INDEX):
        rows = [i for i in live if INDEX[i] == g]
        for i in rows:
            cols = [t for t in range(4) if mask_rows[i][t]]
            for k, t in enumerate(cols):
                if len(rows) == 1:
                    expected[i, t] = G[i][k]
                    continue
                num = sum(G[j][k] * W[j][k] for j in rows if k < len(G[j]))
                den = sum(W[j][k] for j in rows if k < len(W[j])) + 1e-8
                lengths = sorted(len(G[j]) for j in rows)
                longest = [j for j in rows if len(G[j]) == lengths[-1]]
                zero = len(longest) == 1 and i == longest[0] and lengths[-1] > lengths[-2] and k >= lengths[-2]
                expected[i, t] = G[i][k] - (0.0 if zero else num / den)
    assert width == 4 and adv.dtype == dtype
    assert_close(adv, expected, dtype=dtype, what="TIR OTB advantages")
    # without gaps the two estimators agree
    full = torch.ones(6, 4, dtype=dtype)
    kw = dict(index=INDEX, old_log_probs=old, sum_pi_squared=sum_pi2)
    assert_close(compute_advantage("tir_optimal_token_baseline", rewards, full, **kw)[0],
                 compute_advantage("optimal_token_baseline", rewards, full, **kw)[0], dtype=dtype)


def test_otb_requires_its_inputs():
    with pytest.raises(ValueError, match="requires `old_log_probs`"):
        compute_advantage("optimal_token_baseline", *inputs(torch.float64), index=INDEX)


def test_every_verl_estimator_is_registered():
    assert set(ADVANTAGE_ESTIMATORS.names()) >= {
        "gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "rloo", "opo", "grpo_passk",
        "gpg", "rloo_vectorized", "grpo_vectorized", "optimal_token_baseline", "tir_optimal_token_baseline", "gdpo"}
