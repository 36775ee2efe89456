"""The GPU tier: shared assets and helpers. Run it with ``bash tests/gpu/run.sh`` (or ``make test-gpu``).

Every test under tests/gpu is marked ``gpu`` and skipped, with the reason, when torch sees no CUDA/ROCm
device; ``require_gpus(n)`` skips a test that needs more devices than are visible. Each test starts its own
Ray cluster over the visible GPUs (``gpu_ray_cluster``) and tears it down, so the next test's vLLM finds
its memory free.

The model is Qwen2.5-0.5B-shaped (configs/models/qwen2.5-0.5b-instruct.json: hidden 896, 24 layers, 14
heads, 2 KV heads, intermediate 4864, tied embeddings) with random weights and the char tokenizer, so
nothing comes from the hub. The vocabulary is the tokenizer's padded to 128 (divisible by 64 x t_g for
rollout TP 2): with Qwen's 151936 rows a random model would emit almost only ids the char tokenizer
cannot decode, every reward would be equal and the steps would train nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
REPO = _HERE.parent.parent
QWEN_05B = REPO / "configs" / "models" / "qwen2.5-0.5b-instruct.json"
NO_GPU = ("no CUDA/ROCm device visible to torch (torch.cuda.is_available() is False); "
          "the GPU tier runs on a GPU machine: bash tests/gpu/run.sh")


def gpu_count() -> int:
    """Devices torch can see (ROCm builds report AMD GPUs through torch.cuda too)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def require_gpus(n: int) -> None:
    """Skip the calling test when fewer than ``n`` devices are visible."""
    have = gpu_count()
    if have < n:
        pytest.skip(f"needs {n} GPUs, {have} visible")


@pytest.hookimpl(tryfirst=True)  # before `-m gpu` deselects by marker
def pytest_collection_modifyitems(config, items):  # noqa: ARG001
    skip = None if gpu_count() else pytest.mark.skip(reason=NO_GPU)
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:  # this hook sees every collected item
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)


# --- reward used by the tier ---------------------------------------------------------------------

def _register_scorer():
    from hybridflow.rewards import register_scorer

    @register_scorer("gpu_tier_char_variety")
    def char_variety(response: str, answer: str) -> float:  # noqa: ARG001
        """Distinct characters in the response: varies between random responses, so advantages (GAE
        and GRPO alike) are non-zero and the steps really update the weights."""
        return len(set(response)) / 8.0


SCORER = "gpu_tier_char_variety"
_register_scorer()


# --- assets ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GpuAssets:
    root: Path
    model_dir: Path
    train_file: Path
    val_file: Path
    param_bytes: int  # M: the actor's parameter bytes in bf16 (tied embedding counted once)


@pytest.fixture(scope="session")
def gpu_assets(tmp_path_factory) -> GpuAssets:
    """The random Qwen2.5-0.5B-shaped model (bf16 safetensors) and the arithmetic prompts, once per session."""
    import torch
    from safetensors.torch import load_file

    from hybridflow.config import ConfigError
    from hybridflow.data.arithmetic import write_arithmetic_parquet
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.versions import check_stack

    try:  # a wrong vLLM / TE / transformers fails here in one line, not deep inside a worker
        check_stack(True)
    except ConfigError as e:
        pytest.fail(f"GPU stack: {e}", pytrace=False)

    root = tmp_path_factory.mktemp("gpu_assets")
    # No SFT warm start (prepare_quickstart always runs one): write the data and the model directly.
    train, val = write_arithmetic_parquet(root / "data", max_operand=99, n_val=64, seed=1)
    shape = json.loads(QWEN_05B.read_text())
    model_dir = root / "model"
    tokenizer = build_char_tokenizer(model_dir)
    model = build_tiny_qwen2(
        model_dir, tokenizer, hidden_size=shape["hidden_size"], num_layers=shape["num_hidden_layers"],
        num_heads=shape["num_attention_heads"], num_kv_heads=shape["num_key_value_heads"],
        intermediate_size=shape["intermediate_size"], max_position_embeddings=shape["max_position_embeddings"],
        vocab_multiple=128, tie_word_embeddings=shape["tie_word_embeddings"], seed=0)
    # Re-save in bf16 (half the bytes; what the workers train in). No logit scaling: measured on this
    # shape, scaling the tied embedding x30 makes the input embedding dominate the residual stream and
    # every prompt's greedy output becomes one repeated token (the layers no longer matter), and peaked
    # logits would make GRPO's samples of a group identical (zero advantages). Unscaled, greedy outputs
    # differ per prompt; bf16 noise is relative, so scaling would not remove near-ties anyway: the
    # greedy check tolerates genuine near-ties instead (test_gpu_ppo.NEAR_TIE).
    for f in [*model_dir.glob("*.safetensors"), *model_dir.glob("*.safetensors.index.json")]:
        f.unlink()
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(str(model_dir))
    files = sorted(model_dir.glob("*.safetensors"))
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    del model
    return GpuAssets(root, model_dir, train, val, param_bytes=sum(t.numel() * t.element_size() for t in state.values()))


# --- other architectures ---------------------------------------------------------------------------

# vLLM-GPU picks an attention backend by head size (v1/attention/backends/flash_attn.py supports_head_size:
# a multiple of 8 up to 256; FlashInfer 64, 128, 256, 512): tiny_arch's default head_dim (2 x hidden / heads
# for Qwen3, hidden / heads for the others) would be 16 or 32 on a tiny model, so it is set to 64.
GPU_HEAD_DIM = 64


def build_gpu_tiny(root, arch: str, seed: int = 0) -> Path:
    """A tiny random ``arch`` model (hybridflow/models/tiny_arch.py) whose heads every vLLM-GPU backend runs:
    hidden 256 = 4 heads x 64 (2 KV heads), 2 layers, MoE 8 experts top-2 of width 128, vocab padded to 128."""
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_arch import build_tiny

    out = Path(root) / arch
    build_tiny(out, build_char_tokenizer(out), arch, hidden_size=4 * GPU_HEAD_DIM, num_layers=2, num_heads=4,
               num_kv_heads=2, head_dim=GPU_HEAD_DIM, intermediate_size=512, num_experts=8, top_k=2,
               moe_intermediate_size=128, max_position_embeddings=128, vocab_multiple=128, seed=seed)
    return out


@pytest.fixture(scope="session")
def arch_models(tmp_path_factory):
    """``arch -> model folder``, each built once per session (build_gpu_tiny)."""
    root, built = tmp_path_factory.mktemp("gpu_archs"), {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = build_gpu_tiny(root, arch)
        return built[arch]
    return get


# --- Ray over the visible GPUs ---------------------------------------------------------------------

@contextlib.contextmanager
def gpu_ray_cluster():
    """An embedded Ray cluster owning all visible GPUs, for one test. Shutdown waits (by PID) until its
    processes are gone, so the GPUs' memory is free again for the next test's vLLM start-up check."""
    from hybridflow.controller import start_ray

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    n = gpu_count()
    handle = start_ray(num_cpus=max(4, min(os.cpu_count() or 4, 4 * n)), num_gpus=n)
    try:
        yield handle
    finally:
        handle.shutdown()
