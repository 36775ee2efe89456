"""Rollout correction (algorithms/rollout_correction.py): truncated and IcePop IS weights, rejection masks and
the bypass loss against values computed by hand from verl 0.9.1's rollout_corr_helper formulas; the weights
reaching every policy loss; the config checks raised by loading the config."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hybridflow.algorithms import POLICY_LOSSES, GlobalBatch
from hybridflow.algorithms.rollout_correction import (
    HYBRIDFLOW_ONLY_METRICS,
    compute_policy_loss_bypass_mode,
    correct,
    is_weights,
    mismatch_metrics,
    parse_rs,
    rejection_mask,
)
from hybridflow.config import ConfigError
from hybridflow.config.schema import RolloutCorrection
from hybridflow.plan import load_experiment
from hybridflow.plan.rules import check_rollout_correction as check_config
from tests.numerics import assert_close

DTYPES = [torch.float32, torch.float64]
# two rows: row 0 has 3 valid tokens, row 1 has 2 (a padded tail, as responses end at different lengths)
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
LOG_RATIO = [[math.log(3.0), math.log(0.5), 0.0, 7.0], [math.log(1.5), math.log(1.2), -9.0, 0.0]]


def _log_ratio(dtype):
    return torch.tensor(LOG_RATIO, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_weights_are_truncated_ratios(dtype):
    w, m = is_weights(_log_ratio(dtype), MASK, "token", 2.0)
    expected = torch.tensor([[2.0, 0.5, 1.0, 0.0], [1.5, 1.2, 0.0, 0.0]], dtype=dtype)  # min(ratio, 2), 0 at padding
    assert w.dtype == dtype and not w.requires_grad
    assert_close(w, expected, dtype=dtype, what="token TIS weights")
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)  # 3 > 2
    assert m["rollout_is_ratio_fraction_low"] == pytest.approx(0.0)  # 0.5 is not < 1/2
    assert m["rollout_is_max"] == pytest.approx(2.0) and m["rollout_is_min"] == pytest.approx(0.5)
    assert m["rollout_is_mean"] == pytest.approx((2 + 0.5 + 1 + 1.5 + 1.2) / 5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sequence_weights_multiply_the_row_and_truncate(dtype):
    w, m = is_weights(_log_ratio(dtype), MASK, "sequence", 2.0)
    # row 0: 3 * 0.5 * 1 = 1.5; row 1: 1.5 * 1.2 = 1.8 -> both under 2; the padded log-ratios do not count
    expected = torch.tensor([[1.5, 1.5, 1.5, 0.0], [1.8, 1.8, 0.0, 0.0]], dtype=dtype)
    assert_close(w, expected, dtype=dtype, what="sequence IS weights")
    w, m = is_weights(_log_ratio(dtype), MASK, "sequence", 1.6)
    assert_close(w, torch.tensor([[1.5, 1.5, 1.5, 0.0], [1.6, 1.6, 0.0, 0.0]], dtype=dtype), dtype=dtype,
                 what="sequence TIS at 1.6")
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(0.5)  # rows, not tokens
    assert m["rollout_is_max"] == pytest.approx(1.8, rel=1e-6)  # verl: the untruncated max


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_normalized_weights_have_mean_one(dtype):
    w, m = is_weights(_log_ratio(dtype), MASK, "token", 2.0, batch_normalize=True)
    mean = (2 + 0.5 + 1 + 1.5 + 1.2) / (5 + 1e-8)  # verl's masked mean: sum / (count + 1e-8)
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(mean)
    assert_close(w, torch.tensor([[2.0, 0.5, 1.0, 0.0], [1.5, 1.2, 0.0, 0.0]], dtype=dtype) / mean, dtype=dtype,
                 what="normalized token weights")
    w, m = is_weights(_log_ratio(dtype), MASK, "sequence", 2.0, batch_normalize=True)
    assert m["rollout_is_batch_norm_factor"] == pytest.approx((1.5 + 1.8) / 2)  # the mean over rows


def test_icepop_threshold_zeroes_weights_outside_the_band():
    w, m = is_weights(_log_ratio(torch.float64), MASK, "token", "0.6_2.0")
    assert_close(w, torch.tensor([[0.0, 0.0, 1.0, 0.0], [1.5, 1.2, 0.0, 0.0]], dtype=torch.float64),
                 dtype=torch.float64, what="IcePop weights")
    assert m["rollout_is_oob_ratio"] == pytest.approx(2 / 5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rejection_masks_by_hand(dtype):
    lr = _log_ratio(dtype)
    # token_k1 with t=2: keep log(1/2) <= -log_ratio <= log(2): the ratio 3 is rejected, 0.5 kept (edge)
    mask, m = rejection_mask(lr, MASK, "token_k1", 2.0)
    assert mask.tolist() == [[0, 1, 1, 0], [1, 1, 0, 0]] and mask.dtype == MASK.dtype
    assert m["rollout_rs_masked_fraction"] == pytest.approx(1 / 5)
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)
    # seq_mean_k3 (sequence level): row 0's mean k3 is (3-1-ln3 + 0.5-1-ln0.5 + 0)/3 = 0.1601; row 1's 0.0140
    k3 = lambda r: r - 1 - math.log(r)  # noqa: E731
    row0, row1 = (k3(3) + k3(0.5)) / 3, (k3(1.5) + k3(1.2)) / 2
    mask, m = rejection_mask(lr, MASK, "seq_mean_k3", (row0 + row1) / 2)
    assert mask.tolist() == [[0, 0, 0, 0], [1, 1, 0, 0]]
    assert m["rollout_rs_seq_mean_k3_max"] == pytest.approx(row0, rel=1e-5)
    # seq_max_k2 and token_k2 together, one threshold each: both must pass
    mask, _ = rejection_mask(lr, MASK, "seq_max_k2,token_k2", f"{0.5 * math.log(3) ** 2 + 1e-3},0.1")
    assert mask.tolist() == [[0, 0, 1, 0], [1, 1, 0, 0]]  # token_k2 <= 0.1 rejects ln3^2/2 and ln2^2/2


def test_rejection_options_and_thresholds_are_checked():
    assert parse_rs("token_k1", "0.5_3") == {"token_k1": (0.5, 3.0)}
    assert parse_rs("seq_sum_k2,token_k1", "4") == {"seq_sum_k2": (None, 4.0), "token_k1": (0.25, 4.0)}
    for options, spec, message in [("token_k4", 1.0, "options must be among"), ("token_k2", None, "must be set"),
                                    ("seq_max_k2", "0.1_2", "for seq_max_k2"), ("token_k1,token_k2", "1,2,3", "one per")]:
        with pytest.raises(ValueError, match=message):
            parse_rs(options, spec)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mismatch_metrics_by_hand(dtype):
    train = torch.log(torch.tensor([[0.6, 0.2, 0.9, 1.0], [0.3, 0.5, 1.0, 1.0]], dtype=dtype))
    rollout = train - _log_ratio(dtype)  # log_ratio = train - rollout
    m = mismatch_metrics(train, rollout, MASK, 2.0)
    lr = [math.log(3.0), math.log(0.5), 0.0, math.log(1.5), math.log(1.2)]
    assert m["rollout_corr/kl"] == pytest.approx(-sum(lr) / 5)
    assert m["rollout_corr/k3_kl"] == pytest.approx(sum(math.exp(x) - x - 1 for x in lr) / 5)
    assert m["rollout_corr/token_ratio_max"] == pytest.approx(3.0) and m["rollout_corr/token_ratio_min"] == pytest.approx(0.5)
    assert m["rollout_corr/token_fraction_beyond_threshold"] == pytest.approx(1 / 5)  # only 3 is outside [1/2, 2]
    assert m["rollout_corr/seq_fraction_beyond_threshold"] == pytest.approx(1 / 2)
    same = mismatch_metrics(train, train, MASK)
    assert same["rollout_corr/kl"] == 0 and same["rollout_corr/token_ratio_max"] == 1.0
    assert same["training/rollout_probs_diff_max"] == 0


def test_correct_rejects_from_the_mask_and_measures_all_tokens():
    rc = RolloutCorrection(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1", rollout_rs_threshold=2.0)
    old = torch.zeros(2, 4, dtype=torch.float64)
    weights, mask, m = correct(old, old - _log_ratio(torch.float64), MASK, rc)
    assert mask.tolist() == [[0, 1, 1, 0], [1, 1, 0, 0]] and weights[0, 0] == 2.0
    assert m["rollout_corr/token_ratio_max"] == pytest.approx(3.0)  # the rejected token still counts
    assert {"rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_masked_fraction"} <= set(m)


def _actor(**kw):
    from hybridflow.config.schema import Actor

    return Actor(**kw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bypass_reinforce_is_weighted_policy_gradient(dtype):
    rollout = torch.log(torch.tensor([[0.5, 0.4, 0.9, 1.0], [0.2, 0.7, 1.0, 1.0]], dtype=dtype))
    log_prob = (rollout + _log_ratio(dtype) * MASK).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 1.0, 0.0], [-2.0, -2.0, 0.0, 0.0]], dtype=dtype)
    rc = RolloutCorrection(rollout_is="token", rollout_is_threshold=2.0, bypass_mode=True, loss_type="reinforce")
    loss, m = compute_policy_loss_bypass_mode(rollout, log_prob, adv, MASK, loss_agg_mode="token-mean",
                                              config=_actor(), global_batch=GlobalBatch.of(MASK),
                                              rollout_correction=rc)
    w = torch.tensor([[2.0, 0.5, 1.0, 0.0], [1.5, 1.2, 0.0, 0.0]], dtype=dtype)
    assert_close(loss, (-(adv * log_prob.detach() * w) * MASK).sum() / 5, dtype=dtype, what="reinforce loss")
    loss.backward()
    assert_close(log_prob.grad, -adv * w * MASK / 5, dtype=dtype, what="gradient: -A w / tokens")
    assert "rollout_corr/kl" in m and loss.dtype == dtype


def test_bypass_ppo_clip_is_vanilla_on_the_rejected_mask():
    rollout = torch.log(torch.tensor([[0.5, 0.4, 0.9, 1.0], [0.2, 0.7, 1.0, 1.0]], dtype=torch.float64))
    log_prob = rollout + _log_ratio(torch.float64) * MASK
    adv = torch.tensor([[1.0, -1.0, 1.0, 0.0], [-2.0, 2.0, 0.0, 0.0]], dtype=torch.float64)
    rc = RolloutCorrection(rollout_rs="token_k1", rollout_rs_threshold=2.0, bypass_mode=True)
    loss, _ = compute_policy_loss_bypass_mode(rollout, log_prob, adv, MASK, config=_actor(),
                                              global_batch=GlobalBatch.of(MASK), rollout_correction=rc)
    kept = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0]])
    expected, _ = POLICY_LOSSES.get("vanilla")(rollout, log_prob, adv, kept, config=_actor(),
                                               global_batch=GlobalBatch.of(MASK))
    assert_close(loss, expected, dtype=torch.float64, what="bypass ppo_clip = vanilla with rejection")


def test_config_checks_are_one_line():
    ok = RolloutCorrection()
    check_config(ok, "vanilla", 1.0)  # measuring only: any loss, any temperature
    check_config(ok, "vanilla", 0.0)
    with pytest.raises(ValueError, match="rollout.temperature > 0"):
        check_config(RolloutCorrection(rollout_is="token"), "vanilla", 0.0)
    with pytest.raises(ValueError, match="rollout_rs_threshold must be set"):
        check_config(RolloutCorrection(rollout_rs="token_k2"), "vanilla", 1.0)
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        check_config(SimpleNamespace(**{**vars(RolloutCorrection()), "rollout_is_threshold": "wide"}), "vanilla", 1.0)


def _load(*overrides):
    return load_experiment([{}], ["data.batch_size=16", "actor.ppo_mini_batch_size=16", *overrides])


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncated_is_weights_reach_the_loss(level):
    """Decoupled mode end to end: correct()'s truncated weights, passed as the batch carries them, multiply the
    vanilla loss per token (row 1's sequence ratio 1.5 * 1.2 = 1.8 stays under the threshold, row 0's
    3 * 0.5 = 1.5 too)."""
    rollout = torch.log(torch.tensor([[0.5, 0.4, 0.9, 1.0], [0.2, 0.7, 1.0, 1.0]], dtype=torch.float64))
    old = rollout + _log_ratio(torch.float64) * MASK
    log_prob = old + 0.05  # ratio exp(0.05): inside the clip range, every token keeps its gradient
    adv = torch.tensor([[1.0, -1.0, 1.0, 0.0], [-2.0, 2.0, 0.0, 0.0]], dtype=torch.float64)
    weights, mask, _ = correct(old, rollout, MASK, RolloutCorrection(rollout_is=level, rollout_is_threshold=2.0))
    assert torch.equal(mask, MASK)  # no rejection configured
    by_hand = {"token": [[2.0, 0.5, 1.0, 0.0], [1.5, 1.2, 0.0, 0.0]], "sequence": [[1.5] * 3 + [0.0], [1.8] * 2 + [0.0] * 2]}
    w = torch.tensor(by_hand[level], dtype=torch.float64)
    assert_close(weights, w, dtype=torch.float64, what=f"{level} weights")
    loss, _ = POLICY_LOSSES.get("vanilla")(old, log_prob, adv, mask, config=_actor(), rollout_is_weights=weights)
    expected = (-adv * math.exp(0.05) * w * MASK).sum() / 5
    assert_close(loss, expected, dtype=torch.float64, what=f"vanilla loss with {level} weights")


def test_every_registered_loss_takes_is_weights():
    for mode in set(POLICY_LOSSES.names()) - {"bypass_mode"}:  # bypass_mode computes its own weights
        check_config(RolloutCorrection(rollout_is="sequence"), mode, 1.0)


def test_bypass_mode_is_a_registered_loss_that_needs_bypass_mode():
    """verl's trainer sets loss_mode bypass_mode from algorithm.rollout_correction.bypass_mode; the loss alone
    is refused at load, and the two together are bypass mode."""
    with pytest.raises(ConfigError, match="bypass_mode=true") as e:
        _load("actor.policy_loss.loss_mode=bypass_mode")
    assert "\n" not in str(e.value)
    cfg = _load("actor.policy_loss.loss_mode=bypass_mode", "algorithm.rollout_correction.bypass_mode=true")
    assert POLICY_LOSSES.get(cfg.actor.policy_loss.loss_mode) is compute_policy_loss_bypass_mode
    rollout = torch.log(torch.tensor([[0.5, 0.4, 0.9, 1.0], [0.2, 0.7, 1.0, 1.0]], dtype=torch.float64))
    log_prob = rollout + _log_ratio(torch.float64) * MASK
    adv = torch.tensor([[1.0, -1.0, 1.0, 0.0], [-2.0, 2.0, 0.0, 0.0]], dtype=torch.float64)
    rc = cfg.algorithm.rollout_correction
    via_registry, _ = POLICY_LOSSES.get("bypass_mode")(rollout, log_prob, adv, MASK, config=cfg.actor,
                                                        rollout_is_weights=None, rollout_correction=rc)
    vanilla, _ = POLICY_LOSSES.get("vanilla")(rollout, log_prob, adv, MASK, config=cfg.actor)
    assert_close(via_registry, vanilla, dtype=torch.float64, what="bypass_mode ppo_clip without RS = vanilla")


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.rollout_correction.rollout_is=token", "rollout.temperature=0"], "rollout.temperature > 0"),
    (["algorithm.rollout_correction.rollout_rs=token_k2"], "rollout_rs_threshold must be set"),
    (["algorithm.rollout_correction.rollout_is_threshold=wide"], "rollout_is_threshold"),
])
def test_config_errors_come_from_loading_the_config(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        _load(*overrides)
    assert "\n" not in str(e.value)


# verl 0.9.1's own outputs on one batch (tests/fixtures/verl/make_rollout_corr_metrics.py ran verl's source)
VERL = json.loads((Path(__file__).parents[1] / "fixtures" / "verl" / "rollout_corr_metrics.json").read_text())


def _verl_inputs():
    x = {k: torch.tensor(v, dtype=torch.float64) for k, v in VERL["inputs"].items()}
    return x["old_log_prob"], x["rollout_log_prob"], x["response_mask"]


@pytest.mark.parametrize("case", VERL["rollout_correction"], ids=lambda c: ",".join(map(str, c["config"].values())))
def test_metrics_are_verls_names_and_values(case):
    """Every metric verl's trainer logs for this rollout_correction (compute_rollout_correction_and_rejection_mask
    and calculate_debug_metrics) exists under its name with its value; the IS weights and the rejected mask are
    verl's. The inputs have junk in the padding, an empty row and a +25 log-ratio (the +-20 safety bound)."""
    old, rollout, mask = _verl_inputs()
    weights, kept, ours = correct(old, rollout, mask, RolloutCorrection(**case["config"]))
    verl = case["metrics"]
    assert set(ours) - HYBRIDFLOW_ONLY_METRICS == set(verl), sorted(set(ours) ^ set(verl) - HYBRIDFLOW_ONLY_METRICS)
    for key, value in verl.items():
        # float32: verl takes its fractions through .float(); everything else is float64 on both sides
        assert_close(ours[key], value, dtype=torch.float32, what=key)
    assert kept.tolist() == case["response_mask"]
    if case["rollout_is_weights"] is None:
        assert weights is None
    else:
        assert_close(weights, torch.tensor(case["rollout_is_weights"], dtype=torch.float64), dtype=torch.float64,
                     what="IS weights")


def test_the_verl_cases_cover_every_is_mode_and_rs_option():
    configs = [c["config"] for c in VERL["rollout_correction"]]
    is_modes = {(c["rollout_is"], "_" in str(c["rollout_is_threshold"]), c["rollout_is_batch_normalize"])
                for c in configs if c.get("rollout_is")}
    assert len(is_modes) == 8  # token/sequence x TIS/IcePop x normalized or not
    options = {o for c in configs if c.get("rollout_rs") for o in c["rollout_rs"].split(",")}
    assert options == set(parse_rs.__globals__["RS_OPTIONS"])
