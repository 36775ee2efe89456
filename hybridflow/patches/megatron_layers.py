"""megatron-core's layers where the local spec (no Transformer Engine) or HF's models need more than it gives: a
sequence-parallel torch norm, HF's scaled-RoPE frequencies, rotary positions for packed rows, sliding windows that
keep the packed rows' mask, and context-parallel attention (``gathered_kv_attention``). On every device."""

from __future__ import annotations

import contextlib
import copy
import functools
import threading

from hybridflow.patches.megatron_core import MCORE
from hybridflow.patches.registry import declare

SP_TORCH_NORM = declare(
    "megatron.sequence_parallel_torch_norm", "megatron-core", MCORE,
    "megatron.core.transformer.torch_norm:WrappedTorchNorm.__new__",
    "the local spec's torch norm asserts `not sequence_parallel` (on GPU too, without Apex/TE); a plain "
    "norm is right under sequence parallel when megatron all-reduces its weight grads across TP, which it "
    "does for params marked `sequence_parallel` (finalize_model_grads)")
ROPE_FREQUENCIES = declare(
    "megatron.rope_inverse_frequencies", "megatron-core", MCORE,
    "megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding.inv_freq",
    "GPTModel hands RotaryEmbedding only rope_scaling_factor and _apply_scaling hard-codes Llama 3.1's "
    "low/high frequency factors and original context: set the HF model's own inverse frequencies")
ROPE_POSITIONS = declare(
    "megatron.rope_at_positions", "megatron-core", MCORE,
    "megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding.forward",
    "GPTModel rotates by index and reads position ids only for learned embeddings: packed rows whose "
    "responses continue from one prompt need their own positions (per instance, inside a block)")
LOCAL_ATTENTION = declare(
    "megatron.context_parallel_local_attention", "megatron-core", MCORE,
    "megatron.core.transformer.dot_product_attention:DotProductAttention.forward",
    "context parallelism without Transformer Engine: megatron's local attention asserts context_parallel_size == 1 "
    "in __init__; a subclass built as CP 1 gathers K/V over the CP group and relies on forward taking sk != sq "
    "with an explicit [b, 1, sq, sk] mask")
WINDOW_WITHIN_ROWS = declare(
    "megatron.sliding_window_within_rows", "megatron-core", MCORE,
    "megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax.forward_torch_softmax",
    "the local attention's windowed softmax replaces the mask it is given with an index-space window "
    "(get_sliding_window_causal_mask, on a 'cuda' device): packed rows (shared prompts, token budgets) would "
    "attend across rows, and a shared prompt's responses sit apart from it in index space. The window is built "
    "from the tokens' positions and combined with the mask given. On GPU, TE's attention gets window_size "
    "(extensions/transformer_engine.py TEDotProductAttention) and windows each packed sequence (cu_seqlens) itself")

BIASED_EXPERTS = declare(
    "megatron.biased_experts", "megatron-core", MCORE,
    "megatron.core.transformer.mlp:MLP.forward",
    "two faults of an expert MLP's linear_fc2 bias (gpt-oss; megatron builds biased experts only at expert TP 1). "
    "(1) MLP.forward adds it to linear_fc2's output in place, scaled by the routing probability (transformer/mlp.py "
    "`output += output_bias...`); where that linear reduces over a TP group of one (explicit_expert_comm False: no "
    "TP, no EP) its output is its input returned by _ReduceFromModelParallelRegion, a view autograd forbids "
    "modifying in place, so a training step fails: a forward hook hands MLP.forward a copy there. (2) "
    "RowParallelLinear marks the bias `sequence_parallel`, so finalize_model_grads sums its gradient over the TP "
    "group, whose ranks hold other experts (expert TP 1 < TP): unmarked, it is reduced over its expert-data-parallel "
    "ranks only, as the expert weights are")

_lock = threading.Lock()
_sp_norm_patched = False
_window_patched = False
_positions = threading.local()  # the [b, s] positions of the rows the forward running on this thread attends over


def allow_sequence_parallel_torch_norm() -> None:
    """Build WrappedTorchNorm with sequence_parallel off and mark its params ``sequence_parallel``."""
    global _sp_norm_patched
    with _lock:
        if _sp_norm_patched:
            return
        original_new = SP_TORCH_NORM.require()

        def new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                normalization="LayerNorm"):
            sp = config.sequence_parallel
            config.sequence_parallel = False
            try:
                norm = original_new(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma,
                                    normalization)
            finally:
                config.sequence_parallel = sp
            for p in norm.parameters():
                setattr(p, "sequence_parallel", sp)
            return norm

        SP_TORCH_NORM.replace(staticmethod(new))
        _sp_norm_patched = True


def set_rope_inverse_frequencies(rope, inv_freq) -> None:
    """Give the RotaryEmbedding instance ``rope`` these inverse frequencies (every rotary table megatron
    builds, ``get_emb``, and ``rope_at_positions`` read ``inv_freq``)."""
    current = ROPE_FREQUENCIES.require(rope)
    rope.inv_freq = inv_freq.to(device=current.device, dtype=current.dtype)


@contextlib.contextmanager
def rope_at_positions(model, position_ids):
    """Rotary embeddings at ``position_ids`` [b, s] for the forwards of the GPTModel ``model`` run inside: its own
    rotary module, or each multi-latent attention layer's (MLA rotates by a table of its own).
    Same formula as ``RotaryEmbedding.get_emb`` (non-interleaved), one [s, b, 1, dim] table that
    ``_apply_rotary_pos_emb_bshd`` broadcasts per row; for YaRN the rows of its own table (and its mscale, which
    GPTModel unpacks and drops: the attention reads it from the config; MLA applies it)."""
    import torch

    ropes = list({id(m.rotary_pos_emb): m.rotary_pos_emb for m in model.modules()
                  if isinstance(getattr(m, "rotary_pos_emb", None), torch.nn.Module)}.values())
    with contextlib.ExitStack() as stack:
        for rope in ropes:
            stack.enter_context(_rope_at_positions(rope, position_ids))
        yield


@contextlib.contextmanager
def _rope_at_positions(rope, position_ids):
    import torch

    ROPE_POSITIONS.require(rope)

    def at_positions(*_, **__):
        if hasattr(rope, "inv_freq_extra"):  # YaRN: its get_emb blends two frequency sets; (table, mscale)
            table, mscale = rope.get_emb(int(position_ids.max()) + 1)  # [max + 1, 1, 1, dim]
            return table[:, 0][position_ids.t()], mscale
        freqs = position_ids.t()[..., None].to(rope.inv_freq) * rope.inv_freq  # [s, b, dim/2]
        return torch.cat((freqs, freqs), dim=-1)[:, :, None, :]

    rope.forward = at_positions  # shadows the (cached) class method for this instance only
    try:
        yield
    finally:
        del rope.forward


def window_within_rows() -> None:
    """Sliding-window layers of the local spec attend within ``window_size`` of each token's position and within
    the mask they are given (``WINDOW_WITHIN_ROWS``); positions are the index unless ``attention_positions``
    names them. Installed once per process, by a model with a window."""
    global _window_patched
    with _lock:
        if _window_patched:
            return
        original = WINDOW_WITHIN_ROWS.require()

        def forward_torch_softmax(self, input, mask, softmax_offset=None):
            if self.window_size is None:
                return original(self, input, mask, softmax_offset)
            window = _outside_window(input.shape[2], input.shape[3], self.window_size, input.device)
            size, self.window_size = self.window_size, None  # the original then applies the mask as given
            try:
                return original(self, input, window if mask is None else mask | window, softmax_offset)
            finally:
                self.window_size = size

        WINDOW_WITHIN_ROWS.replace(forward_torch_softmax)
        _window_patched = True


def _outside_window(sq: int, sk: int, window_size: tuple[int, int], device):
    """[b or 1, 1, sq, sk], True where a key is outside the query's window (megatron's convention: left tokens
    before, right after, by position)."""
    import torch

    positions = getattr(_positions, "ids", None)
    if positions is None:
        if sq != sk:
            raise ValueError(f"a sliding window over {sq} queries and {sk} keys needs their positions")
        positions = torch.arange(sk, device=device)[None]
    positions = positions.to(device)
    ahead = positions[:, None, :] - positions[:, :, None]  # key position - query position
    left, right = window_size
    return ((ahead < -left) | (ahead > right))[:, None]


@contextlib.contextmanager
def attention_positions(position_ids):
    """Sliding windows of the forwards run inside measure distances by ``position_ids`` [b, s] (packed rows)."""
    _positions.ids = position_ids
    try:
        yield
    finally:
        _positions.ids = None


@functools.cache
def gathered_kv_attention(cp_group):
    """megatron's local ``DotProductAttention`` under context parallelism (hybridflow/megatron/context_parallel.py):
    K and V [sk, b, g, d] are gathered over the CP group (``cp_group()``) before its own computation; the mask
    (required: [.., sq, cp * sk], True = masked) says which of them each local query sees."""
    import torch
    import torch.distributed as dist
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    LOCAL_ATTENTION.require()

    class GatherSequence(torch.autograd.Function):
        """[s, ...] on each CP rank -> [cp * s, ...] in rank order. Backward: every rank's queries used every
        rank's keys, so the gradients are summed over the group, and each rank keeps its own part."""

        @staticmethod
        def forward(ctx, x, group):
            ctx.group, ctx.length = group, x.shape[0]
            parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, x.contiguous(), group=group)
            return torch.cat(parts)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
            rank = dist.get_rank(ctx.group)
            return grad[rank * ctx.length:(rank + 1) * ctx.length], None

    class GatheredKVAttention(DotProductAttention):
        def __init__(self, config, *args, **kwargs):
            # built as CP 1: the assertion is the only use of the CP size there
            as_one = copy.copy(config)
            as_one.context_parallel_size = 1
            super().__init__(as_one, *args, **kwargs)
            self.cp_group = cp_group()

        def forward(self, query, key, value, attention_mask, *args, **kwargs):
            if attention_mask is None:
                raise ValueError("context parallel attention without Transformer Engine needs the mask of its "
                                 "queries against the gathered keys (row_layout.split_for_context_parallel)")
            key = GatherSequence.apply(key, self.cp_group)
            value = GatherSequence.apply(value, self.cp_group)
            return super().forward(query, key, value, attention_mask, *args, **kwargs)

    return GatheredKVAttention


def mend_biased_experts(model) -> int:
    """The two BIASED_EXPERTS fixes on each expert linear_fc2 with a bias; returns how many it found."""
    BIASED_EXPERTS.require()
    n = 0
    for name, m in model.named_modules():
        if ".local_experts." in name and name.endswith("linear_fc2") and getattr(m, "bias", None) is not None:
            # explicit_expert_comm: the linear's own output, no view. TE's linears keep it as a local only
            # (extensions/transformer_engine.py TELinear): copied there too, the safe side of an unknown
            local = type(m).__name__ == "RowParallelLinear"
            if not (m.explicit_expert_comm if local else False):
                m.register_forward_hook(lambda _m, _i, out: (out[0].clone(), *out[1:]))
            m.bias.sequence_parallel = False
            n += 1
    return n
