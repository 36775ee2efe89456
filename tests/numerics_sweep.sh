#!/usr/bin/env bash
# The numeric test tiers (unit + distributed) under every kernel set torch can pick on this CPU and with
# 1 and 2 threads: a stand-in for "another x86-64 machine". Not part of `make test` (6 runs of the tiers).
#
#   ATEN_CPU_CAPABILITY=default   scalar kernels, as on a CPU without AVX2 kernels in torch's dispatch
#   ATEN_CPU_CAPABILITY=avx2      an AVX2-only CPU (older Intel, AMD Zen 1-3)
#   (unset)                       the machine's best (AVX-512 where present)
# Threads: OMP_NUM_THREADS for the pytest process, HYBRIDFLOW_RANK_THREADS for the gloo ranks it spawns.
#
# Usage: bash tests/numerics_sweep.sh [pytest args]     e.g. bash tests/numerics_sweep.sh -k checkpoint
# Environment: PYTHON (default .venv/bin/python), SWEEP_LOG_DIR (default a new temp dir),
#              SWEEP_CAPABILITIES (default "default avx2 best"), SWEEP_THREADS (default "1 2").
# Prints one line per setting and exits non-zero if any setting failed; HYBRIDFLOW_TOL_REPORT=1 makes
# each log list how much of its tolerance every comparison used (grep '\[tolerance\]').
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

PY=${PYTHON:-.venv/bin/python}
logs=${SWEEP_LOG_DIR:-$(mktemp -d -t numerics_sweep.XXXXXX)}
mkdir -p "$logs"
failed=0
for cap in ${SWEEP_CAPABILITIES:-default avx2 best}; do
  for threads in ${SWEEP_THREADS:-1 2}; do
    log="$logs/${cap}_t${threads}.log"
    start=$SECONDS
    if [[ $cap == best ]]; then unset ATEN_CPU_CAPABILITY; else export ATEN_CPU_CAPABILITY=$cap; fi
    OMP_NUM_THREADS=$threads HYBRIDFLOW_RANK_THREADS=$threads HYBRIDFLOW_TOL_REPORT=1 \
      "$PY" -m pytest tests/unit tests/distributed -s -p no:cacheprovider "$@" >"$log" 2>&1
    status=$?
    summary=$(grep -E '[0-9]+ (passed|failed)' "$log" | tail -n 1)
    worst=$(grep -o 'used [0-9.e+-]*' "$log" | awk '{print $2}' | sort -g | tail -n 1)
    printf 'capability=%-7s threads=%s  %s  (worst tolerance use %s, %ss, log %s)\n' \
      "$cap" "$threads" "${summary:-no summary (exit $status)}" "${worst:-n/a}" $((SECONDS - start)) "$log"
    [[ $status -eq 0 ]] || failed=1
  done
done
exit $failed
