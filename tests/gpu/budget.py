"""The GPU tier's time budget, for ``tests/gpu/run.sh``: the sum of the pytest-timeout limits of the cases a
run selects, plus the time outside every case (interpreter and torch start-up, collection, the summary).

    python -m tests.gpu.budget [pytest args]     prints the budget in whole seconds

It collects ``tests/gpu -m gpu`` with the same arguments the run gets (so ``-k single`` shrinks it), and
counts every selected case at its full limit, also those that will skip for want of GPUs: a bound, not a
forecast. pytest-timeout's limit covers a case's setup, call and teardown, so a case never needs more.
"""

from __future__ import annotations

import contextlib
import math
import sys

import pytest

OUTSIDE_CASES_S = 120


class _CaseLimits:
    """A pytest plugin: the timeout (seconds) of every case left after selection."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def pytest_collection_finish(self, session) -> None:
        default = float(session.config.getini("timeout") or 0)
        for item in session.items:
            marker = item.get_closest_marker("timeout")
            if marker is None:
                self.seconds.append(default)
            else:  # @pytest.mark.timeout(420) or timeout=420
                self.seconds.append(float(marker.args[0] if marker.args else marker.kwargs["timeout"]))


def case_limits(pytest_args: list[str]) -> list[float]:
    """The limits of the cases ``pytest tests/gpu -m gpu <pytest_args>`` would run; collection errors raise."""
    limits = _CaseLimits()
    with contextlib.redirect_stdout(sys.stderr):  # pytest's collection report must not mix with the number
        code = pytest.main(["tests/gpu", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider",
                            *pytest_args], plugins=[limits])
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        raise SystemExit(f"collecting the GPU tier failed (pytest exit {int(code)}): see above")
    return limits.seconds


def budget_s(limits: list[float]) -> int:
    return math.ceil(sum(limits)) + OUTSIDE_CASES_S


if __name__ == "__main__":
    limits = case_limits(sys.argv[1:])
    print(budget_s(limits), len(limits))
