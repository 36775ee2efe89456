#!/usr/bin/env bash
# PPO-family training on a Slurm allocation: a job-private Ray cluster over the allocated nodes, then the
# driver on the first node.       sbatch launchers/ppo_multinode.sh CONFIG [key=value ...]
# Edit the #SBATCH lines for your cluster. On CPU-only clusters drop --gpus-per-node.
#SBATCH --job-name=hybridflow
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --partition=gpu
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --output=hybridflow-%j.out
#
# --signal=B:USR1@300: five minutes before the time limit this script gets SIGUSR1 and passes it to the
# driver, which finishes its step, writes a checkpoint and exits 75; the job is then requeued (--requeue)
# and the rerun resumes from that checkpoint (trainer.resume_mode=auto). Preemption (SIGTERM) does the same.
#
# Python: every node runs Ray and the driver with HYBRIDFLOW_PYTHON, by default this repository's
# .venv/bin/python (what `make run` / `make install` create; the repository must be on a shared filesystem)
# when it exists, else python3 from PATH; in container mode the image's python3.
#
# Environment (optional): HYBRIDFLOW_ROOT (this repository; default: the submit dir), HYBRIDFLOW_PYTHON,
# HYBRIDFLOW_NODE_WAIT_S, HYBRIDFLOW_CONTAINER=podman|docker with HYBRIDFLOW_IMAGE (container mode),
# HYBRIDFLOW_DASHBOARD=true, HYBRIDFLOW_SOCKET_IFNAME, HYBRIDFLOW_IB_HCA, HYBRIDFLOW_WORKERS_PER_NODE (CPU
# clusters; default 1), HYBRIDFLOW_CPUS_PER_NODE, HYBRIDFLOW_TERM_GRACE_S, HYBRIDFLOW_SHARED_DIR. Your NCCL_*,
# RCCL_*, UCX_*, PYTORCH_*, CUDA_*, TORCH_*, VLLM_*, RAY_* (e.g. RAY_DEBUG), HF_*, WANDB_* ... variables reach
# every Ray process and the driver, in container mode too (slurm/common.sh: forward_prefixes).
set -euo pipefail

HYBRIDFLOW_ROOT=${HYBRIDFLOW_ROOT:-${SLURM_SUBMIT_DIR:-$(pwd)}}
# shellcheck source-path=SCRIPTDIR/.. source=slurm/common.sh
source "$HYBRIDFLOW_ROOT/slurm/common.sh"
cd "$HYBRIDFLOW_ROOT"

(( $# >= 1 )) || hybridflow_die "usage: sbatch launchers/ppo_multinode.sh CONFIG [key=value ...]"
config=$1; shift
[[ -f $config ]] || hybridflow_die "config file not found: $config"

mapfile -t nodes < <(hybridflow_nodes)
gpus=$(hybridflow_gpus_per_node)
per_node=${HYBRIDFLOW_WORKERS_PER_NODE:-$(( gpus > 0 ? gpus : 1 ))}
cpus=${HYBRIDFLOW_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-1}}
# Filled in from the allocation; any of these the user passes comes later and wins.
derived=("ray.address=$(hybridflow_head_ip):$(hybridflow_port_base)" "ray.num_cpus=null" "ray.temp_dir=null"
  "resources.n_workers=$(( ${#nodes[@]} * per_node ))" "resources.gpus_per_worker=$(( gpus > 0 ? 1 : 0 ))"
  "resources.cpus_per_worker=$(( cpus / per_node > 0 ? cpus / per_node : 1 ))")

status=0
driver=""
# shellcheck disable=SC2329  # invoked by the traps below
cleanup() {
  trap - EXIT TERM USR1 INT
  [[ -n $driver ]] && kill -TERM "$driver" 2>/dev/null && wait "$driver" 2>/dev/null
  hybridflow_ray_stop
  hybridflow_stop_containers
  rm -rf "$(hybridflow_token_dir)"
}
# shellcheck disable=SC2329
forward() { [[ -n $driver ]] && kill "-$1" "$driver" 2>/dev/null; }
# SIGTERM (scancel, preemption) reaches every job step, Ray's too: the driver cannot checkpoint any more
# and gets HYBRIDFLOW_TERM_GRACE_S to end before it is killed, so that the cleanup fits in Slurm's KillWait.
# shellcheck disable=SC2329
terminate() {
  forward TERM
  [[ -n $driver ]] && ( sleep "${HYBRIDFLOW_TERM_GRACE_S:-8}"; kill -KILL "$driver" 2>/dev/null ) &
}
trap cleanup EXIT
trap 'forward USR1' USR1
trap terminate TERM

hybridflow_comm_env
hybridflow_make_token
hybridflow_log "job ${SLURM_JOB_ID:-?}: nodes ${nodes[*]}, ${gpus} GPUs per node, Ray head $(hybridflow_head_ip):$(hybridflow_port_base)"
hybridflow_start_containers
hybridflow_ray_start
hybridflow_ray_wait || { status=$?; hybridflow_log "Ray cluster incomplete; stopping"; exit "$status"; }

mapfile -d '' -t prefix < <(hybridflow_env_prefix)  # `env ...`, or `podman|docker exec ...` in container mode
"${prefix[@]}" "$HYBRIDFLOW_PYTHON" -m hybridflow.trainer.main --config "$config" "${derived[@]}" "$@" &
driver=$!
# `wait` returns early when a trapped signal arrives: wait again until the driver has really exited.
while true; do
  wait "$driver" && status=0 || status=$?
  kill -0 "$driver" 2>/dev/null || break
done
driver=""
if (( status == 75 )) && [[ -n ${SLURM_JOB_ID:-} ]]; then
  hybridflow_log "preempted: checkpoint written; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID" || true
fi
hybridflow_log "driver exited with status $status"
exit "$status"
