"""Single-controller runtime: Ray cluster, resource pools, worker groups, dispatch.

Generic: knows nothing about models or trainers, only `hybridflow.protocol.Batch`.
"""

from .cluster import RayHandle, start_ray
from .decorator import DISPATCH_TABLE, Dispatch, register
from .resource_pool import ResourcePool, ResourcePoolError
from .worker import Worker
from .worker_group import DispatchFuture, RayWorkerGroup, WorkerGroupError, get_together

__all__ = [
    "DISPATCH_TABLE",
    "Dispatch",
    "DispatchFuture",
    "get_together",
    "RayHandle",
    "RayWorkerGroup",
    "ResourcePool",
    "ResourcePoolError",
    "Worker",
    "WorkerGroupError",
    "register",
    "start_ray",
]
