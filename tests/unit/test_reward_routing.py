"""Rule scorers routed per row by data source, as verl's default_compute_score routes them; unknown
sources are a one-line error when the data is loaded, before a run starts."""

import numpy as np
import pytest
import torch

from hybridflow.protocol import Batch
from hybridflow.rewards import SourceRouter, get_scorer, gsm8k, math_dapo, register_scorer
from hybridflow.rewards.routing import MATH_SOURCES


@register_scorer("test_routing_constant")
def constant(response: str, answer: str) -> float:
    return 0.5


def test_gsm8k_source_uses_the_verl_identical_scorer():
    router = SourceRouter("arithmetic")
    responses = ["so #### 42", "#### 41", "42", "#### 1,000", "#### 42.0"]
    truths = ["42", "42", "42", "1000", "42"]
    assert router.score_all(responses, truths, ["openai/gsm8k"] * 5) == [
        gsm8k.compute_score(r, t) for r, t in zip(responses, truths)] == [1.0, 0.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize("source", MATH_SOURCES)
def test_math_sources_use_math_verify(source):
    router = SourceRouter("arithmetic")
    assert router.scorer_name(source) == "math_verify"
    cases = [  # (response, ground truth, score): equivalence, not string equality
        ("The answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", 1.0),
        ("So we get \\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("Thus $x = \\boxed{\\sqrt{4}}$", "2", 1.0),
        ("\\boxed{(1, 2)}", "(1,2)", 1.0),
        ("The answer is \\boxed{3}", "\\frac{1}{2}", 0.0),
        ("I do not know.", "2", 0.0),
    ]
    responses, truths, expected = zip(*cases)
    assert router.score_all(list(responses), list(truths), [source] * len(cases)) == list(expected)


@pytest.mark.parametrize("source", ["math_dapo", "math", "math_dapo_reasoning", "aime2024", "aime25"])
def test_dapo_sources(source):
    router = SourceRouter("arithmetic")
    assert router.scorer_name(source) == "math_dapo"
    cases = [  # verl's math_dapo: +1 correct, -1 otherwise; "Answer:" first, then the last \boxed{}
        ("Reasoning...\nAnswer: 42", "42", 1.0),
        ("Answer: $\\frac{1}{2}$", "\\frac{1}{2}", 1.0),
        ("Answer: 1,000 dollars", "1000", 1.0),  # Minerva normalization drops units and commas
        ("Answer: 41", "42", -1.0),
        ("so \\boxed{42}", "42", 1.0),  # no "Answer:" line: the boxed fallback
        ("nothing here", "42", -1.0),
    ]
    responses, truths, expected = zip(*cases)
    assert router.score_all(list(responses), list(truths), [source] * len(cases)) == list(expected)
    assert math_dapo.compute_score("Answer: 7", "7") == {"score": 1.0, "acc": True, "pred": "7"}


def test_rows_without_a_source_and_the_quickstart_task_use_reward_name():
    router = SourceRouter("test_routing_constant")
    assert router.score_all(["x", "#### 3", "85"], ["1", "3", "85"], [None, "openai/gsm8k", "arithmetic"]) == [
        0.5, 1.0, 0.5]
    assert router.score_all(["x"], ["1"]) == [0.5]  # no source column at all
    assert SourceRouter("arithmetic").score_all(["85"], ["85"], ["arithmetic"]) == [1.0]


def test_unknown_source_is_one_line_naming_the_row():
    router = SourceRouter("arithmetic", source_key="task")
    with pytest.raises(ValueError) as e:
        router.check(["openai/gsm8k", "openai/gsm8k", "my/task"], where=lambda row: f"train.parquet row {row}")
    message = str(e.value)
    assert message.startswith("train.parquet row 2: task 'my/task' is not scorable (no scorer is routed to it; "
                              "known: openai/gsm8k, lighteval/MATH, ")
    assert message.endswith("or none for reward.name='arithmetic'); score it with custom_reward_function.path")
    assert "\n" not in message
    with pytest.raises(ValueError, match="'hiyouga/geometry3k' is not scorable \\(verl routes it to a scorer "
                                         "hybridflow does not carry;"):
        router.check(["hiyouga/geometry3k"])
    with pytest.raises(ValueError, match="'codecontests' is not scorable \\(a code source: set "
                                         "reward.sandbox_fusion.url"):
        router.check(["codecontests"])
    router.check(["openai/gsm8k", None, "arithmetic", "aime_2025", "HuggingFaceH4/MATH-500"])  # all fine
    with pytest.raises(KeyError, match="unknown reward scorer 'nope'"):
        SourceRouter("nope")


def test_check_dataset_names_file_and_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hybridflow.data.dataset import PromptDataset
    from hybridflow.models.char_tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer(tmp_path / "tok")
    good, bad = tmp_path / "good.parquet", tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["Q: 1+1= A:"], "answer": ["2"], "data_source": ["openai/gsm8k"]}), good)
    pq.write_table(pa.table({"prompt": ["Q: 1+1= A:"] * 2, "answer": ["2"] * 2,
                             "data_source": ["arithmetic", "x"]}), bad)
    data = PromptDataset([str(good), str(bad)], tokenizer, prompt_key="prompt", max_prompt_length=16)
    with pytest.raises(ValueError, match=rf"^{bad} row 1: data_source 'x' is not scorable"):
        SourceRouter("arithmetic").check_dataset(data)
    SourceRouter("arithmetic", source_key="no_such_column").check_dataset(data)  # no column: reward.name


def test_score_responses_routes_each_row(tmp_path):
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.trainer.experience import score_responses

    tokenizer = build_char_tokenizer(tmp_path / "tok")
    responses = ["#### 4", "answer: 4", "4", "#### 4"]
    ids = torch.tensor([tokenizer(r.ljust(9)).input_ids for r in responses])
    mask = torch.tensor([[1] * len(r) + [0] * (9 - len(r)) for r in responses])
    batch = Batch.from_dict(
        tensors={"responses": ids, "response_mask": mask},
        non_tensors={"answer": np.array(["4", "4", "4", "5"], dtype=object),
                     "task": np.array(["openai/gsm8k", "math_dapo", None, "openai/gsm8k"], dtype=object)})
    out = score_responses(batch, tokenizer, SourceRouter("arithmetic", source_key="task"))
    assert out.tensors["scores"].tolist() == [1.0, 1.0, 1.0, 0.0]  # gsm8k, math_dapo, reward.name, gsm8k
    assert out.tensors["token_level_scores"][0, 5] == 1.0 and out.tensors["token_level_scores"][0].sum() == 1.0


def test_registered_names():
    assert get_scorer("math_verify")("\\boxed{2}", "2") == 1.0
    assert get_scorer("math_dapo")("Answer: 2", "3") == -1.0


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2_chat

    out = tmp_path_factory.mktemp("chat_model")
    build_tiny_qwen2_chat(out, num_layers=1, max_position_embeddings=64)
    return out


def _preflight_cfg(chat_model, tmp_path, val_source, *overrides):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hybridflow.plan import load_experiment

    def rows(n, source):
        return [{"data_source": source, "prompt": [{"role": "user", "content": f"{i}+1="}],
                 "reward_model": {"style": "rule", "ground_truth": str(i + 1)}} for i in range(n)]

    pq.write_table(pa.Table.from_pylist(rows(4, "openai/gsm8k")), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows(2, val_source)), tmp_path / "val.parquet")
    return load_experiment(["configs/quickstart_cpu.yaml"], [
        f"model.path={chat_model}", f"data.train_files=[{tmp_path}/train.parquet]",
        f"data.val_files=[{tmp_path}/val.parquet]", f"trainer.output_dir={tmp_path}/run", "prepare.enable=false",
        "data.batch_size=4", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=4",
        "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=4", "data.max_prompt_length=24",
        "data.max_response_length=8", *overrides])


def test_preflight_refuses_an_unknown_validation_source(chat_model, tmp_path):
    from hybridflow.config import ConfigError
    from hybridflow.trainer.preflight import check_files

    cfg = _preflight_cfg(chat_model, tmp_path, "my/task")
    with pytest.raises(ConfigError) as e:
        check_files(cfg)
    assert str(e.value).startswith(f"data.val_files: {tmp_path}/val.parquet row 0: data_source 'my/task' is not "
                                   "scorable (no scorer is routed to it;")
    # a custom reward function scores every source: nothing to refuse
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    assert len(check_files(_preflight_cfg(chat_model, tmp_path, "my/task", f"custom_reward_function.path={reward}"))[2]) == 4
    assert len(check_files(_preflight_cfg(chat_model, tmp_path, "lighteval/MATH"))[2]) == 4
