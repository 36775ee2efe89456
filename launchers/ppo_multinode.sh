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
# and the rerun resumes from that checkpoint (trainer.resume=auto). Preemption (SIGTERM) does the same.
#
# Environment (optional): HF_ROOT (this repository; default: the submit dir), HF_PYTHON, HF_NODE_WAIT_S,
# HF_CONTAINER=podman|docker with HF_IMAGE (container mode), HF_DASHBOARD=true, HF_SOCKET_IFNAME, HF_IB_HCA,
# HF_WORKERS_PER_NODE (CPU clusters; default 1), RAY_DEBUG, RAY_DEBUG_POST_MORTEM.
set -euo pipefail

HF_ROOT=${HF_ROOT:-${SLURM_SUBMIT_DIR:-$(pwd)}}
# shellcheck source-path=SCRIPTDIR/.. source=slurm/common.sh
source "$HF_ROOT/slurm/common.sh"
cd "$HF_ROOT"

(( $# >= 1 )) || hf_die "usage: sbatch launchers/ppo_multinode.sh CONFIG [key=value ...]"
config=$1; shift
[[ -f $config ]] || hf_die "config file not found: $config"

mapfile -t nodes < <(hf_nodes)
gpus=$(hf_gpus_per_node)
per_node=${HF_WORKERS_PER_NODE:-$(( gpus > 0 ? gpus : 1 ))}
cpus=${HF_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-1}}
# Filled in from the allocation; any of these the user passes comes later and wins.
derived=("ray.address=$(hf_head_ip):$(hf_port_base)" "ray.num_cpus=null" "ray.temp_dir=null"
  "resources.n_workers=$(( ${#nodes[@]} * per_node ))" "resources.gpus_per_worker=$(( gpus > 0 ? 1 : 0 ))"
  "resources.cpus_per_worker=$(( cpus / per_node > 0 ? cpus / per_node : 1 ))")

status=0
driver=""
# shellcheck disable=SC2329  # invoked by the traps below
cleanup() {
  trap - EXIT TERM USR1 INT
  [[ -n $driver ]] && kill -TERM "$driver" 2>/dev/null && wait "$driver" 2>/dev/null
  hf_ray_stop
  hf_stop_containers
  rm -rf "$(hf_token_dir)"
}
# shellcheck disable=SC2329
forward() { [[ -n $driver ]] && kill "-$1" "$driver" 2>/dev/null; }
# SIGTERM (scancel, preemption) reaches every job step, Ray's too: the driver cannot checkpoint any more
# and gets HF_TERM_GRACE_S to end before it is killed, so that the cleanup fits in Slurm's KillWait.
# shellcheck disable=SC2329
terminate() {
  forward TERM
  [[ -n $driver ]] && ( sleep "${HF_TERM_GRACE_S:-8}"; kill -KILL "$driver" 2>/dev/null ) &
}
trap cleanup EXIT
trap 'forward USR1' USR1
trap terminate TERM

hf_comm_env
hf_make_token
hf_log "job ${SLURM_JOB_ID:-?}: nodes ${nodes[*]}, ${gpus} GPUs per node, Ray head $(hf_head_ip):$(hf_port_base)"
hf_start_containers
hf_ray_start
hf_ray_wait || { status=$?; hf_log "Ray cluster incomplete; stopping"; exit "$status"; }

if [[ -n $HF_CONTAINER ]]; then
  "$HF_CONTAINER" exec "hf_${SLURM_JOB_ID}" "$HF_PYTHON" -m hybridflow.trainer.main --config "$config" "${derived[@]}" "$@" &
else
  "$HF_PYTHON" -m hybridflow.trainer.main --config "$config" "${derived[@]}" "$@" &
fi
driver=$!
# `wait` returns early when a trapped signal arrives: wait again until the driver has really exited.
while true; do
  wait "$driver" && status=0 || status=$?
  kill -0 "$driver" 2>/dev/null || break
done
driver=""
if (( status == 75 )) && [[ -n ${SLURM_JOB_ID:-} ]]; then
  hf_log "preempted: checkpoint written; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID" || true
fi
hf_log "driver exited with status $status"
exit "$status"
