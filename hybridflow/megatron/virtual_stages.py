"""Virtual pipeline stages (megatron's interleaved schedule): a pipeline stage holds its layers in ``vpp`` model
chunks, chunk c being virtual stage c * pp + pp_rank of pp * vpp (plan/stages.py). The schedule takes the
chunks as a list; everything that reads the stage's weights by name (conversion, resharding, checkpoints, export,
offload) sees them as one GPTModel through ``VirtualStages``: the chunks' layers numbered one after another, the
embedding of the first chunk and the final norm and output layer of the last."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch


def build_chunks(build: Callable[..., torch.nn.Module], vpp: int) -> list[torch.nn.Module]:
    """This stage's model chunks: ``build(pre_process=, post_process=, vp_stage=)`` for each virtual stage (one
    chunk and vp_stage None without virtual stages), megatron deciding which holds the embedding and the head."""
    from megatron.core import parallel_state as ps

    if vpp == 1:
        return [build(pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                      vp_stage=None)]
    return [build(pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=c),
                  post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=c), vp_stage=c)
            for c in range(vpp)]


class VirtualStages(torch.nn.Module):
    """A stage's model chunks seen as one GPTModel by name (the chunks' own modules, not copies): parameters,
    ``state_dict``/``load_state_dict`` and megatron's ``sharded_state_dict`` (whose tensors carry their global layer
    offsets, so a checkpoint resumes at any layout)."""

    def __init__(self, chunks: list[torch.nn.Module]):
        super().__init__()
        first, last = chunks[0], chunks[-1]
        if getattr(first, "embedding", None) is not None:
            self.embedding = first.embedding
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([layer for c in chunks for layer in c.decoder.layers])
        if getattr(last.decoder, "final_layernorm", None) is not None:
            self.decoder.final_layernorm = last.decoder.final_layernorm
        if getattr(last, "output_layer", None) is not None:
            self.output_layer = last.output_layer
        self._chunks = tuple(chunks)  # a tuple: not registered twice as submodules
        self.share_embeddings_and_output_weights = first.share_embeddings_and_output_weights

    def forward(self, *args, **kwargs):
        raise RuntimeError("virtual pipeline stages run through megatron's interleaved schedule, chunk by chunk")

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """The chunks' sharded state dicts under this module's names (their layers renumbered in stage order)."""
        out, offset = {}, 0
        layer = re.compile(rf"^{re.escape(prefix)}decoder\.layers\.(\d+)\.(.*)$", re.S)
        for chunk in self._chunks:
            for key, value in chunk.sharded_state_dict(prefix, sharded_offsets, metadata).items():
                m = layer.match(key)
                out[f"{prefix}decoder.layers.{offset + int(m[1])}.{m[2]}" if m else key] = value
            offset += len(chunk.decoder.layers)
        return out


def as_one_module(chunks: list[torch.nn.Module]) -> torch.nn.Module:
    """The only chunk, or the chunks as ``VirtualStages``."""
    return chunks[0] if len(chunks) == 1 else VirtualStages(chunks)


def microbatch_group_size(num_micro_batches: int, pp: int) -> int:
    """megatron's ``microbatch_group_size_per_vp_stage`` for this many micro-batches: the pipeline size where it
    divides them, else all of them in one group (schedules.forward_backward_pipelining_with_interleaving takes a
    last group of at least pp micro-batches only)."""
    if num_micro_batches < pp:
        raise ValueError(f"virtual pipeline stages need at least {pp} micro-batches (the pipeline size), got "
                         f"{num_micro_batches}")
    return pp if num_micro_batches % pp == 0 else num_micro_batches


def interleaved_count(count: int, pp: int, rows: int) -> int:
    """``count`` micro-batches rounded up to a multiple of ``pp`` where ``rows`` allow it (a micro-batch holds a row at
    least). Where pp does not divide the count, megatron's interleaved schedule runs them as one group
    (``microbatch_group_size``) and warms up (v - 1) x all of them before its first backward, holding about v x
    the activations of every micro-batch at once (schedules.get_pp_rank_microbatches); in groups of pp it holds
    2 (pp - 1) + (v - 1) pp + 1 chunk forwards, what the memory plan counts (tools/memory_plan.stages_in_flight)."""
    rounded = -(-count // pp) * pp
    return rounded if rounded <= rows else count
