"""Code answers scored by a SandboxFusion service (reward.sandbox_fusion.url), as verl 0.9.1 scores its code
sources, and verl's prime reward manager (rows scored concurrently, failures scoring 0). The service cannot be
reached from here: a tiny HTTP server on 127.0.0.1 answers its run_code API by running the code in a Python
subprocess, as the service's python runner does."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hybridflow.rewards.routing import SourceRouter, score_concurrently
from hybridflow.rewards.sandbox_fusion import SandboxScorer, extract_code


class _RunCode(BaseHTTPRequestHandler):
    """SandboxFusion's POST /run_code: {code, stdin, run_timeout, language, ...} -> {status, compile_result,
    run_result: {status, stdout, stderr, return_code}}. ``gateway_timeouts`` first answers are 504s."""

    requests: list = []
    gateway_timeouts = 0

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        if type(self).gateway_timeouts > 0:
            type(self).gateway_timeouts -= 1
            self.send_response(504)
            self.end_headers()
            return
        try:
            done = subprocess.run([sys.executable, "-c", body["code"]], input=body["stdin"] or "", text=True,
                                  capture_output=True, timeout=body["run_timeout"])
            run = {"status": "Finished", "stdout": done.stdout, "stderr": done.stderr, "return_code": done.returncode}
        except subprocess.TimeoutExpired:
            run = {"status": "TimeLimitExceeded", "stdout": "", "stderr": "", "return_code": None}
        ok = run["status"] == "Finished" and run["return_code"] == 0
        answer = json.dumps({"status": "Success" if ok else "Failed", "compile_result": None, "run_result": run})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(answer.encode())

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def sandbox_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RunCode)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/run_code"
    server.shutdown()
    server.server_close()


DOUBLE = "Here it is:\n```python\nn = int(input())\nprint(2 * n)\n```"
CASES = json.dumps({"inputs": ["1\n", "2\n", "5\n", "7\n"], "outputs": ["2\n", "4\n", "10\n", "15\n"]})


def test_answers_are_scored_by_their_pass_rate(sandbox_url):
    scorer = SandboxScorer(sandbox_url, max_concurrent=4, memory_limit_mb=256)
    assert scorer(DOUBLE, CASES) == 0.75  # the last expected output is wrong on purpose: 3 of 4 pass
    assert scorer(DOUBLE.replace("2 * n", "n + 1"), CASES) == 0.25  # only 1 + 1 == 2 * 1
    assert scorer(DOUBLE.replace("print(2 * n)", "raise SystemExit(3)"), CASES) == 0.0  # runtime error
    assert scorer("print(2 * int(input()))", CASES) == 0.0  # no code block: verl scores it 0
    assert scorer(DOUBLE, "not json") == 0.0
    sent = next(r for r in _RunCode.requests if r["stdin"] == "1\n")
    assert (sent["language"], sent["memory_limit_MB"], sent["run_timeout"]) == ("python", 256, 10)


def test_function_cases_and_assert_cases(sandbox_url):
    scorer = SandboxScorer(sandbox_url)
    leetcode = ("```python\nclass Solution:\n    def total(self, a: List[int], b: int) -> int:\n"
                "        return sum(a) + b\n```")
    cases = {"fn_name": "total", "inputs": ["[1, 2]\n3", "[]\n0"], "outputs": ["6", "0"]}
    assert scorer(leetcode, cases) == 1.0  # List comes from the wrapper's typing import, as in verl
    asserts = {"assert_case": ["assert f(2) == 4", "assert f(3) == 9", "assert f(1) == 5"]}
    assert scorer("```python\ndef f(x):\n    return x * x\n```", asserts) == pytest.approx(2 / 3, rel=1e-12)


def test_only_the_first_ten_cases_count_and_504_is_retried(sandbox_url):
    scorer = SandboxScorer(sandbox_url)
    cases = {"inputs": [f"{i}\n" for i in range(12)], "outputs": [f"{2 * i}\n" for i in range(10)] + ["x", "y"]}
    assert scorer(DOUBLE, cases) == 1.0  # verl's continuous score: the two failing cases are 11th and 12th
    _RunCode.gateway_timeouts = 1
    assert SandboxScorer(sandbox_url, max_concurrent=1)(DOUBLE, {"inputs": ["3"], "outputs": ["6"]}) == 1.0


def test_an_unreachable_sandbox_fails_the_cases():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once closed
    assert SandboxScorer(f"http://127.0.0.1:{port}/run_code")(DOUBLE, CASES) == 0.0


def test_extract_code_follows_verl():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```python\ny = 2\n```") == "\ny = 2\n"  # the last python block
    assert extract_code("```cpp\nint x;\n```") == "int x;\n"
    assert extract_code("no code") is None


def test_router_sends_code_sources_to_the_sandbox(sandbox_url):
    from types import SimpleNamespace

    reward = SimpleNamespace(name="arithmetic", manager="naive",
                             sandbox_fusion=SimpleNamespace(url=sandbox_url, max_concurrent=8, memory_limit_mb=512))
    router = SourceRouter.from_config(reward, "data_source")
    assert router.score_all([DOUBLE, "4"], [CASES, "4"], ["codecontests", None]) == [0.75, 1.0]
    with pytest.raises(ValueError, match="a code source: set reward.sandbox_fusion.url"):
        SourceRouter("arithmetic").check(["taco"])


def test_prime_scores_rows_at_once_and_failures_score_zero():
    together = threading.Barrier(3, timeout=10)  # breaks unless three rows run at the same time

    def waits(response, truth):
        together.wait()
        return 1.0

    def fails(response, truth):
        raise RuntimeError("scorer bug")

    def hangs(response, truth):
        time.sleep(5)
        return 1.0

    rows = [(waits, "a", "a"), (waits, "b", "b"), (waits, "c", "c"), (fails, "d", "d"),
            (lambda r, t: (0.5, {}), "e", "")]  # a (score, details) tuple: its score, as verl's manager reads it
    assert score_concurrently(rows, workers=8) == [1.0, 1.0, 1.0, 0.0, 0.5]
    start = time.monotonic()
    assert score_concurrently([(hangs, "x", "x"), (lambda r, t: 1, "y", "y")], timeout_s=0.2) == [0.0, 1.0]
    assert time.monotonic() - start < 4  # the hung row was not awaited
