"""verl 0.9.1's priority-filtered PPO (algorithm.use_pf_ppo, core_algos.compute_pf_ppo_reweight_data): each method's
weights by hand, the resampling drawing rows in proportion to them, and the driver's stage: the batch's rows (tensors
and non-tensors alike) resampled after the gae advantages, the same rows again for the same step (a resumed run)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hybridflow.algorithms.pf_ppo import pf_ppo_rows, pf_ppo_weights
from hybridflow.config import ConfigError
from hybridflow.plan import load_experiment
from hybridflow.protocol import Batch
from tests.numerics import assert_close

SCORES = [2.0, -1.0, 0.0, 0.5, 2.0]


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
@pytest.mark.parametrize("method,power,expected", [
    ("pow", 2.0, [4.0, 1.0, 0.0, 0.25, 4.0]),
    ("pow", 1.0, [2.0, 1.0, 0.0, 0.5, 2.0]),
    ("max_min", 2.0, [1.0, 1.0, 0.0, 0.0, 1.0]),  # the highest (2, twice) and the lowest (-1)
    ("max_random", 2.0, [0.4, 0.1, 0.1, 0.1, 0.4]),
])
def test_weights_by_hand(method, power, expected, dtype):
    got = pf_ppo_weights(torch.tensor(SCORES, dtype=dtype), method, power)
    assert got.dtype == dtype
    assert_close(got, torch.tensor(expected, dtype=dtype) + 1e-8, dtype=dtype, what=method)


def test_unknown_method_is_named():
    with pytest.raises(ValueError, match="reweight_method must be one of pow, max_min, max_random, got 'top'"):
        pf_ppo_weights(torch.tensor(SCORES), "top", 2.0)


def test_rows_are_drawn_in_proportion_to_the_weights():
    # 4000 rows of scores 2, 1, 0: pow 1 weights 2 : 1 : 1e-8, each row's score summed over its tokens
    scores = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]]).repeat(4000 // 3 + 1, 1)[:4000]
    rows = pf_ppo_rows(scores, "pow", 1.0, torch.Generator().manual_seed(0))
    assert rows.shape == (4000,)
    drawn = scores[rows].sum(-1)
    shares = [(drawn == s).float().mean().item() for s in (2.0, 1.0, 0.0)]
    assert abs(shares[0] - 2 / 3) < 0.03 and abs(shares[1] - 1 / 3) < 0.03 and shares[2] == 0.0, shares


def _batch() -> Batch:
    scores = torch.tensor([[0.0, 3.0], [0.0, 0.0], [1.0, 0.0], [0.0, -2.0]])
    return Batch.from_dict(tensors={"token_level_scores": scores, "advantages": torch.arange(8.0).view(4, 2)},
                           non_tensors={"uid": np.array(["a", "b", "c", "d"], dtype=object)})


def test_the_driver_resamples_rows_whole_and_the_same_for_a_step():
    from hybridflow.trainer.ppo import PPODriver

    cfg = load_experiment(["configs/quickstart_cpu.yaml"], ["algorithm.use_pf_ppo=true"])
    driver = SimpleNamespace(cfg=cfg)
    first, again, other = (PPODriver.prioritize(driver, _batch(), step) for step in (3, 3, 4))
    assert len(first) == 4 and "b" not in list(first.non_tensors["uid"])  # score 0: weight 1e-8
    index = {"a": 0, "c": 2, "d": 3}
    rows = [index[u] for u in first.non_tensors["uid"]]
    assert torch.equal(first.tensors["advantages"], _batch().tensors["advantages"][rows])
    assert list(again.non_tensors["uid"]) == list(first.non_tensors["uid"])
    assert len(other) == 4
    off, batch = load_experiment(["configs/quickstart_cpu.yaml"], []), _batch()
    assert PPODriver.prioritize(SimpleNamespace(cfg=off), batch, 3) is batch


def test_verl_keys_and_the_gae_rule():
    from hybridflow.trainer.main import load

    cfg = load(["--config", "configs/ppo_megatron.yaml", "--verl-overrides", "algorithm.use_pf_ppo=True",
                "algorithm.pf_ppo.reweight_method=max_min", "algorithm.pf_ppo.weight_pow=3"])
    assert (cfg.algorithm.use_pf_ppo, cfg.algorithm.pf_ppo.reweight_method, cfg.algorithm.pf_ppo.weight_pow) == \
        (True, "max_min", 3.0)
    with pytest.raises(ConfigError, match="algorithm.use_pf_ppo: verl 0.9.1 resamples after the gae advantages only"):
        load_experiment(["configs/quickstart_cpu.yaml"], ["algorithm.use_pf_ppo=true", "algorithm.adv_estimator=grpo"])


VERL = json.loads((Path(__file__).parents[1] / "fixtures" / "verl" / "pf_ppo.json").read_text())


@pytest.mark.parametrize("case", VERL["cases"], ids=lambda c: f"{c['method']}_{c['weight_pow']}")
def test_rows_equal_verls_own_function_on_the_same_stream(case):
    """verl 0.9.1's compute_pf_ppo_reweight_data (tests/fixtures/verl/make_pf_ppo.py ran its source) after
    torch.manual_seed(seed) draws the rows ours draws from a generator seeded alike."""
    rows = pf_ppo_rows(torch.tensor(VERL["scores"]), case["method"], case["weight_pow"],
                       torch.Generator().manual_seed(case["seed"]))
    assert rows.tolist() == case["rows"]
