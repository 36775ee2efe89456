"""Run model-written Python in a throw-away process: ``run_python(code, limits) -> SandboxResult``.

Each call spawns ``sys.executable -I -S sandbox_launcher.py <spec>`` (the launcher, run by path
rather than ``-m hybridflow.agent.sandbox_launcher`` so that it starts in ~20 ms on the standard library alone, without
importing hybridflow's packages) in a new session with a minimal environment and a
private ``tempfile.mkdtemp`` as its working directory, holding the code as ``main.py``. Three processes:

    launcher (session leader)  ->  supervisor (PID 1 of a new PID namespace)  ->  user code (python main.py)

Isolated mode (``isolation_available()``; Linux >= 5.12 with namespaces usable): the launcher calls unshare(2)
for new mount, network, PID, IPC and UTS namespaces (and a user namespace first when it is not root, with the
caller's uid/gid mapped onto themselves and setgroups denied):

- network: only a loopback that is down, so every connect() fails (ENETUNREACH), 127.0.0.1 included;
- files: ``/`` is made private recursively, ``/tmp``, ``/var/tmp``, ``/run`` and ``/dev/shm`` are covered by
  empty tmpfs (other programs' files and their unix sockets, which a read-only mount does not stop connect(2)
  to: /run/dbus, Ray's session dirs), then everything is made read-only recursively with mount_setattr(2)
  (AT_RECURSIVE, MOUNT_ATTR_RDONLY); the work dir gets a fresh tmpfs of ``file_size_mb`` (what the code may
  write in total, bounded in memory, not on the host's disk) owned by the code's uid, and ``/proc`` a fresh,
  read-only procfs of the new PID namespace (best effort: some containers refuse it);
- processes: the supervisor is PID 1; when it exits (after the user code exits, or when the caller kills the
  launcher's process group at the wall timeout) the kernel kills every process left in the namespace, so
  nothing started by the code (``setsid`` or a double fork included) outlives the call;
- identity: as root, the user code runs under a uid/gid of its own, ``SANDBOX_UID_BASE + launcher pid``
  (root is exempt from RLIMIT_NPROC; a uid per call keeps one call's processes from counting against another's
  limit and keeps concurrent calls out of each other's work dirs). Directories on the way to the interpreter
  that such a uid cannot traverse (``/root`` here: pyenv's Python lives there) are covered, inside the mount
  namespace only, by a tmpfs holding bind mounts of just the entries the interpreter needs, which also hides the
  rest of them (keys, tokens) from the code. Not root: the code keeps the caller's uid inside the user
  namespace; execve(2) of a non-zero uid drops the namespace's capabilities, so it cannot remount anything.

Not covered: the code can read whatever is world-readable on the host outside the hidden dirs (datasets
included), connect to world-writable unix sockets outside them, and open device nodes as their permissions allow
(``/dev`` is the host's, read-only).

Limits, set with setrlimit in the user-code process before exec: RLIMIT_CPU (``cpu_s``), RLIMIT_AS
(``memory_mb``: Python raises MemoryError), RLIMIT_FSIZE (``file_size_mb`` per file), RLIMIT_NPROC
(``max_processes``, counted per uid: threads count too), RLIMIT_NOFILE and RLIMIT_CORE 0; PR_SET_NO_NEW_PRIVS.
The wall time (``timeout_s``) is enforced by the caller: SIGKILL to the launcher's process group (the supervisor
dies, the namespace with it), and a SIGKILL to the group after a normal exit too. stdout and stderr are read
concurrently and capped (``max_output_bytes`` each: the head and the tail are kept, the middle dropped), so a
flood cannot exhaust the caller's memory.

Unisolated mode (``SandboxLimits.isolate=False``; the python tool uses it only with ``allow_unisolated: true``,
for hosts without namespaces, e.g. containers whose seccomp profile forbids unshare): only the rlimits, the
process group, the temp working dir and the minimal environment apply. The code can then read and write
whatever the caller's uid can, use the network, and leave behind processes that leave the process group
(``setsid``); as root RLIMIT_NPROC is not enforced at all, and otherwise it counts every process of the
caller's uid, so it is set to their current number plus ``max_processes``.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

from hybridflow.agent.sandbox_launcher import CODE_FILE, cpu_seconds

_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_launcher.py")

__all__ = ["SandboxLimits", "SandboxResult", "isolation_available", "isolation_problem", "run_python"]

_HEAD_SHARE = 0.75  # of max_output_bytes kept from the start of a stream; the rest from its end


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0  # wall clock, the whole call
    cpu_s: float | None = None  # per process; None: timeout_s
    memory_mb: int = 1024  # address space per process (RLIMIT_AS)
    file_size_mb: int = 16  # per file (RLIMIT_FSIZE); isolated: also the size of the work dir's tmpfs
    max_processes: int = 16  # processes (threads) of the code's uid (RLIMIT_NPROC)
    max_open_files: int = 256
    max_output_bytes: int = 64 * 1024  # kept per stream
    isolate: bool = True


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # -N: killed by signal N; None: no status (timed out, or the launcher failed)
    killed_by: str | None  # None | "timeout" | "cpu" | "memory" | "file_size" | "processes" | "signal" | "setup"
    seconds: float
    output_truncated: bool = False
    setup_error: str | None = None  # why the sandbox could not be set up (killed_by "setup")
    isolated: bool = False


# ---------------------------------------------------------------------------------------------------------
# Caller side


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code`` as ``python main.py`` in a new sandbox; never raises for anything the code does."""
    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="hybridflow-sandbox-")
    status_r, status_w = os.pipe()
    try:
        with open(os.path.join(workdir, CODE_FILE), "w", encoding="utf-8") as f:
            f.write(code)
        spec = {"workdir": workdir, "status_fd": status_w, "parent_pid": os.getpid(), "python": sys.executable,
                "needed": _interpreter_paths(), "env": _user_env(workdir), "limits": asdict(limits)}
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", _LAUNCHER, json.dumps(spec)], cwd=workdir,
                env=_user_env(workdir), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, pass_fds=(status_w,))
        finally:
            os.close(status_w)
        out, err, status_bytes, timed_out = _collect(proc, status_r, start + limits.timeout_s, limits)
        return _result(out, err, status_bytes, timed_out, proc.returncode, limits, time.monotonic() - start)
    finally:
        os.close(status_r)
        shutil.rmtree(workdir, onerror=_force_remove)


class _CappedBuffer:
    """The first and the last bytes of a stream, at most ``cap`` in all; the count of those dropped."""

    def __init__(self, cap: int):
        self.head_cap = int(cap * _HEAD_SHARE)
        self.tail_cap = cap - self.head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def add(self, data: bytes) -> None:
        room = self.head_cap - len(self.head)
        self.head += data[:room]
        data = data[room:] if room > 0 else data
        if data:
            self.tail += data
            over = len(self.tail) - self.tail_cap
            if over > 0:
                del self.tail[:over]
                self.dropped += over

    def text(self) -> str:
        middle = f"\n...[{self.dropped} bytes of output dropped]...\n".encode() if self.dropped else b""
        return (bytes(self.head) + middle + bytes(self.tail)).decode("utf-8", "replace")


def _collect(proc: subprocess.Popen, status_r: int, deadline: float, limits: SandboxLimits):
    """Read both streams and the status pipe until the launcher is gone; SIGKILL its group at ``deadline``."""
    bufs = {proc.stdout.fileno(): _CappedBuffer(limits.max_output_bytes),
            proc.stderr.fileno(): _CappedBuffer(limits.max_output_bytes)}
    status = bytearray()
    sel = selectors.DefaultSelector()
    for fd in (*bufs, status_r):
        sel.register(fd, selectors.EVENT_READ)
    timed_out, exited_at = False, None
    try:
        while sel.get_map():
            now = time.monotonic()
            if exited_at is None and _has_exited(proc.pid):
                _kill_group(proc.pid)  # stragglers still in the group; before reaping, while its id is still ours
                exited_at = now
            if exited_at is None and now >= deadline:
                _kill_group(proc.pid)
                timed_out, exited_at = True, now
            # Isolated, the pipes close as the namespace dies; unisolated, a setsid'd straggler may hold them.
            if exited_at is not None and now - exited_at > 1.0:
                break
            for key, _ in sel.select(timeout=max(0.0, min(0.05, deadline - now)) if exited_at is None else 0.05):
                data = os.read(key.fd, 65536)
                if not data:
                    sel.unregister(key.fd)
                elif key.fd == status_r:
                    status += data[:4096 - len(status)]
                else:
                    bufs[key.fd].add(data)
    finally:
        sel.close()
        if exited_at is None:
            _kill_group(proc.pid)
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    out, err = list(bufs.values())
    return out, err, bytes(status), timed_out


def _has_exited(pid: int) -> bool:
    """Whether the launcher exited, without reaping it (so its pid cannot be reused before the group kill)."""
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    return info is not None


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


_MEMORY = re.compile(r"MemoryError|Cannot allocate memory")
_FILE_SIZE = re.compile(r"File too large|No space left on device")
_PROCESSES = re.compile(r"BlockingIOError: \[Errno 11\]|Resource temporarily unavailable")


def _result(out: _CappedBuffer, err: _CappedBuffer, status_bytes: bytes, timed_out: bool, launcher_rc: int,
            limits: SandboxLimits, seconds: float) -> SandboxResult:
    stdout, stderr = out.text(), err.text()
    status = _last_json(status_bytes)
    res = SandboxResult(stdout, stderr, None, None, seconds, bool(out.dropped or err.dropped),
                        isolated=bool(status.get("isolated", limits.isolate)))
    if timed_out:
        res.killed_by = "timeout"
        return res
    if "setup_error" in status or "exit_code" not in status:
        res.killed_by = "setup"
        res.setup_error = status.get("setup_error") or (
            f"launcher exited with code {launcher_rc} and no status: {stderr.strip()[-500:]}")
        return res
    res.exit_code = status["exit_code"]
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    cpu_limit = cpu_seconds(asdict(limits))
    if res.exit_code == -signal.SIGXCPU or (
            res.exit_code == -signal.SIGKILL and status.get("cpu_s", 0.0) >= cpu_limit - 0.05):  # the hard limit
        res.killed_by = "cpu"
    elif res.exit_code == -signal.SIGXFSZ or (res.exit_code != 0 and _FILE_SIZE.search(last)):
        res.killed_by = "file_size"
    elif res.exit_code != 0 and _MEMORY.search(last):
        res.killed_by = "memory"
    elif res.exit_code != 0 and _PROCESSES.search(last):
        res.killed_by = "processes"
    elif res.exit_code < 0:
        res.killed_by = "signal"
    return res


def _last_json(data: bytes) -> dict:
    for line in reversed(data.decode("utf-8", "replace").splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return {}


def _force_remove(func, path, _exc_info) -> None:
    """rmtree's onerror: the code may have left a directory without write or search permission."""
    try:
        os.chmod(os.path.dirname(path), 0o700)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o700)
        func(path)
    except OSError:
        pass


def _user_env(workdir: str) -> dict[str, str]:
    return {
        "PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        "HOME": workdir, "TMPDIR": workdir,
    }


def _interpreter_paths() -> list[str]:
    """Directories the interpreter (and a venv's site-packages) must reach inside the sandbox."""
    paths = {sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix, os.path.dirname(sys.executable),
             os.path.dirname(os.path.realpath(sys.executable))}
    return sorted({os.path.realpath(p) for p in paths})


_probe_lock = threading.Lock()
_probe: list[str | None] = []


def isolation_problem() -> str | None:
    """None when isolated runs work here, else why not (one line); probed once per process."""
    with _probe_lock:
        if not _probe:
            _probe.append(_probe_isolation())
        return _probe[0]


def isolation_available() -> bool:
    return isolation_problem() is None


def _probe_isolation() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"namespaces are Linux-only (this is {sys.platform})"
    res = run_python("print('ok')", SandboxLimits(timeout_s=30.0, isolate=True))
    if res.setup_error:
        return res.setup_error
    if res.stdout != "ok\n" or not res.isolated:
        return (f"a probe run failed (exit code {res.exit_code}, killed by {res.killed_by}): "
                f"{(res.stderr.strip().splitlines() or [''])[-1]}")
    return None
