"""Process groups: the one place that sets up megatron-core's parallel_state for a worker process."""

from __future__ import annotations

import torch.distributed as dist

from hybridflow.megatron.convert import Shard
from hybridflow.patches import megatron_core
from hybridflow.plan.layout import ParallelLayout
from hybridflow.plan.stages import stage_layers_of


def init_layout(layout: ParallelLayout, seed: int, timeout_s: float = 600) -> None:
    """megatron's groups for the run plan's ``layout`` of this process's role (``init_model_parallel``)."""
    init_model_parallel(layout.tp, layout.pp, seed, timeout_s, ep=layout.ep, etp=layout.etp, cp=layout.cp,
                        vpp=layout.vpp)


def init_model_parallel(tp: int, pp: int, seed: int, timeout_s: float = 600, ep: int = 1,
                        etp: int | None = None, cp: int = 1, vpp: int = 1) -> None:
    """Create TP/CP/PP/DP groups (and the expert-parallel ones: EP x expert-TP over the same ranks) over the
    already-initialized default group (gloo on CPU, nccl on GPU).

    The world must divide by tp*cp*pp; the data-parallel size is what remains. The sequence is split over cp
    ranks (megatron/context_parallel.py), which hold the same weights, as data-parallel ranks do. Experts are
    split over ep ranks and their weights over etp (None: tp) ranks; megatron needs the world to divide by
    etp*ep*pp. ``vpp``: virtual pipeline stages per stage (megatron's interleaved schedule), no groups of their
    own.
    """
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized before megatron's model parallel groups")
    world = dist.get_world_size()
    if world % (tp * cp * pp):
        raise ValueError(f"world size {world} is not divisible by tensor ({tp}) x context ({cp}) x pipeline ({pp}) "
                         "parallel sizes")
    etp = etp or tp
    if world % (etp * ep * pp):
        raise ValueError(f"world size {world} is not divisible by expert tensor ({etp}) x expert ({ep}) x "
                         f"pipeline ({pp}) parallel sizes")
    megatron_core.enable_cpu()
    if ps.model_parallel_is_initialized():
        if (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size(), ps.get_context_parallel_world_size(),
                ps.get_virtual_pipeline_model_parallel_world_size() or 1) != (tp, pp, ep, cp, vpp):
            raise ValueError("this process already has megatron groups of a different layout")
    else:
        with megatron_core.cpu_scope():
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                         context_parallel_size=cp,
                                         virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                         expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                                         distributed_timeout_minutes=max(1, round(timeout_s / 60)))
    if vpp > 1:  # the interleaved schedule's two-way exchanges (megatron's shape order crosses them at pp 2)
        megatron_core.fix_shape_exchange_order()
    megatron_core.model_parallel_seed(seed)


def current_layout(sequence_parallel: bool = False, role: str = "role", overrides: dict | None = None) -> ParallelLayout:
    """The layout of this process's megatron groups, as the run plan would give it (its arithmetic owns the
    facts derived from it: weight replicas, the sequence multiple, micro-batches, whether experts move)."""
    s = current_shard(overrides)
    return ParallelLayout(role, dist.get_world_size(), "", s.tp_size, s.pp_size, s.ep_size, s.expert_tp[1], s.cp_size,
                          s.vpp_size, sequence_parallel and s.tp_size > 1, s.first_stage_layers, s.last_stage_layers)


def current_shard(overrides: dict | None = None) -> Shard:
    """This rank's place; ``overrides`` (the role's override_transformer_config, as megatron is given it) may
    split the pipeline stages unevenly (plan/stages.py)."""
    from megatron.core import parallel_state as ps

    first, last = stage_layers_of(overrides)
    return Shard(
        tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=ps.get_pipeline_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(), etp_size=ps.get_expert_tensor_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(), cp_size=ps.get_context_parallel_world_size(),
        vpp_size=ps.get_virtual_pipeline_model_parallel_world_size() or 1,
        first_stage_layers=first, last_stage_layers=last,
    )


def dispatch_info() -> dict:
    """For the controller's 3D dispatch: this rank's DP shard (the CP ranks of a DP rank share its rows), and
    whether it returns results (TP and CP rank 0 on the last pipeline stage)."""
    from megatron.core import parallel_state as ps

    return dict(
        dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
        collect=(ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
                 and ps.is_pipeline_last_stage()),
    )
