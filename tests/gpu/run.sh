#!/usr/bin/env bash
# The GPU test tier: PPO and GRPO steps on a random Qwen2.5-0.5B-shaped model over the actor/rollout layouts
# (single GPU, actor TP 2, actor PP 2, rollout TP 2, offload), on 1-8 NVIDIA (CUDA) or AMD (ROCm) GPUs in
# this machine. Cases that need more GPUs than are visible are skipped. Without any GPU (none listed by
# nvidia-smi/rocm-smi, none seen by torch) all are skipped and it exits 0; when nvidia-smi or rocm-smi lists
# GPUs but torch sees none (a driver older than the torch build needs, a CPU-only torch, devices hidden by
# CUDA_VISIBLE_DEVICES) it fails (exit 3) instead of skipping everything.
#
# Installs nothing. One-time install into the environment that has the GPU build of torch (order and
# notes, e.g. building TE without build isolation, in constraints/gpu.txt), or use containers/Dockerfile.cuda:
#   pip install -e '.[gpu,test]' -c constraints/gpu.txt
#
# Usage: bash tests/gpu/run.sh [pytest args]      e.g. bash tests/gpu/run.sh -k single
#        make test-gpu PYTEST_ARGS='-k single'
# Environment: PYTHON (default: python); GPU_TEST_TIMEOUT (seconds for the whole tier; default: the sum of
# the selected cases' pytest-timeout limits plus 120 s, from tests/gpu/budget.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

listed=0 lister=""
if command -v nvidia-smi >/dev/null 2>&1; then
  lister=nvidia-smi
  out=$(nvidia-smi -L 2>&1) || true
  listed=$(grep -c '^GPU [0-9]' <<<"$out" || true)  # MIG instances are indented "MIG ..." lines: not counted
elif command -v rocm-smi >/dev/null 2>&1; then
  lister=rocm-smi
  out=$(rocm-smi --showproductname 2>&1) || true
  listed=$({ grep -o '^GPU\[[0-9]*\]' <<<"$out" || true; } | sort -u | wc -l)  # several lines per GPU
else
  out="neither nvidia-smi nor rocm-smi found: the tests are skipped unless torch sees a GPU"
fi
echo "$out"

PY=${PYTHON:-python}
# torch.cuda.device_count() alone may count through NVML even when CUDA cannot start (torch/cuda/__init__.py),
# so count only when is_available(), as tests/gpu/conftest.py:gpu_count does.
if ! seen=$("$PY" -c 'import sys, torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, HIP {torch.version.hip}): {n} GPU(s) visible", file=sys.stderr)
print(n)'); then
  echo "$PY cannot import torch: install the GPU stack first (see the top of $0), or set PYTHON" >&2
  exit 2
fi
if (( listed > 0 && seen == 0 )); then
  echo "error: $lister lists $listed GPU(s) but torch sees none (torch.cuda.is_available() is False: a driver" \
    "older than this torch build needs, a CPU-only torch, or CUDA_VISIBLE_DEVICES/HIP_VISIBLE_DEVICES hiding them);" \
    "every GPU test would be skipped" >&2
  exit 3
fi

if [[ -n ${GPU_TEST_TIMEOUT:-} ]]; then
  budget=$GPU_TEST_TIMEOUT
  echo "GPU tier budget: ${budget} s (GPU_TEST_TIMEOUT)"
else
  sized=$("$PY" -m tests.gpu.budget "$@") || { echo "error: could not collect the GPU tier to size its time budget" >&2; exit 2; }
  read -r budget cases <<<"$sized"
  echo "GPU tier budget: ${budget} s for ${cases} case(s) (their pytest-timeout limits + start-up)"
fi

export PYTHONUNBUFFERED=1
# SIGINT first: pytest then unwinds, and each test's teardown stops the Ray cluster it started (and so
# the processes holding GPU memory); SIGKILL only if that takes more than a minute.
exec timeout --signal=INT --kill-after=60 "$budget" \
  "$PY" -m pytest tests/gpu -m gpu -s -q -p no:cacheprovider "$@"
