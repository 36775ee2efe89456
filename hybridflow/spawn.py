"""Run a function on N local gloo ranks in fresh processes (tests, benchmarks) and return each rank's result."""

from __future__ import annotations

import os
import pickle
import traceback

import torch.multiprocessing as mp

from hybridflow import device
from hybridflow.util import free_port


# On CPU the ranks fork from a server process that imported these once (multiprocessing's forkserver with
# preload): a rank starts without importing them again (seconds a rank, megatron-core and vLLM the most).
# Importing does not start torch's OpenMP pool, so a forked rank sets its own thread count. A CUDA/ROCm host keeps
# spawn: these imports may initialise the driver, which a forked child cannot use.
_PRELOAD = ["torch", "torch.distributed", "megatron.core", "transformers", "vllm"]


def _context():
    if device.has_gpu():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _entry(rank, world_size, port, fn, args, queue, backend="gloo", env=None):
    if env is not None:  # the caller's environment now, not the forkserver's from when it started
        os.environ.clear()
        os.environ.update(env)
    # One torch thread per rank unless HYBRIDFLOW_RANK_THREADS says otherwise (tests/numerics_sweep.sh).
    threads = os.environ.get("HYBRIDFLOW_RANK_THREADS", "1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS=threads)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(threads))
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        # plain pickle: tensors travel by value (torch would share fds that die with this process)
        queue.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 600, backend: str = "gloo") -> list:
    """fn(rank, world_size, *args) on every rank, each in a fresh process (forked from preloaded modules on CPU,
    spawned on a GPU host); results ordered by rank; any rank's error re-raised.
    ``backend``: torch.distributed's; "cpu:gloo,cuda:nccl" where ranks compute on GPUs (CUDA tensors' collectives
    through NCCL, as megatron and vLLM expect there; gloo covers only some of them for CUDA tensors)."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port("127.0.0.1")
    env = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, backend, env))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]


def _run_cases(rank, world_size, fn, cases):
    out = {}
    for key, args in cases:
        try:
            out[key] = fn(rank, world_size, *args)
        except BaseException as e:  # name the case: the world stops at the first failing one
            raise RuntimeError(f"case {key} failed on rank {rank}") from e
    return out


def run_cases(fn, world_size: int, cases: dict, *, timeout: float = 600) -> dict:
    """fn(rank, world_size, *args) for each ``key -> args`` of cases, in order, in ONE world of fresh
    processes: starting them (importing torch and megatron-core) dominates small distributed tests.
    fn must leave the process ready for the next case (e.g. tear down megatron's groups). Returns
    key -> results ordered by rank; any rank's error is re-raised naming its case."""
    per_rank = run_ranks(_run_cases, world_size, fn, list(cases.items()), timeout=timeout)
    return {key: [res[key] for res in per_rank] for key in cases}
