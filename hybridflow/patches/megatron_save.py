"""megatron-core's checkpoint writer, saved synchronously without its results Manager process.

``dist_checkpointing.save`` runs the async-capable torch_dist writer synchronously (``AsyncRequest.execute_sync``,
strategies/base.py): the bucket writers are forked, and their results reach the caller through a queue built on
first use as ``mp.get_context("spawn").Manager().Queue()`` (strategies/filesystem_async.py,
``_get_write_results_queue``). The Manager exists for the async path, whose writer runs in another process; on the
synchronous path the same process puts the results and reads them back, yet the spawn starts a new interpreter that
re-imports the worker's main module: seconds of every process's first save in a Ray worker. A plain
in-process queue carries the same results. We never save asynchronously; an async save would need the Manager back.
"""

from __future__ import annotations

import queue
import threading

from hybridflow.patches.megatron_core import MCORE
from hybridflow.patches.registry import declare

SYNC_RESULTS_QUEUE = declare(
    "megatron.sync_save_results_queue", "megatron-core", MCORE,
    "megatron.core.dist_checkpointing.strategies.filesystem_async:_results_queue",
    "a synchronous save's write results cross no process boundary, yet megatron builds their queue on a spawned "
    "Manager process (seconds to start in a worker that imported torch, megatron and vLLM); a queue.Queue in the "
    "saving process carries them")

_lock = threading.Lock()


def in_process_results_queue() -> None:
    """Give the synchronous writer an in-process results queue (``SYNC_RESULTS_QUEUE``), once per process."""
    with _lock:
        if SYNC_RESULTS_QUEUE.require() is None:
            SYNC_RESULTS_QUEUE.replace(queue.Queue())
