import torch

from hybridflow.rewards import get_scorer, score_batch


def test_arithmetic_exact_match():
    score = get_scorer("arithmetic")
    assert score("85", "85") == 1.0
    assert score(" 85 ", "85") == 1.0  # surrounding whitespace is not an error
    assert score("8", "85") == 0.0
    assert score("855", "85") == 0.0
    assert score("85 ", "86") == 0.0
    assert score("", "0") == 0.0


def test_unknown_scorer_lists_known():
    try:
        get_scorer("nope")
    except KeyError as e:
        assert "unknown reward scorer 'nope'; known: arithmetic" in str(e)
    else:
        raise AssertionError("expected KeyError")


def test_score_lands_on_last_valid_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    scores, token = score_batch(get_scorer("arithmetic"), ["12", "3", ""], ["12", "4", "0"], mask)
    assert scores.tolist() == [1.0, 0.0, 0.0]
    assert token.tolist() == [[0, 0, 1.0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
