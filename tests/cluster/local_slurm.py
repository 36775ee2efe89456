"""A real Slurm on this machine: slurmctld and two slurmd (node1, node2) on their own ports, all state under
a temp dir, auth/none; installed from Debian's packages when absent; stopped by PID."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client"]


def ensure_installed() -> None:
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch")):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", *PACKAGES], check=True, env=env, capture_output=True)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


CONF = """ClusterName=hftest
SlurmctldHost=localhost
SlurmctldPort={ctld}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={d}/jobcomp.txt
ReturnToService=2
MpiDefault=none
KillWait=30
NodeName=node1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n1} CPUs=2 RealMemory=8000 State=UNKNOWN
NodeName=node2 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n2} CPUs=2 RealMemory=8000 State=UNKNOWN
PartitionName=gpu Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class LocalSlurm:
    def __init__(self, root: Path):
        self.dir = root
        ctld, n1, n2 = _free_ports(3)
        (root / "state").mkdir(parents=True)
        for node in ("node1", "node2"):
            (root / "spool" / node).mkdir(parents=True)
        self.conf = root / "slurm.conf"
        self.conf.write_text(CONF.format(d=root, ctld=ctld, n1=n1, n2=n2))
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.daemons: list[subprocess.Popen] = []

    def start(self, timeout_s: float = 30) -> LocalSlurm:
        log = open(self.dir / "daemons.out", "w")
        self.daemons.append(subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(self.conf)], env=self.env,
                                             stdout=log, stderr=log))
        for node in ("node1", "node2"):
            self.daemons.append(subprocess.Popen(["slurmd", "-D", "-f", str(self.conf), "-N", node], env=self.env,
                                                 stdout=log, stderr=log))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout
            if out.count("idle") == 2:
                return self
            time.sleep(0.3)
        self.stop()  # a harness that failed to start leaves no daemon behind
        raise RuntimeError(f"local Slurm did not come up: {out!r}\n{(self.dir / 'slurmctld.log').read_text()[-2000:]}")

    def stop(self) -> None:
        for p in reversed(self.daemons):
            p.terminate()
        for p in self.daemons:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.daemons = []

    def run(self, args, check=True, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(args, env=self.env, capture_output=True, text=True, check=check, **kw)

    def sbatch(self, *args, env: dict | None = None) -> int:
        out = subprocess.run(["sbatch", "--parsable", *args], env={**self.env, **(env or {})},
                             capture_output=True, text=True, check=True).stdout
        return int(out.strip().split(";")[0])

    def completion(self, job: int) -> dict | None:
        """The job's line in the job-completion log (JobState, ExitCode, ...) once it has ended."""
        path = self.dir / "jobcomp.txt"
        if not path.exists():
            return None
        for line in path.read_text().splitlines():
            fields = dict(re.findall(r"(\w+)=(\S*)", line))
            if fields.get("JobId") == str(job):
                return fields
        return None

    def wait(self, job: int, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done = self.completion(job)
            if done is not None:
                return done
            time.sleep(0.5)
        self.run(["scancel", str(job)], check=False)
        raise TimeoutError(f"job {job} not finished after {timeout_s}s")
