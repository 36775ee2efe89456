#!/usr/bin/env bash
# Shell functions the launchers source: the allocation, a job-private Ray cluster (explicit ports, own temp
# dir, token auth), waiting for its nodes, stopping exactly what was started, NCCL/RCCL presets.
# Every function is prefixed hf_; configuration comes from HF_* variables (defaults below).
# shellcheck shell=bash

HF_PYTHON=${HF_PYTHON:-python3}
HF_NODE_WAIT_S=${HF_NODE_WAIT_S:-180}      # every node must register with the Ray head within this
HF_DASHBOARD_HOST=${HF_DASHBOARD_HOST:-127.0.0.1}
HF_CONTAINER=${HF_CONTAINER:-}             # podman or docker: run each node's part in a container
HF_IMAGE=${HF_IMAGE:-}                     # the image for container mode (containers/Dockerfile.*)
HF_RAY_PIDS=()                             # job-step PIDs of the Ray processes this job started

hf_log() { printf '[hybridflow %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
hf_die() { hf_log "error: $*"; exit 2; }

# The allocation's nodes, one per line, head first.
hf_nodes() { scontrol show hostnames "${SLURM_JOB_NODELIST:?not inside a Slurm allocation}"; }

# This node's address as the other nodes reach it (HF_HEAD_IP overrides).
hf_head_ip() {
  if [[ -n ${HF_HEAD_IP:-} ]]; then echo "$HF_HEAD_IP"; return; fi
  hostname -I | awk '{print $1}'
}

# GPUs on a node of this job (0 on CPU clusters).
hf_gpus_per_node() {
  local g=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-0}}
  echo "${g##*:}"   # "a100:8" -> 8
}

# Ports: a base per job so that jobs sharing a node never collide; node i gets its own block.
hf_port_base() { echo $(( 20000 + (${SLURM_JOB_ID:-$$} % 400) * 100 )); }

# A private directory per job: Ray's temp dir (short: Unix socket paths are limited), the auth token.
hf_job_dir() { echo "${HF_JOB_DIR:-/tmp/hf_${SLURM_JOB_ID:-$$}}"; }

# Token auth: a token created for this job, readable by the user only, in a folder every node sees
# (HF_SHARED_DIR, default ~/.hybridflow: home directories are shared on clusters).
hf_token_dir() { echo "${HF_SHARED_DIR:-$HOME/.hybridflow}/jobs/${SLURM_JOB_ID:-$$}"; }
hf_make_token() {
  local dir; dir=$(hf_token_dir)
  (umask 077 && mkdir -p "$dir" && "$HF_PYTHON" -c 'import secrets; print(secrets.token_hex(32))' > "$dir/auth_token")
  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$dir/auth_token"
}

# NCCL (CUDA) / RCCL (ROCm) presets; every value the user exported wins.
hf_comm_env() {
  if [[ -e /dev/kfd ]]; then  # ROCm: ROCR/HIP visibility, not CUDA's
    export NCCL_MIN_NCHANNELS=${NCCL_MIN_NCHANNELS:-112}
    [[ -n ${CUDA_VISIBLE_DEVICES:-} && -z ${HIP_VISIBLE_DEVICES:-} ]] && export HIP_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES
  fi
  if [[ -d /dev/infiniband ]]; then
    export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}
    [[ -n ${HF_IB_HCA:-} ]] && export NCCL_IB_HCA=${NCCL_IB_HCA:-$HF_IB_HCA}
    export NCCL_IB_GID_INDEX=${NCCL_IB_GID_INDEX:-3}
  fi
  [[ -n ${HF_SOCKET_IFNAME:-} ]] && export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$HF_SOCKET_IFNAME} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$HF_SOCKET_IFNAME}
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
  return 0
}

# Variables every Ray process on every node gets (debugging passes through to the workers).
hf_pass_env() {
  local names=(RAY_AUTH_MODE RAY_AUTH_TOKEN_PATH RAY_DEBUG RAY_DEBUG_POST_MORTEM NCCL_DEBUG NCCL_IB_HCA
    NCCL_SOCKET_IFNAME NCCL_IB_GID_INDEX NCCL_IB_DISABLE GLOO_SOCKET_IFNAME HIP_VISIBLE_DEVICES WANDB_MODE
    WANDB_API_KEY HF_HOME PYTHONPATH)
  local n out=()
  for n in "${names[@]}"; do [[ -n ${!n:-} ]] && out+=("$n=${!n}"); done
  printf '%s\n' "${out[@]}"
}

# The `ray start` arguments of node number $1 (0 = head) named $2; ports from the job's base.
hf_ray_args() {
  local i=$1 name=$2 base; base=$(hf_port_base)
  local p=$(( base + 10 + i * 10 )) w=$(( base + 1000 + i * 200 ))
  local cpus=${HF_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-1}} gpus; gpus=$(hf_gpus_per_node)
  # Per node: several "nodes" may share a machine (and Ray's default /tmp/ray may hold a stranger's cluster).
  local args=(--node-name="$name" --num-cpus="$cpus" --num-gpus="$gpus" --block --disable-usage-stats
    --temp-dir="$(hf_job_dir)/r$i"
    "--node-manager-port=$p" "--object-manager-port=$(( p + 1 ))" "--metrics-export-port=$(( p + 2 ))"
    "--dashboard-agent-listen-port=$(( p + 3 ))" "--dashboard-agent-grpc-port=$(( p + 4 ))"
    "--runtime-env-agent-port=$(( p + 5 ))" "--min-worker-port=$w" "--max-worker-port=$(( w + 199 ))")
  if (( i == 0 )); then
    args+=(--head --port="$base" --ray-client-server-port=$(( base + 1 )) --node-ip-address="$(hf_head_ip)"
      --include-dashboard="${HF_DASHBOARD:-false}" --dashboard-host="$HF_DASHBOARD_HOST"
      --dashboard-port=$(( base + 2 )))
  else
    args+=(--address="$(hf_head_ip):$base")
  fi
  printf '%s\n' "${args[@]}"
}

# Run "$@" on node $1 as a background job step; container mode wraps it in `$HF_CONTAINER exec`.
hf_on_node() {
  local node=$1; shift
  local envs=(); mapfile -t envs < <(hf_pass_env)
  if [[ -n $HF_CONTAINER ]]; then
    srun --overlap -N1 -n1 -w "$node" "$HF_CONTAINER" exec "${envs[@]/#/--env=}" "hf_${SLURM_JOB_ID}" "$@" &
  else
    srun --overlap -N1 -n1 -w "$node" env "${envs[@]}" "$@" &
  fi
  HF_LAST_PID=$!
}

# Container mode: one container per node, started before Ray (containers/run.sh has the device flags).
hf_start_containers() {
  [[ -z $HF_CONTAINER ]] && return 0
  [[ -n $HF_IMAGE ]] || hf_die "HF_CONTAINER=$HF_CONTAINER needs HF_IMAGE (an image built from containers/)"
  local node
  while read -r node; do
    srun --overlap -N1 -n1 -w "$node" "$HF_ROOT/containers/run.sh" --engine "$HF_CONTAINER" --name "hf_${SLURM_JOB_ID}" \
      --detach "$HF_IMAGE" sleep infinity
  done < <(hf_nodes)
}

hf_stop_containers() {
  [[ -z $HF_CONTAINER ]] && return 0
  local node
  while read -r node; do
    srun --overlap -N1 -n1 -w "$node" "$HF_CONTAINER" rm -f "hf_${SLURM_JOB_ID}" >/dev/null 2>&1 || true
  done < <(hf_nodes)
}

# Start the head on this node and a worker on every other node; HF_RAY_PIDS holds their job-step PIDs.
hf_ray_start() {
  local nodes=(); mapfile -t nodes < <(hf_nodes)
  local i args=()
  HF_RAY_PIDS=()
  for i in "${!nodes[@]}"; do
    mapfile -t args < <(hf_ray_args "$i" "${nodes[$i]}")
    hf_on_node "${nodes[$i]}" "$HF_PYTHON" -m ray.scripts.scripts start "${args[@]}"
    HF_RAY_PIDS+=("$HF_LAST_PID")
    if (( i == 0 )); then sleep 0.5; fi  # the head's GCS first; the workers retry until it answers
  done
}

# Poll until every node of the allocation is alive in the cluster (by node name), else name the missing.
hf_ray_wait() {
  local expect; expect=$(hf_nodes | paste -sd, -)
  "$HF_PYTHON" -m hybridflow.tools.ray_nodes --address "$(hf_head_ip):$(hf_port_base)" --expect "$expect" \
    --timeout "$HF_NODE_WAIT_S"
}

# Stop exactly the Ray processes this job started: their job steps (Slurm kills each step's processes);
# then each node's temp dir of this job.
hf_ray_stop() {
  local pid node i watchdog
  ((${#HF_RAY_PIDS[@]})) || { rm -rf "$(hf_job_dir)"; return 0; }
  for pid in "${HF_RAY_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  # Bounded waits (a cancelled job is SIGKILLed after Slurm's KillWait, 30 s by default): for the steps'
  # srun clients (killed after 10 s), then for every process of this job's Ray to leave the job dir (Ray
  # nodes drain after SIGTERM). Only waits: nothing is killed by name.
  ( sleep 10; kill -KILL "${HF_RAY_PIDS[@]}" 2>/dev/null ) &
  watchdog=$!
  wait "${HF_RAY_PIDS[@]}" 2>/dev/null || true
  kill "$watchdog" 2>/dev/null || true
  HF_RAY_PIDS=()
  for i in $(seq 10); do
    pgrep -f -- "$(hf_job_dir)/" >/dev/null || break
    sleep 0.5
  done
  rm -rf "$(hf_job_dir)"
  # Other nodes' dirs through a last short step each (a cancelled job can start none: Slurm's epilog or
  # the node's tmpfs cleanup has to take those).
  while read -r node; do
    [[ $node == "${SLURMD_NODENAME:-}" ]] && continue
    timeout 5 srun --overlap -N1 -n1 -w "$node" rm -rf "$(hf_job_dir)" 2>/dev/null || true
  done < <(hf_nodes)
}
