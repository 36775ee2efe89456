"""Parametrized distributed cases that share their gloo worlds: every case of one world size runs in one set of
spawned processes (hybridflow.spawn.run_cases) on first use, and each test checks its own case's results, so a
failure still names its case. Starting the processes (torch and megatron-core imports) dominates small cases."""

from __future__ import annotations

import pytest

from hybridflow.spawn import run_cases


def batched_worlds(fn, cases: dict[str, tuple[int, tuple]]):
    """``cases``: case id -> (world size, args of ``fn(rank, world, *args)``). Returns ``get(case_id)`` -> the
    case's per-rank results."""
    worlds: dict[int, dict | RuntimeError] = {}

    def get(case_id: str) -> list:
        world = cases[case_id][0]
        if world not in worlds:
            batch = {i: args for i, (w, args) in cases.items() if w == world}
            try:
                worlds[world] = run_cases(fn, world, batch)
            except RuntimeError as e:  # kept: each of this world's tests reports it
                worlds[world] = e
        res = worlds[world]
        if isinstance(res, RuntimeError):
            if f"case {case_id} failed " in str(res):
                raise res
            pytest.fail(f"not checked: the {world}-rank world stopped at another case:\n{res}")
        return res[case_id]

    return get
