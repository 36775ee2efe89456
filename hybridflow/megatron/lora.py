"""LoRA adapters on megatron-core's parallel linears: verl 0.9.1's megatron LoRA (``actor_rollout_ref.model.lora``),
which builds Megatron-Bridge's ``LoRALinear`` / ``ParallelLinearAdapter`` (megatron/bridge/peft/lora_layers.py,
utils.py). Megatron-Bridge needs transformers < 5 and imports Transformer Engine at module level, so the same
adapter is written here on megatron-core's own TP mappings.

Each adapted linear gives y + (alpha / r) * B(A(dropout(x))), split the way its base linear is split:
- column-parallel base (linear_qkv, linear_fc1: output rows split over TP): A [r, in] whole on every TP rank,
  B [out/t, r] this rank's rows, in the base weight's fused row order (B's shard pairs with W's shard). The r-wide
  activation A x is gathered over the sequence under sequence parallelism (reduce-scattered back in backward),
  or enters the TP region (its gradient all-reduced) without;
- row-parallel base (linear_proj, linear_fc2: input columns split): A [r, in/t] this rank's columns, B [out, r]
  whole; the r-wide partial sums are all-reduced (reduce-scattered over the sequence under SP).
So the only collectives carry r-wide activations. A parameter that is whole on every TP rank but gets its gradient
from this rank's tokens only (SP) carries megatron's ``sequence_parallel`` attribute: finalize_model_grads sums it
over TP as it does the norms'. As Megatron-Bridge's default ``lora`` type, the fused q/k/v (and gate/up) share one
A; in peft's format that is the same A under each projection (``to_peft``), so an exported adapter is exact.

The adapters hang off their base linears (``<linear>.adapter.lora_a`` / ``lora_b``) and act through a forward hook,
so the base weights keep their names for conversion, resharding and export. ``convert.local_state_dict`` gives the
merged weights W + (alpha/r) B A of this rank's shard (no communication: B's rows or A's columns are the shard's),
which is what vLLM, ``hybridflow export`` and check-model read.

Deliberate differences from verl: the initialization draws each whole adapter from a generator seeded by its
global layer and name (a routed expert's by its global index), then keeps this rank's part, so a run starts from the
same adapters at every layout.

Routed experts (megatron's SequentialMLP) take adapters too, with expert TP 1: each expert's linear sees the tokens
dispatched to it, so its adapter is whole and local, its gradients reduced over the expert-data-parallel ranks like
the expert's weight (``allreduce`` False under EP). Grouped-GEMM experts and expert TP > 1 are refused in one line.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import math
import re
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridflow.config.model import LORA_TARGETS as LINEARS  # the linears an adapter can take

COLUMN, ROW = "column", "row"


@dataclass(frozen=True)
class LoRASettings:
    """The adapters of one model (the defaults are the config's: config/schema.py ``LoRA``)."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]
    exclude_modules: tuple[str, ...]
    a_init: str
    b_init: str
    seed: int

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class Adapter(torch.nn.Module):
    """The two low-rank factors of one parallel linear (this TP rank's parts) and how they meet its input."""

    def __init__(self, kind: str, a: torch.Tensor, b: torch.Tensor, settings: LoRASettings, sequence_parallel: bool,
                 swiglu: bool = False, expert: bool = False):
        """``swiglu``: a gated linear_fc1, whose rows are [gate_r; up_r] on each rank; ``expert``: a routed expert's
        linear (expert TP 1), which sees the tokens dispatched to it and needs no communication."""
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        self.kind, self.scale, self.dropout = kind, settings.scale, settings.dropout
        self.sequence_parallel, self.swiglu, self.expert = sequence_parallel and not expert, swiglu, expert
        self.lora_a, self.lora_b = torch.nn.Parameter(a), torch.nn.Parameter(b)
        self.enabled = True
        if expert:
            return
        split, whole = (self.lora_b, self.lora_a) if kind == COLUMN else (self.lora_a, self.lora_b)
        set_tensor_model_parallel_attributes(split, True, 0 if kind == COLUMN else 1, 1)
        if sequence_parallel:  # its gradient covers this rank's tokens only: summed over TP (finalize_model_grads)
            whole.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        h = F.linear(F.dropout(x, self.dropout, self.training), self.lora_a)
        if not self.expert:  # a routed expert's adapter is whole and local
            if self.kind == COLUMN:
                h = (mappings.gather_from_sequence_parallel_region(h) if self.sequence_parallel
                     else mappings.copy_to_tensor_model_parallel_region(h))
            else:
                h = (mappings.reduce_scatter_to_sequence_parallel_region(h) if self.sequence_parallel
                     else mappings.reduce_from_tensor_model_parallel_region(h))
        return F.linear(h, self.lora_b) * self.scale

    def delta(self) -> torch.Tensor:
        """(alpha/r) B A of this rank's shard of the base weight, in fp32 (the factors may be bf16)."""
        return (self.lora_b.float() @ self.lora_a.float()) * self.scale


def _hook(module, args, output):
    # megatron's linears give (out, bias); TE's LayerNorm-linear with return_layernorm_output ((out, ln_out), bias),
    # or (out, bias, ln_out) where TE returns its bias too (layernorm_linear.py forward; Megatron-Bridge's
    # AdapterWrapper.base_linear_forward reads the same three forms). The caller gets (out, bias) in every case.
    if len(output) == 3:
        out, bias, x = output
    else:
        (out, bias), x = output, args[0]
        if isinstance(out, tuple):
            out, x = out
    adapter = module.adapter
    return (out + adapter(x).to(out.dtype) if adapter.enabled else out), bias


def _sharded_state_dict(linear, original, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
    """The linear's checkpoint entries (megatron's ``sharded_state_dict``) with its adapter's split factor sharded
    over TP: megatron's linears take every entry but weight and bias for a TP replica
    (utils.make_sharded_tensors_for_checkpoint), which holds for the whole factor only."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

    sd = original(prefix, sharded_offsets, metadata)
    name, axis = ("lora_b", 0) if linear.adapter.kind == COLUMN else ("lora_a", 1)
    key = f"{prefix}adapter.{name}"
    sd[key] = make_tp_sharded_tensor_for_checkpoint(getattr(linear.adapter, name), key, axis,
                                                    prepend_offsets=sharded_offsets)
    if linear.adapter.swiglu and name == "lora_b":  # [gate_r; up_r] rows per rank, as megatron's MLP saves fc1
        sd[key] = apply_swiglu_sharded_factory(sd[key], sharded_offsets,
                                               (metadata or {}).get("singleton_local_shards", False))
    return sd


def _split(name: str, linear, expert: bool) -> tuple[str, int, int]:
    """(COLUMN or ROW, the TP size the adapter is split over, this rank's index). A routed expert's linear is known by
    its name (linear_fc1 column, linear_fc2 row), and its split by megatron's expert-TP world size: TE's expert
    linears under EP or expert TP > 1 are built with TE's own split off (parallel_mode None, tp_group None:
    megatron-core extensions/transformer_engine.py TELinear, explicit_expert_comm), so neither tells. Adapters on
    routed experts are whole (expert TP 1)."""
    from megatron.core import parallel_state as ps

    if not expert:
        return _kind(linear), ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    etp = ps.get_expert_tensor_parallel_world_size()
    if etp > 1:
        raise ValueError(f"LoRA: {name} is split over expert tensor parallelism ({etp}); adapters on routed experts "
                         "need expert_tensor_parallel_size 1")
    return (COLUMN if name.endswith("linear_fc1") else ROW), 1, 0


def _kind(linear) -> str:
    """COLUMN or ROW for megatron's local and TE linears other than routed experts' (Megatron-Bridge's
    get_adapter_attributes_from_linear). A linear that skips its TP communication (a shared expert under
    moe_shared_expert_overlap: explicit_expert_comm, or TE's parallel_mode None; megatron-core
    transformer/moe/shared_experts.py) is refused: the adapter's would not."""
    if getattr(linear, "explicit_expert_comm", False):
        raise ValueError("LoRA: a linear with explicit_expert_comm (moe_shared_expert_overlap) cannot take an adapter; "
                         "exclude it (model.lora.exclude_modules) or turn the overlap off")
    if hasattr(linear, "input_is_parallel") or getattr(linear, "parallel_mode", None) == "row":
        return ROW
    if hasattr(linear, "gather_output") or getattr(linear, "parallel_mode", None) == "column":
        return COLUMN
    raise TypeError(f"LoRA: {type(linear).__name__} is neither a column- nor a row-parallel linear")


def _init(shape: tuple[int, int], method: str, generator: torch.Generator) -> torch.Tensor:
    """Megatron-Bridge's init methods (ParallelLinearAdapter._get_init_fn) on the whole factor."""
    t = torch.empty(shape, dtype=torch.float32)  # on the host, for the CPU generator; moved to the weight's device after
    if method == "xavier":
        return torch.nn.init.xavier_normal_(t, generator=generator)
    if method == "kaiming":
        return torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=generator)
    if method == "zero":
        return t.zero_()
    raise ValueError(f"LoRA: unknown init method {method!r} (xavier, kaiming, zero)")


_LOCAL_EXPERT = re.compile(r"\bmlp\.experts\.local_experts\.(\d+)\.")


def targets(module: torch.nn.Module, settings: LoRASettings) -> list[tuple[str, torch.nn.Module, bool]]:
    """(global name, linear, routed expert) of every linear ``settings`` adapts on this stage. The global name
    (``decoder.layers.{global layer}.…``, a routed expert's ``mlp.experts.{global index}.…``) is what exclude_modules'
    wildcards match and what seeds the adapter's initialization. Grouped-GEMM experts cannot take adapters."""
    out = []
    for layer in module.decoder.layers:
        prefix = f"decoder.layers.{layer.layer_number - 1}."
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        check_grouped_experts(prefix, "GroupedMLP" in type(experts).__name__, settings)
        offset = experts.ep_group.rank() * experts.num_local_experts if experts is not None else 0
        for name, sub in layer.named_modules():
            full = global_name(layer.layer_number - 1, name, offset)
            if selected(full, settings):  # (a grouped expert linear, TE's, is excluded, or check_grouped_experts refused)
                out.append((full, sub, _LOCAL_EXPERT.search(name) is not None))
    return out


def global_name(layer: int, name: str, expert_offset: int = 0) -> str:
    """A layer's linear ``name`` under its global layer index, a routed expert's under its global index (its local one
    plus ``expert_offset``, the experts before this EP rank's): what exclude_modules' wildcards match."""
    return f"decoder.layers.{layer}." + _LOCAL_EXPERT.sub(lambda m: f"mlp.experts.{expert_offset + int(m[1])}.", name)


def selected(full: str, settings: LoRASettings) -> bool:
    """Whether the linear of global name ``full`` takes an adapter: its own name among target_modules, or matched by
    one of them that is a wildcard pattern on the global name (Megatron-Bridge's, e.g. ``*.layers.0.*.linear_qkv``),
    and not excluded."""
    leaf = full.rsplit(".", 1)[-1]
    if leaf not in LINEARS:
        return False
    targeted = any(t == leaf or (any(c in t for c in "*?[") and fnmatch.fnmatch(full, t))
                   for t in settings.target_modules)
    return targeted and not _excluded(full, settings)


def _excluded(full: str, settings: LoRASettings) -> bool:
    """exclude_modules: a wildcard pattern on the global name, or a linear's own name."""
    leaf = full.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatch(full, p) or p == leaf for p in settings.exclude_modules)


def check_grouped_experts(prefix: str, grouped: bool, settings: LoRASettings) -> None:
    """Grouped-GEMM experts (TE's TEGroupedMLP, megatron's GroupedMLP: no linear per expert; ``grouped``) cannot take
    adapters: refused where linear_fc1/fc2 is a target they are not excluded from."""
    if not grouped:
        return
    for leaf in set(settings.target_modules) & {"linear_fc1", "linear_fc2"}:
        if not _excluded(f"{prefix}mlp.experts.{leaf}", settings):
            raise ValueError(f"LoRA: {prefix}mlp.experts are grouped-GEMM experts, which cannot take adapters; set "
                             "moe_grouped_gemm false or exclude them (model.lora.exclude_modules)")


def add_adapters(module: torch.nn.Module, settings: LoRASettings, tf_config) -> int:
    """Freeze ``module`` and give each target linear its adapter (trainable, in the model's dtype and device);
    returns how many. Call before megatron's DDP wraps the model, so that only the adapters get gradient buffers
    and optimizer state."""
    module.requires_grad_(False)
    found = targets(module, settings)
    for name, linear, expert in found:
        kind, t, rank = _split(name, linear, expert)
        w = linear.weight
        out_dim, in_dim = (w.shape[0] * t, w.shape[1]) if kind == COLUMN else (w.shape[0], w.shape[1] * t)
        g = torch.Generator().manual_seed(settings.seed + zlib.crc32(name.encode()))
        a = _init((settings.rank, in_dim), settings.a_init, g)
        b = _init((out_dim, settings.rank), settings.b_init, g)
        swiglu = tf_config.gated_linear_unit and name.endswith("linear_fc1")
        if swiglu:  # each rank holds [gate_r; up_r]: this rank's part of the [gate; up] drawn at every layout
            b = torch.cat([half.chunk(t, 0)[rank] for half in b.chunk(2, 0)])
        a, b = (a, b if swiglu else b.chunk(t, 0)[rank]) if kind == COLUMN else (a.chunk(t, 1)[rank], b)
        if hasattr(linear, "return_layernorm_output"):
            # TE's LayerNorm-linear: the adapter takes the norm's output, this rank's sequence chunk under SP, gathered
            # r-wide as on the local spec. Not TE's return_layernorm_output_gathered: from TE 2.4 its backward drops
            # the gradient of the gathered output (layernorm_linear.py, the grad_outputs[1] add is skipped there).
            linear.return_layernorm_output = True
        linear.adapter = Adapter(kind, a.to(w.device, w.dtype).contiguous(), b.to(w.device, w.dtype).contiguous(),
                                 settings, tf_config.sequence_parallel, swiglu, expert)
        if expert:  # reduced over the expert-data-parallel ranks, in megatron's expert optimizer, as the weight is
            for p in (linear.adapter.lora_a, linear.adapter.lora_b):
                p.allreduce = getattr(w, "allreduce", True)
        linear.register_forward_hook(_hook)
        if not expert:  # a routed expert's factors are whole (expert TP 1): megatron's own entries are right
            linear.sharded_state_dict = functools.partial(_sharded_state_dict, linear, linear.sharded_state_dict)
    if not found:
        raise ValueError(f"LoRA: no linear matches target_modules {list(settings.target_modules)} "
                         f"(exclude_modules {list(settings.exclude_modules)})")
    if tf_config.recompute_granularity is not None:
        module.decoder.register_forward_pre_hook(_input_requires_grad, with_kwargs=True)
    return len(found)


def _input_requires_grad(block, args, kwargs):
    """The decoder's input made to require grad (as Megatron-Bridge's maybe_enable_recompute_inputs_grad): with the
    whole base frozen the embedding's output does not, and megatron's recompute (CheckpointFunction) then never runs
    its backward, so the adapters inside a recomputed layer would get no gradient."""
    def requiring_grad(x):
        if torch.is_grad_enabled() and x.is_floating_point() and not x.requires_grad:
            return x.detach().requires_grad_(True)
        return x

    if "hidden_states" in kwargs:  # GPTModel passes it by name
        return args, {**kwargs, "hidden_states": requiring_grad(kwargs["hidden_states"])}
    return (requiring_grad(args[0]), *args[1:]), kwargs


def is_adapter(name: str) -> bool:
    """An adapter's parameter, by its state-dict name."""
    return ".adapter.lora_" in name


def adapters(module: torch.nn.Module) -> dict[str, Adapter]:
    """name of the adapted linear (module path) -> its adapter."""
    return {name: m.adapter for name, m in module.named_modules() if isinstance(getattr(m, "adapter", None), Adapter)}


def adapter_bytes(module: torch.nn.Module) -> int:
    """The bytes of this rank's adapters: what an adapter-only weight sync would move, next to the merged sync's
    full-weight transition."""
    return sum(p.numel() * p.element_size() for a in adapters(module).values() for p in (a.lora_a, a.lora_b))


@contextlib.contextmanager
def disabled(module: torch.nn.Module):
    """The base model: every adapter off (the reference policy of a LoRA actor, without a copy of its weights)."""
    found = adapters(module).values()
    for a in found:
        a.enabled = False
    try:
        yield
    finally:
        for a in found:
            a.enabled = True


def merged(module: torch.nn.Module, sd: dict) -> dict:
    """``sd`` (this rank's state dict) with each enabled adapter's weight merged, W + (alpha/r) B A, and the adapters'
    own entries dropped: the weights vLLM, export and check-model see (the base under ``disabled``)."""
    found = adapters(module)
    if not found:
        return sd
    out = {k: v for k, v in sd.items() if not is_adapter(k)}
    with torch.no_grad():
        for name, adapter in found.items():
            key = f"{name}.weight"
            if not adapter.enabled or not out[key].untyped_storage().size():  # off, or offloaded (its shape only)
                continue
            out[key] = (out[key].float() + adapter.delta()).to(out[key].dtype)
    return out
