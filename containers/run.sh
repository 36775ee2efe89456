#!/usr/bin/env bash
# Start a hybridflow image with podman or docker and the flags its GPUs need.
#     containers/run.sh [--engine podman|docker] [--gpu cuda|rocm|none] [--name NAME] [--detach]
#                       [--shm-size SIZE] [--volume DIR ...] [--dry-run] IMAGE [COMMAND ...]
# Host network (Ray and NCCL reach the other nodes directly); the current directory, and each --volume DIR,
# mounted at the same path (the current directory is the work dir); /dev/infiniband passed when present.
# --dry-run prints the command.
set -euo pipefail

engine="" gpu="" name="" detach=0 shm=16g dry=0 volumes=()
while (( $# )); do
  case $1 in
    --engine) engine=$2; shift 2 ;;
    --gpu) gpu=$2; shift 2 ;;
    --name) name=$2; shift 2 ;;
    --detach) detach=1; shift ;;
    --shm-size) shm=$2; shift 2 ;;
    --volume) volumes+=(-v "$2:$2"); shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
    --*) echo "containers/run.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
(( $# >= 1 )) || { echo "containers/run.sh: an IMAGE is required (see --help)" >&2; exit 2; }
image=$1; shift

if [[ -z $engine ]]; then
  if command -v podman >/dev/null; then engine=podman; elif command -v docker >/dev/null; then engine=docker
  else echo "containers/run.sh: neither podman nor docker found" >&2; exit 2; fi
fi
[[ $engine == podman || $engine == docker ]] || { echo "containers/run.sh: --engine must be podman or docker" >&2; exit 2; }
if [[ -z $gpu ]]; then
  if [[ -e /dev/kfd ]]; then gpu=rocm; elif [[ -e /dev/nvidiactl ]]; then gpu=cuda; else gpu=none; fi
fi

cmd=("$engine" run --rm --network host --shm-size "$shm" --ulimit memlock=-1:-1 -v "$PWD:$PWD" "${volumes[@]}" -w "$PWD")
case $gpu in
  cuda) if [[ $engine == podman ]]; then cmd+=(--device nvidia.com/gpu=all); else cmd+=(--gpus all); fi ;;
  rocm) cmd+=(--device /dev/kfd --device /dev/dri --group-add video --security-opt seccomp=unconfined) ;;
  none) ;;
  *) echo "containers/run.sh: --gpu must be cuda, rocm or none" >&2; exit 2 ;;
esac
[[ -d /dev/infiniband ]] && cmd+=(--device /dev/infiniband --cap-add IPC_LOCK)
[[ -n $name ]] && cmd+=(--name "$name")
(( detach )) && cmd+=(--detach)
cmd+=("$image" "$@")

if (( dry )); then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
exec "${cmd[@]}"
