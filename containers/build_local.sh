#!/usr/bin/env bash
# Build hybridflow's images where no container registry can be reached but Debian's packages and the Python index
# can (the CI and development machines of this project): a base image bootstrapped from Debian's packages stands in
# for the registry's (python:3.11-slim-bookworm, nvidia/cuda) through each Dockerfile's BASE argument.
#     containers/build_local.sh base          Debian bookworm (python3, make, a compiler) by mmdebstrap, imported
#                                             as $BASE_TAG (default localhost/hybridflow-base:bookworm)
#     containers/build_local.sh cpu           containers/Dockerfile.cpu on it (the install of `make run`), as
#                                             $CPU_TAG (default localhost/hybridflow:cpu)
#     containers/build_local.sh quickstart    run that image's quickstart to its first RL step (make run,
#                                             trainer.total_steps=1), printing its log's last lines
#     containers/build_local.sh cuda-python   containers/Dockerfile.cuda's "python" stage on the base (torch, vLLM,
#                                             megatron-core wheels from the Python index; no CUDA compiler here, so
#                                             no Transformer Engine or Apex build), then imports them in it
#     containers/build_local.sh all           base, cpu, quickstart, cuda-python
# Needs root, podman, runc and mmdebstrap (apt-get install podman runc mmdebstrap). On these machines podman runs
# containers with runc and explicit ulimits only: PODMAN_FLAGS holds them.
# torch's CPU build comes from the PyTorch index, which these machines cannot reach: the wheel pip finds on this
# machine's disk (PIP_FIND_LINKS) is served to the build over loopback instead.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BASE_TAG=${BASE_TAG:-localhost/hybridflow-base:bookworm}
CPU_TAG=${CPU_TAG:-localhost/hybridflow:cpu}
CUDA_PYTHON_TAG=${CUDA_PYTHON_TAG:-localhost/hybridflow:cuda-python}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
read -r -a flags <<< "${PODMAN_FLAGS:---runtime runc --ulimit nofile=1024:1024 --ulimit nproc=4096:4096}"
# The builds' pip trusts what this machine trusts: a TLS-inspecting proxy's CA is in the host's bundle, not in
# Debian's (HOST_CA_BUNDLE, mounted over the image's for every RUN step; nothing of it stays in the image).
ca=${HOST_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
build_flags=("${flags[@]}" --network host)
[[ -f $ca ]] && build_flags+=(--volume "$ca:/etc/ssl/certs/ca-certificates.crt:ro")

step() { printf '\n== %s (%s)\n' "$1" "$(date +%T)"; }

build_base() {
  step "base: mmdebstrap bookworm -> $BASE_TAG"
  local work; work=$(mktemp -d)
  mmdebstrap --variant=minbase --include=python3,python3-venv,python3-dev,make,gcc,g++,git,ca-certificates,libnuma1,procps \
    bookworm "$work/base.tar" "$MIRROR"
  podman import --change 'CMD ["/bin/bash"]' "$work/base.tar" "$BASE_TAG"
  rm -rf "$work"
}

# Serve the local wheel folder pip finds (PIP_FIND_LINKS) over loopback for the build's pip: sets links (its URL)
# and server (the server's PID), both empty where there is none.
serve_wheels() {
  links="" server=""
  local dir=${PIP_FIND_LINKS:-} port
  [[ -n $dir && -d $dir ]] || return 0
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  python3 -m http.server "$port" --bind 127.0.0.1 --directory "$dir" >/dev/null 2>&1 &
  server=$! links="http://127.0.0.1:$port/"
  sleep 1
}

build_cpu() {
  step "cpu: containers/Dockerfile.cpu on $BASE_TAG -> $CPU_TAG"
  serve_wheels
  local rc=0
  podman build "${build_flags[@]}" -f containers/Dockerfile.cpu --build-arg BASE="$BASE_TAG" \
    --build-arg PIP_FIND_LINKS="$links" -t "$CPU_TAG" . || rc=$?
  if [[ -n $server ]]; then kill "$server"; fi
  return "$rc"
}

quickstart() {
  step "quickstart: $CPU_TAG, make run to the first RL step"
  podman run --rm "${flags[@]}" --network host --shm-size 4g "$CPU_TAG" \
    make -C /opt/hybridflow run VENV=/opt/venv ARGS="trainer.total_steps=1 trainer.save_hf_at_end=false" 2>&1 |
    tee /tmp/hybridflow-container-quickstart.log | grep -E "^step |warm start:|error" | tail -n 5
  grep -q "^step    1 " /tmp/hybridflow-container-quickstart.log
}

build_cuda_python() {
  step "cuda-python: containers/Dockerfile.cuda --target python on $BASE_TAG -> $CUDA_PYTHON_TAG"
  podman build "${build_flags[@]}" -f containers/Dockerfile.cuda --target python \
    --build-arg BASE="$BASE_TAG" -t "$CUDA_PYTHON_TAG" .
  podman run --rm "${flags[@]}" "$CUDA_PYTHON_TAG" python -c '
import importlib.metadata as m, torch, vllm, megatron.core, hybridflow
print("torch", torch.__version__, "cuda", torch.version.cuda, "| vllm", vllm.__version__,
      "| megatron-core", m.version("megatron-core"), "| hybridflow imports")'
}

case ${1:-all} in
  base) build_base ;;
  cpu) build_cpu ;;
  quickstart) quickstart ;;
  cuda-python) build_cuda_python ;;
  all) build_base && build_cpu && quickstart && build_cuda_python ;;
  *) sed -n '2,20p' "$0"; exit 2 ;;
esac
