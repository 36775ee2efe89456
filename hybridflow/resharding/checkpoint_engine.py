"""The checkpoint engine: the actor's weights stream from the training pool into a separate rollout pool
(separate.SeparatePlan's feeds), bucketed, each rollout rank receiving exactly its vLLM TP shard.

Each feed is a process group of its own (the source training rank is group rank 0, its rollout ranks the
rest) built on a TCP store the driver hosts, outside both pools' torch.distributed worlds (megatron's on one
side, vLLM's on the other): gloo on CPU, NCCL on GPU. This is vLLM's own recipe for weight updates from a
trainer (``stateless_init_torch_distributed_process_group`` in vllm/distributed/utils.py); its group
rejects ``dist.broadcast`` (global ranks), so the group's own ``broadcast`` is called with group ranks.

A bucket is one broadcast of a header (names, shapes, dtypes, offsets; pickled) and one of its payload
(``rollout.checkpoint_engine.update_weights_bucket_megabytes`` at most, unless one tensor is larger); an
empty header ends the stream. Every wait has the feed's timeout and fails in one line naming the feed's
ranks. On NCCL that needs blocking waits (TORCH_NCCL_BLOCKING_WAIT, read when the group is built): without them
``Work.wait(timeout)`` only orders the current stream after the collective and returns, and a hung transfer is
caught by NCCL's watchdog, which takes the whole process down after the timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING's
default; torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, WorkNCCL::synchronizeInternal).
"""

from __future__ import annotations

import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

from hybridflow import device
from hybridflow.families import weights
from hybridflow.resharding import vllm_layout
from hybridflow.resharding.separate import Feed
from hybridflow.util import environ

_ALIGN = 16  # payload offsets: any dtype's view of the byte buffer starts aligned


class CheckpointEngineError(RuntimeError):
    """A feed's transfer failed or timed out; the message names the feed's ranks."""


def feed_name(feed: Feed) -> str:
    return f"feed {feed.index} (training rank {feed.source} -> rollout ranks {list(feed.receivers)})"


class FeedGroup:
    """One feed's process group, as seen by one of its members."""

    def __init__(self, feed: Feed, group_rank: int, host: str, port: int, prefix: str, timeout_s: float):
        self.feed, self.timeout = feed, timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, is_master=False, timeout=self.timeout)
        store = dist.PrefixStore(f"{prefix}/feed{feed.index}", store)
        try:
            if device.on_accelerator():  # nccl on CUDA, rccl on ROCm builds of torch
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = self.timeout
                with environ(TORCH_NCCL_BLOCKING_WAIT="1"):  # wait(timeout) raises, as gloo's does (module doc)
                    self.pg = dist.ProcessGroupNCCL(store, group_rank, feed.size, options)
            else:
                self.pg = dist.ProcessGroupGloo(store, group_rank, feed.size, self.timeout)
        except (RuntimeError, dist.DistError) as e:
            raise CheckpointEngineError(f"checkpoint engine: could not open {feed_name(feed)} within "
                                        f"{timeout_s:g} s: {_first_line(e)}") from e

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        try:
            self.pg.broadcast([tensor], options).wait(self.timeout)
        except (RuntimeError, dist.DistError) as e:
            raise CheckpointEngineError(f"checkpoint engine: {what} on {feed_name(self.feed)} failed or took over "
                                        f"{self.timeout.total_seconds():g} s: {_first_line(e)}") from e

    def close(self) -> None:
        self.pg = None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


class _Bucket:
    def __init__(self):
        self.meta, self.pieces, self.size = [], [], 0

    def add(self, name: str, t: torch.Tensor) -> None:
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        self.meta.append((name, tuple(t.shape), str(t.dtype).removeprefix("torch."), self.size, nbytes))
        self.pieces.append((self.size, t))
        self.size += -(-nbytes // _ALIGN) * _ALIGN

    def payload(self) -> torch.Tensor:
        flat = torch.empty(self.size, dtype=torch.uint8, device=device.current())
        for offset, t in self.pieces:
            n = t.numel() * t.element_size()
            flat[offset:offset + n].copy_(t.reshape(-1).view(torch.uint8))
        return flat


def _header(bucket: _Bucket) -> tuple[torch.Tensor, torch.Tensor]:
    """(its length, the pickled (entries, payload size)); length 0 for an empty bucket."""
    raw = (torch.frombuffer(bytearray(pickle.dumps((bucket.meta, bucket.size))), dtype=torch.uint8) if bucket.meta
           else torch.empty(0, dtype=torch.uint8))
    return torch.tensor([raw.numel()], dtype=torch.int64, device=device.current()), raw.to(device.current())


def send(items, feeds: list[FeedGroup], cfg, k_s: int, t_s: int, t_g: int, dtype: torch.dtype, bucket_bytes: int,
         stats) -> None:
    """Stream this training rank's vLLM shard ``items`` ((name, tensor) of shard k_s of t_s) to each of its
    feeds: slice ``feed.part`` of the t_g / t_s that shard k_s holds, cast to the rollout's ``dtype`` (but a weight declared
    float32, which stays so). ``stats`` (a TransitionStats)
    counts the payload bytes sent (once per receiver, as each receives them)."""
    buckets = {g.feed.index: _Bucket() for g in feeds}

    def flush(group: FeedGroup) -> None:
        bucket = buckets[group.feed.index]
        length, raw = _header(bucket)
        group.broadcast(length, "a bucket header's length")
        if bucket.meta:
            group.broadcast(raw, "a bucket header")
            group.broadcast(bucket.payload(), "a bucket")
            stats.bytes_sent += sum(n for *_, n in bucket.meta) * len(group.feed.receivers)
        buckets[group.feed.index] = _Bucket()

    for name, tensor in items:
        for group in feeds:
            k = k_s * (t_g // t_s) + group.feed.part  # the receivers' vLLM TP rank
            piece = tensor if t_g == t_s else vllm_layout.slice_shard({name: tensor}, cfg, k, t_g, t_s)[name]
            buckets[group.feed.index].add(name, piece if weights.keeps_float32(name) else piece.to(dtype))
            if buckets[group.feed.index].size >= bucket_bytes:
                flush(group)
    for group in feeds:
        if buckets[group.feed.index].meta:
            flush(group)
        flush(group)  # the empty header: end of stream


def receive(group: FeedGroup, stats):
    """(name, tensor) pairs of this rollout rank's vLLM shard as its feed's buckets arrive (views into the
    bucket's buffer, valid until the next bucket); ``stats`` counts the payload bytes received."""
    here = device.current()
    while True:
        length = torch.zeros(1, dtype=torch.int64, device=here)
        group.broadcast(length, "a bucket header's length")
        if int(length.item()) == 0:
            return
        raw = torch.empty(int(length.item()), dtype=torch.uint8, device=here)
        group.broadcast(raw, "a bucket header")
        meta, size = pickle.loads(raw.cpu().numpy().tobytes())
        payload = torch.empty(size, dtype=torch.uint8, device=here)
        group.broadcast(payload, "a bucket")
        for name, shape, dtype, offset, nbytes in meta:
            stats.bytes_received += nbytes
            yield name, payload[offset:offset + nbytes].view(getattr(torch, dtype)).view(shape)
