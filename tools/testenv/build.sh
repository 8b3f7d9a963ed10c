#!/usr/bin/env bash
# Builds the real control plane used by the tests (kube-apiserver,
# kube-controller-manager, etcd) from their Go modules into a cache outside
# the repository, once. Later runs find the binaries and return at once.
#
#   tools/testenv/build.sh            build if missing, print the bin dir
#   VMMIGRATE_TESTENV_CACHE=/x ...    cache root (default ~/.cache/vmmigrate/testenv)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
k8s_version=$(awk '$1=="k8s.io/kubernetes" && $2 ~ /^v/ {print $2; exit}' "$here/go.mod")
etcd_version=$(awk '$1=="go.etcd.io/etcd/server/v3" {print $2; exit}' "$here/go.mod")
cache_root=${VMMIGRATE_TESTENV_CACHE:-$HOME/.cache/vmmigrate/testenv}
# The go.sum hash is part of the key, so changing the pinned modules rebuilds.
key=$(sha256sum "$here/go.sum" | cut -c1-12)
bin="$cache_root/$k8s_version-$key/bin"

if [ -x "$bin/kube-apiserver" ] && [ -x "$bin/kube-controller-manager" ] && [ -x "$bin/etcd" ]; then
  echo "$bin"
  exit 0
fi

mkdir -p "$bin"
tmp=$(mktemp -d "$cache_root/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
export GOFLAGS="${GOFLAGS:-} -mod=mod -trimpath"
export CGO_ENABLED=0
ver="k8s.io/component-base/version"
ldflags="-s -w -X $ver.gitVersion=$k8s_version -X $ver.gitMajor=1 -X $ver.gitMinor=$(echo "$k8s_version" | cut -d. -f2) -X $ver.gitTreeState=clean"

cd "$here"
start=$(date +%s)
echo "testenv: building the test control plane from its Go modules into $bin (first run only; about 9 minutes on 2 cores)" >&2
for cmd in kube-apiserver kube-controller-manager; do
  echo "testenv: building $cmd $k8s_version (first time only; several minutes)..." >&2
  go build -ldflags "$ldflags" -o "$tmp/$cmd" "k8s.io/kubernetes/cmd/$cmd"
done
echo "testenv: building etcd $etcd_version..." >&2
go build -ldflags "-s -w" -o "$tmp/etcd" go.etcd.io/etcd/server/v3
mv "$tmp"/* "$bin/"
echo "testenv: built in $(( $(date +%s) - start ))s into $bin" >&2
echo "$bin"
