"""The python tool's sandbox: real processes, real namespaces and rlimits. Each test runs code that misbehaves
(loops, memory and fork bombs, writes outside its dir, network, floods, escapes with setsid) and checks the
result and that no process it started is left on the host (found by a marker in their command lines)."""

from __future__ import annotations

import os
import socket
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hybridflow.agent.python_tool import PythonTool
from hybridflow.agent.sandbox import SandboxLimits, isolation_problem, run_python

ROOT = Path(__file__).resolve().parents[2]
ISOLATED = isolation_problem() is None
needs_isolation = pytest.mark.skipif(
    not ISOLATED, reason=f"process isolation unavailable here ({isolation_problem()}): only the unisolated mode runs")
MODES = [pytest.param(True, marks=needs_isolation, id="isolated"), pytest.param(False, id="unisolated")]
SLACK_S = 1.5  # startup of two interpreters and the kill, on a loaded 2-core machine


def _limits(isolate: bool = ISOLATED, **kw) -> SandboxLimits:
    return SandboxLimits(isolate=isolate, **{"timeout_s": 10.0, **kw})


def _tool(**config) -> PythonTool:
    return PythonTool({"allow_unisolated": not ISOLATED, **config}, PythonTool.default_schema)


def _processes_with(marker: str) -> list[int]:
    """Host pids whose command line holds ``marker`` (the test's own process never does)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(int(pid))
            except OSError:
                pass
    return found


def _sleeper(marker: str, **popen) -> str:
    """Code starting a Python child that sleeps a minute, with ``marker`` in its command line."""
    return (f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}]"
            + "".join(f", {k}={v!r}" for k, v in popen.items()) + ")")


def test_print_returns_stdout():
    res = run_python("import sys\nprint(6 * 7)\nprint('to stderr', file=sys.stderr)", _limits())
    assert (res.stdout, res.exit_code, res.killed_by, res.isolated) == ("42\n", 0, None, ISOLATED)
    assert res.stderr == "to stderr\n"
    tool_result = _tool().call({"code": "print(6 * 7)"})
    assert (tool_result.text, tool_result.error) == ("42\n", None)


def test_a_failing_program_answers_with_its_traceback():
    result = _tool().call({"code": "print('before')\n1 / 0"})
    assert result.error == "exception"
    assert result.text.startswith("before\nTraceback") and result.text.endswith("ZeroDivisionError: division by zero\n")
    assert _tool().call({"code": "import sys; sys.exit(3)"}).text == "Error: exit code 3"


@pytest.mark.parametrize("isolate", MODES)
def test_an_infinite_loop_is_killed_at_the_timeout_with_its_children(isolate):
    marker = f"hf-sandbox-test-{uuid.uuid4().hex}"
    code = f"import subprocess, sys\n{_sleeper(marker)}\nprint('looping', flush=True)\nwhile True: pass"
    res = run_python(code, _limits(isolate, timeout_s=1.5, cpu_s=30))
    assert res.killed_by == "timeout" and res.stdout == "looping\n"
    assert 1.5 <= res.seconds < 1.5 + SLACK_S
    assert _processes_with(marker) == []
    answer = _tool(timeout_s=1.5, cpu_s=30).answer(res)
    assert (answer.error, answer.text) == ("timeout", "looping\nError: timed out after 1.5 s")


def test_cpu_time_limit_kills():
    result = _tool(cpu_s=1).call({"code": "while True: pass"})
    assert (result.error, result.text) == ("killed", "Error: CPU time limit (1 s) exceeded")


@pytest.mark.parametrize("isolate", MODES)
def test_a_memory_bomb_fails_with_a_memory_error(isolate):
    code = "blocks = []\nwhile True: blocks.append(bytearray(16 << 20))"
    res = run_python(code, _limits(isolate, memory_mb=128))
    assert res.killed_by == "memory" and res.stderr.rstrip().endswith("MemoryError")
    answer = _tool(memory_mb=128).answer(res)
    assert answer.error == "killed" and answer.text.endswith("\nError: memory limit (128 MiB) exceeded")


def test_a_file_larger_than_the_limit_fails():
    result = _tool(file_size_mb=1).call({"code": "open('big', 'wb').write(b'x' * (2 << 20))"})
    assert result.error == "killed" and result.text.endswith("Error: file size limit (1 MiB) exceeded")


@needs_isolation
@pytest.mark.parametrize("spawn", ["fork", "subprocess"])
def test_a_fork_bomb_fails_inside_and_nothing_outlives_the_call(spawn):
    marker = f"hf-sandbox-test-{uuid.uuid4().hex}"
    start = {"fork": f"if os.fork() == 0: os.execv(sys.executable, [sys.executable, '-c', "
                     f"'import time; time.sleep(60)', {marker!r}])",
             "subprocess": _sleeper(marker)}[spawn]
    code = (f"import os, subprocess, sys\nn = 0\ntry:\n    while n < 1000:\n        {start}\n        n += 1\n"
            "except OSError as e:\n    print('stopped after', n, type(e).__name__)\n")
    res = run_python(code, _limits(max_processes=8))
    assert res.exit_code == 0 and res.stdout.startswith("stopped after ") and "BlockingIOError" in res.stdout, res
    assert int(res.stdout.split()[2]) < 8
    assert _processes_with(marker) == []
    # every process forking, until the limit stops them all (under load the first process may meet the limit
    # itself and end with fork's BlockingIOError before the supervisor kills the tree)
    bomb = _tool(max_processes=8, timeout_s=3).call({"code": "import os\nwhile True: os.fork()"})
    assert (bomb.error in ("killed", "timeout") and ("process limit (8) reached" in bomb.text
                                                     or "timed out" in bomb.text)
            or bomb.error == "exception" and "BlockingIOError" in bomb.text), bomb


@needs_isolation
def test_writes_outside_the_work_dir_fail_and_inside_work(tmp_path):
    name = f"hf-sandbox-test-{uuid.uuid4().hex}"
    outside = [Path("/tmp") / name, ROOT / name, Path.home() / name, tmp_path / name]
    code = (f"import os\nfor path in {[str(p) for p in outside]!r}:\n"
            "    try:\n        open(path, 'w').write('x')\n        print('WROTE', path)\n"
            "    except OSError as e:\n        print(type(e).__name__, e.strerror)\n"
            "open('inside.txt', 'w').write('kept')\nos.makedirs('sub/dir')\nprint(open('inside.txt').read())")
    res = run_python(code, _limits())
    lines = res.stdout.splitlines()
    assert res.exit_code == 0 and "WROTE" not in res.stdout, res
    assert lines[:3] == ["OSError Read-only file system"] * 3
    assert lines[3] == "FileNotFoundError No such file or directory"  # /tmp's content is hidden
    assert lines[-1] == "kept"
    assert not any(p.exists() for p in outside)


@needs_isolation
def test_the_network_and_host_unix_sockets_are_unreachable():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    unix_path = f"/tmp/hf-sandbox-test-{uuid.uuid4().hex}.sock"  # /tmp: where Ray and others put theirs
    unix_listener = socket.socket(socket.AF_UNIX)
    unix_listener.bind(unix_path)
    os.chmod(unix_path, 0o777)
    unix_listener.listen()
    try:
        code = ("import socket\n"
                f"for family, address in [(socket.AF_INET, ('127.0.0.1', {listener.getsockname()[1]})), "
                f"(socket.AF_INET, ('8.8.8.8', 53)), (socket.AF_UNIX, {unix_path!r})]:\n"
                "    s = socket.socket(family)\n    s.settimeout(2)\n"
                "    try:\n        s.connect(address)\n        print('CONNECTED', address)\n"
                "    except OSError as e:\n        print(type(e).__name__, e.errno)\n")
        res = run_python(code, _limits())
    finally:
        listener.close()
        unix_listener.close()
        os.unlink(unix_path)
    assert res.exit_code == 0 and "CONNECTED" not in res.stdout, res
    # ENETUNREACH: the only interface is a loopback, and it is down; ENOENT: /tmp is an empty tmpfs there
    assert res.stdout.splitlines() == ["OSError 101", "OSError 101", "FileNotFoundError 2"]


@pytest.mark.parametrize("isolate", MODES)
def test_an_output_flood_is_truncated(isolate):
    code = "import sys\nsys.stdout.write('o' * (50 << 20))\nsys.stderr.write('e' * (50 << 20))\nprint('end')"
    res = run_python(code, _limits(isolate, max_output_bytes=4096))
    assert res.exit_code == 0 and res.output_truncated
    assert len(res.stdout) < 4096 + 100 and len(res.stderr) < 4096 + 100
    assert res.stdout.startswith("o" * 3000) and res.stdout.endswith("ooend\n")
    assert "bytes of output dropped]" in res.stdout


@needs_isolation
def test_a_background_process_started_with_setsid_does_not_outlive_the_call():
    marker = f"hf-sandbox-test-{uuid.uuid4().hex}"
    code = f"import subprocess, sys\n{_sleeper(marker, start_new_session=True)}\nprint('started')"
    res = run_python(code, _limits())
    assert (res.stdout, res.exit_code) == ("started\n", 0)
    assert _processes_with(marker) == []


def test_concurrent_calls_from_four_threads_all_work():
    tool = _tool()
    codes = [f"import os\nprint({i} * 10, os.getcwd() == os.environ['HOME'])" for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda code: tool.call({"code": code}), codes))
    assert [(r.text, r.error) for r in results] == [(f"{i * 10} True\n", None) for i in range(4)]


def test_the_environment_is_minimal(monkeypatch):
    monkeypatch.setenv("HF_SANDBOX_SECRET", "do-not-leak")
    res = run_python("import os, sys\nprint(sorted(os.environ))\nprint(sys.executable)", _limits())
    names, executable = res.stdout.splitlines()
    assert "HF_SANDBOX_SECRET" not in names and "PYTHONHASHSEED" in names and "OMP_NUM_THREADS" in names
    assert executable == sys.executable
