"""The driver's typed interfaces (workers/interfaces.py) match the registered worker methods exactly."""

from __future__ import annotations

import inspect
import typing

import pytest

from hybridflow.controller import Dispatch, DispatchFuture
from hybridflow.controller.decorator import get_register_spec
from hybridflow.protocol import Batch
from hybridflow.workers import interfaces


def _pairs():
    from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker
    from hybridflow.workers.critic import CriticWorker
    from hybridflow.workers.reward_model import RewardModelWorker
    from hybridflow.workers.rollout import RolloutWorker

    return [(interfaces.ActorRolloutRefGroup, ActorRolloutRefWorker), (interfaces.CriticGroup, CriticWorker),
            (interfaces.RewardModelGroup, RewardModelWorker), (interfaces.RolloutGroup, RolloutWorker)]


def _own_methods(protocol) -> set[str]:
    base = set(vars(interfaces.WorkerGroupHandle))
    return {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_") and n not in base}


def _parameters(fn) -> list[str]:
    # ray.remote(cls) adds a `_ray_trace_ctx` keyword to the class's own methods, in place
    # (ray/util/tracing/tracing_helper.py, _inject_tracing_into_class): not part of the interface.
    return [p for p in inspect.signature(fn).parameters if p != "_ray_trace_ctx"]


def _registered(worker_cls) -> dict:
    return {n: get_register_spec(getattr(worker_cls, n)) for n in dir(worker_cls)
            if get_register_spec(getattr(worker_cls, n, None)) is not None}


@pytest.mark.parametrize("index", range(4), ids=["actor_rollout_ref", "critic", "reward_model", "rollout"])
def test_interface_lists_every_registered_method_with_its_signature(index):
    protocol, worker_cls = _pairs()[index]
    registered = _registered(worker_cls)
    assert _own_methods(protocol) == set(registered), f"{protocol.__name__} vs {worker_cls.__name__}"
    for name, spec in registered.items():
        assert _parameters(getattr(protocol, name)) == _parameters(getattr(worker_cls, name)), name
        worker_returns = typing.get_type_hints(getattr(worker_cls, name)).get("return")
        group_returns = typing.get_type_hints(getattr(protocol, name))["return"]
        # What the dispatch mode's collect function makes of the per-rank results.
        if not spec.blocking:  # a future of what the blocking call would collect
            assert group_returns is DispatchFuture, name
        elif spec.dispatch_mode in (Dispatch.DP_COMPUTE, Dispatch.DP_COMPUTE_3D) and worker_returns is Batch:
            assert group_returns is Batch, name
        else:
            assert typing.get_origin(group_returns) is list, f"{name}: per-rank results come back as a list"
            (item,) = typing.get_args(group_returns)
            assert (type(None) if item is None else item) is worker_returns, name


def test_the_real_group_offers_the_handle():
    from hybridflow.controller import RayWorkerGroup

    for name in _own_methods(interfaces.WorkerGroupHandle) | {"dispatch_infos", "execute_all", "shutdown"}:
        assert callable(getattr(RayWorkerGroup, name)), name
