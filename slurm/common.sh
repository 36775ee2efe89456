#!/usr/bin/env bash
# Shell functions the launchers source: the allocation, a job-private Ray cluster (explicit ports, own temp
# dir, token auth), waiting for its nodes, stopping exactly what was started, NCCL/RCCL presets.
# Every function is prefixed hybridflow_; configuration comes from HYBRIDFLOW_* variables (defaults below;
# HF_* belongs to Hugging Face, e.g. HF_HOME, and is only passed through).
# shellcheck shell=bash

HYBRIDFLOW_ROOT=${HYBRIDFLOW_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
HYBRIDFLOW_CONTAINER=${HYBRIDFLOW_CONTAINER:-}    # podman or docker: run each node's part in a container
HYBRIDFLOW_IMAGE=${HYBRIDFLOW_IMAGE:-}            # the image for container mode (containers/Dockerfile.*)
HYBRIDFLOW_NODE_WAIT_S=${HYBRIDFLOW_NODE_WAIT_S:-180}  # every node must register with the Ray head within this
HYBRIDFLOW_DASHBOARD_HOST=${HYBRIDFLOW_DASHBOARD_HOST:-127.0.0.1}

# The Python that runs Ray and the driver on every node: the repository's .venv (what `make run` installs)
# when it exists, else python3 from PATH; in container mode the image's (its venv is first on PATH).
hybridflow_default_python() {
  if [[ -z $HYBRIDFLOW_CONTAINER && -x $HYBRIDFLOW_ROOT/.venv/bin/python ]]; then
    echo "$HYBRIDFLOW_ROOT/.venv/bin/python"
  else
    echo python3
  fi
}
HYBRIDFLOW_PYTHON=${HYBRIDFLOW_PYTHON:-$(hybridflow_default_python)}

ray_step_pids=()   # job-step PIDs of the Ray processes this job started
last_step_pid=""   # the job step hybridflow_on_node started last

hybridflow_log() { printf '[hybridflow %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
hybridflow_die() { hybridflow_log "error: $*"; exit 2; }

# The allocation's nodes, one per line, head first.
hybridflow_nodes() { scontrol show hostnames "${SLURM_JOB_NODELIST:?not inside a Slurm allocation}"; }

# This node's address as the other nodes reach it (HYBRIDFLOW_HEAD_IP overrides).
hybridflow_head_ip() {
  if [[ -n ${HYBRIDFLOW_HEAD_IP:-} ]]; then echo "$HYBRIDFLOW_HEAD_IP"; return; fi
  hostname -I | awk '{print $1}'
}

# GPUs on a node of this job (0 on CPU clusters).
hybridflow_gpus_per_node() {
  local g=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-0}}
  echo "${g##*:}"   # "a100:8" -> 8
}

# Ports: a base per job so that jobs sharing a node never collide; node i gets its own block.
hybridflow_port_base() { echo $(( 20000 + (${SLURM_JOB_ID:-$$} % 400) * 100 )); }

# A private directory per job: Ray's temp dir (short: Unix socket paths are limited), the auth token.
hybridflow_job_dir() { echo "${HYBRIDFLOW_JOB_DIR:-/tmp/hybridflow_${SLURM_JOB_ID:-$$}}"; }

# The container of this job on every node (container mode).
hybridflow_container_name() { echo "hybridflow_${SLURM_JOB_ID:-$$}"; }

# Token auth: a token created for this job, readable by the user only, in a folder every node sees
# (HYBRIDFLOW_SHARED_DIR, default ~/.hybridflow: home directories are shared on clusters).
# No Python needed on the host for it (in container mode only the image has hybridflow's).
hybridflow_token_dir() { echo "${HYBRIDFLOW_SHARED_DIR:-$HOME/.hybridflow}/jobs/${SLURM_JOB_ID:-$$}"; }
hybridflow_make_token() {
  local dir; dir=$(hybridflow_token_dir)
  (umask 077 && mkdir -p "$dir" && od -An -N32 -tx1 /dev/urandom | tr -d ' \n' > "$dir/auth_token")
  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$dir/auth_token"
}

# NCCL (CUDA) / RCCL (ROCm) presets; every value the user exported wins. NCCL_IB_GID_INDEX is left to
# NCCL's auto-detection (it finds the RoCEv2 GID on RoCE fabrics; a fixed index breaks those where it is
# elsewhere): a value you export is passed to every node.
hybridflow_comm_env() {
  if [[ -e /dev/kfd ]]; then  # ROCm: ROCR/HIP visibility, not CUDA's
    export NCCL_MIN_NCHANNELS=${NCCL_MIN_NCHANNELS:-112}
    [[ -n ${CUDA_VISIBLE_DEVICES:-} && -z ${HIP_VISIBLE_DEVICES:-} ]] && export HIP_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES
  fi
  if [[ -d /dev/infiniband ]]; then
    export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}
    [[ -n ${HYBRIDFLOW_IB_HCA:-} ]] && export NCCL_IB_HCA=${NCCL_IB_HCA:-$HYBRIDFLOW_IB_HCA}
  fi
  if [[ -n ${HYBRIDFLOW_SOCKET_IFNAME:-} ]]; then
    export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$HYBRIDFLOW_SOCKET_IFNAME}
    export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$HYBRIDFLOW_SOCKET_IFNAME}
  fi
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
  return 0
}

# What every Ray process and the driver get, on every node and in containers: the user's settings of the
# libraries hybridflow runs on, by prefix (HF_ is Hugging Face's), and a few single names.
forward_prefixes=(NCCL_ RCCL_ UCX_ GLOO_ PYTORCH_ TORCH_ CUDA_ NVTE_ HIP_ HSA_ ROCM_ VLLM_ RAY_ HF_ TRANSFORMERS_
  TOKENIZERS_ WANDB_ HYBRIDFLOW_)
forward_names=(PYTHONPATH OMP_NUM_THREADS)
# Device visibility is each node's own (Slurm sets it per node): never copied from this node.
per_node_names=(CUDA_VISIBLE_DEVICES HIP_VISIBLE_DEVICES ROCR_VISIBLE_DEVICES GPU_DEVICE_ORDINAL)

hybridflow_forwarded() {
  local name=$1 prefix
  [[ " ${per_node_names[*]} " == *" $name "* ]] && return 1
  [[ " ${forward_names[*]} " == *" $name "* ]] && return 0
  for prefix in "${forward_prefixes[@]}"; do [[ $name == "$prefix"* ]] && return 0; done
  return 1
}

# The exported variables to forward, as NAME=value records separated by NUL (values may hold newlines).
hybridflow_pass_env() {
  local name
  while read -r name; do
    if hybridflow_forwarded "$name"; then printf '%s=%s\0' "$name" "${!name}"; fi
  done < <(compgen -e)
}

# The command prefix (NUL-separated words) that runs a process with the forwarded variables: `env NAME=value
# ...`, or in container mode `$HYBRIDFLOW_CONTAINER exec --env=NAME=value ...` into this job's container (an
# exec'd process inherits nothing from the caller). The per-node names go by name only: the engine then takes
# the calling process's value, i.e. the one Slurm set for the job step on that node.
hybridflow_env_prefix() {
  local envs=()
  mapfile -d '' -t envs < <(hybridflow_pass_env)
  if [[ -n $HYBRIDFLOW_CONTAINER ]]; then
    printf '%s\0' "$HYBRIDFLOW_CONTAINER" exec "${envs[@]/#/--env=}" "${per_node_names[@]/#/--env=}" \
      "$(hybridflow_container_name)"
  else
    printf '%s\0' env "${envs[@]}"
  fi
}

# The `ray start` arguments of node number $1 (0 = head) named $2; ports from the job's base.
hybridflow_ray_args() {
  local i=$1 name=$2 base; base=$(hybridflow_port_base)
  local p=$(( base + 10 + i * 10 )) w=$(( base + 1000 + i * 200 ))
  local cpus=${HYBRIDFLOW_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-1}} gpus; gpus=$(hybridflow_gpus_per_node)
  # Per node: several "nodes" may share a machine (and Ray's default /tmp/ray may hold a stranger's cluster).
  local args=(--node-name="$name" --num-cpus="$cpus" --num-gpus="$gpus" --block --disable-usage-stats
    --temp-dir="$(hybridflow_job_dir)/r$i"
    "--node-manager-port=$p" "--object-manager-port=$(( p + 1 ))" "--metrics-export-port=$(( p + 2 ))"
    "--dashboard-agent-listen-port=$(( p + 3 ))" "--dashboard-agent-grpc-port=$(( p + 4 ))"
    "--runtime-env-agent-port=$(( p + 5 ))" "--min-worker-port=$w" "--max-worker-port=$(( w + 199 ))")
  if (( i == 0 )); then
    args+=(--head --port="$base" --ray-client-server-port=$(( base + 1 )) --node-ip-address="$(hybridflow_head_ip)"
      --include-dashboard="${HYBRIDFLOW_DASHBOARD:-false}" --dashboard-host="$HYBRIDFLOW_DASHBOARD_HOST"
      --dashboard-port=$(( base + 2 )))
  else
    args+=(--address="$(hybridflow_head_ip):$base")
  fi
  printf '%s\n' "${args[@]}"
}

# Run "$@" on node $1 as a background job step (inside this job's container in container mode).
hybridflow_on_node() {
  local node=$1 prefix=(); shift
  mapfile -d '' -t prefix < <(hybridflow_env_prefix)
  srun --overlap -N1 -n1 -w "$node" "${prefix[@]}" "$@" &
  last_step_pid=$!
}

# Container mode: one container per node, started before Ray (containers/run.sh has the device flags; it
# mounts the current directory, i.e. this repository, and the token's folder).
hybridflow_start_containers() {
  [[ -z $HYBRIDFLOW_CONTAINER ]] && return 0
  [[ -n $HYBRIDFLOW_IMAGE ]] || \
    hybridflow_die "HYBRIDFLOW_CONTAINER=$HYBRIDFLOW_CONTAINER needs HYBRIDFLOW_IMAGE (an image built from containers/)"
  local node
  while read -r node; do
    srun --overlap -N1 -n1 -w "$node" "$HYBRIDFLOW_ROOT/containers/run.sh" --engine "$HYBRIDFLOW_CONTAINER" \
      --name "$(hybridflow_container_name)" --volume "$(hybridflow_token_dir)" --detach "$HYBRIDFLOW_IMAGE" sleep infinity
  done < <(hybridflow_nodes)
}

hybridflow_stop_containers() {
  [[ -z $HYBRIDFLOW_CONTAINER ]] && return 0
  local node
  while read -r node; do
    srun --overlap -N1 -n1 -w "$node" "$HYBRIDFLOW_CONTAINER" rm -f "$(hybridflow_container_name)" >/dev/null 2>&1 || true
  done < <(hybridflow_nodes)
}

# Start the head on this node and a worker on every other node; ray_step_pids holds their job-step PIDs.
hybridflow_ray_start() {
  local nodes=(); mapfile -t nodes < <(hybridflow_nodes)
  local i args=()
  ray_step_pids=()
  for i in "${!nodes[@]}"; do
    mapfile -t args < <(hybridflow_ray_args "$i" "${nodes[$i]}")
    hybridflow_on_node "${nodes[$i]}" "$HYBRIDFLOW_PYTHON" -m ray.scripts.scripts start "${args[@]}"
    ray_step_pids+=("$last_step_pid")
    if (( i == 0 )); then sleep 0.5; fi  # the head's GCS first; the workers retry until it answers
  done
}

# Poll until every node of the allocation is alive in the cluster (by node name), else name the missing.
hybridflow_ray_wait() {
  local expect; expect=$(hybridflow_nodes | paste -sd, -)
  local prefix=(); mapfile -d '' -t prefix < <(hybridflow_env_prefix)
  "${prefix[@]}" "$HYBRIDFLOW_PYTHON" -m hybridflow.tools.ray_nodes \
    --address "$(hybridflow_head_ip):$(hybridflow_port_base)" --expect "$expect" --timeout "$HYBRIDFLOW_NODE_WAIT_S"
}

# Stop exactly the Ray processes this job started: their job steps (Slurm kills each step's processes);
# then each node's temp dir of this job.
hybridflow_ray_stop() {
  local pid node i watchdog
  ((${#ray_step_pids[@]})) || { rm -rf "$(hybridflow_job_dir)"; return 0; }
  for pid in "${ray_step_pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  # Bounded waits (a cancelled job is SIGKILLed after Slurm's KillWait, 30 s by default): for the steps'
  # srun clients (killed after 10 s), then for every process of this job's Ray to leave the job dir (Ray
  # nodes drain after SIGTERM). Only waits: nothing is killed by name.
  ( sleep 10; kill -KILL "${ray_step_pids[@]}" 2>/dev/null ) &
  watchdog=$!
  wait "${ray_step_pids[@]}" 2>/dev/null || true
  kill "$watchdog" 2>/dev/null || true
  ray_step_pids=()
  for i in $(seq 10); do
    pgrep -f -- "$(hybridflow_job_dir)/" >/dev/null || break
    sleep 0.5
  done
  rm -rf "$(hybridflow_job_dir)"
  # Other nodes' dirs through a last short step each (a cancelled job can start none: Slurm's epilog or
  # the node's tmpfs cleanup has to take those).
  while read -r node; do
    [[ $node == "${SLURMD_NODENAME:-}" ]] && continue
    timeout 5 srun --overlap -N1 -n1 -w "$node" rm -rf "$(hybridflow_job_dir)" 2>/dev/null || true
  done < <(hybridflow_nodes)
}
