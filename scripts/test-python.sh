#!/usr/bin/env bash
# Tests of the Python client (client/python) against the real daemon binary
# ${KVCD_BUILD_DIR:-build}/server/kvcd (build it first: scripts/build.sh kvcd).
# Creates (or reuses) virtual environments under .cache (the newest releases, and one pinned
# to the client's declared runtime floors), installs the client's wheel (built from its
# sdist, stubs generated from proto/) into both, and runs client/python/tests (a subset in
# the floor environment). Arguments are passed to pytest (e.g. -k stories, -x).
# The install is redone only when client/python or proto/ changed since the last one (a
# stamp of their contents in the venv). `--prepare` only makes the venv ready (no daemon
# needed: scripts/test.sh runs it while the C++ builds run).
# Needs PyPI (or a pip configured with --find-links) for grpcio, protobuf, numpy, pytest,
# setuptools, grpcio-tools and redis (kvcd.cluster). torch is optional and not installed here: its tests skip.
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
# The package as a user gets it: the wheel built from the sdist (scripts/build-python-dist.sh),
# with the newest grpcio/protobuf, and the same wheel in an environment pinned to the
# declared floors (setup.py RUNTIME_FLOORS): the client must join an environment that pins
# an older protobuf / grpcio. Both are rebuilt only when a file of client/python or proto/
# changed (tracked or not: the stamp hashes their contents).
floor=${KVCD_PY_FLOOR_VENV:-.cache/python-floor-venv}
[[ $floor == /* ]] || floor=$PWD/$floor
[[ -x "$floor/bin/python" ]] || "$venv/bin/python" -m venv "$floor"
dist=$PWD/.cache/python-dist
stamp=$venv/.kvcd-client-stamp
sources=$({ git ls-files -co --exclude-standard client/python proto 2>/dev/null ||
  find client/python proto -type f; } | grep -v '/tests/' | sort | xargs sha256sum | sha256sum)
if [[ ! -f $stamp || $(cat "$stamp") != "$sources" ]]; then
  ./scripts/build-python-dist.sh "$dist" >/dev/null
  wheel=$(ls "$dist"/kvcd-*-py3-none-any.whl)
  "$venv/bin/python" -m pip install -q --force-reinstall --no-cache-dir "$wheel" pytest==8.3.4 \
    redis==8.1.0  # kvcd.cluster's index client (the `cluster` extra)
  # The floors as the wheel declares them (Requires-Dist: name>=version -> name==version).
  floors=$("$venv/bin/python" - "$wheel" <<'PY'
import re, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
print(" ".join(f"{n}=={v}" for n, v in re.findall(r"^Requires-Dist: ([\w.-]+)>=([\d.]+)$", meta, re.M)))
PY
)
  "$floor/bin/python" -m pip install -q $floors pytest==8.3.4
  "$floor/bin/python" -m pip install -q --force-reinstall --no-deps "$wheel"
  "$floor/bin/python" -m pip check
  echo "$sources" >"$stamp"
else
  echo "test-python: client/python and proto/ unchanged since the last install; reusing $venv"
fi
((!prepare_only)) || exit 0
cd client/python
echo "test-python: floor environment ($("$floor/bin/python" -c 'import google.protobuf as p, grpc; print("protobuf", p.__version__, "grpcio", grpc.__version__)'))"
"$floor/bin/python" -W error::DeprecationWarning -m pytest -p no:cacheprovider -q \
  tests/test_api_parity.py tests/test_aio.py tests/test_errors.py tests/test_pages.py
echo "test-python: newest environment"
exec "$venv/bin/python" -m pytest -p no:cacheprovider -q -rs "$@" tests
