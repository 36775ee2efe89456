"""A harness-style agent whose tool is a remote service: the calculator agent (calculator_agent.py), but each call
goes over HTTP to a tool server, as a search API or a test runner in another container would be answered.

    run_episode(task, base_url, api_key, session_id) -> reward

The tool server runs in the agent's process, on its loopback (one per process, started at the first call). Its
latency is that of a remote tool, drawn per call from a log-normal distribution: median ``MEDIAN_S`` = 1.0 s,
sigma ``SIGMA`` = 0.5 (so p10 ~ 0.53 s, p90 ~ 1.9 s, mean ~ 1.13 s), seeded by the session and the call's number
so a run's latencies repeat. The wait happens in the tool server, never in the trainer: an agent program waiting
on its tools is what asynchronous training overlaps with the update (benchmarks/agentic_async.py).
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

MEDIAN_S, SIGMA = 1.0, 0.5

_server: ThreadingHTTPServer | None = None
_started = threading.Lock()


def _calculator():
    import importlib.util

    spec = importlib.util.spec_from_file_location("calculator_agent", Path(__file__).with_name("calculator_agent.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CALC = _calculator()


class _ToolHandler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(body["latency_s"])  # the remote tool's own time
        answer = json.dumps({"result": CALC.calculator(body["arguments"])}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):  # quiet
        pass


class _ToolServer(ThreadingHTTPServer):
    request_queue_size = 1024  # socketserver's listen backlog is 5: hundreds of episodes call at once


def tool_server_url() -> str:
    global _server
    with _started:
        if _server is None:
            _server = _ToolServer(("127.0.0.1", 0), _ToolHandler)
            _server.daemon_threads = True
            threading.Thread(target=_server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{_server.server_address[1]}/"


def remote_calculator(session_id: str):
    """The calculator over HTTP, each call with its seeded latency."""
    calls = iter(range(10**6))

    def call(arguments: str) -> str:
        latency = random.Random(f"{session_id}/{next(calls)}").lognormvariate(math.log(MEDIAN_S), SIGMA)
        request = urllib.request.Request(tool_server_url(), json.dumps({"arguments": arguments,
                                                                        "latency_s": latency}).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            return json.loads(answer.read())["result"]

    return call


def run_episode(task: dict, base_url: str, api_key: str, session_id: str) -> float:
    return CALC.run_episode(task, base_url, api_key, session_id, tool=remote_calculator(session_id))
