"""What every GPU holds whatever the model does, for the memory plan (tools/memory_plan.py): one CUDA context per
process on the GPU, and the NCCL buffers of every communicator its processes run collectives on.

- A CUDA context with torch's cuBLAS/cuDNN workspaces and its caching allocator's slack: about 0.5-1 GiB per
  process on a Hopper GPU (the context alone is a few hundred MiB; torch reserves more as it runs); counted 1 GiB.
  The actor, reference and colocated vLLM share one process (workers/actor_rollout_ref.py); a critic or reward model
  placed on the same GPUs is a process of its own.
- NCCL allocates buffers per communicator when a collective first runs on it (NCCL_RUNTIME_CONNECT): for each
  channel (up to 32 on NVLink systems) and connected peer, one per protocol: Simple (NCCL_BUFFSIZE, 4 MiB), LL128
  (~4.6 MiB) and LL (~0.25 MiB); a ring connects one peer a channel, so about 32 x 9 MiB = 0.28 GiB a communicator,
  counted 0.3 GiB. NVLink SHARP (NVLS) buffers on NVSwitch systems come on top: NCCL_NVLS_ENABLE=0 turns them off.
- Communicators, by process: the megatron role's groups (``ParallelLayout.collective_groups``); vLLM's TP group
  (generation TP > 1); the hybrid engine's micro-data-parallel exchange groups (resharding/transition.py: the
  micro-DP group of d_g ranks, and its stage slices when a generation shard spans pipeline stages); separate_async's
  checkpoint-engine feed (resharding/checkpoint_engine.py).
"""

from __future__ import annotations

GiB = 2 ** 30
CUDA_CONTEXT_BYTES = 1 * GiB
NCCL_COMM_BYTES = 0.3 * GiB


def fixed(processes: int, communicators: dict[str, int]) -> list[tuple[str, float]]:
    """The plan's rows: ``processes`` CUDA contexts and the NCCL buffers of ``communicators`` ({group: how many}; the
    group's name tells its size)."""
    count = sum(communicators.values())
    return [(f"CUDA contexts ({processes} process{'es' if processes > 1 else ''})", processes * CUDA_CONTEXT_BYTES),
            (f"NCCL buffers ({count} communicator{'s' if count != 1 else ''}: {communicator_names(communicators)})"
             if count else "NCCL buffers (none)", count * NCCL_COMM_BYTES)]


def communicator_names(communicators: dict[str, int]) -> str:
    return ", ".join(name if n == 1 else f"{n} x {name}" for name, n in communicators.items())


def _role_groups(role: str, layout, moe: bool) -> dict[str, int]:
    return {f"{role} {name} {size}": 1 for name, size in layout.collective_groups(moe).items()}


def _feeds(run) -> int:
    """Checkpoint-engine feeds a training rank sources at most (resharding/separate.py: one per part of its shard)."""
    import math

    return max(1, run.generation.tp // math.gcd(run.actor.tp, run.generation.tp))


def trainer_gpu(run, moe: bool, critic_here: bool, reward_model: bool) -> list[tuple[str, float]]:
    """A GPU of the actor's pool: the actor process (with its reference and, colocated, vLLM), a critic or reward model
    sharing the GPU, and their communicators."""
    groups = _role_groups("actor", run.actor, moe)
    if critic_here:
        groups.update(_role_groups("critic", run.critic, moe))
    gen, t = run.generation, run.actor.tp
    if not gen.colocated:
        groups["checkpoint-engine feed"] = _feeds(run)
        return fixed(1 + critic_here + reward_model, groups)
    if gen.tp > 1:
        groups[f"vLLM tensor {gen.tp}"] = 1
    micro_dp = max(1, t // gen.tp) * run.actor.pp  # resharding/plan.py's d_g (one generation stage)
    if micro_dp > 1:
        groups[f"resharding micro-DP {micro_dp}"] = 1
    if run.actor.pp > 1:
        groups[f"resharding stage slices {run.actor.pp}"] = 1
    return fixed(1 + critic_here + reward_model, groups)


def rollout_gpu(run) -> list[tuple[str, float]]:
    """A GPU of separate_async's rollout pool: the rollout worker's process, its vLLM TP group and its feed."""
    groups = {f"vLLM tensor {run.generation.tp}": 1} if run.generation.tp > 1 else {}
    groups["checkpoint-engine feed"] = 1
    return fixed(1, groups)


def critic_gpu(run, moe: bool) -> list[tuple[str, float]]:
    """A GPU of a critic placed in a pool of its own."""
    return fixed(1, _role_groups("critic", run.critic, moe))
