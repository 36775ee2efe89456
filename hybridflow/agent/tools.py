"""Tools the agent loop calls, loaded from verl's tool config YAML (``rollout.multi_turn.tool_config_path``).

The file format is verl 0.9.1's (``verl/tools/tool_registry.py``)::

    tools:
      - class_name: calculator            # a registered name, or a dotted path "pkg.mod.Class"
        config: {type: native, timeout_s: 5}
        tool_schema:                      # OpenAI function format; the tool's name is function.name
          type: function
          function:
            name: calculator
            description: Evaluate an arithmetic expression.
            parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}

Where we differ from verl: a hybridflow ``Tool`` is synchronous and stateless per call (``call(arguments)`` ->
``ToolResult``, never raising: the agent loop runs calls in a thread pool); verl's built-in classes
(``verl.tools.*``) do not run here (the built-ins are ``calculator`` and ``python``); a class following verl's
``BaseTool`` contract (async create / execute / release) is adapted, its coroutines run with ``asyncio.run`` in
the calling thread and bounded by ``timeout_s``; its step reward and metrics are not kept. ``tool_schema`` may
be left out for a built-in (its ``default_schema`` is used). Arguments are checked against the schema
(``required`` and each property's JSON type) before the tool runs.
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import inspect
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from hybridflow.registry import Registry

__all__ = ["DEFAULT_TIMEOUT_S", "TOOLS", "Tool", "ToolResult", "check_arguments", "check_tool_config", "tool_schemas",
           "load_tools", "register_tool"]

DEFAULT_TIMEOUT_S = 10.0  # config key "timeout_s": a call's wall-clock bound, for every tool


@dataclass
class ToolResult:
    text: str  # what the model reads as the tool message content
    error: str | None = None  # None, or a kind: "bad_arguments", "timeout", "exception", "killed", "garbage", ...
    seconds: float = 0.0  # wall time of the call


class Tool:
    """Base: name and OpenAI function schema from the config; ``call()`` never raises (errors become
    ``ToolResult.error`` with a message for the model in ``.text``) and is safe to call from several threads at
    once. Subclasses implement ``run(arguments) -> str`` (or a ``ToolResult``, to set an error kind) and may set
    ``default_schema`` (used when the YAML entry has no ``tool_schema``) and ``config_keys`` (the keys their
    config accepts besides ``type`` and ``timeout_s``; None: any)."""

    default_schema: dict | None = None
    config_keys: tuple[str, ...] | None = None

    def __init__(self, config: dict, tool_schema: dict):
        self.config = dict(config)
        self.schema = tool_schema
        self.name: str = tool_schema["function"]["name"]
        if self.config_keys is not None:
            unknown = sorted(set(self.config) - {"type", "timeout_s", *self.config_keys})
            if unknown:
                raise ValueError(f"config: unknown key(s) {unknown} (known: {['timeout_s', *self.config_keys]})")
        self.timeout_s = float(self.config.get("timeout_s", DEFAULT_TIMEOUT_S))
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"config.timeout_s must be a positive number of seconds, got {self.timeout_s}")

    def run(self, arguments: dict) -> str | ToolResult:
        raise NotImplementedError

    def preflight(self) -> None:
        """Checks needing the host (the launcher calls it before any worker starts); raise ValueError."""

    def call(self, arguments: dict) -> ToolResult:
        start = time.perf_counter()
        problem = check_arguments(self.schema, arguments)
        if problem:
            result = ToolResult(f"Error: {problem}", "bad_arguments")
        else:
            try:
                result = _as_result(self.run(arguments))
            except (Exception, SystemExit) as e:  # noqa: BLE001 - a tool's failure is the model's message
                result = ToolResult(f"Error: {type(e).__name__}: {_one_line(e)}", "exception")
        result.seconds = time.perf_counter() - start
        return result


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:500]


def _as_result(out) -> ToolResult:
    if isinstance(out, ToolResult):
        return out
    if isinstance(out, str):
        return ToolResult(out.encode("utf-8", "replace").decode("utf-8"))  # lone surrogates cannot be tokenized
    if isinstance(out, (bool, int, float)) and not isinstance(out, complex):
        return ToolResult(str(out))
    if isinstance(out, (dict, list)):
        try:
            return ToolResult(json.dumps(out, ensure_ascii=False, allow_nan=False))
        except (TypeError, ValueError):
            pass
    return ToolResult(f"Error: the tool returned {type(out).__name__}, not text", "garbage")


# JSON Schema type -> the Python types json.loads produces for it (bool is an int: kept out of numbers)
_JSON_TYPES = {"string": (str,), "number": (int, float), "integer": (int,), "boolean": (bool,),
               "object": (dict,), "array": (list,), "null": (type(None),)}


def _has_type(value, type_name: str) -> bool:
    kinds = _JSON_TYPES.get(type_name)
    if kinds is None:
        return True  # a type this check does not know: the tool validates it
    if isinstance(value, bool) and type_name != "boolean":
        return False
    return isinstance(value, kinds)


def check_arguments(schema: dict, arguments) -> str | None:
    """Why ``arguments`` do not fit the schema's ``required`` and property types (one line), or None."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    params = schema["function"].get("parameters") or {}
    props = params.get("properties") or {}
    missing = [k for k in params.get("required") or [] if k not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    if params.get("additionalProperties") is False:
        extra = sorted(set(arguments) - set(props))
        if extra:
            return f"unexpected argument(s) {extra} (accepted: {sorted(props)})"
    for key, value in arguments.items():
        spec = props.get(key)
        if not isinstance(spec, dict):
            continue
        types = spec.get("type")
        types = [types] if isinstance(types, str) else list(types or [])
        if types and not any(_has_type(value, t) for t in types):
            return f"argument {key!r} must be of type {'/'.join(types)}, got {_json_type(value)}"
        if "enum" in spec and value not in spec["enum"]:
            return f"argument {key!r} must be one of {spec['enum']}, got {value!r}"
    return None


def _json_type(value) -> str:
    for name, kinds in _JSON_TYPES.items():
        if name != "integer" and _has_type(value, name):
            return "integer" if name == "number" and isinstance(value, int) else name
    return type(value).__name__


# ---------------------------------------------------------------------------------------------------------
# Registry and loading

TOOLS = Registry("tool")  # class decorator register_tool(name): ``class_name: <name>`` in a tool config selects it
register_tool = TOOLS.register


def _builtins() -> None:
    # the built-ins register on import; imported here, not at the top, so that they may import this module
    for module in ("hybridflow.agent.calculator", "hybridflow.agent.python_tool"):
        importlib.import_module(module)


class _AttrSchema(dict):
    """A schema dict that verl tools can read as their pydantic model (``tool_schema.function.name``,
    ``model_dump()``)."""

    def __getattr__(self, key):
        try:
            value = self[key]
        except KeyError:
            raise AttributeError(key) from None
        return _AttrSchema(value) if isinstance(value, dict) else value

    def model_dump(self, **_):
        return copy.deepcopy(dict(self))


class VerlToolAdapter(Tool):
    """A class with verl's ``BaseTool`` contract, one instance per call: create -> execute -> release."""

    def __init__(self, config: dict, tool_schema: dict, cls: type):
        super().__init__(config, tool_schema)
        self.inner = cls(config=copy.deepcopy(config), tool_schema=_AttrSchema(copy.deepcopy(tool_schema)))

    def run(self, arguments: dict) -> str | ToolResult:
        try:
            return asyncio.run(asyncio.wait_for(self._once(arguments), self.timeout_s))
        except asyncio.TimeoutError:
            return ToolResult(f"Error: timed out after {self.timeout_s:g} s", "timeout")

    async def _once(self, arguments: dict):
        created = await self.inner.create()
        instance_id = created[0] if isinstance(created, tuple) else created  # verl >= 0.5: (id, response)
        try:
            out = await self.inner.execute(instance_id, arguments)
        finally:
            await self.inner.release(instance_id)
        response = out[0] if isinstance(out, tuple) else out  # (response, step reward, metrics)
        text = getattr(response, "text", response)
        return "" if text is None else text


def _is_verl_style(cls) -> bool:
    return inspect.iscoroutinefunction(getattr(cls, "execute", None))


def _resolve(class_name: str, where: str) -> type:
    if class_name in TOOLS:
        return TOOLS.get(class_name)
    if "." not in class_name:
        raise ValueError(f"{where}.class_name {class_name!r} is not a registered tool ({TOOLS.names()}) "
                         "nor a dotted path pkg.module.Class")
    module_name, attr = class_name.rsplit(".", 1)
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        if class_name.startswith("verl."):
            raise ValueError(f"{where}.class_name {class_name!r} is one of verl's tools, which do not run in "
                             "hybridflow: use class_name 'calculator' or 'python', or a dotted path to your own "
                             "Tool") from None
        raise ValueError(f"{where}.class_name {class_name!r} cannot be imported: {type(e).__name__}: "
                         f"{_one_line(e)}") from None
    if not (inspect.isclass(cls) and (issubclass(cls, Tool) or _is_verl_style(cls))):
        raise ValueError(f"{where}.class_name {class_name!r} is neither a hybridflow Tool subclass nor a class "
                         "with verl's BaseTool contract (async execute)")
    return cls


def _check_schema(schema, where: str) -> None:
    def need(cond, key, what):
        if not cond:
            raise ValueError(f"{where}.{key} {what}")

    need(isinstance(schema, dict), "tool_schema", "must be a mapping (OpenAI function format)")
    need(schema.get("type") == "function", "tool_schema.type", f"must be 'function', got {schema.get('type')!r}")
    fn = schema.get("function")
    need(isinstance(fn, dict), "tool_schema.function", "missing" if fn is None else "must be a mapping")
    name = fn.get("name")
    need(name is not None, "tool_schema.function.name", "missing")
    need(isinstance(name, str) and name.strip() == name and name, "tool_schema.function.name",
         f"must be a non-empty string without spaces around it, got {name!r}")
    params = fn.get("parameters")
    if params is None:
        return
    need(isinstance(params, dict), "tool_schema.function.parameters", "must be a mapping")
    props = params.get("properties", {})
    need(isinstance(props, dict), "tool_schema.function.parameters.properties", "must be a mapping")
    required = params.get("required", [])
    need(isinstance(required, list) and all(isinstance(r, str) for r in required),
         "tool_schema.function.parameters.required", "must be a list of names")
    unknown = [r for r in required if r not in props]
    need(not unknown, "tool_schema.function.parameters.required", f"names {unknown} not in properties")


def load_tools(path: str) -> dict[str, Tool]:
    """The tools of a verl tool config YAML, by name; any problem -> ValueError in one line naming the entry."""
    _builtins()
    file = Path(path).name
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: cannot read the tool config: {_one_line(e)}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tools"), list):
        raise ValueError(f"{path}: expected a mapping with a 'tools' list")
    tools: dict[str, Tool] = {}
    first_at: dict[str, int] = {}
    for i, entry in enumerate(doc["tools"]):
        where = f"{file}: tools[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be a mapping with class_name, config and tool_schema")
        unknown = sorted(set(entry) - {"class_name", "config", "tool_schema"})
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown} (known: class_name, config, tool_schema)")
        class_name = entry.get("class_name")
        if not isinstance(class_name, str) or not class_name:
            raise ValueError(f"{where}.class_name missing")
        config = entry.get("config")
        config = {} if config is None else config
        if not isinstance(config, dict):
            raise ValueError(f"{where}.config must be a mapping, got {type(config).__name__}")
        cls = _resolve(class_name, where)
        schema = entry.get("tool_schema")
        if schema is None and getattr(cls, "default_schema", None) is not None:
            schema = cls.default_schema
        _check_schema(copy.deepcopy(schema), where)
        schema = copy.deepcopy(schema)
        name = schema["function"]["name"]
        if name in first_at:
            raise ValueError(f"{where}.tool_schema.function.name {name!r} duplicates tools[{first_at[name]}]")
        first_at[name] = i
        try:
            tools[name] = cls(config, schema) if issubclass(cls, Tool) else VerlToolAdapter(config, schema, cls)
        except Exception as e:  # noqa: BLE001 - the tool's own complaint about its config, in one line
            raise ValueError(f"{where} ({name}): {_one_line(e)}") from None
    return tools


def check_tool_config(path: str) -> dict[str, Tool]:
    """``load_tools`` plus each tool's host checks (e.g. the python tool's isolation); ValueError in one line.
    Called by the preflight before any worker starts."""
    tools = load_tools(path)
    for i, (name, tool) in enumerate(tools.items()):
        try:
            tool.preflight()
        except ValueError as e:
            raise ValueError(f"{Path(path).name}: tools[{i}] ({name}): {_one_line(e)}") from None
    return tools


def tool_schemas(multi_turn) -> list[dict] | None:
    """The OpenAI function schemas of ``rollout.multi_turn``'s tools, which the chat template shows the model in
    the prompt (verl passes ``tools=`` when it renders the first turn); None for single-turn rollouts."""
    if not multi_turn.enable:
        return None
    return [tool.schema for tool in load_tools(multi_turn.tool_config_path).values()]
