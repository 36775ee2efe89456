#!/usr/bin/env bash
# One machine, no Slurm: the driver with an embedded Ray cluster sized to this machine's GPUs (or one
# worker on CPU); signals are passed to the driver (SIGTERM/SIGUSR1: checkpoint, exit 75).
#     slurm/launch_local.sh CONFIG [key=value ...]
# Python: HYBRIDFLOW_PYTHON, by default this repository's .venv/bin/python when it exists, else python3.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
(( $# >= 1 )) || { echo "usage: slurm/launch_local.sh CONFIG [key=value ...]" >&2; exit 2; }
config=$1; shift
gpus=$("$HYBRIDFLOW_PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
derived=()
if (( gpus > 0 )); then
  derived=("resources.n_workers=$gpus" "resources.gpus_per_worker=1")
fi
"$HYBRIDFLOW_PYTHON" -m hybridflow.trainer.main --config "$config" "${derived[@]}" "$@" &
driver=$!
trap 'kill -USR1 "$driver" 2>/dev/null' USR1
trap 'kill -TERM "$driver" 2>/dev/null' TERM
trap 'kill -INT "$driver" 2>/dev/null' INT
while true; do
  wait "$driver" && status=0 || status=$?
  kill -0 "$driver" 2>/dev/null || break
done
exit "$status"
