"""One megatron-core model of a role (policy, reference or value) with its optimizer.

Forward and backward always go through megatron-core's pipeline schedule (``get_forward_backward_func``),
so the same code runs at any TP/PP/DP layout; losses and outputs appear on the last pipeline stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from hybridflow.megatron import convert, cpu_compat, parallel
from hybridflow.megatron.model import build_gpt, transformer_config_from_hf
from hybridflow.util import mean_by_key


@dataclass
class OptimSettings:
    lr: float
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False


def attention_mask_4d(attention_mask: torch.Tensor) -> torch.Tensor:
    """[b, s] {0,1} padding mask -> megatron's [b, 1, s, s] bool mask (True = not attended), causal."""
    s = attention_mask.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = causal[None] & attention_mask.bool()[:, None, :]
    return ~allowed[:, None]


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) where the vocab dim is split across the TP group (no grad)."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    with torch.no_grad():
        m = logits.max(dim=-1).values
        if ps.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - m[..., None]
        e = shifted.exp()
        stats = torch.stack([e.sum(-1), (e * shifted).sum(-1)])
        if ps.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(stats, group=group)
        return stats[0].log() - stats[1] / stats[0]


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) per position from vocab-parallel logits (differentiable)."""
    from megatron.core import tensor_parallel

    # vocab_parallel_cross_entropy edits its input in place: give it its own copy.
    return -tensor_parallel.vocab_parallel_cross_entropy(logits.float().clone(), labels)


class MegatronRole:
    """A GPT policy or value model sharded over this process's megatron groups."""

    def __init__(self, hf_config, hf_state_dict: dict, *, value_head: bool = False,
                 optim: OptimSettings | None = None, params_dtype=torch.float32, sequence_parallel: bool = False):
        from megatron.core import parallel_state as ps

        self.hf_config = hf_config
        self.value_head = value_head
        self.shard = parallel.current_shard()
        self.tf_config = transformer_config_from_hf(
            hf_config, tp=self.shard.tp_size, pp=self.shard.pp_size, sequence_parallel=sequence_parallel,
            params_dtype=params_dtype)
        model = build_gpt(hf_config, self.tf_config, value_head=value_head,
                          pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
        convert.load_into(model, convert.hf_to_megatron(hf_state_dict, hf_config, self.shard, value_head=value_head))
        self.optimizer = None
        if optim is None:
            model.requires_grad_(False)
            self.model = model.eval()
        else:
            self.model, self.optimizer = self._wrap_for_training(model, optim, params_dtype)

    def _wrap_for_training(self, model, optim: OptimSettings, params_dtype):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.tf_config.finalize_model_grads_func = finalize_model_grads
        with cpu_compat.megatron_cpu_scope():
            ddp = DistributedDataParallel(
                config=self.tf_config,
                ddp_config=DistributedDataParallelConfig(
                    grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                    use_distributed_optimizer=optim.use_distributed_optimizer),
                module=model)
            opt = get_megatron_optimizer(OptimizerConfig(
                optimizer="adam", lr=optim.lr, min_lr=optim.lr, weight_decay=optim.weight_decay,
                adam_beta1=optim.betas[0], adam_beta2=optim.betas[1], adam_eps=optim.eps,
                clip_grad=optim.clip_grad, use_distributed_optimizer=optim.use_distributed_optimizer,
                params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16), [ddp])
        return ddp, opt

    # --- forward / backward through megatron's schedule -------------------------------------------

    def _run_schedule(self, micro_batches: list[dict], loss_fn: Callable, forward_only: bool) -> list[dict]:
        """Run fwd(+bwd) over micro-batches; returns the per-micro-batch dicts from ``loss_fn``
        (on the last pipeline stage; empty elsewhere)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iter, model):
            mb = next(data_iter)
            out = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"],
                        attention_mask=attention_mask_4d(mb["attention_mask"]))
            return out, partial(loss_fn, mb)

        seq_len = micro_batches[0]["input_ids"].shape[1]
        with cpu_compat.megatron_cpu_scope():
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[self.model],
                num_microbatches=len(micro_batches), seq_length=seq_len,
                micro_batch_size=micro_batches[0]["input_ids"].shape[0], forward_only=forward_only)

    def forward(self, micro_batches: list[dict], output_fn: Callable) -> list[dict]:
        """Forward only; ``output_fn(mb, model_output) -> dict of tensors`` per micro-batch."""
        def loss_fn(mb, output):
            with torch.no_grad():
                return torch.zeros((), device=output.device), output_fn(mb, output)

        self.model.eval()
        with torch.no_grad():
            return self._run_schedule(micro_batches, loss_fn, forward_only=True)

    def train_mini_batch(self, micro_batches: list[dict], loss_fn: Callable) -> dict:
        """One optimizer step over a mini-batch; ``loss_fn(mb, output) -> (loss, metrics)``."""
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run_schedule(micro_batches, loss_fn, forward_only=False)
        with cpu_compat.megatron_cpu_scope():
            ok, grad_norm, _ = self.optimizer.step()
        metrics = mean_by_key(outputs)
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["update_skipped"] = float(not ok)
        return metrics

    # --- export -----------------------------------------------------------------------------------

    @property
    def module(self) -> torch.nn.Module:
        """The GPTModel itself (unwrapped from megatron's DDP when training)."""
        return self.model.module if hasattr(self.model, "module") else self.model

    def hf_state_dict(self) -> dict:
        """The full HF state dict of this model, assembled from every TP/PP shard (same on all ranks).

        Tensors may be views of the live parameters: copy them to keep them across an update.
        """
        from megatron.core import parallel_state as ps

        local = {k: v.detach() for k, v in self.module.state_dict().items() if not k.endswith("_extra_state")}
        tp, tp_group = self.shard.tp_size, ps.get_tensor_model_parallel_group()
        full = {}
        for name, tensor in local.items():
            dim = convert.tp_split_dim(name, self.value_head)
            if tp > 1 and dim is not None:
                parts = [torch.empty_like(tensor) for _ in range(tp)]
                dist.all_gather(parts, tensor.contiguous(), group=tp_group)
                tensor = torch.cat(parts, dim=dim)
            full[name] = tensor
        hf = convert.megatron_to_hf(full, self.hf_config, self.shard, value_head=self.value_head)
        if self.shard.pp_size > 1:
            stages = [None] * self.shard.pp_size
            dist.all_gather_object(stages, hf, group=ps.get_pipeline_model_parallel_group())
            hf = {k: v for stage in stages for k, v in stage.items()}
        return hf
