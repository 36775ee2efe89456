"""The checkpoint engine's feeds fail in one line after their own timeout on NCCL as on gloo: a feed's NCCL group is
built with blocking waits (TORCH_NCCL_BLOCKING_WAIT, which ProcessGroupNCCL reads when built), without which
``wait(timeout)`` returns at once and NCCL's watchdog takes the process down instead (resharding/checkpoint_engine.py).
No GPU here: the NCCL group is a stand-in that records the environment it was built in."""

import os
from types import SimpleNamespace

import torch.distributed as dist

from hybridflow import device
from hybridflow.resharding import checkpoint_engine
from hybridflow.util import free_port


def test_a_feeds_nccl_group_is_built_with_blocking_waits(monkeypatch):
    built = []

    class NCCLGroup:
        class Options:
            pass

        def __init__(self, store, rank, size, options):
            built.append((os.environ.get("TORCH_NCCL_BLOCKING_WAIT"), rank, size, options._timeout.total_seconds()))

    monkeypatch.setattr(dist, "ProcessGroupNCCL", NCCLGroup, raising=False)
    monkeypatch.setattr(device, "on_accelerator", lambda: True)
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    feed = SimpleNamespace(index=0, size=2)
    checkpoint_engine.FeedGroup(feed, 1, "127.0.0.1", port, "run", timeout_s=7)
    assert built == [("1", 1, 2, 7.0)]
    assert "TORCH_NCCL_BLOCKING_WAIT" not in os.environ, "only while the feed's group is built"
    del master
