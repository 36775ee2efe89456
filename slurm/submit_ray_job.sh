#!/usr/bin/env bash
# Submit a training run to an existing Ray cluster with `ray job submit` (token auth).
#     slurm/submit_ray_job.sh HEAD_HOST:DASHBOARD_PORT TOKEN_FILE CONFIG [key=value ...]
# The run joins that cluster (ray.address=auto inside the job); the working directory is uploaded.
# The `ray job submit` client runs with HYBRIDFLOW_PYTHON (default: this repository's .venv/bin/python when
# it exists, else python3).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
(( $# >= 3 )) || { echo "usage: slurm/submit_ray_job.sh HEAD:DASHBOARD_PORT TOKEN_FILE CONFIG [key=value ...]" >&2; exit 2; }
address=$1 token=$2 config=$3; shift 3
[[ -r $token ]] || { echo "error: cannot read the cluster's auth token $token" >&2; exit 2; }
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$token
exec "$HYBRIDFLOW_PYTHON" -m ray.scripts.scripts job submit --address "http://$address" --working-dir . -- \
  python -m hybridflow.trainer.main --config "$config" ray.address=auto ray.num_cpus=null ray.temp_dir=null "$@"
