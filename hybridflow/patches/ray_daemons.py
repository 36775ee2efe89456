"""Ray: the embedded cluster's daemons in a session of their own, and the caller's SIGTERM handler kept while
Ray starts.

``ray.init`` starts GCS, raylet and the rest as children in the driver's process group, so a signal to the
run's whole group (what `timeout` sends, or a kill of a job step's group) also ends the daemons at once;
the driver's core worker then exits the process by itself (status 1, no message) before the run can
checkpoint or say why. In a session of their own they get only what the driver sends them: SIGTERM then
preempts the run as it does when sent to the driver alone. Ray still ties them to the driver's life
(fate sharing: PR_SET_PDEATHSIG), and hybridflow's watcher stops them if the driver is killed.
"""

from __future__ import annotations

import contextlib
import signal
import threading
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


SIGTERM_HANDLER = declare(
    "ray.keep_callers_sigterm_handler", "ray", ">=2.60,<3", "ray._private.utils:set_sigterm_handler",
    "ray.init installs a SIGTERM handler that raises SystemExit wherever the driver is; a no-op inside "
    "`keep_sigterm_handler()`")
FAILURE_SIGNAL_HANDLER = declare(
    "ray.driver_without_failure_signal_handler", "ray", ">=2.60,<3",
    "ray._private.ray_constants:RAY_DISABLE_FAILURE_SIGNAL_HANDLER",
    "the driver's core worker installs Abseil's failure-signal handler, which takes SIGTERM too (abort: -6); "
    "Ray's own switch, True inside `keep_sigterm_handler()`, read per process (the workers keep it)")


@contextlib.contextmanager
def keep_sigterm_handler() -> Iterator[None]:
    """A caller that installed a SIGTERM handler of its own (the trainer's records the request,
    hybridflow.trainer.signals) keeps it while Ray starts, so a SIGTERM then ends the run as preempted (75).
    Ray would otherwise take SIGTERM twice: ray.init's handler raises SystemExit wherever the driver is, and
    the driver's core worker installs Abseil's failure-signal handler until ours is back; a SIGTERM inside
    ray.init's connect() then aborts the process (-6). Python's faulthandler still reports a driver crash."""
    mine = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or not callable(mine):
        yield  # no handler of the caller's (SIG_DFL/SIG_IGN): Ray's own are the better ones
        return
    with SIGTERM_HANDLER.swapped(lambda handler: None), FAILURE_SIGNAL_HANDLER.swapped(True):
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, mine)  # in case something else replaced it meanwhile
