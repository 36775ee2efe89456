"""add_advantages hands each estimator what verl's driver hands it: gdpo the reward components named by
algorithm.gdpo_reward_keys (batch columns) and their weights; the optimal token baselines the old log-probs and
sum_pi_squared, with a one-line error when the batch lacks them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.algorithms import compute_advantage
from hybridflow.config.schema import Algorithm
from hybridflow.protocol import Batch
from hybridflow.trainer.experience import add_advantages
from tests.numerics import assert_close

MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.float32)
REWARDS = torch.tensor([[0, 1.0, 0], [0, 0, 0.0], [2.0, 0, 0], [0, 0.5, 0]])
UID = np.array(["p0", "p0", "p1", "p1"], dtype=object)


def batch(**extra_non_tensors):
    return Batch.from_dict(tensors={"token_level_rewards": REWARDS, "response_mask": MASK},
                           non_tensors={"uid": UID, **extra_non_tensors})


def test_gdpo_reads_the_reward_components():
    fmt, acc = np.array([0.0, 1.0, 1.0, 0.0], dtype=object), np.array([0.0, 1.0, 0.0, 1.0], dtype=object)
    algo = Algorithm(adv_estimator="gdpo", gdpo_reward_keys=["fmt", "acc"], gdpo_reward_weights=[2.0, 1.0])
    out = add_advantages(batch(fmt=fmt, acc=acc), algo)
    expected, _ = compute_advantage("gdpo", REWARDS, MASK, index=UID, reward_components=[fmt, acc],
                                    reward_weights=[2.0, 1.0])
    assert_close(out.tensors["advantages"], expected, what="gdpo advantages")
    # the components, not the summed reward, drive it: row 1 beats row 0 on both, not on the reward
    plain, _ = compute_advantage("gdpo", REWARDS, MASK, index=UID)
    assert not torch.allclose(expected, plain)


@pytest.mark.parametrize("keys, message", [
    (None, "adv_estimator gdpo requires algorithm.gdpo_reward_keys"),
    (["fmt", "missing"], r"gdpo reward key\(s\) \['missing'\] not in the batch"),
])
def test_gdpo_without_its_components_is_one_line(keys, message):
    with pytest.raises(ValueError, match=message) as err:
        add_advantages(batch(fmt=np.zeros(4, dtype=object)), Algorithm(adv_estimator="gdpo", gdpo_reward_keys=keys))
    assert "\n" not in str(err.value)


def test_optimal_token_baseline_inputs():
    algo = Algorithm(adv_estimator="optimal_token_baseline")
    with pytest.raises(ValueError, match="needs the actor's sum_pi_squared"):
        add_advantages(batch(), algo)
    old, spi = torch.full((4, 3), -0.7), torch.full((4, 3), 0.3)
    b = batch().union(Batch.from_dict(tensors={"old_log_probs": old, "sum_pi_squared": spi}))
    expected, _ = compute_advantage("optimal_token_baseline", REWARDS, MASK, index=UID, old_log_probs=old,
                                    sum_pi_squared=spi)
    assert_close(add_advantages(b, algo).tensors["advantages"], expected, what="OTB advantages")


def test_a_harmony_response_is_scored_by_its_final_channel(tmp_path):
    """gpt-oss writes its reasoning on the analysis channel and its answer on the final one: the scorer reads the
    final channel of each sampled run (a turn cut before its answer: nothing), text outside the format as decoded,
    and a tokenizer without harmony's tokens decodes as before."""
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.trainer.experience import sampled_text

    tok = build_char_tokenizer(tmp_path)

    def text(s: str, mask=None) -> str:
        ids = tok(s, add_special_tokens=False)["input_ids"]
        return sampled_text(tok, torch.tensor(ids), torch.ones(len(ids)) if mask is None else mask(len(ids)))

    assert text("7 plus 5 is 12") == "7 plus 5 is 12"
    tok.add_special_tokens({"additional_special_tokens": ["<|start|>", "<|channel|>", "<|message|>", "<|end|>",
                                                          "<|return|>"]})
    turn = ("<|channel|>analysis<|message|>7 plus 5 is 12, or 13?<|end|>"
            "<|start|>assistant<|channel|>final<|message|>#### 12<|return|>")
    assert text(turn) == "#### 12"
    assert text("<|channel|>analysis<|message|>7 plus 5 is 12, or") == ""  # cut by the length budget
    assert text("7 plus 5 is 12") == "7 plus 5 is 12"
    n_turn = len(tok(turn, add_special_tokens=False)["input_ids"])
    two = turn + "#### 99" + turn.replace("12<|return|>", "13<|return|>")  # a tool's text (mask 0) between two turns
    assert text(two, lambda n: torch.tensor([1] * n_turn + [0] * 7 + [1] * (n - n_turn - 7))) == "#### 12\n#### 13"
