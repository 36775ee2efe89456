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


def one_case(rank, world, fn, *args):
    """fn(rank, world, *args) as in a fresh process: fn sets up megatron's groups with
    parallel.init_model_parallel (which also reseeds torch's generator and megatron's RNG tracker), and they
    are dropped after it, so that the next case may build another layout. What else a case leaves behind is
    the same for every case (CPU patches installed once, the MoE loss tracker cleared after each step); the
    dropped groups stay registered with torch.distributed until the process ends: harmless, every rank
    creates them in the same order."""
    from megatron.core import parallel_state as ps

    import torch

    assert not ps.model_parallel_is_initialized() and torch.is_grad_enabled()
    assert torch.get_default_dtype() == torch.float32
    try:
        return fn(rank, world, *args)
    finally:
        ps.destroy_model_parallel()  # megatron's groups and global memory buffers
