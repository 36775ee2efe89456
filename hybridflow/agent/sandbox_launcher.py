"""The sandbox's launcher (hybridflow/agent/sandbox.py's module doc): run as ``python -I -S sandbox_launcher.py SPEC``
by path, on the standard library alone, it sets the namespaces and limits up, and supervises the user code as PID 1
of a new PID namespace. The caller imports its shared constants only."""

from __future__ import annotations

import json
import os
import signal
import sys

SANDBOX_UID_BASE = 2_000_000_000  # + launcher pid (< 2**22): a uid no account on the host uses
SETUP_FAILED = 125  # the launcher's exit code when it could not set the sandbox up (its status says why)
CODE_FILE = "main.py"  # not code.py: the script's dir comes first on sys.path and `code` is a stdlib module


_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
_MS_BIND, _MS_REC, _MS_PRIVATE = 0x1000, 0x4000, 0x40000
_AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1
_SYS_MOUNT_SETATTR = 442  # one number on every architecture (the unified syscall table since Linux 5.1)
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(libc, source, target, fstype, flags: int, data=None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    _check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _set_readonly_recursively(libc, path: str) -> None:
    import ctypes

    class MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                    ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

    attr = MountAttr(_MOUNT_ATTR_RDONLY, 0, 0, 0)
    rc = libc.syscall(ctypes.c_long(_SYS_MOUNT_SETATTR), ctypes.c_long(_AT_FDCWD), ctypes.c_char_p(path.encode()),
                      ctypes.c_long(_AT_RECURSIVE), ctypes.byref(attr), ctypes.c_long(ctypes.sizeof(attr)))
    _check(rc, f"mount_setattr {path} read-only (Linux >= 5.12)")


_HIDDEN = ("/tmp", "/var/tmp", "/run", "/dev/shm")  # other programs' files and unix sockets (/run/dbus, Ray's)


def _cover(libc, top: str, needed: list[str]) -> None:
    """Cover directory ``top`` (this mount namespace only) with a tmpfs that holds bind mounts of just the
    entries of ``top`` leading to ``needed``."""
    keep = {p[len(top) + 1:].split("/")[0] for p in needed if p.startswith(top.rstrip("/") + "/")}
    fds = {name: os.open(os.path.join(top, name), os.O_PATH | os.O_CLOEXEC) for name in keep}
    try:
        _mount(libc, "tmpfs", top, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=64k")
        for name, fd in fds.items():
            target = os.path.join(top, name)
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.mkdir(target)
            else:
                open(target, "w").close()
            _mount(libc, f"/proc/self/fd/{fd}", target, None, _MS_BIND | _MS_REC)
    finally:
        for fd in fds.values():
            os.close(fd)


def _hide_and_uncover(libc, needed: list[str], uid: int, root: bool) -> None:
    """Cover ``_HIDDEN``; as root, also every directory on the way to ``needed`` that ``uid`` cannot search."""
    for top in dict.fromkeys(os.path.realpath(d) for d in _HIDDEN):
        if os.path.isdir(top) and top != "/":
            _cover(libc, top, needed)
    for _ in range(16):  # one blocking directory per round, shallowest first
        blocked = []
        for path in needed if root else ():
            parts = path.strip("/").split("/")
            for depth in range(len(parts) - 1):
                anc = "/" + "/".join(parts[:depth + 1])
                st = os.stat(anc)
                if not st.st_mode & 0o001 and st.st_uid != uid:
                    blocked.append(anc)
                    break
        if not blocked:
            return
        _cover(libc, min(blocked, key=lambda p: p.count("/")), needed)
    raise OSError(f"cannot make {needed} traversable")


def _isolate(libc, spec: dict, uid: int, code: bytes) -> None:
    """New namespaces, read-only tree, tmpfs work dir; the next fork is PID 1 of the new PID namespace."""
    root = os.geteuid() == 0
    uid_now, gid_now = os.getuid(), os.getgid()  # read before unshare: then they show as the overflow id
    flags = _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWUTS
    _check(libc.unshare(flags | (0 if root else _CLONE_NEWUSER)), "unshare (user namespaces unavailable?)")
    if not root:  # the caller's ids stay theirs; setgroups must be denied before an unprivileged gid_map
        for name, line in (("setgroups", "deny"), ("uid_map", f"{uid_now} {uid_now} 1"),
                           ("gid_map", f"{gid_now} {gid_now} 1")):
            try:
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(line)
            except OSError as e:
                raise OSError(e.errno, f"writing {line!r} to /proc/self/{name}: {e.strerror}") from None
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing below propagates back to the host
    workdir, size_mb = spec["workdir"], spec["limits"]["file_size_mb"]
    _hide_and_uncover(libc, [*spec["needed"], workdir], uid, root)
    _set_readonly_recursively(libc, "/")
    _mount(libc, "tmpfs", workdir, "tmpfs", _MS_NOSUID | _MS_NODEV,
           f"size={size_mb}m,mode=0700,uid={uid},gid={uid if root else os.getgid()}")
    path = os.path.join(workdir, CODE_FILE)
    with open(path, "wb") as f:
        f.write(code)
    os.chown(path, uid, uid if root else os.getgid())


def _sandbox_uid() -> int:
    """A uid of this call's own, or nobody where the user namespace we are root in does not map it (a
    container's): setuid(2) accepts mapped ids only."""
    with open("/proc/self/uid_map") as f:
        ranges = [tuple(map(int, line.split())) for line in f if line.strip()]
    for uid in (SANDBOX_UID_BASE + os.getpid(), 65534):
        if any(inside <= uid < inside + count for inside, _, count in ranges):
            return uid
    raise OSError(f"neither uid {SANDBOX_UID_BASE + os.getpid()} nor nobody (65534) is mapped in this user "
                  "namespace")


def cpu_seconds(limits: dict) -> int:
    """RLIMIT_CPU counts whole seconds."""
    return max(1, int(limits["cpu_s"] if limits["cpu_s"] is not None else limits["timeout_s"]))


def _user_task_count(uid: int) -> int:
    """Tasks (threads) of ``uid`` now: what RLIMIT_NPROC compares against."""
    count = 0
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
        except (OSError, ValueError, KeyError):
            continue
    return count


def _exec_user_code(libc, spec: dict, uid: int | None) -> None:
    """In the final child: limits, identity, exec; never returns."""
    import resource

    try:
        lim = spec["limits"]
        cpu = cpu_seconds(lim)
        nproc = lim["max_processes"]
        if uid is None and os.geteuid() != 0:  # unisolated: the count covers every process of the caller's uid
            nproc += _user_task_count(os.getuid())
        for res, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)),  # SIGXCPU, then SIGKILL a second later
                           (resource.RLIMIT_AS, lim["memory_mb"] << 20),
                           (resource.RLIMIT_FSIZE, lim["file_size_mb"] << 20),
                           (resource.RLIMIT_NPROC, nproc),
                           (resource.RLIMIT_NOFILE, lim["max_open_files"]),
                           (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(res, value if isinstance(value, tuple) else (value, value))
        if uid is not None and os.geteuid() == 0:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        os.chdir(spec["workdir"])
        os.closerange(3, 1 << 16)
        python = spec["python"]
        os.execve(python, [python, "-s", "-B", CODE_FILE], spec["env"])
    except BaseException as e:  # noqa: BLE001 - report anything, then leave without running the parent's code
        os.write(2, f"sandbox: cannot start the code: {type(e).__name__}: {e}\n".encode())
    os._exit(126)


def _supervise(libc, spec: dict, uid: int | None, isolated: bool, status_fd: int) -> None:
    """PID 1 of the namespace (isolated): run the code, reap orphans until it exits, report, exit."""
    _check(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    if isolated:
        try:  # this namespace's processes only; read-only
            _mount(libc, "proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_RDONLY)
        except OSError:
            pass  # e.g. a container whose /proc has covered entries: the host's /proc stays (read-only)
    child = os.fork()
    if child == 0:
        os.close(status_fd)
        _exec_user_code(libc, spec, uid)
    while True:
        pid, wstatus, usage = os.wait4(-1, 0)
        if pid == child:
            break
    code = os.waitstatus_to_exitcode(wstatus)
    os.write(status_fd, (json.dumps({"exit_code": code, "cpu_s": usage.ru_utime + usage.ru_stime,
                                     "isolated": isolated}) + "\n").encode())
    os._exit(0)  # as PID 1: the kernel now kills whatever the code left running


def _launcher_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    status_fd = spec["status_fd"]
    try:
        libc = _libc()
        _check(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
        if os.getppid() != spec["parent_pid"]:  # the caller died before the line above
            os._exit(SETUP_FAILED)
        isolated = bool(spec["limits"]["isolate"])
        uid = None
        if isolated:
            uid = _sandbox_uid() if os.geteuid() == 0 else os.getuid()
            with open(os.path.join(spec["workdir"], CODE_FILE), "rb") as f:
                code = f.read()
            _isolate(libc, spec, uid, code)
        pid = os.fork()
    except Exception as e:  # noqa: BLE001 - every setup failure is reported in one line
        os.write(status_fd, (json.dumps({"setup_error": f"{type(e).__name__}: {e}"}) + "\n").encode())
        os._exit(SETUP_FAILED)
    if pid == 0:
        _supervise(libc, spec, uid, isolated, status_fd)
    _, wstatus = os.waitpid(pid, 0)
    os._exit(0 if os.waitstatus_to_exitcode(wstatus) == 0 else SETUP_FAILED)


if __name__ == "__main__":
    _launcher_main(sys.argv[1])
