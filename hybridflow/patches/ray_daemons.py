"""Ray: the embedded cluster's daemons in a session of their own.

``ray.init`` starts GCS, raylet and the rest as children in the driver's process group, so a signal to the
run's whole group (what `timeout` sends, or a kill of a job step's group) also ends the daemons at once;
the driver's core worker then exits the process by itself (status 1, no message) before the run can
checkpoint or say why. In a session of their own they get only what the driver sends them: SIGTERM then
preempts the run as it does when sent to the driver alone. Ray still ties them to the driver's life
(fate sharing: PR_SET_PDEATHSIG), and hybridflow's watcher stops them if the driver is killed.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from hybridflow.patches.registry import declare

DAEMON_POPEN = declare(
    "ray.daemons_in_own_session", "ray", ">=2.60,<3", "ray._private.services:ConsolePopen",
    "the Popen class services.start_ray_process starts Ray's daemons with; started with "
    "start_new_session=True inside `own_session()`")


@contextlib.contextmanager
def own_session() -> Iterator[None]:
    """Ray daemons started inside the block (by ``ray.init`` of a new local cluster) lead new sessions."""
    base = DAEMON_POPEN.require()

    class InOwnSession(base):
        def __init__(self, *args, **kwargs):
            kwargs["start_new_session"] = True
            super().__init__(*args, **kwargs)

    with DAEMON_POPEN.swapped(InOwnSession):
        yield
