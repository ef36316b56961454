#!/usr/bin/env bash
# Build the two images, Dockerfile.plugin and Dockerfile.extender, with buildah (Debian's package; vfs storage, chroot
# isolation: no daemon, no privileges beyond root in this machine's sandbox), then prove each works by running
# inside it:
#   plugin:   gpuplugin --help, gpuplugin run --help, gpuplugin topo on the bundled DGX-1, and no FastAPI/uvicorn;
#   extender: gpu-extender serve --help, a standalone extender answering kube-scheduler's POST /filter
#             (scripts/image_smoke.py), and no NVML/gRPC/protobuf.
# Prints each image's build time and size. Takes minutes; tests/deploy/test_image_build.py runs it when
# GPU_TOPOLOGY_IMAGE_TEST=1.
#
# Where the base image (the Dockerfiles' PYTHON_IMAGE, one for both) cannot be pulled, a local stand-in of the same
# Debian release and Python minor is made and tagged with its name: Debian bookworm (debootstrap, minbase, the shared
# libraries CPython links) with this machine's own Python 3.11 build copied under /usr/local and pip from its
# ensurepip, the layout of the official python:3.11-slim-bookworm. The stand-in is kept in the storage for the next
# run.
#
# Behind a proxy, pip inside the build gets what a user there would hand in: the CA bundle as a build secret
# (--ca-bundle, default /etc/ssl/certs/ca-certificates.crt when it exists) and, optionally, an index URL
# (--index-url, passed as a secret since it may hold credentials).
#
# Usage: scripts/build_image.sh [--repository PREFIX] [--only plugin|extender] [--ca-bundle FILE] [--index-url URL]
#                               [--source-url URL] [--no-stand-in] [--keep-image] [--layers]
# --source-url: the OCI source label of a fork's images (default: pyproject.toml's [project.urls] Source).
# After both images built and passed, the fingerprint of the build's inputs taken before building is recorded in
# deploy/image/built-from.sha256 (deploy/image/fingerprint.py; a fast test fails when the inputs move away from it).
# The images are PREFIX-plugin:dev and PREFIX-extender:dev (default PREFIX: localhost/gpu-topology).
# --layers keeps each step as a cached layer for the next run; with vfs storage every layer is a full copy of the
# file system, so a build without it (the default) is the faster one: about 75 s per image here, downloads included.
# Environment: GPU_TOPOLOGY_IMAGE_STATE (default /var/tmp/gpu-topology-image): buildah storage and the stand-in.
set -euo pipefail
cd "$(dirname "$0")/.."

REPOSITORY=localhost/gpu-topology
COMPONENTS=(plugin extender)
CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
INDEX_URL=""
SOURCE_URL=""
STAND_IN=1
KEEP_IMAGE=0
CACHE=(--layers=false)
while [ $# -gt 0 ]; do
  case "$1" in
    --repository) REPOSITORY=$2; shift 2 ;;
    --only)
      case "$2" in plugin|extender) COMPONENTS=("$2") ;; *) echo "--only plugin|extender" >&2; exit 2 ;; esac
      shift 2 ;;
    --ca-bundle) CA_BUNDLE=$2; shift 2 ;;
    --index-url) INDEX_URL=$2; shift 2 ;;
    --source-url) SOURCE_URL=$2; shift 2 ;;
    --no-stand-in) STAND_IN=0; shift ;;
    --keep-image) KEEP_IMAGE=1; shift ;;
    --layers) CACHE=(--layers); shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done

# What is built: the fingerprint of the inputs now, recorded only if they are still the same once both images passed.
INPUTS=$(python3 deploy/image/fingerprint.py)
if [ -n "$SOURCE_URL" ]; then python3 deploy/image/source_url.py --check "$SOURCE_URL" >/dev/null; fi

STATE=${GPU_TOPOLOGY_IMAGE_STATE:-/var/tmp/gpu-topology-image}
mkdir -p "$STATE"
BUILDAH=(buildah --root "$STATE/storage" --runroot "$STATE/run" --storage-driver vfs)
export BUILDAH_ISOLATION=chroot
step() { printf '==> %s\n' "$*"; }

need() {  # need COMMAND DEBIAN_PACKAGE: install from Debian's packages when we may
  command -v "$1" >/dev/null && return
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    step "installing $2 (Debian package)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2" >/dev/null
  else
    echo "$1 is missing: apt-get install $2" >&2
    exit 1
  fi
}
need buildah buildah

BASE=$(sed -n 's/^ARG PYTHON_IMAGE=//p' Dockerfile.plugin)
if [ "$BASE" != "$(sed -n 's/^ARG PYTHON_IMAGE=//p' Dockerfile.extender)" ]; then
  echo "Dockerfile.plugin and Dockerfile.extender name different base images" >&2
  exit 1
fi
case "$BASE" in */*) BASE_REF=$BASE ;; *) BASE_REF=docker.io/library/$BASE ;; esac

unmount_under() {  # unmount_under DIR: every mount at or below DIR, the deepest first
  local dir target
  dir=$(realpath -m "$1")
  awk -v d="$dir" '$2 == d || index($2, d "/") == 1 { print $2 }' /proc/mounts | sort -r \
    | while read -r target; do
        target=$(printf '%b' "$target")  # /proc/mounts writes a space as \040
        umount "$target" 2>/dev/null || umount -l "$target"
      done
}

make_stand_in() {
  # Debian release and Python minor come from the base image's tag, e.g. python:3.11-slim-bookworm.
  local release=${BASE##*-} python_minor
  python_minor=$(sed -E 's/^[^:]*:([0-9]+\.[0-9]+).*/\1/' <<<"$BASE")
  local python="python$python_minor"
  command -v "$python" >/dev/null || { echo "no $python on this machine for the stand-in base" >&2; exit 1; }
  local prefix
  prefix=$("$python" -c 'import sys; print(sys.base_prefix)')
  need debootstrap debootstrap
  local rootfs="$STATE/stand-in-rootfs"
  # debootstrap mounts proc (and sys, dev/pts where it can) inside the rootfs and may leave them mounted; rm
  # --one-file-system then refuses to cross them and stops the script. The trap unmounts them on any exit, so a
  # failure midway leaves no mount behind either; the rootfs itself stays for the next run to remove.
  trap 'unmount_under "$STATE/stand-in-rootfs"' EXIT
  unmount_under "$rootfs"
  rm -rf --one-file-system "$rootfs"
  step "stand-in base: Debian $release (debootstrap minbase) + $python from $prefix"
  # ca-certificates, netbase, tzdata and the libraries CPython's modules link, as the official slim image keeps.
  debootstrap --variant=minbase \
    --include=ca-certificates,netbase,tzdata,libbz2-1.0,libexpat1,libffi8,libgdbm6,liblzma5,libncursesw6,libnsl2,libreadline8,libsqlite3-0,libssl3,libtirpc3,libuuid1,zlib1g \
    "$release" "$rootfs" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$STATE/debootstrap.log" 2>&1 \
    || { tail -20 "$STATE/debootstrap.log" >&2; exit 1; }
  # The interpreter, its shared library and its standard library (no site-packages, tests, IDLE or Tk).
  mkdir -p "$rootfs/usr/local/bin" "$rootfs/usr/local/lib"
  cp -a "$prefix/bin/$python" "$rootfs/usr/local/bin/"
  cp -a "$prefix"/lib/libpython"$python_minor"*.so* "$rootfs/usr/local/lib/"
  # Trimmed as the official image is: no tests, no static library, no bytecode; no docs, manuals or translations
  # (debian:bookworm-slim leaves those out).
  tar -C "$prefix/lib" --exclude="$python/site-packages/*" --exclude=test --exclude=tests --exclude=idle_test \
    --exclude="$python/idlelib" --exclude="$python/tkinter" --exclude="$python/turtledemo" \
    --exclude='libpython*.a' --exclude='__pycache__' --exclude='*.pyc' -cf - "$python" \
    | tar -C "$rootfs/usr/local/lib" -xf -
  for link in python3 python; do ln -sf "$python" "$rootfs/usr/local/bin/$link"; done
  chroot "$rootfs" /sbin/ldconfig
  chroot "$rootfs" "/usr/local/bin/$python" -m ensurepip --default-pip >"$STATE/ensurepip.log" 2>&1 \
    || { cat "$STATE/ensurepip.log" >&2; exit 1; }
  ln -sf pip3 "$rootfs/usr/local/bin/pip"
  find "$rootfs/usr/local" -depth -name __pycache__ -exec rm -rf {} +
  unmount_under "$rootfs"  # before the copy: its tar stays on the rootfs's file system, and rm must too
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/lib/apt/lists/* \
    "$rootfs"/debootstrap "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
    "$rootfs"/usr/share/locale/*
  local ctr mnt
  ctr=$("${BUILDAH[@]}" from scratch)
  mnt=$("${BUILDAH[@]}" mount "$ctr")
  tar -C "$rootfs" --one-file-system -cf - . | tar -C "$mnt" -xf -
  "${BUILDAH[@]}" umount "$ctr" >/dev/null
  "${BUILDAH[@]}" config --env PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --env PYTHON_VERSION="$("$python" -c 'import platform; print(platform.python_version())')" \
    --cmd "$python" --label gpu-topology.stand-in=true "$ctr"
  "${BUILDAH[@]}" commit --quiet "$ctr" "$BASE_REF" >/dev/null
  "${BUILDAH[@]}" rm "$ctr" >/dev/null
  unmount_under "$rootfs"
  rm -rf --one-file-system "$rootfs"
  trap - EXIT
}

if "${BUILDAH[@]}" inspect --type image "$BASE_REF" >/dev/null 2>&1; then
  step "base $BASE_REF: in local storage"
elif timeout 60 "${BUILDAH[@]}" pull --quiet "$BASE_REF" >/dev/null 2>&1; then
  step "base $BASE_REF: pulled"
elif [ "$STAND_IN" = 1 ]; then
  stand_in_start=$(date +%s)
  make_stand_in
  step "stand-in base made in $(( $(date +%s) - stand_in_start )) s (kept in $STATE for the next run)"
else
  echo "cannot pull $BASE_REF and --no-stand-in was given" >&2
  exit 1
fi

# SOURCE_URL only when given: the Dockerfiles' default (pyproject's URL) is what a plain `docker build` gets.
args=(--build-arg "REVISION=$(git rev-parse HEAD 2>/dev/null || echo unknown)"
      --build-arg "CREATED=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
      --build-arg "VERSION=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')")
if [ -n "$SOURCE_URL" ]; then args+=(--build-arg "SOURCE_URL=$SOURCE_URL"); fi
secrets_dir=$(mktemp -d)
trap 'rm -rf "$secrets_dir"' EXIT
if [ -n "$CA_BUNDLE" ] && [ -s "$CA_BUNDLE" ]; then
  args+=(--secret "id=ca_bundle,src=$CA_BUNDLE")
fi
if [ -n "$INDEX_URL" ]; then
  printf '%s' "$INDEX_URL" >"$secrets_dir/index-url"
  args+=(--secret "id=pip_index_url,src=$secrets_dir/index-url")
fi

# Sizes from the manifests (uncompressed layer tars): the whole image, and what it adds to the base.
layer_bytes() { "${BUILDAH[@]}" inspect --type image --format '{{.Manifest}}' "$1" \
  | python3 -c 'import json, sys; print(sum(l["size"] for l in json.load(sys.stdin)["layers"]))'; }
base_size=$(layer_bytes "$BASE_REF")

containers=()
images=()
cleanup() {
  for ctr in "${containers[@]}"; do "${BUILDAH[@]}" rm "$ctr" >/dev/null 2>&1 || true; done
  if [ "$KEEP_IMAGE" = 0 ]; then
    for image in "${images[@]}"; do "${BUILDAH[@]}" rmi "$image" >/dev/null 2>&1 || true; done
  fi
  rm -rf "$secrets_dir"
}
trap cleanup EXIT

# in_image CONTAINER COMMAND...: run inside a working container of the image (chroot isolation, as the build).
in_image() { local ctr=$1; shift; "${BUILDAH[@]}" run --isolation chroot "$ctr" -- "$@"; }
# Exits non-zero when any of the named modules can be found in the image's environment (a parent package first).
NONE_OF='import importlib.util as u, sys; found = [m for m in sys.argv[1:] if all(u.find_spec(".".join(m.split(".")[:i + 1])) for i in range(m.count(".") + 1))]; print("present: " + " ".join(found) if found else "absent: " + " ".join(sys.argv[1:])); sys.exit(bool(found))'
# Exits non-zero when any of the named commands is on the image's PATH.
NO_COMMAND='import shutil, sys; found = [c for c in sys.argv[1:] if shutil.which(c)]; print("on PATH: " + " ".join(found) if found else "no command: " + " ".join(sys.argv[1:])); sys.exit(bool(found))'

smoke_plugin() {
  local ctr=$1
  in_image "$ctr" gpuplugin --help | grep -q 'run' || { echo "gpuplugin --help lacks 'run'" >&2; exit 1; }
  echo "gpuplugin --help: ok"
  in_image "$ctr" gpuplugin run --help | grep -q -- '--device-list-strategy' \
    || { echo "gpuplugin run --help lacks --device-list-strategy" >&2; exit 1; }
  echo "gpuplugin run --help: ok"
  in_image "$ctr" gpuplugin topo | grep -q 'NVLink islands' || { echo "gpuplugin topo failed" >&2; exit 1; }
  echo "gpuplugin topo (bundled DGX-1): ok"
  in_image "$ctr" python -c "$NONE_OF" fastapi uvicorn starlette
  in_image "$ctr" python -c "$NO_COMMAND" gpu-extender
}

smoke_extender() {
  local ctr=$1
  in_image "$ctr" gpu-extender serve --help | grep -q -- '--inventory' \
    || { echo "serve --help lacks --inventory" >&2; exit 1; }
  echo "gpu-extender serve --help: ok"
  in_image "$ctr" gpu-extender webhook --help | grep -q -- '--tls-cert' \
    || { echo "webhook --help lacks --tls-cert" >&2; exit 1; }
  echo "gpu-extender webhook --help: ok"
  in_image "$ctr" python -c "$(cat scripts/image_smoke.py)"
  in_image "$ctr" python -c "$NONE_OF" pynvml grpc google.protobuf watchdog
  in_image "$ctr" python -c "$NO_COMMAND" gpuplugin
}

for component in "${COMPONENTS[@]}"; do
  tag="$REPOSITORY-$component:dev"
  step "building $tag from Dockerfile.$component (buildah $(buildah --version | awk '{print $3}'), vfs storage, chroot isolation)"
  start=$(date +%s)
  "${BUILDAH[@]}" build --pull=never "${CACHE[@]}" --isolation chroot -f "Dockerfile.$component" -t "$tag" "${args[@]}" . \
    >"$STATE/build-$component.log" 2>&1 || { tail -40 "$STATE/build-$component.log" >&2; exit 1; }
  build_s=$(( $(date +%s) - start ))
  images+=("$tag")
  grep -E '^(pruned |imports: )' "$STATE/build-$component.log" || true
  size=$(layer_bytes "$tag")
  label=$("${BUILDAH[@]}" inspect --type image --format '{{index .OCIv1.Config.Labels "org.opencontainers.image.source"}}' "$tag")

  step "running $component inside $tag"
  ctr=$("${BUILDAH[@]}" from --pull=never "$tag")
  containers+=("$ctr")
  in_image "$ctr" id -u | grep -qx 10001 || { echo "$tag does not run as uid 10001" >&2; exit 1; }
  "smoke_$component" "$ctr"

  printf 'image %s: %d MB (%d bytes; %d MB on top of the %d MB base), built in %d s\n' "$tag" \
    "$((size / 1000000))" "$size" "$(((size - base_size) / 1000000))" "$((base_size / 1000000))" "$build_s"
  printf 'org.opencontainers.image.source=%s\n' "$label"
done

if [ "${#COMPONENTS[@]}" = 2 ]; then
  python3 deploy/image/fingerprint.py --write --built-from "$INPUTS"
fi
