"""The parts of agents as a service during a run that need no engine (the run itself, on the hybrid engine's vLLM:
tests/integration/test_tools_quickstart.py): concurrent endpoint requests become one engine batch with each row's
own budget and stop tokens; recorded episodes become training rows (prompt, sampled and tool tokens, log-probs,
versions, the program's reward; a failed episode keeps a row that trains nothing); an episode's own reward comes
before the run's scorer; the entrypoint and the config rules fail before any worker starts, naming the key."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch

from hybridflow.agent.batching import GroupBackend
from hybridflow.agent.episode_rows import episode_batch
from hybridflow.agent.episodes import EpisodeWorker, Outcome, load_entrypoint
from hybridflow.agent.sessions import Segment, Session
from hybridflow.protocol import Batch
from hybridflow.rewards.episode import EpisodeRewards
from hybridflow.rollout.engine_requests import SamplingSettings


class EchoGroup:
    """A worker group's ``generate`` as the layout goes: each row answers its last prompt token + 1, + 2, ... for
    its ``max_new_tokens`` budget, with log-prob -0.25 each; records the batches it got."""

    def __init__(self):
        self.calls: list[Batch] = []

    def generate(self, rows: Batch) -> Batch:
        self.calls.append(rows)
        width = int(rows.meta["max_new_tokens"])
        resp = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros_like(resp)
        for i, (ids, budget) in enumerate(zip(rows.tensors["input_ids"], rows.tensors["max_new_tokens"])):
            resp[i, :budget] = ids[-1] + 1 + torch.arange(int(budget))
            mask[i, :budget] = 1
        return rows.replace(tensors={"responses": resp, "response_mask": mask,
                                     "rollout_log_probs": -0.25 * mask.float()})


def test_concurrent_requests_are_one_engine_batch_with_their_own_budgets():
    group = EchoGroup()
    backend = GroupBackend(lambda: group, replicas=2, pad_id=0, window_s=5.0)
    backend.started(3)  # the batch goes once the three running episodes wait, long before the window
    results = {}

    def ask(name, context, budget):
        results[name] = backend.generate(context, SamplingSettings(temperature=1.0, max_new_tokens=budget), [7],
                                         f"{name}/0")

    threads = [threading.Thread(target=ask, args=a) for a in (("a", [5, 6], 2), ("b", [9], 3), ("c", [1, 2, 3], 1))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=4)
        assert results == {"a": ([7, 8], [-0.25] * 2, 0), "b": ([10, 11, 12], [-0.25] * 3, 0), "c": ([4], [-0.25], 0)}
        (rows,) = group.calls
        assert len(rows) == 4  # padded to the two replicas
        assert rows.meta["stop_token_ids"] == [7] and rows.meta["max_new_tokens"] == 3
        # a seed of each request's own: the ranks of a TP group sample alike (integration: separate_async_tp2)
        assert len(set(rows.tensors["sample_seed"][:3].tolist())) == 3
        assert backend.requests == 3 and backend.batches == 1
    finally:
        backend.close()


def test_requests_sampled_differently_are_separate_calls_and_an_engine_error_reaches_each():
    group = EchoGroup()
    backend = GroupBackend(lambda: group, replicas=1, pad_id=0, window_s=0.0)
    try:
        assert backend.generate([3], SamplingSettings(temperature=0.0, max_new_tokens=1), [], "s/0")[0] == [4]
        assert backend.generate([3], SamplingSettings(temperature=1.0, max_new_tokens=1), [], "s/0")[0] == [4]
        assert [c.meta["temperature"] for c in group.calls] == [0.0, 1.0]
        group.generate = lambda rows: (_ for _ in ()).throw(RuntimeError("engine down"))
        with pytest.raises(RuntimeError, match="engine down"):
            backend.generate([3], SamplingSettings(max_new_tokens=1), [], "s/0")
    finally:
        backend.close()
    with pytest.raises(RuntimeError, match="stopped serving"):
        backend.generate([3], SamplingSettings(max_new_tokens=1), [], "s/0")


def test_a_pool_stamped_version_is_the_sample_version():
    group = EchoGroup()
    stamp = group.generate
    group.generate = lambda rows: (lambda out: out.replace(tensors={
        "token_policy_versions": torch.where(out.tensors["response_mask"].bool(), 5, -1)}))(stamp(rows))
    backend = GroupBackend(lambda: group, replicas=1, pad_id=0, window_s=0.0)
    backend.version = 2  # the hybrid engine's: used only where the engines do not stamp
    try:
        assert backend.generate([3], SamplingSettings(max_new_tokens=2), [], "s/0")[2] == 5
    finally:
        backend.close()


def _segment(prompt, turns) -> Segment:
    """``turns``: (sampled ids, log-probs, version) or (added ids,)."""
    seg = Segment(prompt_length=len(prompt))
    seg.extend(prompt)
    for t in turns:
        seg.extend(*t)
    return seg


def _rows(n, width=4):
    ids = torch.arange(1, n * width + 1).reshape(n, width)
    return Batch.from_dict(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                           non_tensors={"uid": np.array(["g"] * n, dtype=object)})


def test_episodes_become_rows_of_their_last_segment():
    tool = Session(segments=[_segment([1, 2], [([3], [-1.0], 0)]),  # rewritten away: counted, not trained
                             _segment([1, 2, 9], [([3, 4], [-0.5, -0.7], 1), ([20, 21],), ([5], [-0.1], 2)])],
                   rewrites=1, reward=0.5)
    plain = Session(segments=[_segment([8], [([6, 6], [-0.2, -0.3], 2)])])
    rows, counts = episode_batch(_rows(2), [tool, plain], [Outcome(), Outcome(reward=1.0)], max_prompt_length=4,
                                 max_response_length=4, pad_id=0)
    t = rows.tensors
    assert t["prompts"].tolist() == [[0, 1, 2, 9], [0, 0, 0, 8]]
    assert t["responses"].tolist() == [[3, 4, 20, 21], [6, 6, 0, 0]]  # cut at max_response_length
    assert t["response_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 0, 0]]
    assert t["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 0, 0]]
    assert t["position_ids"][0].tolist() == [0, 0, 1, 2, 3, 4, 5, 6]
    assert torch.allclose(t["rollout_log_probs"][0], torch.tensor([-0.5, -0.7, 0.0, 0.0]))
    assert t["token_policy_versions"].tolist() == [[1, 1, -1, -1], [2, 2, -1, -1]]
    assert t["episode_reward"].tolist() == [0.5, 1.0]  # posted, returned
    assert counts["agent/rewrites"] == 1 and counts["agent/reward_from_program"] == 2


def test_a_dropped_episode_keeps_a_row_that_trains_nothing_in_a_group_of_its_own():
    ok = Session(segments=[_segment([1], [([2], [-0.5], 0)])])
    long_prompt = Session(segments=[_segment([1, 2, 3, 4, 5], [([2], [-0.5], 0)])])
    rows, counts = episode_batch(_rows(4), [ok, None, long_prompt, ok],
                                 [Outcome(reward=1.0), Outcome(error="timeout"), Outcome(), Outcome(error="ValueError: x")],
                                 max_prompt_length=4, max_response_length=2, pad_id=0)
    t = rows.tensors
    assert t["response_mask"].sum(-1).tolist() == [1, 0, 0, 0]
    assert t["prompts"][1].tolist() == _rows(4).tensors["input_ids"][1].tolist()  # the task's own prompt
    assert list(rows.non_tensors["uid"]) == ["g", "g/dropped1", "g/dropped2", "g/dropped3"]
    assert math.isnan(t["episode_reward"][1])
    assert (counts["agent/episodes_timeout"], counts["agent/episodes_failed"], counts["agent/episodes_prompt_too_long"]
            ) == (1, 1, 1)


def test_an_episode_reward_comes_before_the_run_scorer():
    scored = Batch.from_dict(tensors={"scores": torch.tensor([0.0, 0.25]), "episode_reward": torch.tensor([1.0, math.nan]),
                                      "response_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])})
    out = EpisodeRewards.apply(scored).tensors
    assert out["scores"].tolist() == [1.0, 0.25]
    assert out["token_level_scores"].tolist() == [[0.0, 1.0, 0.0], [0.25, 0.0, 0.0]]


def test_the_entrypoint_loads_by_path_or_module_and_fails_naming_the_key(tmp_path, monkeypatch):
    assert load_entrypoint("examples/agents/calculator_agent.py:run_episode").__name__ == "run_episode"
    (tmp_path / "my_harness.py").write_text("def episode(task, base_url, api_key, session_id):\n    return 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_entrypoint("my_harness:episode")({}, "u", "k", "s") == 0.5
    (tmp_path / "bad.py").write_text("def episode(task):\n    return 1.0\n\nraise_later = 1\n")
    (tmp_path / "broken.py").write_text("import no_such_module_here\n")
    for entry, message in ((f"{tmp_path}/bad.py:episode", "must take"), (f"{tmp_path}/bad.py:missing", "no function"),
                           (f"{tmp_path}/none.py:f", "no file"), (f"{tmp_path}/broken.py:f", "importing"),
                           ("no_such_package.mod:f", "importing")):
        with pytest.raises(ValueError, match=f"agent.entrypoint.*{message}"):
            load_entrypoint(entry)


def test_an_episode_that_raises_or_returns_a_non_number_is_an_error_outcome(tmp_path):
    (tmp_path / "agents.py").write_text(
        "def boom(task, base_url, api_key, session_id):\n    raise KeyError('answer')\n"
        "def word(task, base_url, api_key, session_id):\n    return 'yes'\n"
        "def fine(task, base_url, api_key, session_id):\n    return task['x']\n"
        "def wrapped(task, base_url, api_key, session_id):\n"
        "    try:\n        raise TimeoutError('connect timed out')\n"
        "    except TimeoutError as e:\n        raise RuntimeError('Connection error.') from e\n")
    run = lambda name, task: EpisodeWorker(f"{tmp_path}/agents.py:{name}").run(task, "u", "k", "s")  # noqa: E731
    assert run("boom", {}).error == "KeyError: 'answer'"
    assert "not a number" in run("word", {}).error
    assert run("fine", {"x": 2}).reward == 2.0 and run("fine", {"x": None}).reward is None
    # a client's error that wraps its cause says it
    assert run("wrapped", {}).error == "RuntimeError: Connection error. (TimeoutError: connect timed out)"


@pytest.mark.parametrize("overrides,message", [
    (["rollout.multi_turn.enable=true", "rollout.multi_turn.tool_config_path=configs/tools/calculator.yaml"],
     "rollout.multi_turn.enable=false"),
    (["schedule.mode=colocate_async"], "not served to agent programs"),
    (["algorithm.adv_estimator=remax"], "ReMax"),
    (["agent.entrypoint=no_colon"], "expected path"),
])
def test_config_rules_of_an_agent_program(overrides, message):
    from hybridflow.plan import load_experiment, resolve

    with pytest.raises(ValueError, match=message):
        resolve(load_experiment(["configs/quickstart_agent_server_cpu.yaml"], overrides))
