#!/usr/bin/env bash
# The GPU test tier: PPO and GRPO steps on a random Qwen2.5-0.5B-shaped model over the actor/rollout layouts
# (single GPU, actor TP 2, actor PP 2, rollout TP 2, offload), on 1-8 NVIDIA (CUDA) or AMD (ROCm) GPUs in
# this machine. Cases that need more GPUs than are visible are skipped; without any GPU all are skipped.
#
# Installs nothing. One-time install into the environment that has the GPU build of torch (order and
# notes, e.g. building TE and flash-attn without build isolation, in constraints/gpu.txt):
#   pip install -e '.[gpu,test]' -c constraints/gpu.txt
#
# Usage: bash tests/gpu/run.sh [pytest args]      e.g. bash tests/gpu/run.sh -k single
#        make test-gpu PYTEST_ARGS='-k single'
# Environment: PYTHON (default: python), GPU_TEST_TIMEOUT (seconds for the whole tier, default 600).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi -L || true
elif command -v rocm-smi >/dev/null 2>&1; then
  rocm-smi --showproductname || true
else
  echo "neither nvidia-smi nor rocm-smi found; the tests are skipped unless torch sees a GPU"
fi

PY=${PYTHON:-python}
if ! "$PY" -c 'import torch; print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, HIP {torch.version.hip}): {torch.cuda.device_count()} GPU(s) visible")'; then
  echo "$PY cannot import torch: install the GPU stack first (see the top of $0), or set PYTHON" >&2
  exit 2
fi

export PYTHONUNBUFFERED=1
# SIGINT first: pytest then unwinds, and each test's teardown stops the Ray cluster it started (and so
# the processes holding GPU memory); SIGKILL only if that takes more than a minute.
exec timeout --signal=INT --kill-after=60 "${GPU_TEST_TIMEOUT:-600}" \
  "$PY" -m pytest tests/gpu -m gpu -s -q -p no:cacheprovider "$@"
