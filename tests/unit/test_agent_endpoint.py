"""The OpenAI-compatible endpoint's request handling, through the real ``openai`` client and the real HTTP server,
on a backend that answers scripted token ids (the engine's part is tests/distributed/test_agent_endpoint.py):
a tool call comes back as OpenAI ``tool_calls``; a harness sending the conversation back continues the session
token for token (only the tool message is tokenized); a rewritten history begins a segment of its own and is
counted; bad requests are answered 4xx in one line and the endpoint goes on serving."""

from __future__ import annotations

import json

import httpx
import pytest

from hybridflow.agent.chat import ChatFormat
from hybridflow.agent.endpoint import Endpoint, EndpointSettings, Server
from hybridflow.agent.parsers import get_parser
from hybridflow.agent.sessions import SessionStore

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call><|im_end|>'
CALCULATOR = {"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


class ScriptedBackend:
    """Answers each request with the next scripted text's token ids (log-prob -0.5 each) and records contexts."""

    def __init__(self, tokenizer, texts: list[str]):
        self.tokenizer, self.texts, self.contexts, self.version = tokenizer, list(texts), [], 3
        self.keys = []

    def generate(self, context, sampling, stop_token_ids, key):
        self.contexts.append(list(context))
        self.keys.append(key)
        ids = self.tokenizer(self.texts.pop(0), add_special_tokens=False).input_ids[:sampling.max_new_tokens]
        return ids, [-0.5] * len(ids), self.version


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from hybridflow.models.tiny_qwen2 import build_chat_tokenizer, build_tiny_qwen2

    path = tmp_path_factory.mktemp("tools_model")
    build_tiny_qwen2(path, build_chat_tokenizer(path, tools=True), hidden_size=32, num_layers=1,
                     intermediate_size=64, vocab_multiple=16, max_position_embeddings=256, seed=0)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture
def served(tokenizer):
    import openai

    backend = ScriptedBackend(tokenizer, [CALL, "408<|im_end|>", "12<|im_end|>", "7<|im_end|>", "9<|im_end|>"])
    chat = ChatFormat(tokenizer)
    endpoint = Endpoint(backend, SessionStore(chat, max_sessions=3), get_parser("hermes", tokenizer),
                        EndpointSettings("policy", max_model_len=256))
    server = Server(endpoint)
    url = server.start()
    try:
        yield openai.OpenAI(base_url=url, api_key=endpoint.api_key, max_retries=0), endpoint, backend, url
    finally:
        server.stop()


def test_a_tool_episode_continues_token_for_token(served, tokenizer):
    client, endpoint, backend, _ = served
    assert [m.id for m in client.models.list().data] == ["policy"]
    messages = [{"role": "user", "content": "12*34="}]
    first = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR], max_tokens=64,
                                           extra_body={"session_id": "e1"})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("calculator", {"expression": "12*34"})
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "408"}]
    second = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR], max_tokens=64,
                                            extra_body={"session_id": "e1"})
    assert second.choices[0].message.content == "408" and second.choices[0].finish_reason == "stop"

    session = endpoint.sessions.get("e1")
    (segment,) = session.segments
    assert session.rewrites == 0
    sampled_first = tokenizer(CALL, add_special_tokens=False).input_ids
    tool_turn = ChatFormat(tokenizer).message_ids([{"role": "tool", "content": "408"}])
    # the second request generated from the first's tokens, the sampled ones as sampled, then the tool turn
    assert backend.contexts[1] == backend.contexts[0] + sampled_first + tool_turn
    sampled_second = tokenizer("408<|im_end|>", add_special_tokens=False).input_ids
    assert segment.ids == backend.contexts[1] + sampled_second
    assert sum(segment.sampled) == len(sampled_first) + len(sampled_second) and set(segment.versions) == {-1, 3}
    assert [lp for lp, s in zip(segment.log_probs, segment.sampled) if s] == [-0.5] * sum(segment.sampled)
    assert backend.keys == ["e1/0", "e1/1"]  # each request's seed: its session and its number there


def test_a_rewritten_history_is_a_segment_of_its_own(served):
    client, endpoint, backend, _ = served
    kw = dict(model="policy", tools=[CALCULATOR], max_tokens=64, extra_body={"session_id": "e2"})
    first = client.chat.completions.create(messages=[{"role": "user", "content": "12*34="}], **kw)
    assert first.choices[0].finish_reason == "tool_calls"
    # the harness summarizes the call instead of sending the assistant turn back
    rewritten = [{"role": "user", "content": "12*34="}, {"role": "assistant", "content": "I called a tool"},
                 {"role": "tool", "content": "408"}]
    client.chat.completions.create(messages=rewritten, **kw)
    session = endpoint.sessions.get("e2")
    assert session.rewrites == 1 and len(session.segments) == 2
    # the whole rewritten conversation rendered: the second segment's prompt is the second request's context
    assert session.segments[1].prompt_length == len(backend.contexts[1]) and not any(session.segments[1].sampled[
        :session.segments[1].prompt_length])


def test_bad_requests_are_answered_4xx_and_the_endpoint_goes_on(served):
    import openai

    client, endpoint, _, url = served
    good = dict(model="policy", messages=[{"role": "user", "content": "1+1="}], max_tokens=64)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).chat.completions.create(
            **good, extra_body={"session_id": "x"})
    with pytest.raises(openai.BadRequestError, match="session_id"):
        client.chat.completions.create(**good)
    with pytest.raises(openai.BadRequestError, match="max_tokens 100000"):
        client.chat.completions.create(**{**good, "max_tokens": 100000}, extra_body={"session_id": "x"})
    with pytest.raises(openai.BadRequestError, match="^Error code: 400 .*n: one choice"):
        client.chat.completions.create(**good, n=2, extra_body={"session_id": "x"})
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.chat.completions.create(**good, stream=True, extra_body={"session_id": "x"})
    auth = {"Authorization": f"Bearer {endpoint.api_key}"}
    answer = httpx.post(f"{url}/chat/completions", content=b"{not json", headers=auth)
    assert answer.status_code == 400 and answer.json()["error"]["message"].startswith("malformed JSON")
    answer = httpx.post(f"{url}/chat/completions", content=b"x" * (5 * 2**20), headers=auth)
    assert answer.status_code == 413
    answer = httpx.post(url.removesuffix("/v1") + "/rl/reward", json={"session_id": "nobody", "reward": 1}, headers=auth)
    assert answer.status_code == 404
    served_one = client.chat.completions.create(**good, extra_body={"session_id": "x"})  # still serving
    assert served_one.choices[0].finish_reason == "tool_calls"
    answer = httpx.post(url.removesuffix("/v1") + "/rl/reward", json={"session_id": "x", "reward": 1}, headers=auth)
    assert answer.status_code == 200 and endpoint.sessions.get("x").reward == 1.0
    completion = client.completions.create(model="policy", prompt="1+1=", max_tokens=64, extra_body={"session_id": "y"})
    assert completion.choices[0].text == "408" and endpoint.sessions.get("y").segments[0].prompt_length == 4
    client.chat.completions.create(**good, extra_body={"session_id": "z"})
    with pytest.raises(openai.RateLimitError, match="3 sessions are open"):
        client.chat.completions.create(**good, extra_body={"session_id": "w"})


def _example_agent():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "examples" / "agents" / "calculator_agent.py"
    spec = importlib.util.spec_from_file_location("calculator_agent", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_agent_runs_its_tool_and_its_episode_is_recorded(served, tokenizer):
    """examples/agents/calculator_agent.py, a plain openai-client agent: the model's calculator call is run by the
    agent, its result sent back, the answer scored; the session holds the episode as one segment."""
    _, endpoint, backend, url = served
    agent = _example_agent()
    reward = agent.run_episode({"question": "12*34=", "answer": 408}, url, endpoint.api_key, "episode-1")
    assert reward == 1.0
    session = endpoint.sessions.get("episode-1")
    assert len(session.segments) == 1 and session.rewrites == 0
    tool_turn = ChatFormat(tokenizer).message_ids([{"role": "tool", "content": "408"}])  # the real calculator's
    assert backend.contexts[1] == backend.contexts[0] + tokenizer(CALL, add_special_tokens=False).input_ids + tool_turn
    assert agent.run_episode({"question": "12*34=", "answer": 409}, url, endpoint.api_key, "episode-2") == 0.0


def test_more_requests_than_anyio_threads_reach_the_backend_at_once(tokenizer):
    """Every open session's request can wait in one engine batch: 48 at once, beyond anyio's default 40 threads."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import openai

    n = 48
    together = threading.Barrier(n, timeout=30)

    class Together:
        def generate(self, context, sampling, stop_token_ids, key):
            together.wait()  # answered only once all n wait
            return [5], [-0.1], 0

    endpoint = Endpoint(Together(), SessionStore(ChatFormat(tokenizer), max_sessions=n), get_parser("hermes", tokenizer),
                        EndpointSettings("policy", max_model_len=256))
    server = Server(endpoint)
    client = openai.OpenAI(base_url=server.start(), api_key=endpoint.api_key, max_retries=0)
    try:
        with ThreadPoolExecutor(n) as pool:
            answers = list(pool.map(lambda i: client.completions.create(
                model="policy", prompt=[3, 4], max_tokens=1, extra_body={"session_id": f"s{i}"}), range(n)))
        assert len(answers) == n and not together.broken
    finally:
        server.stop()
