#!/usr/bin/env bash
# Tests of the Python client (client/python) against the real daemon binary
# ${KVCD_BUILD_DIR:-build}/server/kvcd (build it first: scripts/build.sh kvcd).
# Creates (or reuses) a virtual environment under .cache/python-venv, pip-installs
# ./client/python (stubs generated from proto/ at build time) and pytest into it, and runs
# client/python/tests. Arguments are passed to pytest (e.g. -k stories, -x).
# The install is redone only when client/python or proto/ changed since the last one (a
# stamp of their contents in the venv). `--prepare` only makes the venv ready (no daemon
# needed: scripts/test.sh runs it while the C++ builds run).
# Needs PyPI (or a pip configured with --find-links) for grpcio, protobuf, numpy, pytest,
# setuptools and grpcio-tools. torch is optional and not installed here: its tests skip.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${KVCD_BUILD_DIR:-build}
export KVCD_BUILD_DIR=$build
prepare_only=0
[[ ${1:-} == --prepare ]] && { prepare_only=1; shift; }
if ((!prepare_only)) && [[ -z "${KVCD_BINARY:-}" && ! -x "$build/server/kvcd" ]]; then
  echo "test-python: no daemon binary at $build/server/kvcd (run scripts/build.sh kvcd)" >&2
  exit 1
fi
venv=${KVCD_PY_VENV:-.cache/python-venv}
[[ $venv == /* ]] || venv=$PWD/$venv
py=${PYTHON:-python3}
if [[ ! -x "$venv/bin/python" ]]; then
  if ! "$py" -c 'import venv, ensurepip' 2>/dev/null; then
    echo "test-python: installing python3-venv"
    sudo_cmd=()
    [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
    "${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    "${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv
    py=/usr/bin/python3
  fi
  mkdir -p "$(dirname "$venv")"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
# The package as a user installs it: pip install ./client/python (PEP 517 build in an
# isolated environment), again whenever a file of client/python or proto/ changed (tracked
# or not: the stamp hashes their contents).
stamp=$venv/.kvcd-client-stamp
sources=$({ git ls-files -co --exclude-standard client/python proto 2>/dev/null ||
  find client/python proto -type f; } | grep -v '/tests/' | sort | xargs sha256sum | sha256sum)
if [[ ! -f $stamp || $(cat "$stamp") != "$sources" ]]; then
  "$venv/bin/python" -m pip install -q ./client/python pytest
  rm -rf client/python/build client/python/src/kvcd.egg-info  # in-tree build leftovers
  echo "$sources" >"$stamp"
else
  echo "test-python: client/python and proto/ unchanged since the last install; reusing $venv"
fi
((!prepare_only)) || exit 0
cd client/python
exec "$venv/bin/python" -m pytest -p no:cacheprovider -q -rs "$@" tests
