"""Code answers scored by a SandboxFusion service (github.com/bytedance/SandboxFusion), as verl 0.9.1 scores
its code sources (codecontests, apps, codeforces, taco) when ``reward.sandbox_fusion.url`` is set
(verl/utils/reward_score/sandbox_fusion/__init__.py ``compute_score`` and utils.py ``check_correctness``,
``call_sandbox_api``): the answer's last fenced code block runs once per test case in the sandbox, with the
case's input on stdin (or, for a ``fn_name`` case, as JSON arguments of that function), and the score is the
pass rate of the first 10 cases (verl's ``continuous=True``). A case passes when the run finishes and its
stdout equals the expected output up to trailing newlines.

Differences from verl, deliberate: the HTTP client is the standard library's (verl uses ``requests``); an
unreachable sandbox fails the case, as in verl, with a warning per case."""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")  # verl's default_compute_score routes these here
CASE_TIMEOUT_S = 10  # verl's compute_score timeout: the sandbox's compile and run limits per case
API_TIMEOUT_S = 10  # on top of those, for the HTTP round trip (verl's API_TIMEOUT)
MAX_RETRIES = 3  # on 504 Gateway Timeout only, waiting 1 s, 2 s between (verl's)
CONTINUOUS_CASES = 10  # the score is the pass rate of the first this many cases
COMPILE_ERROR = -4  # verl's result codes: True / False, -1 api or sandbox error, -2 runtime error, -3 timeout

# verl's wrapper for a ``fn_name`` case (sandbox_fusion/utils.py _process_single_case): the standard-library
# names LeetCode-style answers use unimported (List, deque, ...) are in scope, the answer defines the function
# (or a Solution class with it as a method), each stdin line is one JSON argument, and the result is printed
# (JSON for containers, None and bools; str otherwise)
_MODULES = ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random", "statistics",
            "itertools", "functools", "operator", "io", "sys", "json")
_PRELUDE = "\n".join([*(f"from {m} import *" for m in (*_MODULES, "builtins", "typing")),
                      *(f"import {m}" for m in _MODULES)])
_FN_WRAPPER = _PRELUDE + '''
{generation}

def _hf_call():
    raw = sys.stdin.read()
    args = [json.loads(line) for line in raw.split("\\n")] if raw.strip() else []
    if {fn_name!r} in globals():
        fn = globals()[{fn_name!r}]
    else:
        fn = getattr(globals()["Solution"](), {fn_name!r})
    return fn(*args)

if __name__ == "__main__":
    result = _hf_call()
    print(json.dumps(result) if isinstance(result, (dict, list, tuple, bool)) or result is None else str(result))
'''


def extract_code(completion: str) -> str | None:
    """The code of the answer's ```python block (the last one), else of its first ``` block without its
    language line; None when it has none (verl scores that 0)."""
    if "```python" in completion:
        return completion.split("```python")[-1].split("```")[0]
    if "```" in completion:
        parts = completion.split("```")
        solution = parts[1]
        if "\n" in solution:
            first, rest = solution.split("\n", 1)
            if first.strip().isalpha():  # a language name
                solution = rest
        return solution
    return None


def call_sandbox(url: str, code: str, stdin: str | None, memory_limit_mb: int,
                 timeout_s: int = CASE_TIMEOUT_S, language: str = "python") -> tuple[dict | None, str | None]:
    """POST one run to the sandbox's run_code endpoint: (its JSON answer, None) or (None, the error)."""
    payload = json.dumps({"compile_timeout": timeout_s, "run_timeout": timeout_s, "code": code, "stdin": stdin,
                          "memory_limit_MB": memory_limit_mb, "language": language, "files": {},
                          "fetch_files": []}).encode()
    request = urllib.request.Request(url, data=payload, method="POST",
                                     headers={"Content-Type": "application/json", "Accept": "application/json"})
    error = None
    for attempt in range(MAX_RETRIES):
        try:
            with urllib.request.urlopen(request, timeout=2 * timeout_s + API_TIMEOUT_S) as response:
                return json.loads(response.read()), None
        except urllib.error.HTTPError as e:
            error = f"HTTP {e.code} from {url}"
            if e.code != 504:
                break
            if attempt < MAX_RETRIES - 1:
                time.sleep(attempt + 1)
        except (urllib.error.URLError, OSError, ValueError) as e:
            error = f"{url}: {getattr(e, 'reason', None) or e}"
            break
    return None, error


def case_result(answer: dict | None, expected) -> bool | int:
    """verl's reading of the sandbox's answer: True/False (right or wrong output), -1 error, -2 runtime
    error, -3 time limit, -4 compile error."""
    if answer is None:
        return -1
    status, compile_result, run = answer.get("status"), answer.get("compile_result"), answer.get("run_result")
    if status == "Success":
        if not run or run.get("status") != "Finished":
            return -1
        stdout = run.get("stdout") or ""
        return expected is None or str(stdout).rstrip("\n") == str(expected).rstrip("\n")
    if status != "Failed":
        return -1
    if compile_result and (compile_result.get("status") in ("Error", "TimeLimitExceeded") or
                           (compile_result.get("status") == "Finished" and compile_result.get("return_code") != 0)):
        return COMPILE_ERROR
    if run and run.get("status") == "TimeLimitExceeded":
        return -3
    if run and (run.get("status") == "Error" or (run.get("status") == "Finished" and run.get("return_code") != 0)):
        return -2
    return -1


@dataclass
class SandboxScorer:
    """``(response, ground_truth) -> score`` for code rows; ``ground_truth`` is verl's test-case JSON
    ({"inputs": [...], "outputs": [...]} with optional "fn_name", or "assert_case": [...])."""

    url: str
    max_concurrent: int = 64
    memory_limit_mb: int = 1024
    _slots: threading.Semaphore = field(init=False, repr=False)

    def __post_init__(self):
        self._slots = threading.Semaphore(self.max_concurrent)  # all rows' requests together, as verl's

    def __call__(self, response: str, ground_truth) -> float:
        code = extract_code(response)
        cases = _test_cases(ground_truth)
        if code is None or cases is None:
            return 0.0
        results = self.check(code, cases)
        first = results[:CONTINUOUS_CASES]
        return sum(1 for r in first if r is True) / len(first) if first else 0.0

    def check(self, code: str, cases: dict) -> list:
        """Each case's result (``case_result``), run concurrently; after a compile error every later case
        counts as one too (verl's post-processing)."""
        inputs, outputs = cases["inputs"], cases["outputs"]
        asserts = cases.get("assert_case") or [""] * len(inputs)
        if len(outputs) != len(inputs) or len(asserts) != len(inputs):
            return [-1] * len(inputs)

        def run(i: int):
            source = code + "\n\n" + asserts[i]
            if cases.get("fn_name"):
                source = _FN_WRAPPER.format(generation=source, fn_name=cases["fn_name"])
            stdin = None if inputs[i] is None else str(inputs[i])
            with self._slots:
                answer, error = call_sandbox(self.url, source, stdin, self.memory_limit_mb)
            if error:
                log.warning("sandbox_fusion: %s", error)
            return case_result(answer, outputs[i])

        with ThreadPoolExecutor(max_workers=max(1, min(len(inputs), self.max_concurrent))) as pool:
            results = list(pool.map(run, range(len(inputs))))
        if COMPILE_ERROR in results:
            first = results.index(COMPILE_ERROR)
            results[first:] = [COMPILE_ERROR] * (len(results) - first)
        return results


def _test_cases(ground_truth) -> dict | None:
    """verl's test-case structure from a row's ground truth (a dict or its JSON), None when unusable."""
    cases = ground_truth
    if not isinstance(cases, dict):
        try:
            cases = json.loads(cases)
        except (TypeError, ValueError):
            return None
    if not isinstance(cases, dict):
        return None
    cases = dict(cases)  # the row's own stays as it is
    if isinstance(cases.get("assert_case"), list):
        cases.setdefault("inputs", [""] * len(cases["assert_case"]))
        cases.setdefault("outputs", [None] * len(cases["assert_case"]))
    if not isinstance(cases.get("inputs"), list) or not isinstance(cases.get("outputs"), list):
        return None
    return cases
