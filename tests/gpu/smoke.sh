#!/usr/bin/env bash
# GPU smoke check that fits a short lent slot (under 9 minutes on a fresh NVIDIA machine that reaches only the
# package registries): Transformer Engine's torch extension and flash-attn are source builds (10-25 minutes),
# so they are left out and megatron-core runs its local spec (hybridflow/megatron/model.py layer_spec).
#   0. driver: first, before anything is installed: torch 2.13's CUDA 13 wheels need an R580+ driver; below it the
#      smoke says so in one line and stops
#   1. install: a fresh venv (uv, installed with pip where absent: the multi-GB CUDA wheels take a fraction of pip's
#      time) with the pins of constraints/gpu.txt but the source builds (tests/gpu/smoke.py pins)
#   2. versions: torch and its CUDA, NCCL (one all-reduce), vLLM, megatron-core, transformers, ray
#   3. reload: two weight syncs into a vLLM-GPU engine through hybridflow's own shard path (the HF weights cut into
#      vLLM's TP shard and written in place: workers/generation.load_generation_shard; a MoE model's experts into
#      FusedMoE's weights from the second sync, rollout/fused_experts.py), each against HF greedy, for a dense Qwen3
#      and a Qwen3-MoE (tiny random models with head_dim 64, which vLLM-GPU's attention backends run), through
#      hybridflow's VLLMRollout (sleep mode, bf16, eager: the tier's case runs CUDA graphs)
#   4. tier: one single-GPU case of the GPU tier (tests/gpu/run.sh -k "$SMOKE_TIER_K") in the time left
# One line per check (PASS|FAIL|SKIP <check>: <detail>; each step's output in $SMOKE_LOGS), then a summary.
# Exit status: 1 when a check failed, 0 otherwise (2 on bad usage).
#
# Usage: bash tests/gpu/smoke.sh [--dry-run] [--no-install]
#   --dry-run     print the plan (the install command included) and exit
#   --no-install  use $PYTHON's environment as it is (default python3)
# Environment: SMOKE_VENV (default ${TMPDIR:-/tmp}/hybridflow-smoke-venv), PYTHON (the interpreter that
#   creates the venv, or is used with --no-install; default python3), SMOKE_BUDGET_S (540),
#   SMOKE_ARCHS (default "qwen3 qwen3_moe"), SMOKE_TIER_K (default "single-grpo-temperature"),
#   SMOKE_LOGS (default $OUT/smoke where OUT is set, else a new temporary folder).
set -uo pipefail  # no -e: every check runs and is counted
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2

dry=0 install=1
for arg in "$@"; do
  case $arg in
    --dry-run) dry=1 ;;
    --no-install) install=0 ;;
    *) echo "usage: bash tests/gpu/smoke.sh [--dry-run] [--no-install]" >&2; exit 2 ;;
  esac
done

budget=${SMOKE_BUDGET_S:-540}
venv=${SMOKE_VENV:-${TMPDIR:-/tmp}/hybridflow-smoke-venv}
base_py=${PYTHON:-python3}
archs=${SMOKE_ARCHS:-qwen3 qwen3_moe}
tier_k=${SMOKE_TIER_K:-single-grpo-temperature}
passed=0 failed=0 skipped=0

report() {  # STATUS CHECK DETAIL
  echo "$1 $2: $3"
  case $1 in
    PASS) passed=$((passed + 1)) ;;
    FAIL) failed=$((failed + 1)) ;;
    *) skipped=$((skipped + 1)) ;;
  esac
}

run_step() {  # NAME COMMAND...: one line for the whole command, by its exit status
  local name=$1 t0=$SECONDS log
  shift
  log="$logs/${name// /_}.log"
  if "$@" >"$log" 2>&1; then
    report PASS "$name" "$((SECONDS - t0)) s"
  else
    local rc=$?
    report FAIL "$name" "exit $rc after $((SECONDS - t0)) s: $(tail -n 1 "$log") (log: $log)"
  fi
}

report_lines() {  # LOG: the PASS/FAIL/SKIP lines a check printed, each counted
  local status check detail
  while IFS= read -r out; do
    status=${out%% *} check=${out#* } detail=${check#*: } check=${check%%: *}
    report "$status" "$check" "$detail"
  done < <(grep -E '^(PASS|FAIL|SKIP) ' "$1")
}

run_checks() {  # NAME COMMAND...: the command prints its own PASS/FAIL/SKIP lines, each counted
  local name=$1 log
  shift
  log="$logs/${name// /_}.log"
  "$@" >"$log" 2>&1
  local rc=$?
  report_lines "$log"
  if (( rc != 0 )) && ! grep -q '^FAIL ' "$log"; then  # it died before saying why: its last line does
    report FAIL "$name" "exit $rc: $(tail -n 1 "$log") (log: $log)"
  fi
}

mapfile -t pins < <("$base_py" -m tests.gpu.smoke pins)  # stdlib only: works before the install
if (( ${#pins[@]} == 0 )); then
  echo "error: no pins read from constraints/gpu.txt with $base_py" >&2
  exit 2
fi

if (( dry )); then
  echo "PLAN driver: $base_py -m tests.gpu.smoke driver (stop here below R580)"
  echo "PLAN install: $base_py -m venv $venv; pip install ${pins[*]}; pip install -e '.[test]' -c constraints/gpu.txt" \
    "(no transformer-engine, no flash-attn: source builds)"
  echo "PLAN versions: python -m tests.gpu.smoke versions"
  for arch in $archs; do
    echo "PLAN reload $arch: python -m tests.gpu.smoke reload --arch $arch"
  done
  echo "PLAN tier: bash tests/gpu/run.sh -k \"$tier_k\" (in the time left of ${budget} s)"
  exit 0
fi

if [[ -n ${SMOKE_LOGS:-} ]]; then logs=$SMOKE_LOGS
elif [[ -n ${OUT:-} ]]; then logs=$OUT/smoke  # what a lent machine sends back
else logs=$(mktemp -d "${TMPDIR:-/tmp}/hybridflow-smoke-logs.XXXXXX"); fi
mkdir -p "$logs"

# First, before minutes of install: a driver too old for torch's CUDA 13 ends the smoke in one line.
if ! "$base_py" -m tests.gpu.smoke driver >"$logs/driver.log" 2>&1; then
  cat "$logs/driver.log"
  echo "smoke: stopped: the NVIDIA driver is older than torch's CUDA 13 wheels need (logs in $logs)"
  exit 1
fi
report_lines "$logs/driver.log"

install_stack() {
  local uv=uv
  if ! command -v uv >/dev/null 2>&1; then  # much faster than pip on the multi-GB CUDA wheels: worth its install
    "$base_py" -m pip install -q --target "$venv.uv" uv && uv="$venv.uv/bin/uv" || uv=""
  fi
  if [[ -n $uv ]]; then
    "$uv" venv --python "$base_py" "$venv" &&
      "$uv" pip install --python "$venv/bin/python" "${pins[@]}" &&
      "$uv" pip install --python "$venv/bin/python" -c constraints/gpu.txt -e '.[test]'
  else
    "$base_py" -m venv "$venv" &&
      "$venv/bin/python" -m pip install -q --upgrade pip &&
      "$venv/bin/python" -m pip install -q "${pins[@]}" &&
      "$venv/bin/python" -m pip install -q -c constraints/gpu.txt -e '.[test]'
  fi
}

if (( install )); then
  run_step "install" install_stack
  py="$venv/bin/python"
else
  report SKIP "install" "--no-install: $base_py as it is"
  py=$base_py
fi

run_checks "versions" "$py" -m tests.gpu.smoke versions
for arch in $archs; do
  run_checks "reload $arch" "$py" -m tests.gpu.smoke reload --arch "$arch"
done

gpus=$("$py" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
left=$((budget - SECONDS - 15))
if (( gpus == 0 )); then
  report SKIP "tier" "no CUDA device visible to torch"
elif (( left < 60 )); then
  report FAIL "tier" "only ${left} s of the ${budget} s budget left"
else
  t0=$SECONDS
  if GPU_TEST_TIMEOUT=$left PYTHON=$py bash tests/gpu/run.sh -k "$tier_k" >"$logs/tier.log" 2>&1; then
    report PASS "tier" "$(tail -n 1 "$logs/tier.log") ($((SECONDS - t0)) s)"
  else
    report FAIL "tier" "$(tail -n 1 "$logs/tier.log") ($((SECONDS - t0)) s; log: $logs/tier.log)"
  fi
fi

if (( SECONDS > budget )); then
  report FAIL "budget" "took ${SECONDS} s, over ${budget} s"
fi
echo "smoke: ${passed} passed, ${failed} failed, ${skipped} skipped in ${SECONDS} s (budget ${budget} s; logs in $logs)"
(( failed == 0 ))
