#!/usr/bin/env bash
# Builds the kvcd container image with no container registry: the base image is a Debian 12
# root made here with debootstrap (from the Debian archive this machine's apt uses) and
# imported into Docker; the Dockerfile then builds FROM it with the classic builder.
#
#   deploy/container/build-image.sh [--cuda] [--tag NAME:TAG]
#   deploy/container/build-image.sh --from-build BUILD_DIR [--tag NAME:TAG]
#   deploy/container/build-image.sh --base-only
#
# The first compiles kvcd and kvctl from source inside Docker (Dockerfile, Dockerfile.cuda):
# how release images are made. --from-build packs BUILD_DIR/server/kvcd and
# BUILD_DIR/client/kvctl, already built on this machine (Debian 12, like the base image),
# into the same runtime stage (Dockerfile.prebuilt), tagged kvcd-prebuilt:<git describe>-cpu:
# what the test command checks, without compiling kvcd again. --base-only only starts the
# engine and prepares the base image (scripts/test-deploy.sh --prepare runs it during the
# build).
#
# Starts dockerd if none answers. Caches the debootstrap tarball (rebuilt after
# ${KVCD_BASE_MAX_AGE_DAYS:-7} days) under ${KVCD_BASE_CACHE:-~/.cache/kvcd}, shared by clones,
# and under ${KVCD_DEPLOY_CACHE:-.cache/deploy} the build
# stage's ccache (copied out of the build stage after each build and sent back in the
# context next time). Prints the image name on its last line.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
variant=cpu
tag=""
from_build=""
base_only=0
while (($#)); do
  case $1 in
    --cuda) variant=cuda ;;
    --tag) tag=$2; shift ;;
    --from-build) from_build=$2; shift ;;
    --base-only) base_only=1 ;;
    *) echo "build-image: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done
cache=${KVCD_DEPLOY_CACHE:-$root/.cache/deploy}
mkdir -p "$cache"
cache=$(cd "$cache" && pwd)
# One version: the project's (CMakeLists.txt, project(kvcd VERSION ...)). The image is tagged
# kvcd:<version>-<variant>, the tag the Helm chart and the kustomize overlays default to
# (deploy/tools/sync_generated.py keeps them equal to it), and kvcd:<version>-<commit>-<variant>
# (git describe: which build it is). --from-build images are tagged
# kvcd-prebuilt:<version>-<commit>-cpu: they are test images, never the release tag.
version=$(sed -n 's/^project(kvcd VERSION \([0-9][0-9.]*\).*/\1/p' CMakeLists.txt)
[[ -n $version ]] || { echo "build-image: no project(kvcd VERSION ...) in CMakeLists.txt" >&2; exit 1; }
build_id=$(git describe --always --dirty 2>/dev/null || echo dev)
build_tag=""
log() { echo "build-image: $*" >&2; }
if [[ -n $from_build ]]; then
  [[ $variant == cpu ]] || { log "--from-build makes the CPU image only"; exit 2; }
  for b in "$from_build/server/kvcd" "$from_build/client/kvctl"; do
    [[ -x $b ]] || { log "$b is missing: run scripts/build.sh kvcd kvctl"; exit 1; }
  done
  [[ -n $tag ]] || tag="kvcd-prebuilt:${version}-${build_id}-${variant}"
fi
if [[ -z $tag ]]; then
  tag="kvcd:${version}-${variant}"
  build_tag="kvcd:${version}-${build_id}-${variant}"
fi

need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
if ((${#need[@]})); then
  log "installing ${need[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# --- the Docker engine -----------------------------------------------------------------
if ! docker info >/dev/null 2>&1; then
  log "no Docker engine answers; starting dockerd (log: $cache/dockerd.log)"
  nohup dockerd >"$cache/dockerd.log" 2>&1 &
  for _ in $(seq 120); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || { tail -20 "$cache/dockerd.log" >&2; log "dockerd did not start"; exit 1; }
fi

# --- the base image: debootstrap --variant=minbase bookworm -> docker import -------------
# The mirror is the one this machine's apt already uses (deb822 or one-line sources).
apt_uri() {  # $1: suite to look for
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -f $f ]] || continue
    awk -v s="$1" 'BEGIN{RS=""} $0 ~ ("Suites:[^\n]*" s "([ \n]|$)") {
      for (i = 1; i <= NF; i++) if ($i == "URIs:") { print $(i+1); exit } }' "$f"
  done
  grep -hsE "^deb[[:space:]]+[^[:space:]]+[[:space:]]+$1([[:space:]]|$)" /etc/apt/sources.list \
    /etc/apt/sources.list.d/*.list | awk '{print $2}'
  return 0
}
# The base tarball outside the clone (every clone of every commit imports the same one).
base_cache=${KVCD_BASE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcd}
mkdir -p "$base_cache"
tarball=$base_cache/debian-bookworm-minbase.tar
max_age=${KVCD_BASE_MAX_AGE_DAYS:-7}
if [[ ! -s $tarball ]] || [[ -n $(find "$tarball" -mtime +"$max_age" 2>/dev/null) ]]; then
  mirror=$(apt_uri bookworm | head -1)
  security=$(apt_uri bookworm-security | head -1)
  [[ -n $mirror ]] || { log "no bookworm mirror in /etc/apt sources"; exit 1; }
  log "debootstrap --variant=minbase bookworm from $mirror"
  rootfs=$(mktemp -d "$cache/rootfs.XXXXXX")
  trap 'rm -rf "$rootfs"' EXIT
  debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$cache/debootstrap.log" 2>&1 ||
    { tail -20 "$cache/debootstrap.log" >&2; exit 1; }
  {
    echo "deb $mirror bookworm main"
    echo "deb $mirror bookworm-updates main"
    [[ -z $security ]] || echo "deb $security bookworm-security main"
  } >"$rootfs/etc/apt/sources.list"
  # Like Debian's own container images: no docs or man pages, no apt caches in layers.
  cat >"$rootfs/etc/dpkg/dpkg.cfg.d/excludes" <<'CFG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
CFG
  echo 'APT::Install-Recommends "false"; APT::Install-Suggests "false";' \
    >"$rootfs/etc/apt/apt.conf.d/90kvcd-no-recommends"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" --numeric-owner -cf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
  rm -rf "$rootfs"
  trap - EXIT
fi
base="kvcd-base/debian:bookworm-$(sha256sum "$tarball" | cut -c1-12)"
if ! docker image inspect "$base" >/dev/null 2>&1; then
  log "docker import $tarball as $base"
  docker import --change 'CMD ["/bin/bash"]' "$tarball" "$base" >/dev/null
fi
if ((base_only)); then
  log "base image $base ready"
  exit 0
fi

# --- from binaries already built: strip them, list their libraries' packages, one stage ---
if [[ -n $from_build ]]; then
  ctx=$cache/context-prebuilt
  rm -rf "$ctx" && mkdir -p "$ctx/prebuilt/bin" "$ctx/src/deploy/container"
  strip -o "$ctx/prebuilt/bin/kvcd" "$from_build/server/kvcd"
  strip -o "$ctx/prebuilt/bin/kvctl" "$from_build/client/kvctl"
  "$ctx/prebuilt/bin/kvcd" --version >/dev/null
  # Each shared library must come from a Debian package the runtime stage can install. One
  # dpkg -S for all of them (it reads the whole package database each time), asked for both
  # spellings of a merged-/usr path; then every library must have been found.
  mapfile -t libs < <(ldd "$ctx/prebuilt/bin/kvcd" "$ctx/prebuilt/bin/kvctl" |
    awk '/=> \//{print $3}' | sed 's|^/usr/|/|' | sort -u)
  owners=$(dpkg -S "${libs[@]}" "${libs[@]/#//usr}" 2>/dev/null || true)
  owned=$(sed 's/^.*: //' <<<"$owners")
  for lib in "${libs[@]}"; do
    grep -qxF -e "$lib" -e "/usr$lib" <<<"$owned" ||
      { log "$lib (linked by kvcd or kvctl) is in no Debian package"; exit 1; }
  done
  cut -d: -f1 <<<"$owners" | sort -u >"$ctx/prebuilt/runtime-packages"
  cp deploy/container/Dockerfile.prebuilt deploy/container/kvcd.yaml "$ctx/src/deploy/container/"
  log "docker build (prebuilt from $from_build) FROM $base"
  start=$(date +%s)
  DOCKER_BUILDKIT=0 docker build -f "$ctx/src/deploy/container/Dockerfile.prebuilt" \
    --build-arg "BASE_IMAGE=$base" --build-arg "KVCD_VERSION=$version" -t "$tag" "$ctx" \
    >"$cache/docker-build-prebuilt.log" 2>&1 || { tail -40 "$cache/docker-build-prebuilt.log" >&2; exit 1; }
  log "built $tag in $(($(date +%s) - start)) s ($(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}'))"
  rm -rf "$ctx"
  echo "$tag"
  exit 0
fi

# --- the build context: the sources CMake needs, the ccache, the image's files -----------
ctx=$cache/context-$variant
rm -rf "$ctx" && mkdir -p "$ctx/src" "$ctx/ccache"
srcs=(CMakeLists.txt cmake proto kernels common server client tools testing examples deploy/container)
if git rev-parse --git-dir >/dev/null 2>&1; then
  git ls-files -z --cached --others --exclude-standard -- "${srcs[@]}" | xargs -0 cp --parents -t "$ctx/src"
else
  cp -r --parents -t "$ctx/src" "${srcs[@]}"
fi
ccache_dir=$cache/ccache-$variant
[[ ! -d $ccache_dir ]] || cp -a "$ccache_dir/." "$ctx/ccache/"
dockerfile=deploy/container/Dockerfile
[[ $variant == cpu ]] || dockerfile=deploy/container/Dockerfile.cuda
build_args=(--build-arg "BASE_IMAGE=$base" --build-arg "KVCD_VERSION=$version+$build_id")
if [[ $variant == cuda ]]; then
  cuda=${CUDA_HOME:-/usr/local/cuda}
  [[ -x $cuda/bin/nvcc ]] || { log "the CUDA variant needs a CUDA toolkit at $cuda"; exit 1; }
  # Only what nvcc, CMake's FindCUDAToolkit and the link need, plus NCCL for the runtime
  # image (see Dockerfile.cuda): ~0.4 GB of the toolkit's 2.7.
  mkdir -p "$ctx/cuda/lib"
  cp -a "$cuda/bin" "$cuda/nvvm" "$cuda/include" "$cuda/targets" "$ctx/cuda/"
  [[ ! -e $cuda/version.json ]] || cp -a "$cuda/version.json" "$ctx/cuda/"
  ln -s lib "$ctx/cuda/lib64"
  for f in libcudart_static.a libcudadevrt.a libculibos.a libcudart.so libcudart.so.* \
           libnccl.so libnccl.so.2 cmake; do
    for g in "$cuda"/lib/$f; do [[ ! -e $g ]] || cp -a "$g" "$ctx/cuda/lib/"; done
  done
fi

log "docker build ($variant) FROM $base"
start=$(date +%s)
DOCKER_BUILDKIT=0 docker build -f "$ctx/src/$dockerfile" "${build_args[@]}" -t "$tag" "$ctx" \
  >"$cache/docker-build-$variant.log" 2>&1 || { tail -40 "$cache/docker-build-$variant.log" >&2; exit 1; }
# The same build up to its build stage: every layer comes from the cache; tagged to copy out.
DOCKER_BUILDKIT=0 docker build -q -f "$ctx/src/$dockerfile" "${build_args[@]}" \
  --target build -t "$tag-buildstage" "$ctx" >/dev/null
log "built $tag in $(($(date +%s) - start)) s ($(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}'))"
# Keep the build stage's ccache for the next build.
cid=$(docker create "$tag-buildstage")
rm -rf "$ccache_dir.new" && docker cp "$cid:/ccache" "$ccache_dir.new" && rm -rf "$ccache_dir" &&
  mv "$ccache_dir.new" "$ccache_dir"
docker rm "$cid" >/dev/null
docker image rm "$tag-buildstage" >/dev/null
rm -rf "$ctx"
[[ -z $build_tag ]] || { docker tag "$tag" "$build_tag"; log "also tagged $build_tag"; }
echo "$tag"
