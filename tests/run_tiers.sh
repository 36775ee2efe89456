#!/usr/bin/env bash
# `make test`: the CPU tiers in the time CI allows on two cores. The Slurm tier runs first and alone (its checks
# look for leftover ray/hybridflow processes machine-wide); then the integration tier, which spends most of its
# time waiting on the clusters and workers it starts, runs beside the unit, distributed and GPU tiers. The
# integration tier streams its output; the other lane's is shown when it ends. With test paths or -k among the
# arguments, pytest runs as asked, in one process.
# Usage: tests/run_tiers.sh PYTHON [pytest options...]
set -uo pipefail
py=$1
shift
for arg in "$@"; do
  case $arg in
    -k|-k*|-m|-m*|tests*|*.py|*::*) exec "$py" -m pytest "$@" ;;
  esac
done
lanes=$(mktemp -d)
trap 'rm -rf "$lanes"' EXIT
"$py" -m pytest "$@" --basetemp="$lanes/cluster" tests/cluster
cluster=$?
"$py" -m pytest "$@" --basetemp="$lanes/side" tests/unit tests/distributed tests/gpu >"$lanes/side.log" 2>&1 &
side_pid=$!
"$py" -m pytest "$@" --basetemp="$lanes/integration" tests/integration
integration=$?
wait "$side_pid"
side=$?
echo "=== unit, distributed and GPU tiers (run beside the integration tier) ==="
cat "$lanes/side.log"
echo "=== exit status: cluster $cluster, integration $integration, unit+distributed+gpu $side ==="
for status in $cluster $integration $side; do
  [ "$status" -eq 0 ] || [ "$status" -eq 5 ] || exit "$status"  # 5: no tests collected (a tier left empty)
done
exit 0
