#!/usr/bin/env bash
# Builds the real one-node test cluster from Go modules into a cache outside
# the repository, once: etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kubelet, kube-proxy, kubectl, rancher's
# local-path-provisioner and the sandbox ("pause") program. Later runs find
# the binaries and return at once. containerd, runc and the CNI plugins come
# from Debian (tools/harness/src/setup.rs installs them).
#
#   tools/testenv/build.sh            build if missing, print the bin dir
#   VMMIGRATE_TESTENV_CACHE=/x ...    cache root (default ~/.cache/vmmigrate/testenv)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
k8s_version=$(awk '$1=="k8s.io/kubernetes" && $2 ~ /^v/ {print $2; exit}' "$here/go.mod")
etcd_version=$(awk '$1=="go.etcd.io/etcd/server/v3" {print $2; exit}' "$here/go.mod")
lpp_version=v0.0.30
cache_root=${VMMIGRATE_TESTENV_CACHE:-$HOME/.cache/vmmigrate/testenv}
# The go.sum hash and this script's own hash are part of the key, so
# changing the pinned modules or the list of commands rebuilds.
key=$( (cat "$here/go.sum" "$here/build.sh" "$here/pause/main.go") | sha256sum | cut -c1-12)
bin="$cache_root/$k8s_version-$key/bin"
commands=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl)
all=("${commands[@]}" etcd local-path-provisioner pause)

complete=1
for cmd in "${all[@]}"; do [ -x "$bin/$cmd" ] || complete=0; done
if [ "$complete" = 1 ]; then
  echo "$bin"
  exit 0
fi

mkdir -p "$bin"
tmp=$(mktemp -d "$cache_root/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
export CGO_ENABLED=0
ver="k8s.io/component-base/version"
ldflags="-s -w -X $ver.gitVersion=$k8s_version -X $ver.gitMajor=1 -X $ver.gitMinor=$(echo "$k8s_version" | cut -d. -f2) -X $ver.gitTreeState=clean"

cd "$here"
start=$(date +%s)
echo "testenv: building the test cluster from its Go modules into $bin (first run only; about 20 minutes on 2 cores)" >&2
for cmd in "${commands[@]}"; do
  [ -x "$bin/$cmd" ] && continue
  echo "testenv: building $cmd $k8s_version..." >&2
  GOFLAGS="-mod=mod -trimpath" go build -ldflags "$ldflags" -o "$bin/$cmd.part" "k8s.io/kubernetes/cmd/$cmd"
  mv "$bin/$cmd.part" "$bin/$cmd"
done
if [ ! -x "$bin/etcd" ]; then
  echo "testenv: building etcd $etcd_version..." >&2
  GOFLAGS="-mod=mod -trimpath" go build -ldflags "-s -w" -o "$bin/etcd.part" go.etcd.io/etcd/server/v3
  mv "$bin/etcd.part" "$bin/etcd"
fi
if [ ! -x "$bin/pause" ]; then
  GOFLAGS="-mod=mod -trimpath" go build -ldflags "-s -w" -o "$bin/pause" ./pause
fi
if [ ! -x "$bin/local-path-provisioner" ]; then
  # Its own module, at its own pinned dependencies (go install pkg@version).
  echo "testenv: building local-path-provisioner $lpp_version..." >&2
  GOFLAGS="-trimpath" GOBIN="$tmp" go install -ldflags "-s -w" "github.com/rancher/local-path-provisioner@$lpp_version"
  mv "$tmp/local-path-provisioner" "$bin/"
fi
echo "testenv: built in $(( $(date +%s) - start ))s into $bin" >&2
echo "$bin"
