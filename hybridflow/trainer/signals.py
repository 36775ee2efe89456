"""Preemption: SIGTERM or SIGUSR1 (Slurm's preemption and ``--signal`` time limit warnings) ask the run to
stop at the end of the current step, checkpoint, and exit with ``EXIT_PREEMPTED``; a second signal stops
at once. SIGINT (Ctrl-C) stops at once (exit 130), without a checkpoint.

SIGTERM is followed by SIGKILL after a grace period (Slurm's KillWait: 30 s by default; `timeout -k`), so a
step still running ``STOP_GRACE_S`` after it is abandoned (``give_up_reason``): the run exits 75 naming
the last checkpoint, and the rerun redoes that step. A checkpoint being written is not abandoned (a SIGKILL
in the middle leaves the previous one whole: checkpoints are written atomically). A run stopped before its
first checkpoint sets its metrics aside (``set_aside_metrics``), so that the rerun starts over. SIGUSR1 comes with the lead time the user chose
(``--signal=USR1@<s>``): the step and its checkpoint finish."""

from __future__ import annotations

import signal
import threading
import time

# sysexits' EX_TEMPFAIL ("try again later"): the Slurm launcher requeues the job on this status.
EXIT_PREEMPTED = 75
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# Seconds a step may go on after SIGTERM; with the shutdown that follows, the run ends well within 30 s.
STOP_GRACE_S = 10.0


class Preempted(Exception):
    def __init__(self, signum: int, step: int, checkpoint, abandoned: str = ""):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        cut = f" ({abandoned})" if abandoned else ""
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}{cut}; checkpoint {checkpoint}; "
                         f"rerun the same command to resume (trainer.resume_mode=auto)")


class StopRequests:
    """The first SIGTERM/SIGUSR1 is recorded for the training loop to act on at a step boundary."""

    def __init__(self):
        self.signum: int | None = None
        self.at: float | None = None  # time.monotonic() of the first request

    def install(self) -> None:
        """(Re)install the handlers: ``ray.init`` replaces the SIGTERM handler with its own (sys.exit)."""
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only; an embedding program handles them
        for sig in SIGNALS:
            signal.signal(sig, self._handle)
        # Background jobs of a non-interactive shell start with SIGINT ignored: installed explicitly. It
        # raises KeyboardInterrupt (main() exits 130), not SystemExit: a SystemExit raised inside a blocking
        # Ray call (ray.wait's signal check, _raylet.pyx check_signals) comes back as Ray's own sys.exit(1).
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def _handle(self, signum, _frame) -> None:
        if self.signum is not None:
            raise SystemExit(128 + signum)  # asked twice: do not wait for the step to end
        self.signum, self.at = signum, time.monotonic()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def give_up_reason(self) -> str | None:
        """Why the driver stops waiting for the step in progress: SIGTERM came over ``STOP_GRACE_S`` ago."""
        if self.signum != signal.SIGTERM or time.monotonic() - self.at < STOP_GRACE_S:
            return None
        return f"the step in progress did not end within {STOP_GRACE_S:g} s of SIGTERM and was abandoned"



def set_aside_metrics(output_dir: str) -> str | None:
    """A run preempted before its first checkpoint keeps nothing to resume: its metrics.jsonl is renamed
    metrics.preempted.jsonl, so that the same command, rerun (Slurm's requeue), starts over instead of refusing
    a folder that holds a run; returns the new name, None when there was none."""
    import os

    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return None
    os.replace(path, os.path.join(output_dir, "metrics.preempted.jsonl"))
    return "metrics.preempted.jsonl"
