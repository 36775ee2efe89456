"""verl 0.9.1's nine tool-call formats (``rollout.multi_turn.format``: hermes, gpt-oss, qwen3_coder, glm, seed,
minimax, kimi, deepseek_v4, gemma4): each reads an assistant turn as its family's chat template renders a tool call
(reasoning or text around it, one or two calls), converts parameters by the tools' schemas where the format writes
them as text, reports a call it cannot read as malformed, and resolves from a verl command line."""

from __future__ import annotations

import pytest

from hybridflow.agent.parsers import PARSERS, ToolCall, check_format, get_parser
from hybridflow.config.verl import translate
from hybridflow.plan import load_experiment

VERL_FORMATS = ("hermes", "gpt-oss", "qwen3_coder", "glm", "seed", "minimax", "kimi", "deepseek_v4", "gemma4")

TOOLS = [
    {"type": "function", "function": {"name": "calculator", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
]

# An assistant turn calling calculator(expression="2+2") then add(a=2, b=3), as each family's chat template renders
# tool calls (the formats of the models' own templates; vLLM's parser of each reads exactly these).
TURNS = {
    "hermes": 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    "gpt-oss": "<|channel|>analysis<|message|>Two sums: call the tools.<|end|>"
               '<|start|>assistant<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>'
               '{"expression": "2+2"}<|call|>'
               '<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a": 2, "b": 3}<|call|>',
    "qwen3_coder": "Let me compute.\n<tool_call>\n<function=calculator>\n<parameter=expression>\n2+2\n</parameter>\n"
                   "</function>\n</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n"
                   "<parameter=b>\n3\n</parameter>\n</function>\n</tool_call>",
    "glm": "Let me compute.<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>2+2</arg_value>\n"
           "</tool_call><tool_call>add\n<arg_key>a</arg_key>\n<arg_value>2</arg_value>\n<arg_key>b</arg_key>\n"
           "<arg_value>3</arg_value>\n</tool_call>",
    "seed": "Let me compute.<seed:tool_call>\n<function=calculator>\n<parameter=expression>2+2</parameter>\n"
            "</function>\n</seed:tool_call><seed:tool_call>\n<function=add>\n<parameter=a>2</parameter>\n"
            "<parameter=b>3</parameter>\n</function>\n</seed:tool_call>",
    "minimax": 'Let me compute.\n<minimax:tool_call>\n<invoke name="calculator">\n<parameter name="expression">2+2'
               '</parameter>\n</invoke>\n<invoke name="add">\n<parameter name="a">2</parameter>\n'
               '<parameter name="b">3</parameter>\n</invoke>\n</minimax:tool_call>',
    "kimi": "Let me compute.<|tool_calls_section_begin|><|tool_call_begin|>functions.calculator:0"
            '<|tool_call_argument_begin|>{"expression": "2+2"}<|tool_call_end|><|tool_call_begin|>functions.add:1'
            '<|tool_call_argument_begin|>{"a": 2, "b": 3}<|tool_call_end|><|tool_calls_section_end|>',
    "deepseek_v4": "Let me compute.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"calculator\">\n"
                   "<｜DSML｜parameter name=\"expression\" string=\"true\">2+2</｜DSML｜parameter>\n"
                   "</｜DSML｜invoke>\n<｜DSML｜invoke name=\"add\">\n"
                   "<｜DSML｜parameter name=\"a\" string=\"false\">2</｜DSML｜parameter>\n"
                   "<｜DSML｜parameter name=\"b\" string=\"false\">3</｜DSML｜parameter>\n"
                   "</｜DSML｜invoke>\n</｜DSML｜function_calls>",
    "gemma4": 'Let me compute.<|tool_call>call:calculator{expression:<|"|>2+2<|"|>}<tool_call|>'
              "<|tool_call>call:add{a:2,b:3}<tool_call|>",
}

# A call opened and never readable: cut by the length budget mid-call.
CUT = {
    "hermes": '<tool_call>\n{"name": "calculator", "argum',
    "gpt-oss": '<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{"expression": "2',
    "qwen3_coder": "<tool_call>\n<function=calcul",
    "glm": "<tool_call>",
    "seed": "<seed:tool_call>\n<funct",
    "minimax": "<minimax:tool_call>\n<inv",
    "kimi": "<|tool_calls_section_begin|><|tool_call_begin|>functions.calcu",
    "deepseek_v4": "<｜DSML｜function_calls>\n<｜DSML｜inv",
    "gemma4": "<|tool_call>call:calcu",
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    from hybridflow.models.char_tokenizer import build_char_tokenizer

    out = tmp_path_factory.mktemp("tok")
    build_char_tokenizer(out)
    return PreTrainedTokenizerFast.from_pretrained(out)


def test_every_verl_format_has_a_parser():
    assert set(VERL_FORMATS) <= set(PARSERS.names())
    for name in VERL_FORMATS:
        check_format(name)
    with pytest.raises(ValueError, match=r"^rollout\.multi_turn\.format: .*xml"):
        check_format("xml")


@pytest.mark.parametrize("name", VERL_FORMATS)
def test_a_rendered_turn_parses_into_its_calls(name, tokenizer):
    calls = get_parser(name, tokenizer, TOOLS).parse(TURNS[name])
    assert calls == [ToolCall("calculator", {"expression": "2+2"}), ToolCall("add", {"a": 2, "b": 3})], calls


@pytest.mark.parametrize("name", VERL_FORMATS)
def test_an_answer_calls_nothing_and_a_cut_call_is_malformed(name, tokenizer):
    parser = get_parser(name, tokenizer, TOOLS)
    assert parser.parse("The answer is 4.") == []
    (call,) = parser.parse(CUT[name])
    assert call.error and call.error.startswith("malformed tool call"), call


@pytest.mark.parametrize("name", VERL_FORMATS)
def test_verl_command_line_selects_the_format(name):
    cfg = load_experiment("configs/quickstart_cpu.yaml",
                          translate([f"actor_rollout_ref.rollout.multi_turn.format={name}"]).overrides)
    assert cfg.rollout.multi_turn.format == name
