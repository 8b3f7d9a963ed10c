#!/usr/bin/env bash
# Builds KubeVirt v1.8.0's commands from its Go module, into a cache outside
# the repository, once:
#   bin/virt-operator virt-api virt-controller   CGO off
#   bin/virt-handler                             cgo (<linux/kvm.h> only)
#   bin/virt-launcher                            cgo, build tag libvirt_dlopen
#                                                (libvirt is opened at run
#                                                time: no headers needed here)
#   bin/virt-launcher-monitor virt-freezer virt-probe virt-tail virt-chroot
#   bin/container-disk                           KubeVirt's small C program,
#                                                gcc -static
#   bin/node-labeller.sh                         the launcher's script, as is
#   bin/manifest-templator resource-generator    KubeVirt's own tools that
#                                                write its operator's install
#                                                manifests with given images
# Later runs find them and print the directory at once.
#
# Same way as upstream.sh: the module's own go.mod/go.sum (GOWORK=off) in a
# writable copy of the module cache's tree, its staging modules where its
# replace lines point, and the libnbd stand-in (upstream/libnbd says what
# that leaves out: the changed-block-tracking NBD export, never used here).
# One change to KubeVirt itself, kubevirt/*.patch: software emulation
# without /dev/kvm in the launcher's pod (the patch says why).
#
#   tools/testenv/kubevirt.sh            build if missing, print the dir
#   VMMIGRATE_TESTENV_CACHE=/x ...       cache root (default ~/.cache/vmmigrate/testenv)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
version=v1.8.0
cache_root=${VMMIGRATE_TESTENV_CACHE:-$HOME/.cache/vmmigrate/testenv}
key=$( (cat "$here/kubevirt.sh"; find "$here/upstream/libnbd" "$here/kubevirt" -type f | sort | xargs cat) | sha256sum | cut -c1-12)
out="$cache_root/kubevirt-$version-$key"
pure=(virt-operator virt-api virt-controller virt-launcher-monitor virt-freezer virt-probe virt-tail virt-chroot)
all=("${pure[@]}" virt-handler virt-launcher container-disk node-labeller.sh manifest-templator resource-generator)

complete=1
for cmd in "${all[@]}"; do [ -x "$out/bin/$cmd" ] || complete=0; done
[ -s "$out/share/qemu.conf" ] && [ -d "$out/share/manifests" ] || complete=0
if [ "$complete" = 1 ]; then
  echo "$out"
  exit 0
fi

export PATH="$PATH:/usr/local/go/bin:$HOME/go/bin"
export GOWORK=off GOFLAGS=-mod=mod
mkdir -p "$cache_root" "$out/bin"
tmp=$(mktemp -d "$cache_root/.kubevirt.XXXXXX")
trap 'chmod -R u+w "$tmp" 2>/dev/null; rm -rf "$tmp"' EXIT
start=$(date +%s)

module() {
  local dir
  dir=$(go mod download -json "$1@$2" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
  [ -d "$dir" ] || { echo "kubevirt: go mod download $1@$2 gave no directory" >&2; exit 1; }
  mkdir -p "$3"
  cp -r "$dir/." "$3"
  chmod -R u+w "$3"
}

kv="$tmp/kubevirt"
module kubevirt.io/kubevirt "$version" "$kv"
rm -rf "$kv/staging/src/kubevirt.io/api" "$kv/staging/src/kubevirt.io/client-go"
module kubevirt.io/api "$version" "$kv/staging/src/kubevirt.io/api"
module kubevirt.io/client-go "$version" "$kv/staging/src/kubevirt.io/client-go"
cp -r "$here/upstream/libnbd" "$tmp/libnbd"
(cd "$kv" && go mod edit -replace "libguestfs.org/libnbd=$tmp/libnbd")
# Our changes to KubeVirt, each saying why at its top (kubevirt/*.patch).
for p in "$here"/kubevirt/*.patch; do
  (cd "$kv" && patch -p1 --quiet --no-backup-if-mismatch) < "$p"
done

v=kubevirt.io/client-go/version
ldflags="-s -w -X $v.gitVersion=$version -X $v.gitTreeState=clean -X $v.gitCommit=$version -X $v.buildDate=1970-01-01T00:00:00Z"
build() { # build NAME PACKAGE [go build flags...]
  local name=$1 pkg=$2
  shift 2
  (cd "$kv" && go build -trimpath -ldflags "$ldflags" "$@" -o "$out/bin/$name.part" "$pkg")
  mv "$out/bin/$name.part" "$out/bin/$name"
  echo "kubevirt: $name after $(( $(date +%s) - start )) s" >&2
}
for cmd in "${pure[@]}"; do
  CGO_ENABLED=0 build "$cmd" "./cmd/$cmd"
done
CGO_ENABLED=1 build virt-handler ./cmd/virt-handler
CGO_ENABLED=1 build virt-launcher ./cmd/virt-launcher -tags libvirt_dlopen
CGO_ENABLED=0 build manifest-templator ./tools/manifest-templator
CGO_ENABLED=0 build resource-generator ./tools/resource-generator
gcc -static -O2 -o "$out/bin/container-disk.part" "$kv/cmd/container-disk-v2alpha/main.c"
mv "$out/bin/container-disk.part" "$out/bin/container-disk"
install -m 0755 "$kv/cmd/virt-launcher/node-labeller/node-labeller.sh" "$out/bin/node-labeller.sh"
# The launcher's libvirt configuration and the operator's manifest templates,
# as KubeVirt ships them.
mkdir -p "$out/share"
cp "$kv/cmd/virt-launcher/qemu.conf" "$kv/cmd/virt-launcher/virtqemud.conf" "$kv/cmd/virt-launcher/nsswitch.conf" "$out/share/"
cp -r "$kv/manifests" "$out/share/manifests"
chmod -R u+w "$out/share"
echo "kubevirt: built in $(( $(date +%s) - start )) s" >&2
echo "$out"
