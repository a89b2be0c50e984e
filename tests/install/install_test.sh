#!/usr/bin/env bash
# The installed client library works for a program outside the tree: `cmake --install` of the
# build's dev component into a temporary prefix, then tests/install/consumer (find_package(kvcd),
# kvcd::client) configured and built against that prefix alone, and run against a real daemon
# (loopback, cpu backend): it must print the daemon's version and backend.
#   usage: install_test.sh BUILD_DIR KVCD_BINARY
set -uo pipefail
build=$1 kvcd=$2
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../../scripts/daemon-lib.sh"
dir=$(mktemp -d)
trap 'stop_kvcd >/dev/null 2>&1; rm -rf "$dir" "${KVCD_LOG_DIR:-}"' EXIT

cmake --install "$build" --prefix "$dir/prefix" --component dev >"$dir/install.log" ||
  { cat "$dir/install.log"; echo "FAIL: cmake --install"; exit 1; }
[[ -f $dir/prefix/lib/cmake/kvcd/kvcdConfig.cmake ]] || { echo "FAIL: no kvcdConfig.cmake"; exit 1; }
[[ -f $dir/prefix/include/kvcd/client/client.h ]] || { echo "FAIL: no client/client.h"; exit 1; }
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S "$here/consumer" -B "$dir/consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$dir/prefix" "${launcher[@]}" >"$dir/configure.log" 2>&1 ||
  { cat "$dir/configure.log"; echo "FAIL: the consumer does not configure"; exit 1; }
cmake --build "$dir/consumer" >"$dir/build.log" 2>&1 ||
  { cat "$dir/build.log"; echo "FAIL: the consumer does not build"; exit 1; }
# The consumer's include path reaches only the prefix, never the source or build tree.
root=$(cd "$here/../.." && pwd)
leaks=$(grep -oE -- '(-I|-isystem )[^ ]+' "$dir/consumer/build.ninja" | grep -F -e "$root" -e "$(cd "$build" && pwd)")
[[ -z $leaks ]] || { echo "FAIL: the consumer's includes reach the tree: $leaks"; exit 1; }
grep -qF -- "-isystem $dir/prefix/include/kvcd" "$dir/consumer/build.ninja" ||
  { echo "FAIL: the consumer does not include from the prefix"; exit 1; }

cat >"$dir/kvcd.yaml" <<'YAML'
listen: 127.0.0.1:0
metrics_listen: ""
backend: cpu
memory_budget: 16MiB
models:
  - builtin: tiny
    memory: 1MiB
YAML
start_kvcd "$kvcd" "$dir/kvcd.yaml" || exit 1
out=$("$dir/consumer/consumer" "$KVCD_GRPC" 2>&1) || { echo "FAIL: consumer: $out"; exit 1; }
grep -qE '^kvcd [0-9]+\.[0-9]+\.[0-9]+, backend cpu$' <<<"$out" || { echo "FAIL: consumer printed: $out"; exit 1; }
echo "install: find_package(kvcd) + kvcd::client built and ran against the daemon: $out"
