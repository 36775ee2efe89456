"""Start (or join) Ray and tear down exactly what this process started.

Shared machines may run other people's Ray clusters, so we never stop Ray by
name (`ray stop` kills every cluster on the host): the embedded cluster gets its
own temp dir and we remember the PIDs of the processes it spawned, then check
by PID that they are gone after `ray.shutdown()`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile

import psutil
import ray

from hybridflow.patches import ray_daemons
from hybridflow.util import environ

log = logging.getLogger(__name__)

# Ray puts its Unix sockets at <temp_dir>/session_<%Y-%m-%d_%H-%M-%S_%f>_<pid>/sockets/plasma_store (and
# .../raylet): ray/_private/node.py (_session_name, _sockets_dir, _prepare_socket_file). The longest pid has
# 7 digits (Linux's pid_max is at most 2**22), and a Unix socket path at most 107 bytes (sun_path is 108 with
# its NUL; ray's validate_socket_filepath).
RAY_SOCKET_TAIL = "/session_2000-01-01_00-00-00_000000_4194304/sockets/plasma_store"
AF_UNIX_PATH_MAX = 107
MAX_TEMP_DIR_BYTES = AF_UNIX_PATH_MAX - len(RAY_SOCKET_TAIL)


# How soon the embedded cluster gives up on a part of itself. A GCS that does not answer for 5 s is gone (it runs on
# this machine: a signal to the whole process group ended it), not after Ray's default 60 s of reconnecting. A node
# (raylet) whose health check fails 3 times, a second apart, is dead: a killed raylet refuses the connection at once,
# so its actors fail within ~3-5 s, not Ray's default 5 x 3 s, during which a killed raylet's workers went on
# training. A live raylet on a loaded machine has 5 s to answer each check: with 1 s, one that a saturated CPU
# slowed for 3 s was declared dead and the run with it (seen with two test sessions on 2 cores). ray_config_def.h:
# health_check_period_ms, health_check_timeout_ms, health_check_failure_threshold. A multi-node cluster (slurm/)
# keeps Ray's defaults: its raylets answer over a network.
HEALTH_CHECKS = {"gcs_rpc_server_reconnect_timeout_s": 5, "health_check_period_ms": 1000,
                 "health_check_timeout_ms": 5000, "health_check_failure_threshold": 3}

# No idle Python workers started with the cluster: the raylet prestarts one per CPU for the first driver
# (ray_config_def.h: prestart_worker_first_driver), but our workers carry their own runtime env (rank, master
# port), so Ray never hands them those processes; they only took CPU from the start-up that matters.
NO_PRESTART = {"prestart_worker_first_driver": False}

# The watcher runs as a file, not `-m hybridflow.controller.reaper`: that imports the hybridflow and controller
# packages (torch, Ray: ~3 s of CPU during the cluster's start-up) for a loop that needs only psutil.
REAPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reaper.py")


class RayHandle:
    """What `start_ray` set up; `shutdown()` (or `with`) undoes it."""

    def __init__(self, address: str, temp_dir: str | None, procs: list[psutil.Process],
                 owns_temp_dir: bool, reaper: subprocess.Popen | None = None):
        self.address = address
        self.temp_dir = temp_dir
        self._procs = procs  # psutil objects detect PID reuse via create time
        self._owns_temp_dir = owns_temp_dir
        self._reaper = reaper
        self._closed = False

    @property
    def embedded(self) -> bool:
        return bool(self._procs)

    @property
    def pids(self) -> list[int]:
        """PIDs of the Ray processes this handle is responsible for."""
        return sorted(p.pid for p in self._procs)

    def alive_pids(self) -> list[int]:
        return sorted(p.pid for p in self._procs if _alive(p))

    def shutdown(self, timeout_s: float = 15.0) -> list[int]:
        """Disconnect, stop the embedded cluster, verify by PID; idempotent.

        Returns the PIDs that outlived ray.shutdown() and had to be killed.
        """
        if self._closed:
            return []
        self._closed = True
        if self._reaper is not None:  # this shutdown does its work
            self._reaper.kill()
            self._reaper.wait()
        # Worker processes are spawned by the raylet after start-up, so take
        # the process tree now, while the parents are still alive.
        tree = {p.pid: p for p in self._procs}
        for p in list(self._procs):
            try:
                tree.update({c.pid: c for c in p.children(recursive=True)})
            except psutil.NoSuchProcess:
                pass
        self._procs = list(tree.values())
        if ray.is_initialized():
            ray.shutdown()
        _, alive = psutil.wait_procs(self._procs, timeout=timeout_s)
        killed = [p.pid for p in alive if _alive(p)]
        if killed:
            log.warning("Ray processes still alive after ray.shutdown(), killing PIDs %s", killed)
            for sig in ("terminate", "kill"):
                for p in alive:
                    try:
                        getattr(p, sig)()
                    except psutil.NoSuchProcess:
                        pass
                _, alive = psutil.wait_procs(alive, timeout=3)
        if self._owns_temp_dir and self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        elif self.temp_dir:  # a caller's temp dir keeps Ray's logs; the workers' scratch goes
            shutil.rmtree(worker_tmp_dir(self.temp_dir), ignore_errors=True)
        return killed

    def __enter__(self) -> RayHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        kind = "embedded" if self.embedded else "joined"
        return f"RayHandle({kind}, address={self.address!r}, temp_dir={self.temp_dir!r})"


def worker_tmp_dir(temp_dir: str) -> str:
    """The TMPDIR of an embedded cluster's processes (made here)."""
    path = os.path.join(temp_dir, "tmp")
    os.makedirs(path, exist_ok=True)
    return path


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _embedded_temp_dir(temp_dir: str | None) -> str:
    """The embedded cluster's temp dir, made: a fresh short one under /tmp for None."""
    if temp_dir is None:
        temp_dir = tempfile.mkdtemp(prefix="hybridflow_ray_", dir="/tmp")
    temp_dir = os.path.abspath(temp_dir)
    if len(temp_dir.encode()) > MAX_TEMP_DIR_BYTES:
        raise ValueError(f"Ray temp_dir {temp_dir!r} is {len(temp_dir.encode())} bytes; keep it <= "
                         f"{MAX_TEMP_DIR_BYTES} (Unix socket paths inside it are length-limited)")
    os.makedirs(temp_dir, exist_ok=True)
    return temp_dir


def _stop_started(me: psutil.Process, before: set, temp_dir: str | None) -> None:
    """After a failed start: Ray shut down, the processes it started (children of ``me`` not in ``before``) killed,
    ``temp_dir`` (where it was ours) removed."""
    if ray.is_initialized():
        ray.shutdown()
    started = [p for p in me.children(recursive=True) if p.pid not in before]
    for p in started:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(started, timeout=5)
    if temp_dir is not None:
        shutil.rmtree(temp_dir, ignore_errors=True)


# Ray gives a new node's raylet 30 s to register with the GCS, then raises this (ray/_private/node.py, Node.__init__:
# raylet_start_wait_time_s, not configurable). On two cores under a test run's load it once took longer: the start is
# tried once more, from scratch.
NODE_START_TIMEOUT = "The current node timed out during startup"


def _init_embedded(temp_dir: str, num_cpus: int | None, system_config: dict, init_kwargs: dict):
    """``ray.init`` of a new local cluster in ``temp_dir``, its daemons in a session of their own."""
    # The workers' TMPDIR lies inside the cluster's temp dir (they inherit it from the raylet): what
    # they leave there (wandb's media folders from megatron's import, multiprocessing's pymp-*,
    # torchinductor_*; a worker stopped by ray.kill never cleans up) goes with the cluster.
    with environ(TMPDIR=worker_tmp_dir(temp_dir)), ray_daemons.own_session(), ray_daemons.keep_sigterm_handler():
        return ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True,
                        _temp_dir=temp_dir, _system_config=system_config, **init_kwargs)


def start_ray(address: str | None = None, num_cpus: int | None = None,
              temp_dir: str | None = None, **init_kwargs) -> RayHandle:
    """Start an embedded single-node cluster (address None) or join one.

    temp_dir: for the embedded cluster; a fresh short dir under /tmp is made
    (and removed on shutdown) when None. A caller-given dir is kept, so its
    logs survive. Extra keyword arguments go to `ray.init`.
    """
    if ray.is_initialized():
        raise RuntimeError("Ray is already initialised in this process; shut it down first "
                           "or use the existing connection")
    if address is not None:
        if num_cpus is not None or temp_dir is not None:
            raise ValueError("num_cpus/temp_dir only apply to an embedded cluster (address=None); "
                             f"joining {address!r} uses that cluster's settings")
        with ray_daemons.keep_sigterm_handler():
            ctx = ray.init(address=address, **init_kwargs)
        return RayHandle(ctx.address_info.get("address", address), None, [], False)

    owns = temp_dir is None
    temp_dir = _embedded_temp_dir(temp_dir)
    system_config = {**HEALTH_CHECKS, **NO_PRESTART, **init_kwargs.pop("_system_config", {})}
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    for attempt in (1, 2):
        try:
            ctx = _init_embedded(temp_dir, num_cpus, system_config, init_kwargs)
            break
        except BaseException as e:  # e.g. SIGTERM while starting (Ray's handler exits): stop what had started
            _stop_started(me, before, temp_dir if owns else None)
            if attempt == 2 or NODE_START_TIMEOUT not in str(e):
                raise
            log.warning("Ray's node did not register with its GCS within Ray's 30 s: starting the cluster again")
            temp_dir = _embedded_temp_dir(None if owns else temp_dir)
    procs = [p for p in me.children(recursive=True) if p.pid not in before]
    # Outside our process group and session: a terminal's Ctrl-C or a kill of the driver's group leaves
    # the watcher to do its one job.
    reaper = subprocess.Popen([sys.executable, REAPER, str(me.pid),
                               temp_dir if owns else "-", *map(str, (p.pid for p in procs))],
                              start_new_session=True, stdin=subprocess.DEVNULL)
    log.info("embedded Ray at %s (temp_dir %s, pids %s)", ctx.address_info["address"],
             temp_dir, [p.pid for p in procs])
    return RayHandle(ctx.address_info["address"], temp_dir, procs, owns, reaper)
