#!/usr/bin/env bash
# Set up dpcompare's whole stack in .venv/ at the repository root. Idempotent: a second run only checks
# (no package index is contacted when nothing changed since the last complete run).
#
#   bash scripts/setup.sh          torch (CPU wheel), DeepSpeed, mpi4py + Open MPI, Horovod, transformers, test tools
#
# Order matters: torch goes in first, alone and pinned. A bare `torch` requirement (ours or another
# package's) with no torch installed pulls the newest CUDA build, several GB.
#
# Horovod 0.28.1 (its last release) does not build as released against torch >= 2.1 (C++14) or with GCC 13 and
# CMake 4: scripts/build_horovod.sh patches and builds the sdist (scripts/patch_horovod.sh says what and why). The
# wheel is cached per torch version (the extension is tied to torch's ABI) and reused on the next run.
#
# Environment knobs:
#   DPCOMPARE_PYTHON      interpreter to build the venv from (default: python3.11, else python3)
#   DPCOMPARE_TORCH       torch requirement (default: torch==2.13.0; set it to your CUDA build's pin)
#   DPCOMPARE_NO_HOROVOD=1  skip the Horovod build (compare then lists horovod as unavailable)
#   HOROVOD_NCCL_HOME, CUDA_HOME  NCCL and the CUDA toolkit for Horovod's NCCL operations (CUDA torch only; found
#                         from torch's nvidia-nccl wheel and nvcc when unset)
#   DPCOMPARE_NO_TORCHVISION=1  do not try torchvision (resnet models then use dpcompare's own definition)
#   DPCOMPARE_CACHE       where built wheels are cached (default: ~/.cache/dpcompare)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venv="$root/.venv"
cache="${DPCOMPARE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dpcompare}"
torch_req="${DPCOMPARE_TORCH:-torch==2.13.0}"
horovod_version=0.28.1

say() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 2; }

# --- Python --------------------------------------------------------------------------------------
py="${DPCOMPARE_PYTHON:-}"
if [ -z "$py" ]; then
  if command -v python3.11 >/dev/null 2>&1; then py=python3.11; else py=python3; fi
fi
command -v "$py" >/dev/null 2>&1 || die "no Python interpreter '$py' found: install Python 3.10-3.12 or set DPCOMPARE_PYTHON"
"$py" -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] <= (3, 12) else 1)' \
  || die "$py is $("$py" -V 2>&1); dpcompare needs Python 3.10-3.12 (torch and DeepSpeed wheels): set DPCOMPARE_PYTHON"

# --- system packages: an MPI for mpi4py and Horovod ------------------------------------------------
if ! command -v mpicxx >/dev/null 2>&1 || ! command -v mpirun >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing Open MPI (Debian: openmpi-bin libopenmpi-dev)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null && command -v apt-get >/dev/null 2>&1; then
    say "installing Open MPI with sudo (Debian: openmpi-bin libopenmpi-dev)"
    sudo apt-get update -qq
    sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
  else
    die "Open MPI is missing (no mpicxx/mpirun) and this user cannot install system packages: ask an administrator for 'openmpi-bin libopenmpi-dev' (Debian) or load your cluster's MPI module, then rerun"
  fi
fi
for tool in cmake g++; do
  command -v "$tool" >/dev/null 2>&1 || die "'$tool' is missing; it is needed to build Horovod: install it (Debian: apt-get install $tool) or set DPCOMPARE_NO_HOROVOD=1"
done

# --- a C++ compiler for --compile: TorchInductor builds its CPU kernels with $CXX, else g++ (Triton its GPU launcher) ----
cxx=${CXX:-g++}
if command -v "$cxx" >/dev/null 2>&1 && "$cxx" --version >/dev/null 2>&1; then
  say "C++ compiler for --compile: $(command -v "$cxx")"
else
  say "no working C++ compiler ('$cxx'): runs with --compile will refuse to start; install one (Debian/Ubuntu: apt-get install g++; RHEL/Fedora: dnf install gcc-c++; conda: conda install -c conda-forge gxx) or set CXX=/path/to/g++"
fi

# --- venv ------------------------------------------------------------------------------------------
if [ ! -x "$venv/bin/python" ]; then
  say "creating $venv with $py"
  "$py" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)

# A second run only checks: when nothing that decides the install changed since the last complete run
# (this script, pyproject.toml, the torch pin) and everything imports, no package index is contacted.
stamp="$venv/.dpcompare-setup"
fingerprint=$(cat "$root/scripts/setup.sh" "$root/pyproject.toml" | sha256sum | cut -c1-16)-$torch_req-${DPCOMPARE_NO_HOROVOD:-0}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$fingerprint" ] \
    && "$venv/bin/python" -c 'import torch, dpcompare, deepspeed, mpi4py, transformers, pytest, pytest_benchmark, xdist, hypothesis, sklearn, lion_pytorch, jsonschema, rich, importlinter' &>/dev/null; then
  say "already set up (nothing changed since the last run; remove $stamp to force a reinstall)"
  say "ready: $venv"
  exit 0
fi
rm -f "$stamp"

"${pip[@]}" install --upgrade "pip>=23" "setuptools>=69,<80" wheel

if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  say "installing $torch_req first (pinned: a bare torch requirement pulls a CUDA build)"
  "${pip[@]}" install "$torch_req"
fi
torch_version=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
say "torch $torch_version"

# The project with its extras; torch is already satisfied, so nothing here can replace it.
"${pip[@]}" install -e ".[deepspeed,mpi,hf,test]"

# --- Horovod -----------------------------------------------------------------------------------------
# On a CUDA torch Horovod is built with NCCL operations (HOROVOD_GPU_OPERATIONS=NCCL), which needs NCCL's headers
# and library and a CUDA toolkit (nvcc): NCCL from HOROVOD_NCCL_HOME, else the nvidia-nccl-cu* wheel that CUDA torch
# installs; the toolkit from CUDA_HOME, else the nvcc on PATH, else /usr/local/cuda. When one is missing Horovod is
# built without NCCL (its GPU tensors then go through gloo or MPI on the host) and this says why.
horovod_gpu_env=()
horovod_nccl=0
with_nccl=""
if [ "${DPCOMPARE_NO_HOROVOD:-0}" != 1 ]; then
  # scripts/build_horovod.sh finds NCCL and the toolkit (and says why not); its environment is also what it builds with.
  mapfile -t horovod_gpu_env < <(bash "$root/scripts/build_horovod.sh" --nccl-env "$venv/bin/python")
  if [ ${#horovod_gpu_env[@]} -gt 0 ]; then
    horovod_nccl=1
    with_nccl=" and NCCL"
  fi
fi

horovod_ok() {
  HOROVOD_NCCL_WANTED=$horovod_nccl "$venv/bin/python" - <<'EOF' 2>/dev/null
import os, sys
import torch, horovod.torch as hvd
nccl = os.environ["HOROVOD_NCCL_WANTED"] == "1"
sys.exit(0 if hvd.gloo_built() and hvd.mpi_built() and (hvd.nccl_built() or not nccl) else 1)
EOF
}
if [ "${DPCOMPARE_NO_HOROVOD:-0}" = 1 ]; then
  say "skipping Horovod (DPCOMPARE_NO_HOROVOD=1)"
elif horovod_ok; then
  say "horovod $horovod_version already built against this torch"
else
  wheel_dir="$cache/wheels/horovod-$horovod_version-torch-$torch_version-$("$venv/bin/python" -c 'import sys; print("py%d%d" % sys.version_info[:2])')${with_nccl:+-nccl}"
  if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
    say "building Horovod $horovod_version against torch $torch_version (C++17; 3-12 minutes, once)"
    build=$(mktemp -d)
    trap 'rm -rf "$build"' EXIT
    "${pip[@]}" download --no-deps --no-binary :all: -d "$build" "horovod==$horovod_version"
    "${pip[@]}" install cloudpickle psutil pyyaml packaging cffi
    # scripts/build_horovod.sh patches the sdist (C++17, GCC 13's headers) and builds it (CMake 4's policy floor,
    # NCCL found as above, gloo, MPI where mpicxx is).
    env "${horovod_gpu_env[@]}" HOROVOD_PIP_VERBOSITY=-q \
      bash "$root/scripts/build_horovod.sh" "$venv/bin/python" "$build/horovod-$horovod_version.tar.gz" "$wheel_dir" \
      || die "building Horovod failed (log above); set DPCOMPARE_NO_HOROVOD=1 to go on without it"
  fi
  "${pip[@]}" install --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
  "${pip[@]}" install cloudpickle psutil pyyaml packaging cffi
  horovod_ok || die "Horovod installed but does not load with gloo and MPI$with_nccl: see '$venv/bin/horovodrun --check-build'"
  say "horovod $horovod_version built with gloo and MPI$with_nccl"
fi

# --- torchvision (optional: dpcompare has its own ResNet with torchvision's layout) ---------------------------
# Only a build matching torch works: the plain PyPI wheel is a CUDA build and does not import on a CPU torch.
if [ "${DPCOMPARE_NO_TORCHVISION:-0}" != 1 ] && ! "$venv/bin/python" -c 'import torchvision.models' 2>/dev/null; then
  tv_req=$("$venv/bin/python" -c 'import torch; v = torch.__version__; minor = int(v.split("+")[0].split(".")[1]); local = v.partition("+")[2]; print(f"torchvision==0.{minor + 15}.*" + (f" --index-url https://download.pytorch.org/whl/{local}" if local else ""))')
  # shellcheck disable=SC2086  # the requirement and its index are separate words on purpose
  if PIP_FIND_LINKS= "${pip[@]}" install --no-deps --timeout 20 --retries 1 $tv_req 2>/dev/null \
      && "$venv/bin/python" -c 'import torchvision.models' 2>/dev/null; then
    say "torchvision installed ($tv_req)"
  else
    "${pip[@]}" uninstall -y torchvision >/dev/null 2>&1 || true
    say "torchvision's build for this torch could not be installed ($tv_req): --model resnet18/resnet50 use dpcompare's own definition of the same network"
  fi
fi

# --- DeepSpeed's CPU communication op --------------------------------------------------------------------------
# DeepSpeed JIT-compiles a shared-memory all-reduce op on its first start on a CPU (~40-70 s on two cores), cached
# under TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions). Build it here, once, so the first compare does not
# spend that inside its runs. On a CUDA build the op does not apply and this does nothing.
# With the environment's bin first on PATH, as dpcompare puts it for the runs it starts: DeepSpeed builds with the
# first ninja on PATH, and the environment's (PyPI) and a system ninja each take the other's build as stale.
if "$venv/bin/python" -c 'import deepspeed' 2>/dev/null; then
  if PATH="$venv/bin:$PATH" "$venv/bin/python" -c 'from deepspeed.comm.torch import build_shm_op; build_shm_op()' >/dev/null 2>&1; then
    say "DeepSpeed's CPU communication op is built (cached under ${TORCH_EXTENSIONS_DIR:-~/.cache/torch_extensions})"
  else
    say "DeepSpeed's CPU communication op could not be built here: DeepSpeed will try again on its first start"
  fi
fi

echo "$fingerprint" >"$stamp"
say "ready: $venv"
