#!/usr/bin/env bash
# The cluster's failure tests (docs/cluster.md "When a part fails"): tests/cluster/failures.py
# through kvcd.cluster's client, in the topology of scripts/cluster-topology.sh (4 daemons on
# the CPU backend, etcd and Redis, each in a network namespace of its own), with a member
# SIGKILLed, a member cut off, Redis restarted empty and etcd restarted empty. Lease TTL 3 s
# (the bounds scale with it). Bounded: 170 s for everything, teardown included.
# Needs scripts/build.sh kvcd and the Python client's venv (scripts/test-python.sh --prepare,
# run here; quick when nothing changed). Root and network namespaces: where they are not
# permitted, cluster-topology.sh says why and this exits 0 (SKIP).
#   scripts/test-cluster.sh [--json FILE] [--markdown FILE]   (paths from the repository root)
# The report: per phase requests, errors, wrong results, hit rate, failovers, measured bounds.
set -uo pipefail
cd "$(dirname "$0")/.."
build=${KVCD_BUILD_DIR:-build}
[[ -x $build/server/kvcd ]] || { echo "test-cluster: $build/server/kvcd is missing: run scripts/build.sh kvcd" >&2; exit 1; }
./scripts/test-python.sh --prepare >/dev/null || { echo "test-cluster: the Python venv failed" >&2; exit 1; }
py=${KVCD_PY_VENV:-.cache/python-venv}/bin/python
[[ $py == /* ]] || py=$PWD/$py
exec ./scripts/cluster-topology.sh --daemons 4 --lease-ttl 3 --load-interval 250 --timeout 170 \
  -- "$py" "$PWD/tests/cluster/failures.py" "$@"
