#!/usr/bin/env bash
# Kubernetes control-plane and node binaries for `make test-k8s`, built offline from Debian's `kubernetes`
# source package (1.20, vendored Go modules) with Debian's Go — Debian ships only kubectl as a binary.
# Cached: ${SPLITFIRE_HOME:-~/.cache/splitfire}/k8s/<version>/bin; a second run prints the path at once.
#
#   bash helm/tools/kube_build.sh        # prints the bin directory
set -euo pipefail
home=${SPLITFIRE_HOME:-$HOME/.cache/splitfire}
bins=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy)

need_pkgs=()
for p in golang-go etcd-server containerd jq rsync dpkg-dev; do
    dpkg -s "$p" >/dev/null 2>&1 || need_pkgs+=("$p")
done
if [ ${#need_pkgs[@]} -gt 0 ]; then
    echo "kube_build: installing ${need_pkgs[*]} (Debian packages)" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}" >&2
fi

if ! apt-cache showsrc kubernetes >/dev/null 2>&1 || [ -z "$(apt-cache showsrc kubernetes 2>/dev/null)" ]; then
    echo "kube_build: adding Debian's deb-src entry for the kubernetes source package" >&2
    cat > /etc/apt/sources.list.d/splitfire-debsrc.sources <<'EOF'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    apt-get update -qq
fi
version=$(apt-cache showsrc kubernetes | awk '/^Version:/ {print $2; exit}')
out="$home/k8s/$version/bin"
if [ -x "$out/kubelet" ] && [ -x "$out/kube-apiserver" ]; then
    echo "$out"
    exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "kube_build: fetching and building kubernetes $version (${bins[*]}), ~6-10 minutes on 2 cores" >&2
(cd "$work" && apt-get source -qq kubernetes >&2)
src=$(find "$work" -maxdepth 1 -mindepth 1 -type d | head -1)
(
    cd "$src"
    export GOPATH="$src/.go" CGO_ENABLED=0 HOME="$work/home" GOFLAGS=-mod=vendor
    mkdir -p .go/src/k8s.io "$HOME"
    [ -L .go/src/k8s.io/kubernetes ] || ln -s ../../.. .go/src/k8s.io/kubernetes
    make WHAT="$(printf 'cmd/%s ' "${bins[@]}")" >&2
)
mkdir -p "$out"
for b in "${bins[@]}"; do cp "$src/_output/bin/$b" "$out/"; done
echo "$out"
