"""Registry behaviour and the registered names."""

import pytest
import torch

from hybridflow.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_PENALTIES,
    LOSS_AGG_MODES,
    Registry,
    UnknownNameError,
    compute_advantage,
    register_advantage,
)


def test_registered_names():
    assert ADVANTAGE_ESTIMATORS.names() == sorted(
        ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "gpg", "opo",
         "grpo_passk", "gdpo", "grpo_vectorized", "rloo_vectorized", "optimal_token_baseline",
         "tir_optimal_token_baseline"]
    )
    assert set(KL_PENALTIES.names()) == {"k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"}
    assert set(LOSS_AGG_MODES.names()) == {
        "token-mean",
        "token-sum",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    }


def test_unknown_name_error_message():
    reg = Registry("widget")
    reg.add("a", len)
    reg.add("b", len)
    with pytest.raises(UnknownNameError) as err:
        reg.get("c")
    assert str(err.value) == "unknown widget 'c'; known: a, b"
    with pytest.raises(KeyError):
        reg.get(None)


def test_duplicate_registration_rejected():
    reg = Registry("widget")

    @reg.register("x", "x-alias")
    def f():
        pass

    assert reg.get("x-alias") is f
    reg.add("x", f)  # same function again is harmless
    with pytest.raises(ValueError, match="already registered"):
        reg.add("x", len)


def test_user_estimator_through_dispatch():
    name = "_test_constant_one"
    if name not in ADVANTAGE_ESTIMATORS:

        @register_advantage(name)
        def _const(token_level_rewards, response_mask, *, gamma=1.0):
            adv = torch.ones_like(token_level_rewards) * gamma * response_mask
            return adv, adv

    mask = torch.tensor([[1.0, 0.0]])
    adv, _ = compute_advantage(name, torch.zeros(1, 2), mask, gamma=2.0, index=[0])
    torch.testing.assert_close(adv, torch.tensor([[2.0, 0.0]]))
