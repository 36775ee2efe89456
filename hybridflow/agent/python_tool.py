"""The ``python`` tool: runs the model's code in a sandbox (``agent/sandbox.py``) and answers with its stdout.

Config keys (defaults: ``SandboxLimits`` in sandbox.py, ``timeout_s``: tools.DEFAULT_TIMEOUT_S): ``timeout_s``
(wall clock), ``cpu_s``, ``memory_mb``, ``file_size_mb``, ``max_processes``, and ``allow_unisolated``: where
process isolation is unavailable the tool refuses to run (the preflight fails naming this key) unless it is
true; the code then runs with only rlimits, a process group and a temp dir (see sandbox.py).

The answer is the code's stdout, plus its stderr when it failed, plus one error line when a limit stopped it.
Error kinds: "timeout" (wall clock), "killed" (CPU, memory, file size, process limits or a signal),
"exception" (a non-zero exit), "sandbox" (the sandbox could not be set up).
"""

from __future__ import annotations

import dataclasses
import signal

from hybridflow.agent.sandbox import SandboxLimits, SandboxResult, isolation_problem, run_python
from hybridflow.agent.tools import Tool, ToolResult, register_tool

__all__ = ["PythonTool"]

_LIMIT_KEYS = ("cpu_s", "memory_mb", "file_size_mb", "max_processes")


@register_tool("python")
class PythonTool(Tool):
    default_schema = {"type": "function", "function": {
        "name": "python",
        "description": "Run a Python 3 program and return what it prints (stdout). No network, no files outside "
                       "its working directory; use print() to see values.",
        "parameters": {"type": "object", "required": ["code"], "properties": {
            "code": {"type": "string", "description": "the program"}}}}}
    config_keys = (*_LIMIT_KEYS, "allow_unisolated")

    def __init__(self, config: dict, tool_schema: dict):
        super().__init__(config, tool_schema)
        for key in _LIMIT_KEYS:
            value = self.config.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0
                                      or (key != "cpu_s" and not isinstance(value, int))):
                kind = "a positive number" if key == "cpu_s" else "a positive integer"
                raise ValueError(f"config.{key} must be {kind}, got {value!r}")
        self.allow_unisolated = self.config.get("allow_unisolated", False)
        if not isinstance(self.allow_unisolated, bool):
            raise ValueError(f"config.allow_unisolated must be true or false, got {self.allow_unisolated!r}")
        self.limits = dataclasses.replace(SandboxLimits(), timeout_s=self.timeout_s,
                                          **{k: self.config[k] for k in _LIMIT_KEYS if k in self.config})

    def _problem(self) -> str | None:
        problem = isolation_problem()
        if problem and not self.allow_unisolated:
            return (f"process isolation is unavailable here ({problem}); set allow_unisolated: true in this tool's "
                    "config to run code with only rlimits, a process group and a temp dir")
        return None

    def preflight(self) -> None:
        problem = self._problem()
        if problem:
            raise ValueError(problem)

    def run(self, arguments: dict) -> ToolResult:
        problem = self._problem()
        if problem:
            return ToolResult(f"Error: the python tool cannot run: {problem}", "sandbox")
        limits = dataclasses.replace(self.limits, isolate=isolation_problem() is None)
        return self.answer(run_python(arguments["code"], limits))

    def answer(self, res: SandboxResult) -> ToolResult:
        lim = self.limits
        if res.killed_by == "setup":
            return ToolResult(f"Error: the sandbox could not start: {res.setup_error}", "sandbox")
        failed = res.killed_by is not None or res.exit_code != 0
        text = res.stdout + (res.stderr if failed else "")
        cpu_s = lim.cpu_s if lim.cpu_s is not None else lim.timeout_s
        line, error = {
            "timeout": (f"Error: timed out after {lim.timeout_s:g} s", "timeout"),
            "cpu": (f"Error: CPU time limit ({cpu_s:g} s) exceeded", "killed"),
            "memory": (f"Error: memory limit ({lim.memory_mb} MiB) exceeded", "killed"),
            "file_size": (f"Error: file size limit ({lim.file_size_mb} MiB) exceeded", "killed"),
            "processes": (f"Error: process limit ({lim.max_processes}) reached", "killed"),
        }.get(res.killed_by, (None, None))
        if res.killed_by == "signal":
            line, error = f"Error: killed by {_signal_name(-res.exit_code)}", "killed"
        elif line is None and failed:
            line, error = (None if res.stderr.strip() else f"Error: exit code {res.exit_code}"), "exception"
        if line:
            text += ("" if not text or text.endswith("\n") else "\n") + line
        return ToolResult(text, error)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
