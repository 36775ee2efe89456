"""The OpenAI-compatible endpoint on a real vLLM engine, driven by the real ``openai`` client: a two-turn episode
(the harness sends the assistant turn back with a tool result) is one segment whose tokens are the rendered
prompt, the sampled tokens as sampled, and the tool turn as the chat template renders it; every sampled token's
recorded log-prob is transformers' on those tokens (fp32 rule)."""

from __future__ import annotations

import torch

from hybridflow.spawn import run_ranks

CALCULATOR = {"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def _rank_fn(rank, world, hf_dir):
    import openai
    from transformers import AutoTokenizer

    from hybridflow.agent.chat import ChatFormat
    from hybridflow.agent.endpoint import Endpoint, EndpointSettings, RolloutBackend, Server
    from hybridflow.agent.parsers import get_parser
    from hybridflow.agent.sessions import SessionStore
    from hybridflow.rollout.vllm_rollout import VLLMRollout
    from hybridflow.workers.common import load_hf_folder

    tok = AutoTokenizer.from_pretrained(hf_dir)
    rollout = VLLMRollout(hf_dir, max_model_len=256, seed=0)
    rollout.update_weights(load_hf_folder(hf_dir)[1])
    endpoint = Endpoint(RolloutBackend(rollout, version=0), SessionStore(ChatFormat(tok)), get_parser("hermes", tok),
                        EndpointSettings("policy", max_model_len=256))
    server = Server(endpoint)
    client = openai.OpenAI(base_url=server.start(), api_key=endpoint.api_key, max_retries=0)
    try:
        messages = [{"role": "user", "content": "12*34="}]
        kw = dict(model="policy", tools=[CALCULATOR], max_tokens=24, temperature=1.0, extra_body={"session_id": "e"})
        first = client.chat.completions.create(messages=messages, **kw)
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": "call_0", "content": "408"}]
        client.chat.completions.create(messages=messages, **kw)
        try:
            client.chat.completions.create(messages=messages, **{**kw, "max_tokens": 10**6})
            refused = None
        except openai.BadRequestError as e:
            refused = e.message
        after = client.chat.completions.create(messages=[{"role": "user", "content": "1+1="}],
                                               **{**kw, "extra_body": {"session_id": "f"}})
        session = endpoint.sessions.get("e")
    finally:
        server.stop()
        rollout.close()
    (segment,) = session.segments
    return dict(ids=segment.ids, sampled=segment.sampled, log_probs=segment.log_probs, versions=segment.versions,
                prompt_length=segment.prompt_length, rewrites=session.rewrites, refused=refused,
                served_after=after.usage.completion_tokens)


def test_an_episode_through_the_openai_client_is_recorded_as_sampled(tmp_path):
    from transformers import AutoModelForCausalLM

    from hybridflow.models.tiny_qwen2 import build_chat_tokenizer, build_tiny_qwen2
    from tests.numerics import assert_close

    build_tiny_qwen2(tmp_path, build_chat_tokenizer(tmp_path, tools=True), hidden_size=128, num_layers=2,
                     intermediate_size=256, vocab_multiple=16, max_position_embeddings=256, seed=0)
    (got,) = run_ranks(_rank_fn, 1, str(tmp_path), timeout=300)
    assert got["rewrites"] == 0, "the harness sent the conversation back as returned: one segment"
    assert got["refused"] and "max_tokens 1000000" in got["refused"]
    assert got["served_after"] > 0, "a refused request leaves the engine serving"
    ids, sampled = torch.tensor(got["ids"]), torch.tensor(got["sampled"])
    assert not sampled[:got["prompt_length"]].any() and sampled.sum() > 0
    assert set(got["versions"]) <= {-1, 0} and (torch.tensor(got["versions"]) == 0).eq(sampled).all()
    model = AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    with torch.no_grad():
        logits = model(ids[None]).logits[0]
    positions = torch.nonzero(sampled)[:, 0]
    expected = torch.log_softmax(logits[positions - 1], -1).gather(1, ids[positions, None])[:, 0]
    assert_close(torch.tensor(got["log_probs"])[sampled], expected, dtype=torch.float32, slack=4,
                 what="recorded log-probs")
