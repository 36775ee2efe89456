"""The checkpoint engine's transport (resharding/checkpoint_engine.py) over gloo, outside the ranks' own world:
a source streams tensors of mixed dtypes in buckets smaller than some tensors to two receivers, who get them bit
for bit; a receiver whose source sends nothing fails within the feed's timeout in one line naming the feed."""

from __future__ import annotations

import time

import pytest
import torch

from hybridflow.spawn import run_ranks

pytestmark = pytest.mark.distributed


def _tensors() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 5, generator=g), "b": torch.randn(40, generator=g).to(torch.bfloat16),
            "c": torch.arange(7, dtype=torch.float32), "big": torch.randn(30, 10, generator=g)}


def _rank_fn(rank, world, port):
    from hybridflow.resharding import checkpoint_engine
    from hybridflow.resharding.separate import Feed
    from hybridflow.resharding.transition import TransitionStats

    feed = Feed(0, source=0, part=0, receivers=(1, 2))
    group = checkpoint_engine.FeedGroup(feed, rank, "127.0.0.1", port, "t", timeout_s=3)
    stats = TransitionStats("checkpoint_engine")
    streams = [["a", "c", "big"], ["b"]]  # a stream is cast to one dtype: float32 ones, then a bfloat16 one
    if rank == 0:  # 100-byte buckets: several per stream, and "big" (1200 bytes) alone in one
        tensors = _tensors()
        for names in streams:
            checkpoint_engine.send([(n, tensors[n]) for n in names], [group], None, 0, 1, 1, tensors[names[0]].dtype,
                                   bucket_bytes=100, stats=stats)
        time.sleep(5)  # alive but silent: the receivers' next wait times out
        return {"sent": stats.bytes_sent}
    got = {}
    for _ in streams:
        got.update({name: t.clone() for name, t in checkpoint_engine.receive(group, stats)})
    start = time.monotonic()
    try:
        list(checkpoint_engine.receive(group, stats))
        error = None
    except checkpoint_engine.CheckpointEngineError as e:
        error = str(e)
    return {"got": got, "received": stats.bytes_received, "error": error, "waited": time.monotonic() - start}


def test_buckets_arrive_whole_and_a_silent_source_times_out_in_one_line():
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    source, *receivers = run_ranks(_rank_fn, 3, store.port, timeout=120)
    expected = _tensors()
    nbytes = sum(t.numel() * t.element_size() for t in expected.values())
    assert source["sent"] == 2 * nbytes
    for r in receivers:
        assert r["received"] == nbytes
        for name, t in expected.items():
            assert r["got"][name].dtype == t.dtype and torch.equal(r["got"][name], t), name
        assert r["error"] is not None and "\n" not in r["error"], r["error"]
        assert "feed 0 (training rank 0 -> rollout ranks [1, 2])" in r["error"] and "3 s" in r["error"], r["error"]
        assert r["waited"] < 10
