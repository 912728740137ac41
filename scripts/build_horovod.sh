#!/usr/bin/env bash
# Build Horovod 0.28.1 from its sdist against the torch of PYTHON, with NCCL operations where torch is a CUDA build
# and NCCL's headers and nvcc are found, and MPI where mpicxx is found; gloo always.
#
#   bash scripts/build_horovod.sh PYTHON SDIST WHEEL_DIR
#   bash scripts/build_horovod.sh --nccl-env PYTHON     (the NCCL environment it would build with, a line each)
#
# The sdist is patched first (scripts/patch_horovod.sh: C++17, the headers GCC 13 wants). NCCL: HOROVOD_NCCL_HOME, else torch's
# nvidia-nccl wheel (its libnccl.so.2 linked to the libnccl.so CMake looks for); CUDA: CUDA_HOME, else nvcc's.
# HOROVOD_BUILD_CUDA_CC_LIST defaults to the compute capability of the visible GPU. Exit 0 with the wheel in
# WHEEL_DIR; otherwise the build's own error and exit 1. HOROVOD_MAKEFLAGS (default -jNPROC) and HOROVOD_PIP_VERBOSITY
# (default -v: the compiler's lines in the log; -q for a quiet build) are passed on.
set -euo pipefail
say() { printf '[build_horovod] %s\n' "$*" >&2; }
# nccl_env PY: the environment for NCCL operations (one NAME=VALUE a line) where PY's torch is a CUDA build and
# NCCL's headers and nvcc are found; nothing, with the reason said, where they are not.
nccl_env() {
  local py=$1 torch_cuda nccl_home nvcc_path cuda_home cc
  torch_cuda=$("$py" -c 'import torch; print(torch.version.cuda or "")')
  [ -n "$torch_cuda" ] || return 0
  nccl_home="${HOROVOD_NCCL_HOME:-$("$py" -c 'import importlib.util as u; s = u.find_spec("nvidia.nccl"); print(list(s.submodule_search_locations)[0] if s else "")' 2>/dev/null)}"
  nvcc_path=$(command -v nvcc 2>/dev/null || true)
  cuda_home="${CUDA_HOME:-${nvcc_path:+$(dirname "$(dirname "$nvcc_path")")}}"
  cuda_home="${cuda_home:-/usr/local/cuda}"
  if [ -z "$nccl_home" ] || [ ! -f "$nccl_home/include/nccl.h" ]; then
    say "torch has CUDA $torch_cuda, but NCCL's headers were not found (HOROVOD_NCCL_HOME='$nccl_home'): Horovod is built WITHOUT NCCL operations; set HOROVOD_NCCL_HOME to a directory with include/nccl.h and lib/libnccl.so*"
    return 0
  fi
  if [ ! -x "$cuda_home/bin/nvcc" ]; then
    say "torch has CUDA $torch_cuda, but no CUDA toolkit was found (no $cuda_home/bin/nvcc): Horovod is built WITHOUT NCCL operations; install the CUDA toolkit matching torch (nvcc) or set CUDA_HOME"
    return 0
  fi
  # The nvidia-nccl wheel ships lib/libnccl.so.2 without the unversioned link Horovod's CMake looks for.
  if [ ! -e "$nccl_home/lib/libnccl.so" ] && [ -e "$nccl_home/lib/libnccl.so.2" ]; then
    ln -s libnccl.so.2 "$nccl_home/lib/libnccl.so"
  fi
  # The pip CUDA toolkit (nvidia/cu13: nvidia-cuda-nvcc, -runtime) has lib/ only, but nvcc.profile links from lib64/
  # (CMake's CUDA check: "cannot find -lcudadevrt", "-lcudart_static"), and libcudart.so.13 without the unversioned link
  # Horovod's FindCUDAToolkit looks for ("Could NOT find CUDAToolkit (missing: CUDA_CUDART)").
  if [ ! -e "$cuda_home/lib64" ] && [ -e "$cuda_home/lib/libcudart_static.a" ]; then
    ln -s lib "$cuda_home/lib64"
  fi
  local cudart
  cudart=$(cd "$cuda_home/lib64" 2>/dev/null && ls libcudart.so.[0-9]* 2>/dev/null | head -n 1 || true)
  if [ ! -e "$cuda_home/lib64/libcudart.so" ] && [ -n "$cudart" ]; then
    ln -s "$cudart" "$cuda_home/lib64/libcudart.so"
  fi
  cc=$("$py" -c 'import torch; print("%d%d" % torch.cuda.get_device_capability()) if torch.cuda.is_available() else print("")')
  say "torch has CUDA $torch_cuda: Horovod is built with NCCL operations (NCCL: $nccl_home, CUDA: $cuda_home, compute capability ${HOROVOD_BUILD_CUDA_CC_LIST:-${cc:-default}})"
  # NCCL_LINK=SHARED: torch's libnccl, not a static libnccl_static.a found elsewhere on the system.
  printf '%s\n' HOROVOD_GPU_OPERATIONS=NCCL "HOROVOD_NCCL_HOME=$nccl_home" "HOROVOD_CUDA_HOME=$cuda_home" \
    HOROVOD_NCCL_LINK=SHARED "HOROVOD_BUILD_CUDA_CC_LIST=${HOROVOD_BUILD_CUDA_CC_LIST:-$cc}"
}
if [ "${1:-}" = --nccl-env ]; then  # the detection alone (scripts/setup.sh asks it)
  nccl_env "$2"
  exit 0
fi
py=$1 sdist=$2 wheel_dir=$3
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
tar -xzf "$sdist" -C "$build"
src=$(echo "$build"/horovod-*)
bash "$(dirname "${BASH_SOURCE[0]}")/patch_horovod.sh" "$src"
# CMake 4 refuses the cmake_minimum_required(< 3.5) of Horovod's bundled gloo unless told the policy floor.
env_args=(HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1
          CMAKE_POLICY_VERSION_MINIMUM=3.5)
if command -v mpicxx >/dev/null 2>&1; then env_args+=(HOROVOD_WITH_MPI=1); else env_args+=(HOROVOD_WITHOUT_MPI=1); say "no mpicxx: built without MPI"; fi
mapfile -t nccl_args < <(nccl_env "$py")
env_args+=("${nccl_args[@]}")
mkdir -p "$wheel_dir"
env "${env_args[@]}" MAKEFLAGS="${HOROVOD_MAKEFLAGS:--j$(nproc)}" "$py" -m pip wheel "${HOROVOD_PIP_VERBOSITY:--v}" --no-index --no-build-isolation --no-deps -w "$wheel_dir" "$src"
