#!/usr/bin/env bash
# `make image`: the chart's CPU images, built with podman and no registry.
#   1. a Debian bookworm base from Debian's packages (mmdebstrap), imported as localhost/splitfire-base:bookworm
#      (built once, kept in podman's store);
#   2. a wheel house: this checkout as a wheel and its dependencies at the versions CI tested
#      (constraints.txt, `make constraints` refreshes it), from the package indexes pip is set up with;
#   3. localhost/splitfire-worker:VERSION and localhost/splitfire-router:VERSION from
#      helm/docker/Containerfile.cpu, installing from the wheel house only (no network in the build).
# Cached under ${SPLITFIRE_IMAGE_CACHE:-~/.cache/splitfire/image}: a second run rebuilds only what changed.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
VERSION=$($PY -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['version'])")
CACHE=${SPLITFIRE_IMAGE_CACHE:-$HOME/.cache/splitfire/image}
# The base's Debian packages; the tag follows the list, so changing it rebuilds the base. libcurl4:
# Mooncake's engine.so links it (found by `make test-k8s`: decode pods could not load the engine).
BASE_PACKAGES=python3,python3-venv,libibverbs1,ibverbs-providers,librdmacm1,libnuma1,libgomp1,libcurl4,ca-certificates
BASE=localhost/splitfire-base:bookworm-$(printf '%s' "$BASE_PACKAGES" | sha1sum | cut -c1-8)
# runc here: the defaults must be explicit, at most this shell's hard limits (nproc also at most 32768:
# runc could not set more on this host).
NPROC=$(( $(ulimit -Hu) < 32768 ? $(ulimit -Hu) : 32768 ))
ULIMITS=(--ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit "nproc=$NPROC:$NPROC")
mkdir -p "$CACHE"

need=()
for tool in podman buildah mmdebstrap; do command -v "$tool" >/dev/null || need+=("$tool"); done
command -v runc >/dev/null || need+=(runc)
if ((${#need[@]})); then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo ">> apt-get install ${need[*]} uidmap slirp4netns fuse-overlayfs"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" uidmap slirp4netns \
      fuse-overlayfs >/dev/null
  else
    echo "make image needs: ${need[*]} (Debian: apt-get install ${need[*]})" >&2; exit 1
  fi
fi

step() { printf '\n== %s\n' "$*"; }

step "base image $BASE"
if podman image exists "$BASE"; then
  echo "kept (podman rmi $BASE to rebuild)"
else
  t0=$SECONDS
  mmdebstrap --variant=minbase --quiet \
    --include="$BASE_PACKAGES" \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
    bookworm "$CACHE/rootfs.tar"
  podman import --change 'CMD ["/bin/bash"]' "$CACHE/rootfs.tar" "$BASE" >/dev/null
  rm -f "$CACHE/rootfs.tar"
  echo "built in $((SECONDS - t0)) s"
fi

step "wheel house (constraints.txt)"
t0=$SECONDS
ctx="$CACHE/context"
rm -rf "$ctx" && mkdir -p "$ctx/wheelhouse"
# (async-timeout: redis needs it on Debian's Python 3.11.2, which the venv's Python may not be)
$PY -m pip wheel -q --wheel-dir "$ctx/wheelhouse" -c constraints.txt "torch==$(sed -n 's/^torch==//p' constraints.txt)" \
  ".[router,mooncake]" "async-timeout>=4.0.3" 2>&1 | grep -v "is ignored: it is neither" || true
[ -n "$(ls "$ctx"/wheelhouse/splitfire-*.whl 2>/dev/null)" ] || { echo "no splitfire wheel was built" >&2; exit 1; }
echo "$(ls "$ctx/wheelhouse" | wc -l) wheels, $(du -sh "$ctx/wheelhouse" | cut -f1), $((SECONDS - t0)) s"

wheels=$(cd "$ctx/wheelhouse" && sha256sum ./* | sha256sum | cut -c1-16)
for target in worker router; do
  step "localhost/splitfire-$target:$VERSION"
  t0=$SECONDS
  podman build -q "${ULIMITS[@]}" --network none -f helm/docker/Containerfile.cpu --target "$target" \
    --build-arg "BASE=$BASE" --build-arg "WHEELS=$wheels" \
    -t "localhost/splitfire-$target:$VERSION" "$ctx" >/dev/null
  echo "built in $((SECONDS - t0)) s, $(podman image inspect --format '{{.Size}}' "localhost/splitfire-$target:$VERSION" \
    | awk '{printf "%.0f MB", $1 / 1e6}')"
done
rm -rf "$ctx"
