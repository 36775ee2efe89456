"""megatron-core's multi-latent attention (DeepSeek-V3's) on its local spec: two faults that stop it being built
without Transformer Engine (found by the probe in shared/notes/model-families-2026.md; 0.19.2 fixes the first only)."""

from __future__ import annotations

import functools

from hybridflow.patches.megatron_core import MCORE
from hybridflow.patches.registry import declare

MLA_TE_FLAG = declare(
    "megatron.mla_have_te_flag", "megatron-core", MCORE,
    "megatron.core.transformer.multi_latent_attention:HAVE_TE",
    "multi_latent_attention.py sets HAVE_TE whenever megatron's TE extension module imports, which it does without "
    "TE (its names are MagicMock stubs): MLA's constructor then asks isinstance(linear_proj, TELinear) of a stub and "
    "raises TypeError. The extension's own HAVE_TE says whether TE is there (0.19.2 imports that one)")
MLA_LOCAL_ATTENTION = declare(
    "megatron.mla_local_core_attention", "megatron-core", MCORE,
    "megatron.core.transformer.dot_product_attention:DotProductAttention.__init__",
    "MLA builds its core attention with k_channels and v_channels (TE's DotProductAttention takes them), which the "
    "local DotProductAttention does not accept; it sizes its output by config.kv_channels, which hybridflow sets to "
    "v_head_dim for MLA, and takes the query/key head size from the tensors it is given")


def have_te_in_mla() -> None:
    """MLA's HAVE_TE as the TE extension's own (MLA_TE_FLAG); idempotent."""
    from megatron.core.extensions import transformer_engine as te

    MLA_TE_FLAG.require()
    MLA_TE_FLAG.replace(bool(te.HAVE_TE))


@functools.cache
def local_core_attention(base=None):
    """The local core attention (``base``: megatron's DotProductAttention, or a subclass of it such as the
    context-parallel one) taking and dropping MLA's k_channels / v_channels (MLA_LOCAL_ATTENTION)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    MLA_LOCAL_ATTENTION.require()
    base = base or DotProductAttention

    class LatentCoreAttention(base):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):  # noqa: ARG002 (sized from config)
            super().__init__(*args, **kwargs)

    return LatentCoreAttention
