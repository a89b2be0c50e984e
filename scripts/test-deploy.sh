#!/usr/bin/env bash
# The deployment and observability checks (deploy/, see deploy/README.md). Needs kvcd and
# kvctl built (${KVCD_BUILD_DIR:-build}/server/kvcd, .../client/kvctl); installs the rest:
# Debian packages (prometheus for promtool, docker.io, debootstrap) and a venv under
# ~/.cache/kvcd/deploy-venv-<hash> (shared by clones) with the PyPI tools (helm-python-sdk, kubernetes-validate,
# grafana-foundation-sdk, pytest).
#   1. promtool check rules + promtool test rules (a unit test per alert, and each alert
#      disabled in turn must fail its test)
#   2. the committed Grafana JSON and the synced copies equal their generators' output
#   3. kustomize and Helm renders: strict schemas, assertions, equivalence, every daemon
#      example config through the chart, the cluster overlays and values (pytest); the
#      chart's helm-unittest-style suites (deploy/helm/kvcd/tests, deploy/tests/chart_unittest.py)
#   4. a real kvcd scraped by a real Prometheus: promtool check metrics, every dashboard
#      query returns data, recording rules evaluate, SIGTERM drains (pytest)
#   5. the container image: registry-free, from the kvcd and kvctl just built (no second
#      compile: build-image.sh --from-build, Dockerfile.prebuilt, whose runtime stage must be
#      Dockerfile's byte for byte), run on 127.0.0.1, kvctl, docker stop drains
#      (build-image.sh installs docker.io and debootstrap and starts dockerd when no engine
#      answers). KVCD_DEPLOY_SKIP_IMAGE=1 skips it.
#   6. with KVCD_DEPLOY_SOURCE_IMAGE=1: the release image (Dockerfile, compiled inside
#      Docker) is built and checked the same way; an image of this very commit (clean tree:
#      kvcd:<version>-<git describe>-cpu) is reused, not rebuilt
#   7. with KVCD_DEPLOY_CUDA_IMAGE=1: the CUDA image builds (compile and link for sm_90)
# `--prepare` only installs what the checks need (packages, the venv, the Docker engine and
# the base image) and needs no build (scripts/test.sh runs it while the C++ builds run).
# `--venv-path` only prints the venv's directory (installs and checks nothing).
set -uo pipefail
cd "$(dirname "$0")/.."
build=${KVCD_BUILD_DIR:-build}
prepare_only=0
[[ ${1:-} == --prepare ]] && prepare_only=1
reqs="helm-python-sdk==0.2.2 kubernetes-validate==1.37.0 grafana-foundation-sdk==1769699998!10.1.0 pytest==8.* PyYAML==6.*"
# Outside the clone, keyed by the requirements and the Python version (scripts/cached-venv.sh,
# as the vLLM venv), so clean clones reuse it; .reqs is written last, so a venv without it is
# rebuilt.
source scripts/cached-venv.sh
venv=$( { echo "$reqs"; python3 -c 'import sys; print(sys.version)'; } | cached_venv_dir deploy-venv)
venv=${KVCD_DEPLOY_VENV:-$venv}
[[ ${1:-} == --venv-path ]] && { echo "$venv"; exit 0; }
export KVCD_BIN=$PWD/$build/server/kvcd KVCTL_BIN=$PWD/$build/client/kvctl
if ((!prepare_only)); then
  for b in "$KVCD_BIN" "$KVCTL_BIN"; do
    [[ -x $b ]] || { echo "test-deploy: $b is missing: run scripts/build.sh kvcd kvctl" >&2; exit 1; }
  done
fi
command -v kubectl >/dev/null || { echo "test-deploy: kubectl (kustomize) is missing" >&2; exit 1; }

# The image step: run (a Docker engine answers, or KVCD_DEPLOY_IMAGE=1), or skipped and why.
image=run image_why=""
if [[ -n ${KVCD_DEPLOY_SKIP_IMAGE:-} ]]; then
  image=skip image_why="KVCD_DEPLOY_SKIP_IMAGE is set"
fi

pkgs=(prometheus curl python3-venv)
[[ $image == skip ]] || pkgs+=(docker.io debootstrap)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "test-deploy: installing ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
install() {
  local pins
  read -ra pins <<<"$reqs"
  "$1/bin/pip" install -q "${pins[@]}"
}
cached_venv_ensure "$venv" .reqs "$reqs" python3 install || { echo "test-deploy: pip install failed" >&2; exit 1; }
py=$venv/bin/python
export PATH=$venv/bin:$PATH
if ((prepare_only)); then
  prepared="packages, $venv"
  if [[ $image == run ]]; then
    deploy/container/build-image.sh --base-only || { echo "test-deploy: base image failed" >&2; exit 1; }
    prepared+=", Docker engine and base image"
  fi
  echo "test-deploy: prepared ($prepared)"
  exit 0
fi

passed=0 failed=0 names=()
step() {  # step NAME COMMAND...
  local name=$1 start=$SECONDS
  shift
  echo "=== test-deploy: $name"
  if "$@"; then
    passed=$((passed + 1)); names+=("PASS $name ($((SECONDS - start)) s)")
  else
    failed=$((failed + 1)); names+=("FAIL $name ($((SECONDS - start)) s)")
  fi
}
step "promtool check/test rules" bash -c \
  "promtool check rules deploy/prometheus/kvcd-rules.yaml && '$py' -m pytest -q -p no:cacheprovider deploy/tests/test_rules.py"
step "generated files up to date" bash -c \
  "'$py' deploy/grafana/generate_dashboard.py --check && '$py' deploy/tools/sync_generated.py --check"
step "kustomize + helm renders" "$py" -m pytest -q -p no:cacheprovider deploy/tests/test_kubernetes.py \
  deploy/tests/test_cluster.py
step "helm chart unit tests" "$py" deploy/tests/chart_unittest.py
step "live kvcd + prometheus" "$py" -m pytest -q -p no:cacheprovider deploy/tests/test_live_metrics.py
if [[ $image == run ]]; then
  # The test image holds the binaries just built; its runtime stage is the release one.
  runtime_stage() { sed -n '/^# --- runtime:/,$p' "$1"; }
  step "Dockerfile.prebuilt's runtime stage is Dockerfile's" \
    diff <(runtime_stage deploy/container/Dockerfile) <(runtime_stage deploy/container/Dockerfile.prebuilt)
  step "container image (from $build)" bash -o pipefail -c \
    "tag=\$(deploy/container/build-image.sh --from-build '$build' | tail -1) && deploy/tests/test_container.sh \"\$tag\""
  if [[ -n ${KVCD_DEPLOY_SOURCE_IMAGE:-} ]]; then
    # The release image (compiled inside Docker); one of this very commit (clean tree) is reused.
    build_id=$(git describe --always --dirty 2>/dev/null || echo dev)
    version=$(sed -n 's/^project(kvcd VERSION \([0-9][0-9.]*\).*/\1/p' CMakeLists.txt)
    tag="kvcd:${version}-${build_id}-cpu"  # build-image.sh's second tag: this very build
    if [[ $build_id != *-dirty && $build_id != dev ]] && docker image inspect "$tag" >/dev/null 2>&1; then
      echo "test-deploy: reusing the image $tag (built from this commit)"
      step "release container image (cached $tag)" deploy/tests/test_container.sh "$tag"
    else
      step "release container image" deploy/tests/test_container.sh
    fi
  fi
else
  echo "test-deploy: SKIP container image: $image_why"
  names+=("SKIP container image: $image_why")
fi
if [[ -n ${KVCD_DEPLOY_CUDA_IMAGE:-} ]]; then
  step "CUDA image builds" deploy/container/build-image.sh --cuda
fi
echo "--- test-deploy summary"
printf '  %s\n' "${names[@]}"
echo "test-deploy: $SECONDS s"
echo "$passed passed, $failed failed"
((failed == 0))
