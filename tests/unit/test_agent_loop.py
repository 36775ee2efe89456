"""The agent loop's parts: tool-call parsing, the chat template's turns, truncation of tool output, and the
trajectory's tokens, mask and log-probs (sampled ids as the engine returned them, tool messages as the template
renders them)."""

from __future__ import annotations

import json

import pytest
import torch

from hybridflow.agent.chat import ChatFormat, truncate_tool_response
from hybridflow.agent.loop import AgentLoop, AgentSettings, trajectory_columns
from hybridflow.agent.parsers import get_parser
from hybridflow.rollout.vllm_rollout import SamplingSettings


def call_text(name="calculator", **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


# --- parsing ------------------------------------------------------------------------------------------

def test_hermes_parses_one_and_several_calls():
    parser = get_parser("hermes")
    (call,) = parser.parse("let me compute " + call_text(expression="1+2"))
    assert (call.name, call.arguments, call.error) == ("calculator", {"expression": "1+2"}, None)
    calls = parser.parse(call_text(expression="1+2") + "\n" + call_text("python", code="print(3)"))
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "1+2"}),
                                                      ("python", {"code": "print(3)"})]
    assert parser.parse("the answer is 3") == []
    # arguments JSON-encoded as a string, as some models write them
    (call,) = parser.parse('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2*3\\"}"}</tool_call>')
    assert call.arguments == {"expression": "2*3"} and call.error is None


@pytest.mark.parametrize("text, why", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>', "invalid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', "expected"),
    ('<tool_call>["calculator"]</tool_call>', "expected"),
    ('<tool_call>{"name": "calculator", "arguments": [1, 2]}</tool_call>', "not a JSON object"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+', "without </tool_call>"),
])
def test_hermes_reports_malformed_calls(text, why):
    (call,) = get_parser("hermes").parse(text)
    assert call.error and why in call.error, call


def test_a_valid_call_beside_a_malformed_one_keeps_both():
    calls = get_parser("hermes").parse(call_text(expression="1+1") + "<tool_call>{oops}</tool_call>")
    assert calls[0].error is None and calls[1].error.startswith("malformed tool call")


def test_unknown_format_is_one_line():
    with pytest.raises(ValueError, match="rollout.multi_turn.format: unknown tool-call format 'xml'"):
        get_parser("xml")


# --- the chat template --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    """A tiny random Qwen2 whose char-level ChatML template has Hermes tool tokens (the tools quickstart's)."""
    from transformers import AutoTokenizer

    from hybridflow.models.tiny_qwen2 import build_chat_tokenizer, build_tiny_qwen2

    path = tmp_path_factory.mktemp("tools_model")
    build_tiny_qwen2(path, build_chat_tokenizer(path, tools=True), hidden_size=64, num_layers=1,
                     intermediate_size=128, vocab_multiple=16, max_position_embeddings=256, seed=0)
    return path, AutoTokenizer.from_pretrained(path)


def test_chat_format_finds_the_turn_end_and_renders_tool_messages(tools_model):
    _, tok = tools_model
    chat = ChatFormat(tok)
    assert chat.end_of_turn == "<|im_end|>" and chat.stop_token_ids == [tok.convert_tokens_to_ids("<|im_end|>")]
    ids = chat.tool_message_ids(["5535", "error"])
    # the template's tool turns after the assistant's <|im_end|>, and the next generation prompt (this
    # tokenizer drops whitespace, see models/tiny_qwen2.py build_chat_tokenizer)
    assert tok.decode(ids) == ("<|im_start|>user<tool_response>5535</tool_response><|im_end|>"
                               "<|im_start|>user<tool_response>error</tool_response><|im_end|><|im_start|>assistant")
    # rendering the whole conversation gives the same tokens as the prompt + sampled turn + tool message
    conversation = [{"role": "user", "content": "1*2="},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1*2"}}}]},
                    {"role": "tool", "content": "2"}]
    whole = tok(chat.render(conversation, add_generation_prompt=True), add_special_tokens=False).input_ids
    prompt = tok(chat.render(conversation[:1], add_generation_prompt=True), add_special_tokens=False).input_ids
    turn = tok(call_text(expression="1*2"), add_special_tokens=False).input_ids + [chat.end_of_turn_id]
    assert prompt + turn + chat.tool_message_ids(["2"]) == whole


def test_a_template_that_rewrites_earlier_turns_is_refused(tools_model):
    _, tok = tools_model
    rewriting = tok.__class__.from_pretrained(tools_model[0])
    # drops the assistant's end-of-turn once a tool message follows it: the trajectory cannot be extended
    rewriting.chat_template = (
        "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + (m['content'] or '') }}"
        "{%- if not (m['role'] == 'assistant' and not loop.last) %}{{- '<|im_end|>' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant' }}{%- endif %}")
    with pytest.raises(ValueError, match="renders an assistant turn differently"):
        ChatFormat(rewriting).tool_message_ids(["1"])


def test_no_chat_template_is_one_line(tools_model):
    _, tok = tools_model
    plain = tok.__class__.from_pretrained(tools_model[0])
    plain.chat_template = None
    with pytest.raises(ValueError, match="rollout.multi_turn needs a chat template"):
        ChatFormat(plain)


@pytest.mark.parametrize("side, expected", [("left", "(truncated)...6789"), ("right", "0123...(truncated)"),
                                            ("middle", "01...(truncated)...89")])
def test_tool_output_truncation(side, expected):
    assert truncate_tool_response("0123456789", 4, side) == (expected, True)
    assert truncate_tool_response("0123", 4, side) == ("0123", False)


# --- the trajectory -----------------------------------------------------------------------------------

class ScriptedPolicy:
    """An engine whose turns are given: ``turns[k]`` is the text of every trajectory's k-th assistant turn (a
    stand-in for a model's choices, to reach each branch of the loop; the real engines are tested with
    models: below with transformers, in tests/integration/test_tools_quickstart.py with vLLM). Records what
    it was asked and what it returned."""

    def __init__(self, tok, turns: list[str], end_turn: bool = True):
        self.tok, self.turns, self.end_turn, self.calls = tok, turns, end_turn, []

    def generate_with_log_probs(self, prompts, sampling, *, log_probs, max_new_tokens, stop_token_ids):
        out = []
        for context, budget in zip(prompts, max_new_tokens):
            turn = self._turn_index(context)
            ids = self.tok(self.turns[turn], add_special_tokens=False).input_ids
            ids = (ids + ([stop_token_ids[0]] if self.end_turn else []))[:budget]
            out.append((ids, [-0.5 - 0.01 * i for i in range(len(ids))] if log_probs else None))
        self.calls.append((list(prompts), [o[0] for o in out]))
        return out

    def _turn_index(self, context) -> int:
        return (sum(1 for tok in context if tok == self.tok.convert_tokens_to_ids("<|im_start|>")) - 2) // 2


def make_loop(tok, tools=None, **limits):
    from hybridflow.agent.tools import load_tools

    settings = dict(max_response_length=200, max_assistant_turns=None, max_user_turns=None, max_parallel_calls=1,
                    max_tool_response_length=256, tool_response_truncate_side="middle")
    settings.update(limits)
    return AgentLoop(tok, tools if tools is not None else load_tools("configs/tools/calculator.yaml"),
                     get_parser("hermes"), AgentSettings(**settings), ChatFormat(tok))


def prompt_ids(tok, question="12*34="):
    return tok(tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                       tokenize=False), add_special_tokens=False).input_ids


def test_call_tool_then_answer(tools_model):
    _, tok = tools_model
    loop, chat = make_loop(tok), ChatFormat(tok)
    engine = ScriptedPolicy(tok, [call_text(expression="12*34"), "408"])
    prompt = prompt_ids(tok)
    (t,) = loop.run(engine, [prompt], SamplingSettings(), log_probs=True)
    first, second = engine.calls[0][1][0], engine.calls[1][1][0]
    tool = chat.tool_message_ids(["408"])
    # token-in, token-out: the sampled ids as returned, the tool message as rendered, nothing re-tokenized
    assert t.response_ids == first + tool + second
    assert t.response_mask == [1] * len(first) + [0] * len(tool) + [1] * len(second)
    assert engine.calls[1][0][0] == prompt + first + tool  # the second turn continues the token context
    assert t.log_probs[len(first): len(first) + len(tool)] == [0.0] * len(tool)
    assert t.log_probs[: len(first)] == pytest.approx([-0.5 - 0.01 * i for i in range(len(first))])
    assert (t.assistant_turns, t.user_turns, t.tool_calls, dict(t.tool_errors)) == (2, 1, 1, {})
    tensors, non_tensors = trajectory_columns([t])
    assert tensors["agent_assistant_turns"].tolist() == [2] and non_tensors["agent_tool_errors"][0] == {}


class RoutedPolicy(ScriptedPolicy):
    """A ScriptedPolicy that also routes, as a MoE engine with routed_experts does: every token of the context and
    of the turn but the last, each to the expert numbered by its position."""

    routed_experts = True

    def generate_with_log_probs(self, prompts, sampling, *, with_routes=False, **kw):
        assert with_routes
        outs = super().generate_with_log_probs(prompts, sampling, **kw)
        return [(ids, lps, torch.arange(len(p) + len(ids) - 1, dtype=torch.int16)[:, None, None].expand(-1, 2, 1))
                for p, (ids, lps) in zip(prompts, outs)]


def test_a_trajectorys_routes_are_its_last_requests_and_land_on_its_tokens(tools_model):
    """R3 with the agent: the last turn's request routed the prompt, every earlier turn and tool message again;
    trajectories_to_batch lays them on the row's cells (the last token, never fed, has none)."""
    from hybridflow.megatron.routing import NO_ROUTE
    from hybridflow.protocol import Batch
    from hybridflow.workers.generation import trajectories_to_batch

    _, tok = tools_model
    prompt = prompt_ids(tok)
    (t,) = make_loop(tok).run(RoutedPolicy(tok, [call_text(expression="12*34"), "408"]), [prompt], SamplingSettings(),
                              log_probs=True)
    n = len(prompt) + len(t.response_ids)
    assert t.routes.shape == (n - 1, 2, 1)
    P, R = len(prompt) + 2, len(t.response_ids) + 3
    ids = torch.tensor([[0, 0] + prompt])
    batch = trajectories_to_batch(Batch.from_dict(tensors={"input_ids": ids, "attention_mask": (ids != 0).long()}),
                                  [t], R, 0)
    grid = batch.tensors["routed_experts"][0, :, 0, 0].tolist()
    assert grid == [NO_ROUTE] * 2 + list(range(n - 1)) + [NO_ROUTE] * (R - len(t.response_ids) + 1)
    assert len(grid) == P + R


def test_several_calls_in_a_turn_run_up_to_max_parallel_calls(tools_model):
    _, tok = tools_model
    chat = ChatFormat(tok)
    two = call_text(expression="1+1") + call_text(expression="2+2")
    for parallel, responses in ((1, ["2"]), (2, ["2", "4"])):
        engine = ScriptedPolicy(tok, [two, "6"])
        (t,) = make_loop(tok, max_parallel_calls=parallel).run(engine, [prompt_ids(tok)], SamplingSettings(), log_probs=False)
        first = engine.calls[0][1][0]
        assert t.response_ids[len(first): len(first) + len(chat.tool_message_ids(responses))] == chat.tool_message_ids(responses)
        assert t.tool_calls == parallel


@pytest.mark.parametrize("turn, kind, message", [
    ('<tool_call>{"name": "calculator", "arguments": {</tool_call>', "malformed_call", "Error: malformed tool call"),
    (call_text("search", query="x"), "unknown_tool", "Error: unknown tool 'search'"),
    (call_text(expression=12), "bad_arguments", "Error: argument 'expression' must be of type string"),
    (call_text(expression="1/0"), "exception", "Error: division by zero"),
])
def test_bad_calls_answer_the_model_with_an_error(tools_model, turn, kind, message):
    _, tok = tools_model
    engine = ScriptedPolicy(tok, [turn, "0"])
    (t,) = make_loop(tok).run(engine, [prompt_ids(tok)], SamplingSettings(), log_probs=False)
    first = engine.calls[0][1][0]
    tool_text = tok.decode(t.response_ids[len(first):][: t.response_mask[len(first):].index(1)])
    assert message.replace(" ", "") in tool_text.replace(" ", ""), tool_text  # this tokenizer drops spaces
    assert t.assistant_turns == 2 and dict(t.tool_errors) == {kind: 1}, t.tool_errors


def test_turn_limits_and_the_response_budget_end_trajectories(tools_model):
    _, tok = tools_model
    chat = ChatFormat(tok)
    turns = [call_text(expression="1+1")] * 5
    (t,) = make_loop(tok, max_assistant_turns=2).run(ScriptedPolicy(tok, turns), [prompt_ids(tok)], SamplingSettings(),
                                                     log_probs=False)
    assert (t.assistant_turns, t.user_turns) == (2, 1)  # the second turn's call is not run
    (t,) = make_loop(tok, max_user_turns=1).run(ScriptedPolicy(tok, turns), [prompt_ids(tok)], SamplingSettings(),
                                                log_probs=False)
    assert (t.assistant_turns, t.user_turns) == (2, 1)
    call = len(tok(call_text(expression="1+1"), add_special_tokens=False).input_ids) + 1
    tool = len(chat.tool_message_ids(["2"]))
    # the tool message would reach the budget: the trajectory ends without it (verl's rule)
    (t,) = make_loop(tok, max_response_length=call + tool).run(ScriptedPolicy(tok, turns), [prompt_ids(tok)],
                                                               SamplingSettings(), log_probs=False)
    assert (len(t.response_ids), t.assistant_turns, t.tool_calls) == (call, 1, 1)
    # a turn cut by the budget mid-call: not parsed, not run
    (t,) = make_loop(tok, max_response_length=call - 5).run(ScriptedPolicy(tok, turns), [prompt_ids(tok)],
                                                            SamplingSettings(), log_probs=False)
    assert (len(t.response_ids), t.tool_calls) == (call - 5, 0)


def test_long_tool_output_is_truncated(tools_model):
    from hybridflow.agent.tools import Tool

    class Flood(Tool):
        def run(self, arguments):
            return "x" * 10_000

    _, tok = tools_model
    schema = {"type": "function", "function": {"name": "flood", "parameters": {"type": "object", "properties": {}}}}
    loop = make_loop(tok, tools={"flood": Flood({}, schema)}, max_tool_response_length=20, tool_response_truncate_side="right")
    engine = ScriptedPolicy(tok, [call_text("flood"), "done"])
    (t,) = loop.run(engine, [prompt_ids(tok)], SamplingSettings(), log_probs=False)
    first = engine.calls[0][1][0]
    assert t.response_ids[len(first):len(first) + 30] == ChatFormat(tok).tool_message_ids(["x" * 20 + "...(truncated)"])[:30]
    assert t.truncated_tool_responses == 1


def test_sampled_tokens_and_log_probs_are_the_models(tools_model):
    """With a real model (transformers): every sampled token and its log-prob as the model gives them to the
    trainer's forward over the whole trajectory."""
    from transformers import AutoModelForCausalLM

    from hybridflow.agent.hf_engine import HFEngine

    path, tok = tools_model
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    loop = make_loop(tok, max_response_length=24)
    prompts = [prompt_ids(tok, q) for q in ("12*34=", "5*6=", "100*20=")]
    torch.manual_seed(0)
    trajectories = loop.run(HFEngine(model, tok.pad_token_id), prompts, SamplingSettings(temperature=1.0),
                            log_probs=True)
    for t in trajectories:
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(t.prompt_ids) - 1:-1].float()
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(t.response_ids)[:, None])[:, 0]
        sampled = torch.tensor(t.response_mask, dtype=torch.bool)
        from tests.numerics import assert_close

        assert_close(torch.tensor(t.log_probs)[sampled], expected[sampled], dtype=torch.float32, what="log-probs")
