#!/usr/bin/env bash
# Builds what the tests take from KubeVirt v1.8.0 and CDI v1.65.0, from their
# Go modules, into a cache outside the repository, once:
#   crds/kubevirt.yaml   every CRD virt-operator installs (its own functions)
#   crds/cdi.yaml        every CRD CDI's operator installs (its own factory)
#   bin/cdi-*            CDI's commands (operator, controller, apiserver,
#                        importer, uploadproxy, uploadserver, cloner)
#   bin/manifest-generator  CDI's own tool that writes its operator's
#                        install manifests with the image names it is given
# Later runs find them and print the directory at once.
#
# Each module builds from its own go.mod/go.sum (GOWORK=off) in a writable
# copy of the module cache's tree, with its nested staging modules put where
# its replace lines point, and one stand-in: the libnbd Go binding, which the
# module proxy here refuses (upstream/libnbd/libnbd.go says what that leaves
# out). Our two small generator programs are built inside those trees.
#
#   tools/testenv/upstream.sh            build if missing, print the dir
#   VMMIGRATE_TESTENV_CACHE=/x ...       cache root (default ~/.cache/vmmigrate/testenv)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
kubevirt_version=v1.8.0
cdi_version=v1.65.0
cache_root=${VMMIGRATE_TESTENV_CACHE:-$HOME/.cache/vmmigrate/testenv}
key=$( (cat "$here/upstream.sh"; find "$here/upstream" -type f | sort | xargs cat) | sha256sum | cut -c1-12)
out="$cache_root/upstream-$kubevirt_version-$cdi_version-$key"
cdi_commands=(cdi-operator cdi-controller cdi-apiserver cdi-importer cdi-uploadproxy cdi-uploadserver cdi-cloner)

complete=1
for f in crds/kubevirt.yaml crds/cdi.yaml; do [ -s "$out/$f" ] || complete=0; done
for cmd in "${cdi_commands[@]}" manifest-generator; do [ -x "$out/bin/$cmd" ] || complete=0; done
if [ "$complete" = 1 ]; then
  echo "$out"
  exit 0
fi

export PATH="$PATH:/usr/local/go/bin:$HOME/go/bin"
export GOWORK=off GOFLAGS=-mod=mod CGO_ENABLED=0
mkdir -p "$cache_root" "$out/bin" "$out/crds"
tmp=$(mktemp -d "$cache_root/.upstream.XXXXXX")
trap 'chmod -R u+w "$tmp" 2>/dev/null; rm -rf "$tmp"' EXIT
start=$(date +%s)

# A module's tree from the proxy, writable.
module() {
  local dir
  dir=$(go mod download -json "$1@$2" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
  [ -d "$dir" ] || { echo "upstream: go mod download $1@$2 gave no directory" >&2; exit 1; }
  mkdir -p "$3"
  cp -r "$dir/." "$3"
  chmod -R u+w "$3"
}

# generate TREE GENERATOR OUT: builds one of our generators inside a
# module's tree and writes what it prints to crds/OUT.
generate() {
  mkdir -p "$1/tools/vmmigrate-crds"
  cp "$here/upstream/$2/main.go" "$1/tools/vmmigrate-crds/"
  (cd "$1" && go build -trimpath -o "$tmp/$2" ./tools/vmmigrate-crds)
  "$tmp/$2" > "$out/crds/$3.part"
  mv "$out/crds/$3.part" "$out/crds/$3"
}

# KubeVirt: the CRD generator only.
kv="$tmp/kubevirt"
module kubevirt.io/kubevirt "$kubevirt_version" "$kv"
rm -rf "$kv/staging/src/kubevirt.io/api" "$kv/staging/src/kubevirt.io/client-go"
module kubevirt.io/api "$kubevirt_version" "$kv/staging/src/kubevirt.io/api"
module kubevirt.io/client-go "$kubevirt_version" "$kv/staging/src/kubevirt.io/client-go"
cp -r "$here/upstream/libnbd" "$tmp/libnbd"
(cd "$kv" && go mod edit -replace "libguestfs.org/libnbd=$tmp/libnbd")
generate "$kv" kubevirt-crds kubevirt.yaml
echo "upstream: KubeVirt CRDs after $(( $(date +%s) - start )) s" >&2

# CDI: the CRD generator and its commands.
cdi="$tmp/cdi"
module kubevirt.io/containerized-data-importer "$cdi_version" "$cdi"
rm -rf "$cdi/staging/src/kubevirt.io/containerized-data-importer-api"
module kubevirt.io/containerized-data-importer-api "$cdi_version" "$cdi/staging/src/kubevirt.io/containerized-data-importer-api"
(cd "$cdi" && go mod edit -replace "libguestfs.org/libnbd=$tmp/libnbd")
generate "$cdi" cdi-crds cdi.yaml
echo "upstream: CDI CRDs after $(( $(date +%s) - start )) s" >&2

ldflags="-s -w -X kubevirt.io/containerized-data-importer/pkg/version.gitVersion=$cdi_version -X kubevirt.io/containerized-data-importer/pkg/version.gitTreeState=clean"
for cmd in "${cdi_commands[@]}"; do
  (cd "$cdi" && go build -trimpath -ldflags "$ldflags" -o "$out/bin/$cmd.part" "./cmd/$cmd")
  mv "$out/bin/$cmd.part" "$out/bin/$cmd"
  echo "upstream: $cmd after $(( $(date +%s) - start )) s" >&2
done
(cd "$cdi" && go build -trimpath -o "$out/bin/manifest-generator.part" ./tools/manifest-generator)
mv "$out/bin/manifest-generator.part" "$out/bin/manifest-generator"
echo "upstream: built in $(( $(date +%s) - start )) s" >&2
echo "$out"
