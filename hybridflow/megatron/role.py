"""One megatron-core model of a role (policy, reference or value) with its optimizer.

Forward and backward always go through megatron-core's pipeline schedule (``get_forward_backward_func``),
so the same code runs at any TP/PP/DP layout; losses and outputs appear on the last pipeline stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from hybridflow import device
from hybridflow.megatron import convert, hf_export, lora, lr_schedule, parallel, virtual_stages
from hybridflow.megatron.routing import RoleRouting
from hybridflow.megatron.model import build_gpt, te_available, transformer_config_from_hf
from hybridflow.megatron.moe_config import moe_layer_pattern_of
from hybridflow.megatron.offload import Offloader, optimizer_tensors
from hybridflow.patches import megatron_core, megatron_layers
from hybridflow.util import mean_by_key


@dataclass
class OptimSettings:
    lr: float
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False
    schedule: lr_schedule.LRSchedule | None = None  # None: a constant ``lr`` (lr_schedule.resolve builds one)
    overrides: dict | None = None  # optim.override_optimizer_config (megatron/optimizer_config.py)
    muon: dict | None = None  # Muon's OptimizerConfig fields (optimizer_config.muon_fields); None: Adam


@dataclass(frozen=True)
class OffloadSettings:
    """What stays on host memory while the role is idle (verl's param/grad/optimizer_offload)."""

    params: bool = False
    grads: bool = False
    optimizer: bool = False


def vocab_parallel_entropy(logits: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """Entropy of softmax(logits) where the vocab dim is split across the TP group, differentiable (the
    entropy bonus, verl's ``entropy_coeff``; under ``torch.no_grad`` it records nothing).

    H = log S0 - S1 / S0 with S0 = sum exp(z - m), S1 = sum exp(z - m) (z - m): the two sums cross the TP
    ranks through megatron's ``reduce_from_tensor_model_parallel_region`` (forward all-reduce, backward
    identity), so each rank's gradient is that of its own vocab shard, as in megatron's
    ``vocab_parallel_cross_entropy``. The shift m is the global max, detached: H does not depend on it.
    megatron-core 0.16 has no entropy of its own; verl 0.9.1's is a hand-written autograd function
    (utils/megatron/tensor_parallel.py) that saves memory by working in place.

    ``chunk``: rows (response tokens) at a time, the same values with the fp32 softmax of one chunk alive at
    once instead of all rows' (actor.entropy_from_logits_with_chunking); every TP rank holds the same rows, so
    each chunk's all-reduces pair up."""
    if chunk is not None and logits.shape[0] > chunk:
        return torch.cat([vocab_parallel_entropy(part) for part in logits.split(chunk)])
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    logits = logits.float()
    m = logits.detach().max(dim=-1, keepdim=True).values
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = logits - m
    e = shifted.exp()
    stats = tensor_parallel.reduce_from_tensor_model_parallel_region(torch.stack([e.sum(-1), (e * shifted).sum(-1)]))
    return stats[0].log() - stats[1] / stats[0]


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) per position from vocab-parallel logits (differentiable)."""
    from megatron.core import tensor_parallel

    # vocab_parallel_cross_entropy edits its input in place: give it its own (fp32) copy.
    own = logits.float() if logits.dtype != torch.float32 else logits.clone()
    return -tensor_parallel.vocab_parallel_cross_entropy(own, labels)


@dataclass(frozen=True)
class ModelBuild:
    """How a role's megatron model is built (the layout comes from this process's megatron groups)."""

    value_head: bool = False  # a value model: a scalar head instead of the vocabulary
    dtype: torch.dtype = torch.float32
    sequence_parallel: bool = False
    transformer_overrides: dict | None = None  # megatron.override_transformer_config
    # the MoE routers can record and replay their top-k (megatron/routing.py): a micro-batch with routed_experts
    # replays them
    routing_replay: bool = False
    # the base weights are frozen and adapters train (megatron/lora.py); the optimizer holds the adapters only
    lora_settings: lora.LoRASettings | None = None

    def transformer_config(self, hf_config, shard: convert.Shard):
        replay = {"moe_enable_routing_replay": True} if self.routing_replay else {}
        return transformer_config_from_hf(
            hf_config, tp=shard.tp_size, pp=shard.pp_size, ep=shard.ep_size, cp=shard.cp_size, vpp=shard.vpp_size,
            etp=shard.expert_tp[1], sequence_parallel=self.sequence_parallel, params_dtype=self.dtype,
            overrides={**(self.transformer_overrides or {}), **replay})


class MegatronRole:
    """A GPT policy or value model sharded over this process's megatron groups, on this worker's device."""

    def __init__(self, hf_config, hf_state_dict: Mapping | None, build: ModelBuild = ModelBuild(), *,
                 optim: OptimSettings | None = None, offload: OffloadSettings = OffloadSettings(),
                 start_weights: Callable | None = None):
        """``hf_state_dict`` None: weights come from a checkpoint (megatron.checkpoint.load_role) or ``start_weights``.
        ``optim`` None: a frozen model (reference, export). ``start_weights(role)``: loads weights that do not come
        from ``hf_state_dict`` (a megatron dist checkpoint, a peft adapter) into the built model before the optimizer
        is made: a 16-bit model's fp32 main parameters are copies taken then, and the first step would write them
        back over anything loaded later."""
        self.hf_config = hf_config
        self.value_head = build.value_head
        self.shard = parallel.current_shard(build.transformer_overrides)
        self.layout = parallel.current_layout(build.sequence_parallel, overrides=build.transformer_overrides)
        self.device = device.current()
        self.tf_config = build.transformer_config(hf_config, self.shard)
        chunks = virtual_stages.build_chunks(partial(build_gpt, hf_config, self.tf_config, value_head=build.value_head,
                                                     device=self.device), self.shard.vpp_size)
        # the stage as one module by name (conversion, resharding, checkpoints, export); the schedule runs the chunks
        self.module = virtual_stages.as_one_module(chunks)
        if hf_state_dict is not None:
            convert.load_into(self.module, convert.hf_to_megatron(hf_state_dict, hf_config, self.shard,
                                                                  value_head=build.value_head))
        if build.lora_settings is not None:  # before DDP: gradient buffers and optimizer state for the adapters only
            lora.add_adapters(self.module, build.lora_settings, self.tf_config)
        self.chunks, self.optimizer, self.scheduler = chunks, None, None
        if start_weights is not None:
            start_weights(self)
        if optim is None:
            for chunk in chunks:
                chunk.requires_grad_(False).eval()
        else:
            self.chunks, self.optimizer = self._wrap_for_training(chunks, optim, build.dtype)
        params = lambda: list(self.module.parameters())  # noqa: E731
        self._offloaders = {
            "params": Offloader(params),
            "optimizer": Offloader(lambda: optimizer_tensors(self.optimizer) if self.optimizer else [], exclude=params),
        }
        self.offload_settings = offload
        self.routing = RoleRouting(self.module, self.tf_config, self.shard.pp_size) if build.routing_replay else None
        # Rows of one GRPO group may share one packed prompt (workers/row_layout.shared_prompt_rows) where attention
        # honours an arbitrary mask: megatron's local spec with its torch softmax (masked_softmax_fusion off)
        # on CPU, one pipeline stage. On GPU the attention kernels apply the causal mask only
        # (model.layer_spec), so rows keep the rotated causal layout there.
        self.shares_prompts = not device.has_gpu() and self.shard.pp_size == 1
        # Token-budget micro-batches as packed sequences (THD, cu_seqlens) for TE's attention; else one packed row
        # with a block mask. Under CP the local attention takes THD rows too, as a mask (row_layout
        # .split_for_context_parallel), so the CPU tests run the GPU's CP partition of packed sequences.
        self.packs_sequences = te_available()
        self._offload_idle()

    def _wrap_for_training(self, chunks: list, optim: OptimSettings, params_dtype):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from hybridflow.megatron.optimizer_config import build_optimizer

        schedule = optim.schedule or lr_schedule.LRSchedule.constant(optim.lr)
        self.tf_config.finalize_model_grads_func = finalize_model_grads
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=optim.use_distributed_optimizer)
        with megatron_core.cpu_scope():
            # one DDP per chunk, buckets for the first only (as Megatron-LM's get_model wraps virtual stages)
            ddp = [DistributedDataParallel(config=self.tf_config, ddp_config=ddp_config, module=chunk,
                                           disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]
            # 16-bit params get megatron's fp32 main params and grads in the optimizer.
            opt = build_optimizer(optim, params_dtype, ddp)
        if (optim.overrides or {}).get("optimizer_cpu_offload"):
            # the DistributedOptimizer replaces the HybridDeviceOptimizer it was first built with over the model's
            # parameters (distrib_optimizer.py), whose fp32 and pinned copies only the cyclic collector frees
            import gc

            gc.collect()
            if device.on_accelerator():
                torch.cuda.empty_cache()
        # The schedule scales each loss by the optimizer's loss scale (as Megatron-LM's training loop
        # wires it); without this fp16 gradients would be divided by a scale that was never applied.
        self.tf_config.grad_scale_func = opt.scale_loss
        # Sets each param group's lr and weight decay from now on (the decay skips biases and norms).
        self.scheduler = lr_schedule.build_scheduler(opt, schedule, optim.weight_decay)
        return ddp, opt

    # --- memory phases ----------------------------------------------------------------------------

    def _offload_idle(self) -> None:
        s = self.offload_settings
        for kind, wanted in (("params", s.params), ("optimizer", s.optimizer)):
            if wanted:
                self._offloaders[kind].offload()
        if s.grads and self.optimizer is not None:
            # Freed, not copied: every step zeroes the grads first, and restore_grad_buffers gives them
            # back zeroed (megatron-core 0.16.1, distributed_data_parallel.py).
            for chunk in self.chunks:
                chunk.offload_grad_buffers(synchronize=self.device.type == "cuda", empty_cache=False)
        if self.device.type == "cuda":
            # Cached blocks (this role's activations, what was just offloaded) back to the driver, or vLLM
            # and the colocated roles could not use them while this role idles.
            torch.cuda.empty_cache()

    @contextlib.contextmanager
    def resident(self, *, training: bool = False):
        """The role's params (and, when ``training``, its grads and optimizer state) on the device for the
        duration; what the offload settings name goes back to host memory afterwards, and the device's
        cached blocks are released."""
        self._offloaders["params"].reload()
        if training:
            self._offloaders["optimizer"].reload()
            if self.offload_settings.grads and self.optimizer is not None:
                for chunk in self.chunks:
                    chunk.restore_grad_buffers(synchronize=False)
        try:
            yield self
        finally:
            self._offload_idle()

    def host_bytes(self) -> int:
        """Bytes of this role currently offloaded to host memory."""
        return sum(o.host_bytes for o in self._offloaders.values())

    # --- forward / backward through megatron's schedule -------------------------------------------

    def _run_schedule(self, micro_batches: list[dict], loss_fn: Callable, forward_only: bool) -> list[dict]:
        """Run fwd(+bwd) over micro-batches; returns the per-micro-batch dicts from ``loss_fn``
        (on the last pipeline stage; empty elsewhere).

        Each micro-batch moves to the device right before its forward. No padding mask is passed: rows
        are laid out so that the causal mask alone is exact (workers/row_layout.py), which is all that TE's
        flash/cuDNN attention applies on GPU. Only CPU shared-prompt rows pass a mask, their packed one
        (megatron's local attention applies it; ``shares_prompts`` is off on GPU). Token-budget micro-batches
        (row_layout.token_micro_batches) are one packed row each: on CPU with their mask, on GPU with
        ``cu_seqlens`` for TE's packed-sequence attention (``packed_seq_params``).

        Shapes may differ between micro-batches: ``variable_seq_lengths`` (model.transformer_config_from_hf)
        makes megatron's pipeline send each activation's shape before it (p2p_communication
        ``_communicate_shapes``), so the first micro-batch's sizes given below only fill the schedule's
        arguments."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iter, model):
            mb = device.to_device(next(data_iter))
            if self.routing is not None:
                self.routing.before_forward(mb)
            packed = mb.get("packed_mask")  # shared-prompt or token-budget rows on CPU (row_layout)
            bare = model.module if hasattr(model, "module") else model  # under DDP
            with _at_positions(bare, mb["position_ids"]) if packed is not None else contextlib.nullcontext():
                out = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], attention_mask=packed,
                            **_packed_sequences(mb))
            if self.routing is not None:
                self.routing.after_forward(mb)
            return out, partial(loss_fn, mb)

        data = iter(micro_batches)
        if len(self.chunks) > 1:  # the interleaved schedule: each chunk takes every micro-batch, in order
            data = [iter(micro_batches) for _ in self.chunks]
            self.tf_config.microbatch_group_size_per_vp_stage = virtual_stages.microbatch_group_size(
                len(micro_batches), self.shard.pp_size)
        with megatron_core.cpu_scope():
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=data, model=list(self.chunks),
                num_microbatches=len(micro_batches), seq_length=micro_batches[0]["input_ids"].shape[1],
                micro_batch_size=micro_batches[0]["input_ids"].shape[0], forward_only=forward_only)

    def forward(self, micro_batches: list[dict], output_fn: Callable, record_routes: bool = False) -> list[dict]:
        """Forward only; ``output_fn(mb, model_output) -> dict of tensors`` per micro-batch, on host. With routing
        replay the outputs also hold, per input row, ``routed_experts`` [n, T, L, k] (what the routers chose)
        when ``record_routes``, and where the micro-batch replays routes ``routing_differing`` / ``routing_counted``
        [n]: token-layers whose own top-k differed from the replayed one / were replayed. Every pipeline stage
        routes its own layers: their parts meet on the last stage (``RoleRouting.of_all_stages``)."""
        def loss_fn(mb, output):
            with torch.no_grad():
                return torch.zeros((), device=output.device), device.to_host(output_fn(mb, output))

        for chunk in self.chunks:
            chunk.eval()
        recording = self.routing.forward_pass(record_routes) if self.routing is not None else contextlib.nullcontext()
        with recording as routed, torch.no_grad(), self.resident():
            outs = self._run_schedule(micro_batches, loss_fn, forward_only=True)
            routed = self.routing.of_all_stages(routed) if routed is not None else None
        return [{**o, **r} for o, r in zip(outs, routed)] if routed else outs

    def train(self, steps: Iterable[tuple[list[dict], Callable]]) -> list[dict]:
        """One optimizer step per (micro-batches, ``loss_fn(mb, output) -> (loss, metrics)``) of ``steps``,
        all inside one residency: params, grads and optimizer state come to the device once per call,
        however many mini-batches and epochs it runs (as verl loads them once per update). The learning-rate
        schedule then advances one step: once per update call, as verl's (megatron/lr_schedule.py)."""
        for chunk in self.chunks:
            chunk.train()
        with self.resident(training=True):
            metrics = [self._train_step(mbs, loss_fn) for mbs, loss_fn in steps]
        self.scheduler.step(1)
        return metrics

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step applies."""
        return lr_schedule.current_lr(self.optimizer)

    def _train_step(self, micro_batches: list[dict], loss_fn: Callable) -> dict:
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run_schedule(micro_batches, loss_fn, forward_only=False)
        with megatron_core.cpu_scope():
            ok, grad_norm = megatron_core.optimizer_step(self.optimizer)
        metrics = mean_by_key(outputs)
        metrics.update(self._router_losses(len(micro_batches)))
        metrics["grad_norm"] = grad_norm
        metrics["update_skipped"] = float(not ok)
        metrics["lr"] = self.lr  # what this step applied
        return metrics

    def _router_losses(self, num_micro_batches: int) -> dict:
        """The MoE routers' auxiliary losses of this step (load balancing, z-loss: whichever the config turns
        on), as megatron's routers recorded them (moe_utils.save_to_aux_losses_tracker, summed over layers and
        micro-batches): ``moe/<name>`` = their mean per MoE layer and micro-batch, unscaled by the coefficient,
        as Megatron-LM's track_moe_metrics logs them. The tracker is cleared for the next step."""
        if not self.tf_config.num_moe_experts:
            return {}
        from megatron.core.transformer.moe import moe_utils

        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        out = {}
        layers = max(1, sum(moe_layer_pattern_of(self.tf_config)))
        for name, entry in tracker.items():
            values = entry.get("values")
            if values is not None:
                out[f"moe/{name}"] = float(values.sum()) / layers / max(1, num_micro_batches)
        moe_utils.clear_aux_losses_tracker()
        return out

    # --- export -----------------------------------------------------------------------------------

    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, host tensor) of the whole model on global rank 0 (megatron/hf_export.py); every rank of the
        role exhausts it together."""
        return hf_export.iter_hf_weights(self)

    def hf_state_dict(self) -> dict:
        """The full HF state dict on global rank 0 (empty elsewhere); all ranks must call it together."""
        return dict(self.iter_hf_weights())


@contextlib.contextmanager
def _at_positions(model, position_ids):
    """A CPU packed micro-batch's forward: rotary embeddings and sliding windows at the rows' own positions."""
    with megatron_layers.rope_at_positions(model, position_ids), megatron_layers.attention_positions(position_ids):
        yield


def _packed_sequences(mb: dict) -> dict:
    """``packed_seq_params`` for a GPU token-budget micro-batch (row_layout.token_micro_batches with
    ``thd``): its rows end to end in one [1, T] row, split by ``cu_seqlens``. TE's attention takes them as
    THD (qkv_format) and megatron restarts rotary positions per sequence (rope_utils
    ``_apply_rotary_pos_emb_thd``). A sequence's padding under CP (to 2 x CP chunks) follows its tokens and
    belongs to it, so the padded boundaries are the real ones; under CP this rank holds its chunks of every
    sequence (row_layout.split_for_context_parallel) and the boundaries stay the whole row's, which TE's CP
    attention and megatron's THD rotary (``_get_thd_freqs_on_this_cp_rank``) divide by the CP size."""
    if "cu_seqlens" not in mb:
        return {}
    from megatron.core.packed_seq_params import PackedSeqParams

    cu, longest = mb["cu_seqlens"], int(mb["max_seqlen"])
    return {"packed_seq_params": PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
        max_seqlen_q=longest, max_seqlen_kv=longest)}
