"""Controller runtime on a real (embedded, 2-CPU) Ray cluster.

Resources are fractional so every group of the module fits at once:
dp group 2 x 0.25, 3D group 4 x 0.25, colocated pool 2 x 0.5 = 2 CPUs.
"""

from __future__ import annotations

import os
import re
import sys
import time

import numpy as np
import pytest
import ray
import ray.cloudpickle
import torch

from hybridflow.controller import (
    DISPATCH_TABLE, Dispatch, DispatchFuture, RayWorkerGroup, ResourcePool,
    ResourcePoolError, Worker, WorkerGroupError, register,
)
from hybridflow.protocol import Batch

# pytest imports this file by path; Ray workers cannot import it by name, so
# ship its worker classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _batch(n: int) -> Batch:
    return Batch.from_dict(tensors={"x": torch.arange(n, dtype=torch.float32)},
                           non_tensors={"id": [f"s{i}" for i in range(n)]})


class DPWorker(Worker):
    def __init__(self, scale: float = 2.0):
        super().__init__()
        self.scale = scale

    @register(Dispatch.ONE_TO_ALL)
    def info(self, tag):
        return {"rank": self.rank, "world_size": self.world_size, "tag": tag,
                "local_rank": self.local_rank, "master": (self.master_addr, self.master_port),
                "omp": os.environ["OMP_NUM_THREADS"], "torch_threads": torch.get_num_threads(),
                "flag": os.environ.get("HYBRIDFLOW_TEST_FLAG")}

    def _double(self, batch: Batch) -> Batch:
        return Batch.from_dict(
            tensors={"x": batch["x"] * self.scale},
            non_tensors={"id": batch["id"], "rank": np.full(len(batch), self.rank)})

    @register(Dispatch.DP_COMPUTE)
    def double(self, batch: Batch) -> Batch:
        return self._double(batch)

    @register(Dispatch.RANK_ZERO)
    def whoami(self):
        return self.rank

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def slow(self, seconds: float):
        time.sleep(seconds)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def pid(self):
        return os.getpid()

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int):
        if self.rank == rank:
            raise ValueError(f"boom from rank {self.rank}")
        return "ok"

    @register(Dispatch.ONE_TO_ALL)
    def allreduce(self):
        import torch.distributed as dist

        backend = self.init_distributed(timeout_s=60)
        assert self.init_distributed() == backend  # idempotent
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return t.item(), backend, dist.get_world_size()


class Worker3D(Worker):
    """Fake 2 (dp) x 2 (tp) layout: dp_rank = rank // 2, tp rank 1 returns results."""

    def dispatch_info(self, mesh: str = "train") -> dict:
        if mesh == "flat":  # a second layout: every rank its own shard
            return {"dp_rank": self.rank, "dp_size": self.world_size, "collect": True}
        return {"dp_rank": self.rank // 2, "dp_size": self.world_size // 2,
                "collect": self.rank % 2 == 1}

    @register(Dispatch.DP_COMPUTE_3D, mesh="flat")
    def tag_flat(self, batch: Batch) -> Batch:
        return Batch.from_dict(tensors={"rank": torch.full((len(batch),), self.rank)})

    @register(Dispatch.DP_COMPUTE_3D)
    def compute(self, batch: Batch) -> Batch:
        self.seen = batch["x"].tolist()
        return Batch.from_dict(tensors={"x": batch["x"] * 2},
                               non_tensors={"rank": np.full(len(batch), self.rank)})

    @register(Dispatch.ONE_TO_ALL)
    def last_seen(self):
        return self.seen


class Colocated(Worker):
    def __init__(self, role: str):
        super().__init__()
        self.role = role

    @register(Dispatch.ONE_TO_ALL)
    def where(self):
        import ray

        ctx = ray.get_runtime_context()
        return {"role": self.role, "rank": self.rank, "node": ctx.get_node_id(),
                "pg": ctx.get_placement_group_id(), "resources": ctx.get_assigned_resources()}


@pytest.fixture(scope="module")
def dp_group(ray_cluster):
    pool = ResourcePool("dp", world_size=2, cpus_per_bundle=0.25)
    wg = RayWorkerGroup(pool, DPWorker, 2.0, name_prefix="dp", env={"HYBRIDFLOW_TEST_FLAG": "on"})
    yield wg
    wg.shutdown()
    pool.remove()


def test_dispatch_table_covers_every_mode():
    assert set(DISPATCH_TABLE) == set(Dispatch)


def test_one_to_all_env_and_layout(dp_group):
    infos = dp_group.info("hi")
    assert [i["rank"] for i in infos] == [0, 1]
    assert all(i["world_size"] == 2 and i["tag"] == "hi" for i in infos)
    assert [i["local_rank"] for i in infos] == [0, 1]  # single node
    assert len({i["master"] for i in infos}) == 1  # one rendezvous per group
    assert all(i["omp"] == "1" and i["torch_threads"] == 1 for i in infos)
    assert all(i["flag"] == "on" for i in infos)
    assert dp_group.world_size == 2


def test_dp_compute_preserves_order(dp_group):
    out = dp_group.double(_batch(8))
    assert isinstance(out, Batch) and len(out) == 8
    assert torch.equal(out["x"], torch.arange(8, dtype=torch.float32) * 2)
    assert out["id"].tolist() == [f"s{i}" for i in range(8)]
    assert out["rank"].tolist() == [0] * 4 + [1] * 4


def test_dp_compute_divisibility_error(dp_group):
    with pytest.raises(ValueError, match=r"double: DP_COMPUTE .* size 5 into 2 equal chunks"):
        dp_group.double(_batch(5))


def test_rank_zero_and_non_blocking(dp_group):
    assert dp_group.whoami() == 0
    fut = dp_group.slow(0.2)
    assert isinstance(fut, DispatchFuture)
    assert fut.get(timeout=30) == [0, 1] and fut.done()
    assert dp_group.execute_all("whoami") == [0, 1]  # any method, all ranks


def test_stopped_worker_is_named_within_the_call_timeout(ray_cluster):
    """A worker that is stuck rather than dead (SIGSTOP) ends the call after call_timeout_s, naming it."""
    import signal

    pool = ResourcePool("stuck", world_size=2, cpus_per_bundle=0.25)
    wg = RayWorkerGroup(pool, DPWorker, name_prefix="stuck", call_timeout_s=3)
    try:
        pids = _first_answer(wg.pid)  # the workers' start-up is not what this test times
        os.kill(pids[1], signal.SIGSTOP)
        start = time.monotonic()
        try:
            with pytest.raises(WorkerGroupError) as ei:
                wg.info("x")
        finally:
            os.kill(pids[1], signal.SIGCONT)
        assert time.monotonic() - start < 30
        assert re.fullmatch(r"worker group 'stuck' \(DPWorker.info\): rank\(s\) 1 of 2 on node\(s\) \S+ did not "
                            r"finish within 3 s \(a stopped worker or a wedged collective\)", ei.value.summary), \
            ei.value.summary
        assert wg.info("y")[1]["tag"] == "y"  # resumed, the worker answers again
    finally:
        wg.shutdown()
        pool.remove()


def _first_answer(call, within_s: float = 120):
    """``call()`` once the group's workers have started: on a loaded machine their start-up alone can outlast a
    short call timeout."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return call()
        except WorkerGroupError:
            if time.monotonic() > deadline:
                raise


class SlowStartWorker(Worker):
    def __init__(self, start_s: float):
        super().__init__()
        time.sleep(start_s)  # as a worker importing vLLM and loading its model

    @register(Dispatch.ONE_TO_ALL)
    def info(self):
        return self.rank


def test_the_first_call_waits_for_the_workers_construction_apart_from_its_timeout(ray_cluster):
    """A call timeout shorter than the workers' start-up times the call, not the start-up (bounded by
    build_timeout_s, which names the ranks still being built)."""
    pool = ResourcePool("slow_start", world_size=2, cpus_per_bundle=0.25)
    try:
        wg = RayWorkerGroup(pool, SlowStartWorker, 3.0, name_prefix="slow", call_timeout_s=1, build_timeout_s=120)
        try:
            assert wg.info() == [0, 1]
        finally:
            wg.shutdown()
        wg = RayWorkerGroup(pool, SlowStartWorker, 60.0, name_prefix="slower", call_timeout_s=120, build_timeout_s=2)
        try:
            with pytest.raises(WorkerGroupError) as ei:
                wg.info()
            assert re.fullmatch(r"worker group 'slower' \(SlowStartWorker.info\): rank\(s\) 0, 1 of 2 on node\(s\) "
                                r"\S+ did not finish within 2 s \(a stopped worker or a wedged collective\)",
                                ei.value.summary), ei.value.summary
        finally:
            wg.shutdown()
    finally:
        pool.remove()


class BrokenWorker(Worker):
    def __init__(self):
        super().__init__()
        raise ValueError("actor.optim.lr=nan is not a learning rate")

    @register(Dispatch.ONE_TO_ALL)
    def info(self):
        return self.rank


def test_worker_that_fails_while_being_built_names_its_own_error(ray_cluster):
    pool = ResourcePool("broken", world_size=1, cpus_per_bundle=0.25)
    wg = RayWorkerGroup(pool, BrokenWorker, name_prefix="broken")
    try:
        with pytest.raises(WorkerGroupError) as ei:
            wg.info()
        assert re.fullmatch(r"worker group 'broken' \(BrokenWorker.info\), rank 0 of 1 on node \S+: failed while being "
                            r"built: ValueError: actor.optim.lr=nan is not a learning rate", ei.value.summary), \
            ei.value.summary
    finally:
        wg.shutdown()
        pool.remove()


def test_worker_exception_names_rank_and_method(dp_group):
    with pytest.raises(WorkerGroupError) as ei:
        dp_group.fail_on(1)
    msg = str(ei.value)
    assert re.search(r"\(DPWorker.fail_on\), rank 1 of 2 on node [\d.]+: failed: ValueError: boom from rank 1", msg), msg
    assert ei.value.summary == msg.splitlines()[0]
    assert "boom from rank 1" in msg and ", in fail_on" in msg  # remote traceback kept
    assert "\x1b[" not in msg
    assert ei.value.rank == 1 and ei.value.method == "fail_on"
    assert isinstance(ei.value.cause, ValueError)
    assert dp_group.fail_on(-1) == ["ok", "ok"]  # actors survive a raised exception


def test_torch_distributed_gloo_all_reduce(dp_group):
    assert dp_group.allreduce() == [(3.0, "gloo", 2), (3.0, "gloo", 2)]


def test_dp_compute_3d(ray_cluster):
    pool = ResourcePool("three_d", world_size=4, cpus_per_bundle=0.25)
    wg = RayWorkerGroup(pool, Worker3D, name_prefix="three_d")
    try:
        out = wg.compute(_batch(6))
        assert torch.equal(out["x"], torch.arange(6, dtype=torch.float32) * 2)
        assert out["rank"].tolist() == [1, 1, 1, 3, 3, 3]  # only collect ranks, dp order
        # every rank computed its dp shard, collecting or not
        assert wg.last_seen() == [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]]
        with pytest.raises(ValueError, match="compute: DP_COMPUTE_3D .* size 5 into 2"):
            wg.compute(_batch(5))
        # a method registered on another mesh splits over that mesh's layout
        assert wg.tag_flat(_batch(8))["rank"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    finally:
        wg.shutdown()
        pool.remove()


def _bundle_cpu_free(pool: ResourcePool, expect: list[float], timeout_s: float = 10) -> list[float]:
    """Free CPU per bundle, polled: the GCS resource view trails placement a bit."""
    pg = pool.placement_group.id.hex()
    deadline = time.monotonic() + timeout_s
    while True:
        avail = ray.available_resources()
        free = [avail.get(f"CPU_group_{i}_{pg}", 0.0) for i in range(pool.world_size)]
        if free == pytest.approx(expect) or time.monotonic() > deadline:
            return free
        time.sleep(0.1)


def test_colocated_groups_share_bundles(ray_cluster):
    pool = ResourcePool("coloc", world_size=2, cpus_per_bundle=0.5)
    actor = RayWorkerGroup(pool, Colocated, "actor", name_prefix="coloc_actor", share=0.5)
    critic = None
    try:
        a = actor.where()
        # one actor rank per bundle, each holding half of it
        assert _bundle_cpu_free(pool, [0.25, 0.25]) == pytest.approx([0.25, 0.25])
        critic = RayWorkerGroup(pool, Colocated, role="critic", name_prefix="coloc_critic",
                                share=0.5)
        c = critic.where()
        assert _bundle_cpu_free(pool, [0.0, 0.0]) == pytest.approx([0.0, 0.0])
        with pytest.raises(ResourcePoolError, match="does not fit"):
            RayWorkerGroup(pool, Colocated, "extra", share=0.5)
        assert [x["role"] for x in a] == ["actor"] * 2 and [x["role"] for x in c] == ["critic"] * 2
        assert {x["pg"] for x in a + c} == {pool.placement_group.id.hex()}
        assert all(x["resources"] == {"CPU": pytest.approx(0.25)} for x in a + c)
    finally:
        for group in (actor, critic):
            if group is not None:
                group.shutdown()
    assert pool.free_share == pytest.approx(1.0)
    with pytest.raises(RuntimeError, match="shut down"):
        actor.where()
    pool.remove()


def test_pool_shortage_error_is_clear(ray_cluster):
    pool = ResourcePool("too_big", world_size=4, cpus_per_bundle=1.0, ready_timeout_s=1)
    with pytest.raises(ResourcePoolError, match=r"asked 4 CPUs / 0 GPUs, cluster has .*/2 CPUs"):
        pool.placement_group
    pool.remove()


def test_a_call_is_given_up_once_the_driver_is_asked_to_stop(ray_cluster):
    """A call that would not end (an endless generation) is given up within a wait slice of the driver's
    check saying so (the trainer's: SIGTERM past its grace period), naming the group and method; the worker
    is left running for the caller to stop."""
    from hybridflow.controller.worker_group import WaitAbandoned, give_up_waiting_when

    pool = ResourcePool("endless", world_size=1, cpus_per_bundle=0.25)
    wg = RayWorkerGroup(pool, DPWorker, name_prefix="endless")
    try:
        _first_answer(wg.pid)  # the worker's start-up is not what this test times
        asked = time.monotonic() + 1.0
        with give_up_waiting_when(lambda: "asked to stop" if time.monotonic() > asked else None):
            with pytest.raises(WaitAbandoned, match=r"^stopped waiting for worker group 'endless' \(DPWorker.slow\): "
                                                    r"asked to stop$"):
                wg.slow(600).get()
        assert time.monotonic() - asked < 5
    finally:
        wg.shutdown()
        pool.remove()


def test_a_quick_call_is_given_up_too_once_the_driver_is_asked_to_stop(ray_cluster):
    """A step made of quick calls (DAPO's dynamic sampling generating batch after batch with no limit, each
    call shorter than a wait slice) gives up at its next call, so SIGTERM ends it too."""
    from hybridflow.controller.worker_group import WaitAbandoned, give_up_waiting_when

    pool = ResourcePool("quick", world_size=1, cpus_per_bundle=0.25)
    wg = RayWorkerGroup(pool, DPWorker, name_prefix="quick")
    try:
        _first_answer(wg.pid)
        with give_up_waiting_when(lambda: "asked to stop"):
            with pytest.raises(WaitAbandoned, match=r"\(DPWorker.pid\): asked to stop$"):
                wg.pid()
        assert wg.pid()  # outside the block the group answers as before
    finally:
        wg.shutdown()
        pool.remove()


SIGTERM_AS_RAY_STARTS = """
import os, signal
import ray._private.worker as ray_worker
from hybridflow.controller import start_ray
from hybridflow.trainer.signals import StopRequests


stops = StopRequests()
stops.install()
ray_worker._post_init_hooks.append(lambda: os.kill(os.getpid(), signal.SIGTERM))  # inside ray.init, at its end
handle = start_ray(num_cpus=1)
print("recorded", stops.signum, flush=True)
handle.shutdown()
"""


def test_sigterm_while_ray_starts_is_recorded_by_the_callers_handler(tmp_path):
    """SIGTERM inside ray.init (the trainer's start): the caller's handler records it (the trainer then exits
    75, preempted) instead of Ray's SystemExit in the middle of its connect, which aborted the process (-6)."""
    import signal
    import subprocess

    done = subprocess.run([sys.executable, "-c", SIGTERM_AS_RAY_STARTS], capture_output=True, text=True, timeout=300,
                          cwd=os.getcwd(), env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert done.stdout.splitlines() == [f"recorded {int(signal.SIGTERM)}"], done.stdout
    assert "SIGTERM received" not in done.stderr, done.stderr[-3000:]  # Abseil's failure handler took no part


NODE_START_TIMES_OUT_ONCE = """
import psutil, ray
from hybridflow.controller import cluster


def once(real):
    calls = []

    def init(*args):
        calls.append(real(*args))  # a real cluster whose node then fails Ray's 30 s wait, as it raises it
        if len(calls) == 1:
            ray.shutdown()  # what Ray's failing Node.__init__ leaves: daemons running, nothing connected
            raise Exception(cluster.NODE_START_TIMEOUT + ". This could happen because some of the raylet failed")
        return calls[-1]
    return init


me = psutil.Process()
cluster._init_embedded = once(cluster._init_embedded)
handle = cluster.start_ray(num_cpus=1)
print("answer", ray.get(ray.remote(lambda: 42).remote()), flush=True)
handle.shutdown()
print("left", [p.pid for p in me.children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE], flush=True)
"""


def test_a_node_that_misses_rays_start_wait_is_started_again(tmp_path):
    """Ray raises when a new node's raylet does not register within its fixed 30 s (seen once under make test's load):
    start_ray stops what the failed start left and starts the cluster once more, and nothing of either stays."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", NODE_START_TIMES_OUT_ONCE], capture_output=True, text=True,
                          timeout=300, cwd=os.getcwd(), env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert done.stdout.splitlines() == ["answer 42", "left []"], (done.stdout, done.stderr[-3000:])
    assert "starting the cluster again" in done.stderr, done.stderr[-3000:]
