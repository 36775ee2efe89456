"""Tools of the agent loop: the calculator (ast, never eval), verl's tool config format (built-ins, a dotted-path
Tool, a verl-BaseTool-style async class), one-line config errors, argument checks, errors as results."""

from __future__ import annotations

import asyncio
import textwrap
import threading

import pytest
import yaml

from hybridflow.agent.calculator import Calculator, evaluate
from hybridflow.agent.tools import Tool, check_tool_config, load_tools

CALC_SCHEMA = {"type": "function", "function": {
    "name": "calculator", "description": "arithmetic",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def _schema(name: str, properties: dict | None = None, required: list | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {
        "type": "object", "properties": properties or {}, "required": required or []}}}


# ---------------------------------------------------------------- tool classes loaded by dotted path from here


class EchoTool(Tool):
    """A hybridflow Tool; counts its runs to show that a bad argument never reaches run()."""

    runs = 0

    def run(self, arguments: dict):
        EchoTool.runs += 1
        kind = arguments.get("kind", "text")
        if kind == "raise":
            raise RuntimeError("boom\nsecond line")
        if kind == "exit":
            raise SystemExit(3)
        return {"text": f"{self.config.get('prefix', '')}{arguments.get('text', '')}", "int": 42,
                "dict": {"a": [1, 2]}, "object": object(), "none": None}[kind]


class FakeToolResponse:  # verl's ToolResponse: .text (and .image / .video, not used here)
    def __init__(self, text):
        self.text = text


class VerlStyleTool:
    """Follows verl 0.9.1's BaseTool contract (verl/tools/base_tool.py) without importing verl."""

    released: list[str] = []

    def __init__(self, config: dict, tool_schema):
        self.config = config
        self.tool_schema = tool_schema
        self.name = tool_schema.function.name  # verl reads its pydantic model's attributes
        tool_schema.model_dump(exclude_unset=True, exclude_none=True)
        self._instances: dict[str, str] = {}
        self._lock = threading.Lock()

    async def create(self, instance_id=None, **kwargs):
        instance_id = instance_id or f"id-{id(asyncio.current_task())}"
        with self._lock:
            self._instances[instance_id] = ""
        return instance_id, FakeToolResponse(None)

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(parameters.get("sleep", 0.0))
        return FakeToolResponse(f"{self.config['greeting']}, {parameters['who']}"), 0.5, {"calls": 1}

    async def release(self, instance_id, **kwargs):
        with self._lock:
            self._instances.pop(instance_id)
        VerlStyleTool.released.append(instance_id)


# ---------------------------------------------------------------------------------------------- calculator


@pytest.mark.parametrize("expression, expected", [
    ("123*45", "5535"), ("2+3*4", "14"), ("(2+3)*4", "20"), ("-3**2", "-9"), ("2**-1", "0.5"),
    ("7/2", "3.5"), ("10/2", "5"), ("7//2", "3"), ("-7//2", "-4"), ("7%3", "1"), ("0.1+0.2", "0.3"),
    ("1.5e3", "1500"), ("+-+4", "-4"), (" ((1)) ", "1"), ("10**100", str(10**100)), ("2**0.5", "1.4142135623731"),
])
def test_calculator_evaluates_arithmetic_with_python_precedence(expression, expected):
    assert evaluate(expression) == expected


@pytest.mark.parametrize("expression, message", [
    ("1/0", "division by zero"), ("1//0", "division by zero"), ("5%0", "division by zero"),
    ("0**-1", "division by zero"), ("2**101", "exponent 101 too large"), ("9**100**2", "exponent 10000 too large"),
    ("(10**100)**50", "result too large"), ("(10**100)**40*(10**100)**40", "result too large"),
    ("1e308*10", "not a finite number"), ("(-8)**0.5", "not a real number"), ("2^3", "use ** for powers"),
    ("1" * 501, "expression too long"), ("1+", "cannot parse"),
])
def test_calculator_refuses_what_it_cannot_or_must_not_compute(expression, message):
    result = Calculator({}, CALC_SCHEMA).call({"expression": expression})
    assert result.error in ("bad_arguments", "exception")
    assert result.text.startswith("Error: ") and message in result.text, result.text
    assert "\n" not in result.text


@pytest.mark.parametrize("expression", [
    "x+1", "abs(-1)", "(1).real", "[1][0]", "'a'*3", "True+1", "1j*1", "1 if 1 else 2", "(lambda: 1)()", "a:=1",
])
def test_calculator_rejects_names_calls_attributes_and_non_numbers(expression):
    result = Calculator({}, CALC_SCHEMA).call({"expression": expression})
    assert result.error == "bad_arguments" and result.text.startswith("Error: "), result.text


def test_calculator_never_evaluates_import(tmp_path):
    target = tmp_path / "pwned"
    tool = load_tools_from({"tools": [{"class_name": "calculator"}]}, tmp_path)["calculator"]
    result = tool.call({"expression": f"__import__('os').mkdir({str(target)!r})"})
    assert result.error == "bad_arguments" and "Call" in result.text
    assert not target.exists()


# ------------------------------------------------------------------------------------------ loading and calling


def load_tools_from(doc: dict, tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_tools(str(path))


def test_load_tools_reads_verl_format_with_builtins_dotted_path_and_verl_style_class(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(textwrap.dedent("""\
        tools:
          - class_name: calculator
            config: {type: native}
            tool_schema:
              type: function
              function:
                name: calc
                description: Evaluate arithmetic.
                parameters:
                  type: object
                  properties: {expression: {type: string, description: the expression}}
                  required: [expression]
          - class_name: python
            config: {type: native, timeout_s: 7, memory_mb: 512, allow_unisolated: true}
          - class_name: tests.unit.test_agent_tools.EchoTool
            config: {type: native, prefix: "> "}
            tool_schema:
              type: function
              function:
                name: echo
                description: Echo.
                parameters: {type: object, properties: {text: {type: string}}, required: [text]}
          - class_name: tests.unit.test_agent_tools.VerlStyleTool
            config: {type: native, greeting: Hello, timeout_s: 0.5}
            tool_schema:
              type: function
              function:
                name: greet
                description: Greet.
                parameters: {type: object, properties: {who: {type: string}, sleep: {type: number}}, required: [who]}
        """))
    tools = load_tools(str(path))
    assert list(tools) == ["calc", "python", "echo", "greet"]
    assert tools["calc"].call({"expression": "6*7"}).text == "42"
    assert tools["python"].timeout_s == 7 and tools["python"].limits.memory_mb == 512
    assert tools["python"].schema["function"]["parameters"]["required"] == ["code"]
    echo = tools["echo"].call({"text": "hi"})
    assert (echo.text, echo.error) == ("> hi", None)
    VerlStyleTool.released.clear()
    result = tools["greet"].call({"who": "world"})
    assert (result.text, result.error) == ("Hello, world", None) and result.seconds > 0
    assert len(VerlStyleTool.released) == 1 and not tools["greet"].inner._instances  # released after the call
    slow = tools["greet"].call({"who": "world", "sleep": 30})
    assert slow.error == "timeout" and slow.text == "Error: timed out after 0.5 s" and slow.seconds < 10
    assert len(VerlStyleTool.released) == 2  # released on the timeout too


@pytest.mark.parametrize("tools_doc, message", [
    ([{"class_name": "calculator"}, {"class_name": "tests.unit.test_agent_tools.EchoTool",
                                     "tool_schema": {"type": "function", "function": {"description": "x"}}}],
     "tools.yaml: tools[1].tool_schema.function.name missing"),
    ([{"class_name": "calculator"}, {"class_name": "calculator"}],
     "tools.yaml: tools[1].tool_schema.function.name 'calculator' duplicates tools[0]"),
    ([{"class_name": "verl.tools.gsm8k_tool.Gsm8kTool", "config": {"type": "native"},
       "tool_schema": _schema("calc_gsm8k_reward")}],
     "tools.yaml: tools[0].class_name 'verl.tools.gsm8k_tool.Gsm8kTool' is one of verl's tools, which do not run in "
     "hybridflow: use class_name 'calculator' or 'python', or a dotted path to your own Tool"),
    ([{"class_name": "calculater"}], "tools.yaml: tools[0].class_name 'calculater' is not a registered tool"),
    ([{"class_name": "no_such_pkg.mod.Tool", "tool_schema": _schema("t")}],
     "tools.yaml: tools[0].class_name 'no_such_pkg.mod.Tool' cannot be imported: ModuleNotFoundError"),
    ([{"class_name": "tests.unit.test_agent_tools.FakeToolResponse", "tool_schema": _schema("t")}],
     "is neither a hybridflow Tool subclass nor a class with verl's BaseTool contract"),
    ([{"class_name": "calculator", "config": ["type", "native"]}], "tools.yaml: tools[0].config must be a mapping"),
    ([{"class_name": "calculator", "config": {"timeout": 3}}],
     "tools.yaml: tools[0] (calculator): config: unknown key(s) ['timeout']"),
    ([{"class_name": "python", "config": {"memory_mb": "1G"}}],
     "tools.yaml: tools[0] (python): config.memory_mb must be a positive integer, got '1G'"),
    ([{"class_name": "calculator", "config": {"timeout_s": -1}}], "config.timeout_s must be a positive number"),
    ([{"class_name": "tests.unit.test_agent_tools.EchoTool", "tool_schema": {"type": "function", "function": {
        "name": "e", "parameters": {"type": "object", "properties": {}, "required": ["text"]}}}}],
     "tools.yaml: tools[0].tool_schema.function.parameters.required names ['text'] not in properties"),
    ([{"class_name": "tests.unit.test_agent_tools.EchoTool"}], "tools.yaml: tools[0].tool_schema must be a mapping"),
    ([{"class_name": "calculator", "schema": CALC_SCHEMA}], "tools.yaml: tools[0]: unknown key(s) ['schema']"),
])
def test_config_errors_are_one_line_naming_file_and_entry(tmp_path, tools_doc, message):
    with pytest.raises(ValueError) as err:
        load_tools_from({"tools": tools_doc}, tmp_path)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_file_without_a_tools_list_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"tools.yaml: expected a mapping with a 'tools' list$"):
        load_tools_from({"tool": []}, tmp_path)


def test_arguments_are_checked_against_the_schema_before_the_tool_runs(tmp_path):
    schema = _schema("typed", {"text": {"type": "string"}, "n": {"type": "integer"}, "x": {"type": "number"},
                               "flag": {"type": "boolean"}, "items": {"type": "array"}, "opts": {"type": "object"},
                               "either": {"type": ["integer", "null"]}, "mode": {"type": "string", "enum": ["a"]}},
                     ["text"])
    tool = load_tools_from({"tools": [{"class_name": "tests.unit.test_agent_tools.EchoTool", "tool_schema": schema}]},
                           tmp_path)["typed"]
    EchoTool.runs = 0
    for args, message in [
        ({}, "missing required argument(s) ['text']"),
        ({"text": 1}, "argument 'text' must be of type string, got integer"),
        ({"text": "", "n": 1.5}, "argument 'n' must be of type integer, got number"),
        ({"text": "", "n": True}, "argument 'n' must be of type integer, got boolean"),
        ({"text": "", "x": "1"}, "argument 'x' must be of type number, got string"),
        ({"text": "", "flag": 1}, "argument 'flag' must be of type boolean, got integer"),
        ({"text": "", "items": {}}, "argument 'items' must be of type array, got object"),
        ({"text": "", "opts": []}, "argument 'opts' must be of type object, got array"),
        ({"text": "", "either": "1"}, "argument 'either' must be of type integer/null, got string"),
        ({"text": "", "mode": "b"}, "argument 'mode' must be one of ['a'], got 'b'"),
        (["text"], "arguments must be a JSON object, got list"),
    ]:
        result = tool.call(args)
        assert (result.error, result.text) == ("bad_arguments", f"Error: {message}")
    assert EchoTool.runs == 0
    ok = {"text": "t", "n": 2, "x": 2, "flag": False, "items": [], "opts": {}, "either": None, "mode": "a"}
    assert tool.call(ok).error is None and EchoTool.runs == 1


def test_exceptions_and_non_text_results_become_error_results(tmp_path):
    tool = load_tools_from({"tools": [{"class_name": "tests.unit.test_agent_tools.EchoTool",
                                       "tool_schema": _schema("echo", {"kind": {"type": "string"}})}]},
                           tmp_path)["echo"]
    boom = tool.call({"kind": "raise"})
    assert (boom.error, boom.text) == ("exception", "Error: RuntimeError: boom second line")
    assert tool.call({"kind": "exit"}).error == "exception"  # a tool calling sys.exit does not stop the loop
    assert (tool.call({"kind": "int"}).text, tool.call({"kind": "int"}).error) == ("42", None)
    assert tool.call({"kind": "dict"}).text == '{"a": [1, 2]}'
    for kind in ("object", "none"):
        garbage = tool.call({"kind": kind})
        assert garbage.error == "garbage" and garbage.text.startswith("Error: the tool returned ")


def test_preflight_refuses_the_python_tool_without_isolation_unless_opted_in(tmp_path, monkeypatch):
    import hybridflow.agent.python_tool as python_tool

    monkeypatch.setattr(python_tool, "isolation_problem", lambda: "OSError: unshare: Operation not permitted")
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": [{"class_name": "calculator"}, {"class_name": "python"}]}))
    with pytest.raises(ValueError) as err:
        check_tool_config(str(path))
    assert str(err.value).startswith("tools.yaml: tools[1] (python): process isolation is unavailable here "
                                     "(OSError: unshare: Operation not permitted); set allow_unisolated: true")
    assert "\n" not in str(err.value)
    refused = load_tools(str(path))["python"].call({"code": "print(1)"})
    assert refused.error == "sandbox" and "allow_unisolated" in refused.text
    path.write_text(yaml.safe_dump({"tools": [{"class_name": "python", "config": {"allow_unisolated": True}}]}))
    tool = check_tool_config(str(path))["python"]
    result = tool.call({"code": "print(6*7)"})  # a real run, in the unisolated mode
    assert (result.text, result.error) == ("42\n", None)
