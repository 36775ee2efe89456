"""Loading user reward files (verl's custom_reward_function) and adapting them to suite scorers."""

import pickle
import sys
import textwrap
import threading
import time

import pytest

from hybridflow.rewards.custom import RewardFunctionError, adapt_to_scorer, load_custom_reward_function


def _write(tmp_path, body, name="my_reward.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_missing_file(tmp_path):
    path = tmp_path / "nope.py"
    with pytest.raises(FileNotFoundError) as e:
        load_custom_reward_function(str(path))
    assert str(e.value) == f"custom_reward_function.path={path}: file not found"


@pytest.mark.parametrize("body, error", [
    ("raise RuntimeError('boom')\n", "RuntimeError: boom"),
    ("def compute_score(:\n", "SyntaxError"),
    ("import no_such_module_xyz\n", "ModuleNotFoundError: No module named 'no_such_module_xyz'"),
])
def test_import_failure(tmp_path, body, error):
    path = _write(tmp_path, body)
    before = set(sys.modules)
    with pytest.raises(ImportError) as e:
        load_custom_reward_function(str(path))
    msg = str(e.value)
    assert msg.startswith(f"custom_reward_function.path={path}: importing the file failed: ") and error in msg
    assert set(sys.modules) == before  # a broken module is not left half-registered


def test_missing_function_lists_callables(tmp_path):
    path = _write(tmp_path, """
        import os
        VALUE = 3
        class Helper: pass
        def other_score(data_source, solution_str, ground_truth, extra_info=None): return 1.0
        def _private(): pass
    """)
    with pytest.raises(AttributeError) as e:
        load_custom_reward_function(str(path), "compute_score")
    assert str(e.value) == (f"custom_reward_function.name='compute_score': no such function in {path}; "
                            "callables there: Helper, other_score")
    empty = _write(tmp_path, "X = 1\n", "empty.py")
    with pytest.raises(AttributeError, match=r"callables there: \(none\)"):
        load_custom_reward_function(str(empty))


def test_not_callable(tmp_path):
    path = _write(tmp_path, "compute_score = 3\n")
    with pytest.raises(TypeError) as e:
        load_custom_reward_function(str(path))
    assert str(e.value) == f"custom_reward_function.name='compute_score' in {path} is a int, not a function"


@pytest.mark.parametrize("params, reason", [
    ("solution_str, ground_truth", "unexpected keyword argument 'data_source'"),
    ("data_source, solution_str, ground_truth", "unexpected keyword argument 'extra_info'"),
    ("data_source, solution_str, ground_truth, extra_info, method", "missing a required argument: 'method'"),
    ("data_source, solution_str, ground_truth, extra_info, /", "positional only"),
    ("*args", "unexpected keyword argument"),
])
def test_wrong_signature(tmp_path, params, reason):
    path = _write(tmp_path, f"def score({params}):\n    return 0.0\n")
    with pytest.raises(TypeError) as e:
        load_custom_reward_function(str(path), name="score")
    msg = str(e.value)
    assert msg.startswith(f"custom_reward_function.name='score' in {path} has signature score({params})")
    assert "cannot be called as score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)" in msg
    assert reason in msg


def test_async_rejected(tmp_path):
    path = _write(tmp_path, "async def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                            "    return 1.0\n")
    with pytest.raises(TypeError, match=r"custom_reward_function.name='compute_score' in .*my_reward.py is async"):
        load_custom_reward_function(str(path))


@pytest.mark.parametrize("params", [
    "data_source, solution_str, ground_truth, extra_info=None",
    "data_source, solution_str, ground_truth, extra_info",  # verl always passes extra_info
    "data_source, solution_str, ground_truth, **kwargs",
    "**kwargs",
    "data_source, solution_str, ground_truth, extra_info=None, scale=1.0",
])
def test_accepted_signatures(tmp_path, params):
    path = _write(tmp_path, f"def compute_score({params}):\n    return 0.5\n")
    assert load_custom_reward_function(str(path))("d", "s", "g") == 0.5


def test_working_function_with_and_without_extra_info(tmp_path):
    path = _write(tmp_path, """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            correct = solution_str.strip().endswith(ground_truth)
            return {"score": 1.0 if correct else 0.0, "source": data_source, "extra": extra_info}
    """)
    fn = load_custom_reward_function(str(path))
    assert fn("openai/gsm8k", "so 42", "42") == {"score": 1.0, "source": "openai/gsm8k", "extra": None}
    assert fn("openai/gsm8k", "so 41", "42", extra_info={"split": "test"}) == {
        "score": 0.0, "source": "openai/gsm8k", "extra": {"split": "test"}}
    assert fn(data_source="d", solution_str="42", ground_truth="42")["score"] == 1.0

    scorer = adapt_to_scorer(fn, data_source="openai/gsm8k")
    assert scorer("so 42", "42") == 1.0 and scorer("so 41", "42") == 0.0
    assert fn.path == str(path) and fn.name == "compute_score"


def test_pickles_by_reloading_the_file(tmp_path):
    path = _write(tmp_path, "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                            "    return float(solution_str == ground_truth)\n")
    scorer = pickle.loads(pickle.dumps(adapt_to_scorer(load_custom_reward_function(str(path)))))
    assert scorer("7", "7") == 1.0 and scorer("7", "8") == 0.0


def test_same_stem_in_two_folders_do_not_collide(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    fa = load_custom_reward_function(str(_write(tmp_path / "a", "def compute_score(**kw): return 1.0\n", "r.py")))
    fb = load_custom_reward_function(str(_write(tmp_path / "b", "def compute_score(**kw): return 2.0\n", "r.py")))
    assert (fa("d", "s", "g"), fb("d", "s", "g")) == (1.0, 2.0)


def test_adapted_scorer_results():
    def numbers(data_source, solution_str, ground_truth, extra_info=None):
        return {"int": 1, "bool": True, "dict": {"score": 0.25, "acc": True}}[solution_str]

    scorer = adapt_to_scorer(numbers)
    assert scorer("int", "") == 1.0 and isinstance(scorer("int", ""), float)
    assert scorer("bool", "") == 1.0
    assert scorer("dict", "") == 0.25

    def text(data_source, solution_str, ground_truth, extra_info=None):
        return "1.0"

    with pytest.raises(TypeError) as e:
        adapt_to_scorer(text)("x", "y")
    assert str(e.value) == ("reward function 'test_adapted_scorer_results.<locals>.text' returned str '1.0'; "
                            "expected a number or a dict with a numeric 'score'")

    def no_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"acc": 1.0}

    with pytest.raises(TypeError, match=r"'test_adapted_scorer_results.<locals>.no_score' returned a dict "
                                        r"without a 'score' key \(keys: \['acc'\]\)"):
        adapt_to_scorer(no_score)("x", "y")


def test_adapted_loaded_function_error_names_file(tmp_path):
    path = _write(tmp_path, "def compute_score(**kw):\n    return None\n")
    with pytest.raises(TypeError) as e:
        adapt_to_scorer(load_custom_reward_function(str(path)))("x", "y")
    assert str(e.value).startswith(f"custom reward function 'compute_score' from {path} returned NoneType None")


def test_data_source_passed_through():
    seen = []

    def record(data_source, solution_str, ground_truth, extra_info=None):
        seen.append((data_source, solution_str, ground_truth, extra_info))
        return 0.0

    adapt_to_scorer(record)("resp", "gt")
    adapt_to_scorer(record, data_source="openai/gsm8k")("resp", "gt")
    adapt_to_scorer(record)("resp", "gt", "lighteval/MATH", {"index": 1})  # a row's own source wins
    assert seen == [("custom", "resp", "gt", None), ("openai/gsm8k", "resp", "gt", None),
                    ("lighteval/MATH", "resp", "gt", {"index": 1})]


# --- failures while scoring a batch: one line naming the function, the row and the value ---------------

FAILS_ON_ROW_2 = """
    import math, sys
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str != "bad":
            return 1.0
        {body}
"""


@pytest.mark.parametrize("body, problem", [
    ("raise ValueError('no answer\\nin there')", "raised ValueError: no answer in there"),
    ("return None", "returned NoneType None; expected a number or a dict with a numeric 'score'"),
    ("return '1.0'", "returned str '1.0'; expected a number or a dict with a numeric 'score'"),
    ("return {'acc': 1.0}", "returned a dict without a 'score' key (keys: ['acc'])"),
    ("return {'score': 'high'}", "returned str 'high'; expected a number or a dict with a numeric 'score'"),
    ("return math.nan", "returned nan; expected a finite number"),
    ("return {'score': -math.inf}", "returned -inf; expected a finite number"),
    ("return 1e300", "returned 1e+300, beyond float32's range (the batch's scores; +-3.4e+38): it would be inf there"),  # inf in the batch: non-finite losses at step 1
    ("sys.exit(3)", "called sys.exit(3)"),
    ("raise KeyboardInterrupt", "raised KeyboardInterrupt"),
])
def test_a_failing_row_is_one_line_naming_function_row_and_value(tmp_path, body, problem):
    path = _write(tmp_path, FAILS_ON_ROW_2.format(body=body))
    scorer = adapt_to_scorer(load_custom_reward_function(str(path)), timeout_s=60)
    with pytest.raises(RewardFunctionError) as e:
        scorer.score_all(["ok", "ok", "bad", "ok"], ["1", "1", "1", "1"])
    assert e.value.row == 2
    assert str(e.value) == f"custom reward function 'compute_score' from {path} {problem}"


def test_good_rows_score_in_order():
    def length(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": len(solution_str) / 4}

    assert adapt_to_scorer(length, timeout_s=60).score_all(["a", "ab", "abcd"], ["", "", ""]) == [0.25, 0.5, 1.0]
    assert adapt_to_scorer(length).score_all(["abc"], [""]) == [0.75]  # no time limit


def test_a_call_that_never_returns_ends_within_the_timeout(tmp_path):
    path = _write(tmp_path, FAILS_ON_ROW_2.format(body="import time; time.sleep(1e9)"))
    scorer = adapt_to_scorer(load_custom_reward_function(str(path)), timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(RewardFunctionError) as e:
        scorer.score_all(["ok", "ok", "bad"], ["1", "1", "1"])
    took = time.monotonic() - start
    assert e.value.row == 2
    assert str(e.value) == (f"custom reward function 'compute_score' from {path} did not return within "
                            "custom_reward_function.timeout_s=0.5 s")
    assert 0.5 <= took < 5, took
    stuck = [t for t in threading.enumerate() if t.name == "custom reward function"]
    assert stuck and all(t.daemon for t in stuck), "the abandoned call must not keep the process alive"


def test_a_driver_asked_to_stop_stops_waiting_for_a_call_that_never_returns():
    """After SIGTERM's grace period the trainer stops waiting (controller.worker_group.give_up_waiting_when),
    for a reward call too: within a wait slice, well before custom_reward_function.timeout_s."""
    from hybridflow.controller.worker_group import WaitAbandoned, give_up_waiting_when

    def stuck(data_source, solution_str, ground_truth, extra_info=None):
        time.sleep(1e9)

    asked = time.monotonic() + 0.5
    with give_up_waiting_when(lambda: "asked to stop" if time.monotonic() > asked else None):
        with pytest.raises(WaitAbandoned, match=r"^stopped waiting for reward function '.*stuck': asked to stop$"):
            adapt_to_scorer(stuck, timeout_s=10).score_all(["x"], ["y"])
    assert time.monotonic() - asked < 3


def test_the_timeout_is_per_call_not_per_batch():
    def slow(data_source, solution_str, ground_truth, extra_info=None):
        time.sleep(0.02)
        return 1.0

    # 60 calls take >= 1.2 s together, each far below the 1 s limit
    assert adapt_to_scorer(slow, timeout_s=1.0).score_all(["x"] * 60, ["y"] * 60) == [1.0] * 60


def _rollout_batch(tokenizer, prompts, responses, answers):
    """A rollout batch as the actor's generate returns it: left-padded prompts, responses, masks."""
    import numpy as np
    import torch

    from hybridflow.protocol import Batch

    width = max(map(len, prompts))
    prompt_ids = torch.full((len(prompts), width), tokenizer.pad_token_id)
    prompt_mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids = tokenizer(p).input_ids
        prompt_ids[i, width - len(ids):], prompt_mask[i, width - len(ids):] = torch.tensor(ids), 1
    response_ids = torch.tensor([tokenizer(r).input_ids for r in responses])
    return Batch.from_dict(
        tensors={"prompts": prompt_ids, "responses": response_ids, "response_mask": torch.ones_like(response_ids),
                 "attention_mask": torch.cat([prompt_mask, torch.ones_like(response_ids)], dim=1)},
        non_tensors={"answer": np.array(answers, dtype=object),
                     "data_source": np.array(["arith"] * len(prompts), dtype=object)})


def test_score_responses_names_the_failing_row_by_prompt_and_response(tmp_path):
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.trainer.experience import score_responses

    tokenizer = build_char_tokenizer(tmp_path / "tok")
    path = _write(tmp_path, "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                            "    return float(solution_str) / int(ground_truth)\n")
    scorer = adapt_to_scorer(load_custom_reward_function(str(path)), timeout_s=60)
    prompts, responses = ["Q: 1+2= A:", "Q: 3-3= A:"], ["3", "0"]
    scored = score_responses(_rollout_batch(tokenizer, prompts, responses, ["3", "4"]), tokenizer, scorer)
    assert scored.tensors["scores"].tolist() == [1.0, 0.0]
    assert scored.tensors["token_level_scores"].tolist() == [[1.0], [0.0]]
    with pytest.raises(RewardFunctionError) as e:
        score_responses(_rollout_batch(tokenizer, prompts, responses, ["3", "0"]), tokenizer, scorer)
    assert str(e.value) == (f"custom reward function 'compute_score' from {path} raised ZeroDivisionError: float "
                            "division by zero on row 1 of 2 of the batch (data_source 'arith', prompt 'Q: 3-3= A:', "
                            "response '0')")


def test_score_responses_gives_each_row_its_source_ground_truth_and_extra_info(tmp_path):
    """As verl's reward loop calls it: the row's data.reward_fn_key value, the ground truth as stored (not
    made a string), and the row's extra_info plus num_turns and rollout_reward_scores."""
    import numpy as np

    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.trainer.experience import score_responses

    tokenizer = build_char_tokenizer(tmp_path / "tok")
    seen = []

    def record(data_source, solution_str, ground_truth, extra_info=None):
        seen.append((data_source, solution_str, ground_truth, extra_info))
        return 1.0

    batch = _rollout_batch(tokenizer, ["Q: 1+2= A:", "Q: 3-3= A:"], ["3", "0"], ["3", "0"])
    batch.non_tensors["answer"] = np.array([3, [0, 1]], dtype=object)
    batch.non_tensors["task"] = np.array(["openai/gsm8k", None], dtype=object)
    batch.non_tensors["extra_info"] = np.array([{"index": 7, "split": "train"}, None], dtype=object)
    score_responses(batch, tokenizer, adapt_to_scorer(record, timeout_s=60, source_key="task"))
    turn = {"num_turns": 2, "rollout_reward_scores": {}}
    assert seen == [("openai/gsm8k", "3", 3, {"index": 7, "split": "train", **turn}),
                    ("custom", "0", [0, 1], turn)]  # a row without a source: the scorer's data_source
    assert batch.non_tensors["extra_info"][0] == {"index": 7, "split": "train"}  # the data is not changed

    seen.clear()
    score_responses(batch, tokenizer, adapt_to_scorer(record, timeout_s=60))  # the default key: data_source
    assert [s[0] for s in seen] == ["arith", "arith"]


def test_a_process_runs_the_file_once_until_it_changes(tmp_path):
    """The run's checks (load_experiment, preflight) and the driver all load it: the user's file runs once."""
    log = tmp_path / "imports.log"
    body = f"open({str(log)!r}, 'a').write('x')\ndef compute_score(**kw): return {{}}\n"
    path = _write(tmp_path, body.format("1.0"))
    first, second = load_custom_reward_function(str(path)), load_custom_reward_function(str(path))
    assert log.read_text() == "x" and first("d", "s", "g") == second("d", "s", "g") == 1.0
    path.write_text(textwrap.dedent(body.format("2.0 ")))  # edited (another size): imported again
    assert load_custom_reward_function(str(path))("d", "s", "g") == 2.0 and log.read_text() == "xx"
