#!/usr/bin/env bash
# Patch Horovod 0.28.1's unpacked sdist (its last release) so that it builds with today's toolchains:
#
#   bash scripts/patch_horovod.sh SRC_DIR
#
#   - C++17 for its torch extension: torch >= 2.1 headers need it, and both CMAKE_CXX_STANDARD lines say 14
#     (horovod/horovod#3996, fixed on master, never released);
#   - the standard headers GCC 13 no longer pulls in transitively: <string> in common/group_table.h and <stdexcept>
#     in common/common.h (std::string and std::logic_error are "not a member of std" there, seen building against
#     torch 2.11 with GCC 13.3 on a CUDA 13 machine).
# CMake 4's refusal of the bundled gloo's cmake_minimum_required(< 3.5) is answered by the builder's environment
# (CMAKE_POLICY_VERSION_MINIMUM=3.5), not here. Exit 1, naming the line, where the sdist no longer has what is patched.
set -euo pipefail
src=$1
fail() { printf '[patch_horovod] %s\n' "$*" >&2; exit 1; }
sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt" \
  || fail "horovod/torch/CMakeLists.txt no longer has the C++14 line raised to 17"
add_include() {  # add_include FILE HEADER ANCHOR: '#include <HEADER>' before the line '#include <ANCHOR>'
  local file="$src/$1"
  grep -q "^#include <$2>" "$file" && return 0
  grep -q "^#include <$3>" "$file" || fail "$1 no longer includes <$3>, before which <$2> goes"
  sed -i "0,/^#include <$3>/s//#include <$2>\n#include <$3>/" "$file"
}
add_include horovod/common/group_table.h string unordered_map
add_include horovod/common/common.h stdexcept string
