#!/usr/bin/env bash
# Installs kvcd's build and test dependencies from Debian 12 packages (idempotent).
# CUDA (nvcc, NCCL) is optional and never installed here: with /usr/local/cuda present
# the CUDA kernels are compile-checked for sm_90, without it they are skipped.
# --no-python: skip the Python FSQ tools' venv (the main job does not use it).
set -euo pipefail
pkgs=(build-essential cmake ninja-build ccache pkg-config git curl
      libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
      prometheus-cpp-dev libgtest-dev libgmock-dev libbenchmark-dev libeigen3-dev
      libyaml-cpp-dev nlohmann-json3-dev gnuplot-nox libssl-dev openssl clang-format
      clang libclang-rt-14-dev python3-venv
      etcd-server etcd-client redis-server libhiredis-dev libzmq3-dev cppzmq-dev libmsgpack-cxx-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}"
  sudo_cmd=()
  [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  "${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# PyPI packages of the Python FSQ tools (pinned; scripts/fsq-venv.sh says where).
[[ ${1:-} == --no-python ]] || "$(dirname "$0")/fsq-venv.sh" >/dev/null
