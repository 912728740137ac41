#!/usr/bin/env bash
# What a GPU machine without network needs to run experiments/gpu_check.sh, gathered here into one folder:
#
#   bash experiments/gpu_bundle.sh [DIR]        (default DIR: .whl at the repository root, ignored by git)
#
# dpcompare's own wheel (built from this checkout), DeepSpeed and the pure-Python packages it and dpcompare need that a
# CUDA image with torch usually lacks (hjson, pydantic and pydantic-core, jsonschema and its parts), cffi for
# Horovod's build, and Horovod's sdist (built there by scripts/build_horovod.sh). Wheels for CPython 3.12 on
# manylinux x86-64 (PY_VERSION to change it). About 12 MB.
#
# On the GPU machine, from the checkout (dpcompare itself from the wheel: a checkout's dpcompare/ lacks the
# dpcompare.adapters the wheel maps, so run from another directory with the checkout after the wheels on the path):
#
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl
#   export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH; R=$PWD; cd /tmp
#   GPU_CHECK_WHEELS=$R/DIR DPCOMPARE_PY=python3 bash $R/experiments/gpu_check.sh /tmp/gc
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${1:-$root/.whl}
py=${DPCOMPARE_PY:-$root/.venv/bin/python}
ver=${PY_VERSION:-3.12}
mkdir -p "$dir"
rm -f "$dir"/dpcompare-*.whl
rm -rf "$root/build"  # setuptools reuses build/lib: a module since removed would ride along in the wheel
"$py" -m pip wheel -q --no-deps --no-build-isolation -w "$dir" "$root"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
binary=(--no-deps --only-binary=:all: --python-version "$ver" --implementation cp "${platforms[@]}" -d "$dir")
# The versions installed here, which work together (pydantic pins its pydantic-core): NAME==VERSION each.
pins=$("$py" - <<'PY'
from importlib.metadata import PackageNotFoundError, version
names = ("hjson pydantic pydantic-core annotated-types typing-inspection jsonschema jsonschema-specifications "
         "referencing rpds-py cffi pycparser").split()
for name in names:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        print(name)
PY
)
# shellcheck disable=SC2086  # one requirement per word
"$py" -m pip download -q "${binary[@]}" --platform any $pins
"$py" -m pip wheel -q --no-deps -w "$dir" "deepspeed==$("$py" -c 'from importlib.metadata import version; print(version("deepspeed"))')"
"$py" -m pip download -q --no-deps --no-binary :all: -d "$dir" horovod==0.28.1
ls -la "$dir"
