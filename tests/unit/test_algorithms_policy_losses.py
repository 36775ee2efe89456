"""verl 0.9.1's policy losses beyond vanilla (gspo, sapo, gpg, geo_mean, dro, cispo, dppo_tv, dppo_kl, clip_cov,
kl_cov, reinforce): each against a per-token re-derivation from its paper's formula in plain Python floats, on rows with
a multi-turn gap (a mask-0 token inside a response, holding values that must not count) and a one-token
row, in float32 and float64; plus values of verl's own functions, micro-batch independence and rollout
correction's IS weights (``rollout_is_weights``) applied where verl 0.9.1 applies them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hybridflow.algorithms import POLICY_LOSSES, GlobalBatch
from hybridflow.config.schema import Actor, PolicyLoss
from tests.numerics import assert_close

# Three rows of 4 tokens: row 0 has a gap at position 2, row 2 is one token. Log-ratios (log pi - log pi_old)
# span both sides of the clip range; the gap holds a large log-ratio and advantage that must be ignored.
OLD = [[-1.0, -0.5, -2.0, -0.3], [-0.8, -1.5, -0.2, -1.0], [-2.5, -0.4, -1.2, -0.9]]
LOG_RATIO = [[math.log(1.5), math.log(0.5), 0.7, math.log(1.1)], [math.log(0.7), math.log(1.3), 0.1, 0.0],
             [math.log(3.0), -0.3, 0.1, 0.4]]
ADV = [[1.0, 1.0, 5.0, 1.0], [-0.5, -0.5, -0.5, -0.5], [2.0, 2.0, 2.0, 2.0]]
MASK = [[1, 1, 0, 1], [1, 1, 1, 0], [1, 0, 0, 0]]
LOW, HIGH = 0.2, 0.28
N = sum(map(sum, MASK))  # 7 valid tokens
N_METRIC = N + 1e-8  # metrics are verl's masked_mean: sum / (count + 1e-8)
DTYPES = (torch.float32, torch.float64)
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def config(**policy_loss):
    return Actor(clip_ratio_low=LOW, clip_ratio_high=HIGH, policy_loss=PolicyLoss(**policy_loss))


def tensors(dtype):
    old = torch.tensor(OLD, dtype=dtype)
    log_prob = (old + torch.tensor(LOG_RATIO, dtype=dtype)).requires_grad_(True)
    return old, log_prob, torch.tensor(ADV, dtype=dtype), torch.tensor(MASK, dtype=torch.bool)


def tokens(old, log_prob, adv):
    """Per valid token (row, old log-prob, log-prob, advantage) as Python floats, from the tensors' values."""
    o, lp, a = old.tolist(), log_prob.detach().tolist(), adv.tolist()
    return [(i, o[i][j], lp[i][j], a[i][j]) for i in range(3) for j in range(4) if MASK[i][j]]


def aggregate(per_token, mode):
    """verl's loss_agg_mode, by hand: per_token is [(row, loss)] over valid tokens."""
    rows = {}
    for i, v in per_token:
        rows.setdefault(i, []).append(v)
    if mode == "token-mean":
        return sum(v for _, v in per_token) / len(per_token)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows.values()) / len(rows)
    return sum(sum(r) / len(r) for r in rows.values()) / len(rows)


def weights(mode):
    """d loss / d (per-token loss) of each valid token under ``mode``."""
    lengths = [sum(r) for r in MASK]
    n = sum(lengths)
    return {(i, j): (1 / n if mode == "token-mean" else 1 / 3 if mode == "seq-mean-token-sum" else 1 / (3 * lengths[i]))
            for i in range(3) for j in range(4) if MASK[i][j]}


def grad_matrix(per_token_grad, mode, dtype):
    """The expected gradient wrt log_prob: d(per-token loss)/d(log pi) times the aggregation weight."""
    w = weights(mode)
    g = torch.zeros(3, 4, dtype=torch.float64)
    for (i, j), d in per_token_grad.items():
        g[i, j] = d * w[(i, j)]
    return g


def run(mode, dtype, agg="token-mean", cfg=None):
    old, log_prob, adv, mask = tensors(dtype)
    loss, metrics = POLICY_LOSSES.get(mode)(old, log_prob, adv, mask, loss_agg_mode=agg, config=cfg)
    loss.backward()
    assert loss.dtype == dtype and all(v.dtype == dtype and v.dim() == 0 for v in metrics.values())
    return loss, metrics, log_prob.grad, tokens(old, log_prob, adv)


def clip(x, lo, hi):
    return min(max(x, lo), hi)


def token_grads(toks, fn):
    """{(row, col): fn(old, log_prob, adv)} over valid tokens (cols recovered from MASK order)."""
    cols = [(i, j) for i in range(3) for j in range(4) if MASK[i][j]]
    return {c: fn(o, lp, a) for c, (_, o, lp, a) in zip(cols, toks)}


# ---- token-level losses -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("agg", AGG_MODES)
def test_gpg_is_plain_policy_gradient(dtype, agg):
    loss, metrics, grad, toks = run("gpg", dtype, agg, config())
    assert_close(loss, aggregate([(i, -lp * a) for i, o, lp, a in toks], agg), dtype=dtype, what="gpg loss")
    assert_close(grad, grad_matrix(token_grads(toks, lambda o, lp, a: -a), agg, dtype), dtype=dtype, what="gpg grad")
    assert metrics == {}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("agg", AGG_MODES)
def test_cispo_clipped_detached_weight(dtype, agg):
    loss, metrics, grad, toks = run("cispo", dtype, agg, config())
    weight = lambda o, lp: clip(math.exp(lp - o), 1 - LOW, 1 + HIGH)  # noqa: E731
    assert_close(loss, aggregate([(i, -weight(o, lp) * a * lp) for i, o, lp, a in toks], agg), dtype=dtype,
                 what="cispo loss")
    # every token keeps a gradient, scaled by its clipped (constant) weight
    assert_close(grad, grad_matrix(token_grads(toks, lambda o, lp, a: -weight(o, lp) * a), agg, dtype), dtype=dtype,
                 what="cispo grad")
    # ratios 1.5, 0.5, 1.1 | 0.7, 1.3, 1.105 | 3.0: 5 outside [0.8, 1.28]
    assert_close(metrics["pg_clipfrac"], 5 / N_METRIC, dtype=dtype)
    assert_close(metrics["ppo_kl"], -sum(lp - o for _, o, lp, _ in toks) / N_METRIC, dtype=dtype)
    assert float(metrics["pg_clipfrac_lower"]) == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_dro_quadratic_penalty(dtype):
    beta = 0.5
    loss, metrics, grad, toks = run("dro", dtype, "token-mean", config(loss_mode="dro", dro_beta=beta))
    expected = aggregate([(i, -(lp * a - 0.5 * beta * (lp - o) ** 2)) for i, o, lp, a in toks], "token-mean")
    assert_close(loss, expected, dtype=dtype, what="dro loss")
    assert_close(grad, grad_matrix(token_grads(toks, lambda o, lp, a: -(a - beta * (lp - o))), "token-mean", dtype),
                 dtype=dtype, what="dro grad")
    assert set(metrics) == {"ppo_kl"}


def test_dro_requires_beta():
    with pytest.raises(ValueError, match="dro_beta must be a positive value"):
        run("dro", torch.float64, cfg=config())


def _dppo_reference(toks, divergence, low, high, c):
    per_token, grads, dropped, truncated = [], {}, 0, 0
    cols = [(i, j) for i in range(3) for j in range(4) if MASK[i][j]]
    for (i, j), (_, o, lp, a) in zip(cols, toks):
        p, q = math.exp(lp), math.exp(o)
        if divergence == "tv":
            keep = p - q <= high if a > 0 else p - q >= -low
        else:
            kl = q * (o - lp) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
            keep = (kl <= high or p <= q) if a > 0 else (kl <= low or p >= q)
        r = math.exp(lp - o)
        w = min(r, c) if keep else 0.0
        per_token.append((i, -a * w * lp))
        grads[(i, j)] = -a * w
        dropped += not keep
        truncated += keep and r > c
    return per_token, grads, dropped, truncated


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("divergence", ["tv", "kl"])
def test_dppo_drops_tokens_beyond_the_divergence_threshold(dtype, divergence):
    low, high, c = (0.1, 0.17, 2.5) if divergence == "tv" else (0.03, 0.1, 2.5)
    cfg = Actor(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c)
    loss, metrics, grad, toks = run(f"dppo_{divergence}", dtype, "token-mean", cfg)
    per_token, grads, dropped, truncated = _dppo_reference(toks, divergence, low, high, c)
    assert 0 < dropped < N and truncated == 1  # both branches and the truncation are exercised
    assert_close(loss, aggregate(per_token, "token-mean"), dtype=dtype, what="dppo loss")
    assert_close(grad, grad_matrix(grads, "token-mean", dtype), dtype=dtype, what="dppo grad")
    assert_close(metrics["pg_clipfrac"], dropped / N_METRIC, dtype=dtype)
    assert_close(metrics["pg_clipfrac_lower"], truncated / N_METRIC, dtype=dtype)


def test_dppo_truncation_defaults_to_clip_ratio_c():
    """verl reads config.get("clip_ratio_c", 20.0), but its ActorConfig always has clip_ratio_c (3.0): a
    ratio of 5 is truncated at 3 with the actor config's default, at 20 (not at all) without the key."""
    old = torch.tensor([[-2.0]], dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    for cfg, weight in ((Actor(clip_ratio_low=1.0, clip_ratio_high=1.0), 3.0),
                        (SimpleNamespace(clip_ratio_low=1.0, clip_ratio_high=1.0), 5.0)):
        log_prob = (old + math.log(5.0)).requires_grad_(True)
        loss, _ = POLICY_LOSSES.get("dppo_tv")(old, log_prob, torch.ones(1, 1, dtype=torch.float64), mask, config=cfg)
        loss.backward()
        assert_close(log_prob.grad[0, 0], -weight, dtype=torch.float64, what=f"weight {weight}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_sapo_gate_ignores_loss_agg_mode(dtype):
    tau_pos, tau_neg = 1.0, 1.05  # verl's defaults, and a config without them takes those

    def gate(o, lp, a):
        tau = tau_pos if a > 0 else tau_neg
        return 1 / (1 + math.exp(-tau * (math.exp(lp - o) - 1))) * 4 / tau

    def dgate(o, lp, a):  # d/d log pi of -A * gate
        tau = tau_pos if a > 0 else tau_neg
        r = math.exp(lp - o)
        s = 1 / (1 + math.exp(-tau * (r - 1)))
        return -a * 4 * s * (1 - s) * r

    for agg in AGG_MODES:
        loss, metrics, grad, toks = run("sapo", dtype, agg, config())
        assert_close(loss, aggregate([(i, -gate(o, lp, a) * a) for i, o, lp, a in toks], "seq-mean-token-mean"),
                     dtype=dtype, what=f"sapo loss ({agg} ignored)")
        assert_close(grad, grad_matrix(token_grads(toks, dgate), "seq-mean-token-mean", dtype), dtype=dtype,
                     what="sapo grad")
    other = run("sapo", dtype, cfg=SimpleNamespace(tau_pos=2.0, tau_neg=3.0))[0]
    tau_pos, tau_neg = 2.0, 3.0
    assert_close(other, aggregate([(i, -gate(o, lp, a) * a) for i, o, lp, a in toks], "seq-mean-token-mean"),
                 dtype=dtype, what="sapo with tau_pos/tau_neg")


# ---- sequence-level ratios ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("agg", AGG_MODES)
def test_gspo_sequence_ratio(dtype, agg):
    loss, metrics, grad, toks = run("gspo", dtype, agg, config())
    seq = {}
    for i, o, lp, a in toks:
        seq.setdefault(i, []).append(lp - o)
    s = {i: math.exp(min(sum(v) / len(v), 10.0)) for i, v in seq.items()}  # geometric mean of the row's ratios
    per_token, grads, clipped = [], {}, 0
    cols = [(i, j) for i in range(3) for j in range(4) if MASK[i][j]]
    for (i, j), (_, o, lp, a) in zip(cols, toks):
        unclipped, clipped_loss = -a * s[i], -a * clip(s[i], 1 - LOW, 1 + HIGH)
        per_token.append((i, max(unclipped, clipped_loss)))
        # d/dlog pi_t of -A * sg[s_i] * pi_t / sg[pi_t] is -A * s_i (0 where the clipped branch wins)
        grads[(i, j)] = -a * s[i] if unclipped >= clipped_loss else 0.0
        clipped += clipped_loss > unclipped
    assert 0 < clipped < N
    assert_close(loss, aggregate(per_token, agg), dtype=dtype, what="gspo loss")
    assert_close(grad, grad_matrix(grads, agg, dtype), dtype=dtype, what="gspo grad")
    assert_close(metrics["pg_clipfrac"], clipped / N_METRIC, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_geo_mean_one_value_per_sequence(dtype):
    rows = {}
    for agg in AGG_MODES:  # loss_agg_mode is ignored
        loss, metrics, grad, toks = run("geo_mean", dtype, agg, config())
        for i, o, lp, a in toks:
            rows.setdefault(i, []).append((lp - o, a))
        expected, grads = 0.0, torch.zeros(3, 4, dtype=torch.float64)
        for i, v in rows.items():
            # pessimistic one-sided clip of each log-ratio: capped above at +HIGH for A > 0, below at -LOW for A < 0
            clipped = [min(lr, HIGH) if a > 0 else max(lr, -LOW) if a < 0 else 0.0 for lr, a in v]
            ratio = math.exp(sum(clipped) / len(v))
            mean_adv = sum(a for _, a in v) / len(v)
            expected += -mean_adv * ratio / 3
            cols = [j for j in range(4) if MASK[i][j]]
            for j, c, (lr, _) in zip(cols, clipped, v):
                grads[i, j] = -mean_adv * ratio / len(v) / 3 if c == lr else 0.0
        rows.clear()
        assert_close(loss, expected, dtype=dtype, what=f"geo_mean loss ({agg})")
        assert_close(grad, grads, dtype=dtype, what="geo_mean grad")
    # log-ratios outside [-0.2, 0.28]: with A > 0 ratios 1.5, 0.5 (row 0) and 3.0 (row 2); with A < 0 0.7 (row 1)
    assert_close(metrics["pg_clipfrac"], 3 / N_METRIC, dtype=dtype)
    assert_close(metrics["pg_clipfrac_lower"], 1 / N_METRIC, dtype=dtype)


# ---- covariance-selected tokens -----------------------------------------------------------------------


def _covariances(toks):
    mean_a = sum(a for *_, a in toks) / len(toks)
    mean_lp = sum(lp for _, _, lp, _ in toks) / len(toks)
    return [(a - mean_a) * (lp - mean_lp) for _, _, lp, a in toks]


def _ppo(o, lp, a):
    r = math.exp(lp - o)
    return max(-a * r, -a * clip(r, 1 - LOW, 1 + HIGH))


@pytest.mark.parametrize("dtype", DTYPES)
def test_kl_cov_penalizes_the_top_covariance_tokens(dtype):
    coef = 0.3
    loss, metrics, grad, toks = run("kl_cov", dtype, "token-mean", config(kl_cov_ratio=0.34, ppo_kl_coef=coef))
    cov = _covariances(toks)
    top = sorted(range(N), key=lambda k: -cov[k])[: int(N * 0.34)]  # 2 tokens
    assert len(top) == 2 and cov[top[1]] > sorted(cov)[-3]  # no tie at the cut
    per_token = [(i, -a * math.exp(lp - o) + (coef * abs(lp - o) if k in top else 0.0))
                 for k, (i, o, lp, a) in enumerate(toks)]
    assert_close(loss, aggregate(per_token, "token-mean"), dtype=dtype, what="kl_cov loss")
    grads = {}
    cols = [(i, j) for i in range(3) for j in range(4) if MASK[i][j]]
    for k, ((i, j), (_, o, lp, a)) in enumerate(zip(cols, toks)):
        grads[(i, j)] = -a * math.exp(lp - o) + (coef * math.copysign(1.0, lp - o) if k in top else 0.0)
    assert_close(grad, grad_matrix(grads, "token-mean", dtype), dtype=dtype, what="kl_cov grad")
    # verl's kl_cov reports the mean |log r| as ppo_kl
    assert_close(metrics["ppo_kl"], sum(abs(lp - o) for _, o, lp, _ in toks) / N_METRIC, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_clip_cov_cuts_the_gradient_of_tokens_in_the_covariance_band(dtype):
    old, log_prob, adv, mask = tensors(dtype)
    toks = tokens(old, log_prob, adv)
    cov = _covariances(toks)
    lb, ub = -0.2, 0.35
    in_band = [k for k, (c, (_, o, lp, a)) in enumerate(zip(cov, toks))
               if lb < c < ub and -a * math.exp(lp - o) >= -a * clip(math.exp(lp - o), 1 - LOW, 1 + HIGH)]
    assert len(in_band) == 2
    cols = [(i, j) for i in range(3) for j in range(4) if MASK[i][j]]
    # a ratio above the number of candidates: all of them are cut, no randomness
    loss, metrics, grad, _ = run("clip_cov", dtype, "token-mean",
                                 config(clip_cov_ratio=1.0, clip_cov_lb=lb, clip_cov_ub=ub))
    per_token = [(i, 0.0 if k in in_band else _ppo(o, lp, a)) for k, (i, o, lp, a) in enumerate(toks)]
    assert_close(loss, aggregate(per_token, "token-mean"), dtype=dtype, what="clip_cov loss")
    assert all(grad[cols[k]] == 0 for k in in_band)
    assert_close(metrics["pg_clipfrac"], len(in_band) / N_METRIC, dtype=dtype)
    # max(int(ratio * 7), 1) = 1 token, drawn at random among the candidates
    torch.manual_seed(0)
    _, metrics, grad, _ = run("clip_cov", dtype, "token-mean",
                              config(clip_cov_ratio=0.2, clip_cov_lb=lb, clip_cov_ub=ub))
    cut = [k for k in range(N) if grad[cols[k]] == 0]
    assert_close(metrics["pg_clipfrac"], 1 / N_METRIC, dtype=dtype)
    assert len(set(cut) & set(in_band)) == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("agg", AGG_MODES)
def test_reinforce_is_weighted_log_prob_gradient(dtype, agg):
    """verl's compute_policy_loss_reinforce: -A log pi (times the caller's detached weights), no ratio; its
    ppo_kl is the mean of log pi_old - log pi (pi_old: the rollout's)."""
    loss, metrics, grad, toks = run("reinforce", dtype, agg, config())
    assert_close(loss, aggregate([(i, -a * lp) for i, o, lp, a in toks], agg), dtype=dtype, what="reinforce loss")
    assert_close(grad, grad_matrix(token_grads(toks, lambda o, lp, a: -a), agg, dtype), dtype=dtype,
                 what="reinforce grad")
    assert_close(metrics["ppo_kl"], sum(o - lp for _, o, lp, _ in toks) / N_METRIC, dtype=dtype, what="ppo_kl")
    loss, grad, toks = run_weighted("reinforce", dtype, agg, torch.tensor(IS_WEIGHTS, dtype=dtype))
    w = _valid_weights()
    assert_close(loss, aggregate([(i, -a * lp * w[k]) for k, (i, o, lp, a) in enumerate(toks)], agg), dtype=dtype,
                 what="weighted reinforce loss")


_VERL = json.loads((Path(__file__).parents[1] / "fixtures" / "verl" / "rollout_corr_metrics.json").read_text())
VERL_LOSSES, VERL_FIXTURE_INPUTS = _VERL["losses"], _VERL["inputs"]


@pytest.mark.parametrize("case", VERL_LOSSES["reinforce"], ids=lambda c: f"{c['loss_agg_mode']}-{c['with_weights']}")
def test_reinforce_values_of_verl(case):
    """verl 0.9.1's own compute_policy_loss_reinforce (tests/fixtures/verl/make_rollout_corr_metrics.py), as its
    actor calls it (bool mask), with and without IS weights, for every loss_agg_mode."""
    x = {k: torch.tensor(v, dtype=torch.float64) for k, v in VERL_FIXTURE_INPUTS.items()}
    weights = torch.tensor(VERL_LOSSES["reinforce_weights"], dtype=torch.float64) if case["with_weights"] else None
    loss, metrics = POLICY_LOSSES.get("reinforce")(
        x["rollout_log_prob"], x["old_log_prob"], x["advantages"], x["response_mask"].bool(),
        loss_agg_mode=case["loss_agg_mode"], config=config(), rollout_is_weights=weights,
        global_batch=GlobalBatch(loss_scale_factor=VERL_LOSSES["loss_scale_factor"]))
    assert_close(loss, case["loss"], dtype=torch.float64, what="reinforce loss")
    # float32: verl's masked_mean of a bool mask divides by an int64 count + 1e-8, a float32
    assert_close(metrics["ppo_kl"], case["metrics"]["actor/ppo_kl"], dtype=torch.float32, what="ppo_kl")


# ---- verl's own numbers, micro-batch independence, dispatch ------------------------------------------

# verl 0.9.1's functions (core_algos.py, loaded with torch only in a scratch interpreter) on this file's
# batch in float64 with a bool mask, clip 0.2/0.28, dro_beta 0.5, token-mean; loss values:
VERL_FLOAT64 = {
    "gspo": -0.5529741176737187, "sapo": -2.7032635198477184, "gpg": 0.5068559965108023,
    "geo_mean": -1.005975586122331, "dro": 0.5806752815787146, "cispo": 0.6026026221534723,
    "dppo_tv": 1.26532899913512, "dppo_kl": 1.26532899913512,
}


@pytest.mark.parametrize("mode", sorted(VERL_FLOAT64))
def test_values_of_verl(mode):
    loss = run(mode, torch.float64, cfg=config(loss_mode=mode, dro_beta=0.5))[0]
    assert_close(loss, VERL_FLOAT64[mode], dtype=torch.float64, what=mode)


# clip_cov and kl_cov choose tokens by statistics of the micro-batch they see (as verl): not split-independent
SPLIT_INDEPENDENT = ("vanilla", "gspo", "sapo", "gpg", "geo_mean", "dro", "cispo", "dppo_tv", "dppo_kl", "reinforce")


@pytest.mark.parametrize("mode", SPLIT_INDEPENDENT)
@pytest.mark.parametrize("agg", AGG_MODES + ("seq-mean-token-sum-norm",))
def test_micro_batches_sum_to_the_whole(mode, agg):
    """Each micro-batch's loss, normalized by the whole batch's counts, sums (value and gradient) to the
    loss of the whole batch: rows {0}, {1, 2}."""
    cfg = config(loss_mode=mode, dro_beta=0.5)
    old, log_prob, adv, mask = tensors(torch.float64)
    whole, _ = POLICY_LOSSES.get(mode)(old, log_prob, adv, mask, loss_agg_mode=agg, config=cfg)
    (expected,) = torch.autograd.grad(whole, log_prob)
    counts = GlobalBatch.of(mask)
    total = 0
    for rows in (slice(0, 1), slice(1, 3)):
        part, _ = POLICY_LOSSES.get(mode)(old[rows], log_prob[rows], adv[rows], mask[rows], loss_agg_mode=agg,
                                          config=cfg, global_batch=counts)
        total = total + part
    (got,) = torch.autograd.grad(total, log_prob)
    assert_close(total, whole, dtype=torch.float64, what=f"{mode} {agg} loss")
    assert_close(got, expected, dtype=torch.float64, what=f"{mode} {agg} grad")


def test_every_verl_loss_is_registered_with_one_signature():
    assert set(POLICY_LOSSES.names()) == {"vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro",
                                          "cispo", "dppo_tv", "dppo_kl", "bypass_mode", "reinforce"}
    old, log_prob, adv, mask = tensors(torch.float32)
    for mode in set(POLICY_LOSSES.names()) - {"bypass_mode"}:  # bypass_mode: tests/unit/test_rollout_correction.py
        loss, _ = POLICY_LOSSES.get(mode)(old, log_prob, adv, mask, loss_agg_mode="token-mean",
                                          config=config(loss_mode=mode, dro_beta=0.1), global_batch=None)
        assert loss.dim() == 0 and torch.isfinite(loss)


# ---- rollout correction's IS weights (verl: pg_losses * rollout_is_weights before aggregation) ------------

# Truncated IS weights as rollout_correction.is_weights gives them: <= 2, zero on padding; the gap holds 9.0 (as
# the gap's log-ratio and advantage, a value that must not count). Per valid token: 2.0, 0.5, 1.5 | 0.3, 1.0,
# 2.0 | 1.7.
IS_WEIGHTS = [[2.0, 0.5, 9.0, 1.5], [0.3, 1.0, 2.0, 0.0], [1.7, 0.0, 0.0, 0.0]]
TOKEN_LEVEL = sorted(set(SPLIT_INDEPENDENT + ("clip_cov", "kl_cov")) - {"geo_mean"})


def run_weighted(mode, dtype, agg, is_weights):
    old, log_prob, adv, mask = tensors(dtype)
    torch.manual_seed(0)  # clip_cov draws its cut tokens at random (as verl): the same draw with and without
    loss, _ = POLICY_LOSSES.get(mode)(old, log_prob, adv, mask, loss_agg_mode=agg, rollout_is_weights=is_weights,
                                      config=config(loss_mode=mode, dro_beta=0.5, clip_cov_ratio=0.3, kl_cov_ratio=0.3))
    loss.backward()
    return loss, log_prob.grad, tokens(old, log_prob, adv)


@pytest.mark.parametrize("mode", sorted(set(POLICY_LOSSES.names()) - {"bypass_mode"}))
@pytest.mark.parametrize("agg", AGG_MODES)
def test_weights_of_one_give_the_unweighted_loss(mode, agg):
    """Weights 1 on the valid tokens (0 on padding, as rollout correction gives them) change nothing."""
    ones = torch.tensor(MASK, dtype=torch.float64)
    loss, grad, _ = run_weighted(mode, torch.float64, agg, ones)
    plain, plain_grad, _ = run_weighted(mode, torch.float64, agg, None)
    # geo_mean takes log(w + 1e-10), as verl: weights 1 scale the loss by exp(1e-10), above float64's tolerance
    slack = 200 if mode == "geo_mean" else 1
    assert_close(loss, plain, dtype=torch.float64, slack=slack, what=f"{mode} loss, weights 1")
    assert_close(grad, plain_grad, dtype=torch.float64, slack=slack, what=f"{mode} grad, weights 1")


@pytest.mark.parametrize("mode", TOKEN_LEVEL)
def test_token_weights_scale_each_tokens_gradient(mode):
    """A token-level loss times detached weights: each token's gradient is its weight times the unweighted
    one (the token selection of clip_cov/kl_cov is made before the weights, as verl)."""
    w = torch.tensor(IS_WEIGHTS, dtype=torch.float64)
    _, grad, _ = run_weighted(mode, torch.float64, "token-mean", w)
    _, plain_grad, _ = run_weighted(mode, torch.float64, "token-mean", None)
    assert_close(grad, plain_grad * w * torch.tensor(MASK), dtype=torch.float64, what=f"{mode} weighted grad")


def _valid_weights():
    return [IS_WEIGHTS[i][j] for i in range(3) for j in range(4) if MASK[i][j]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("agg", AGG_MODES)
def test_vanilla_weighted_by_hand(dtype, agg):
    loss, _, toks = run_weighted("vanilla", dtype, agg, torch.tensor(IS_WEIGHTS, dtype=dtype))
    per_token = []
    for w, (i, o, lp, a) in zip(_valid_weights(), toks):
        ppo = _ppo(o, lp, a)
        per_token.append((i, w * (min(ppo, -a * 3.0) if a < 0 else ppo)))  # dual clip at clip_ratio_c = 3
    assert_close(loss, aggregate(per_token, agg), dtype=dtype, what="vanilla weighted loss")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("agg", AGG_MODES)
def test_gspo_weighted_by_hand(dtype, agg):
    """GSPO's sequence ratio is clipped per row; the token weights multiply each token's clipped loss."""
    loss, _, toks = run_weighted("gspo", dtype, agg, torch.tensor(IS_WEIGHTS, dtype=dtype))
    seq = {}
    for i, o, lp, _ in toks:
        seq.setdefault(i, []).append(lp - o)
    s = {i: math.exp(sum(v) / len(v)) for i, v in seq.items()}
    per_token = [(i, w * max(-a * s[i], -a * clip(s[i], 1 - LOW, 1 + HIGH)))
                 for w, (i, _, _, a) in zip(_valid_weights(), toks)]
    assert_close(loss, aggregate(per_token, agg), dtype=dtype, what="gspo weighted loss")


@pytest.mark.parametrize("dtype", DTYPES)
def test_geo_mean_weighted_by_the_rows_geometric_mean_weight(dtype):
    """verl: the row's loss times exp(mean over its valid tokens of log w) (the gap's 9.0 does not count)."""
    loss, grad, toks = run_weighted("geo_mean", dtype, "token-mean", torch.tensor(IS_WEIGHTS, dtype=dtype))
    plain, plain_grad, _ = run_weighted("geo_mean", dtype, "token-mean", None)
    rows = {}
    for w, (i, o, lp, a) in zip(_valid_weights(), toks):
        rows.setdefault(i, []).append((lp - o, a, w))
    expected, seq_w = 0.0, torch.zeros(3, 1, dtype=torch.float64)
    for i, v in rows.items():
        clipped = [min(lr, HIGH) if a > 0 else max(lr, -LOW) for lr, a, _ in v]
        # verl's log(w + 1e-10): row 0: (2.0 * 0.5 * 1.5)**(1/3), row 1: 0.6**(1/3), row 2: 1.7
        seq_w[i] = math.exp(sum(math.log(w + 1e-10) for *_, w in v) / len(v))
        expected += -sum(a for _, a, _ in v) / len(v) * math.exp(sum(clipped) / len(v)) * float(seq_w[i]) / 3
    assert_close(loss, expected, dtype=dtype, what="geo_mean weighted loss")
    assert_close(grad, plain_grad * seq_w, dtype=dtype, what="geo_mean weighted grad: row's gradient times its weight")
