#!/usr/bin/env bash
# Builds the images of CDI v1.65.0 for the test node, as oci-archives for
# `ctr images import`, from the commands tools/testenv/upstream.sh built from
# CDI's Go module (umoci only, no registry, no container engine):
#
#   registry.test.local/cdi-{operator,controller,apiserver,uploadproxy,uploadserver,cloner}:v1.65.0
#       the static command on a BusyBox tree, user 1001 (CDI's deployments
#       run as non-root)
#   registry.test.local/cdi-importer:v1.65.0
#       Debian bookworm (mmdebstrap) with what the importer calls on its HTTP
#       path: qemu-img (qemu-utils) and nbdkit with its curl plugin; user 107
#       (CDI runs importer pods as 107, fsGroup 107)
#
#   tools/testenv/cdi-images.sh UPSTREAM_DIR OUT_DIR   (UPSTREAM_DIR: what upstream.sh printed)
#
# Prints the directory of the archives. Nothing is rebuilt for the same
# inputs (the key is the hash of these scripts and the binaries); the Debian
# root file system is cached beside them.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
upstream=${1:?usage: $0 UPSTREAM_DIR OUT_DIR}
out=${2:?usage: $0 UPSTREAM_DIR OUT_DIR}
version=v1.65.0
busybox=/bin/busybox
for tool in umoci jq mmdebstrap; do
  command -v "$tool" >/dev/null || { echo "cdi-images: $tool not found (apt-get install umoci jq mmdebstrap)" >&2; exit 1; }
done
go_commands=(cdi-operator cdi-controller cdi-apiserver cdi-uploadproxy cdi-uploadserver cdi-cloner)
key=$(cat "$0" "$here/image-lib.sh" "$busybox" "$upstream"/bin/cdi-* | sha256sum | cut -c1-12)
dest="$out/$key"
if [ -s "$dest/done" ]; then
  echo "$dest"
  exit 0
fi
mkdir -p "$dest"
arch=$(dpkg --print-architecture)
epoch=0
. "$here/image-lib.sh"

# The importer's Debian root file system, once per package list.
packages=qemu-utils,nbdkit,ca-certificates
base="$out/importer-base-$(echo "$packages" | sha256sum | cut -c1-12).tar"
if [ ! -s "$base" ]; then
  mmdebstrap --quiet --format=tar --variant=essential --include="$packages" --mode=root \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    bookworm "$base.part" >&2
  mv "$base.part" "$base"
fi

command_tree() {
  busybox_tree "$1"
  echo 'cdi:x:1001:1001::/tmp:/bin/sh' >> "$1/etc/passwd"
  install -D -m 0755 "$upstream/bin/$current" "$1/usr/bin/$current"
}
importer_tree() {
  tar -C "$1" -xf "$base"
  install -D -m 0755 "$upstream/bin/cdi-importer" "$1/usr/bin/cdi-importer"
  install -d -m 1777 "$1/scratch" "$1/data"
}

for current in "${go_commands[@]}"; do
  IMAGE_USER=1001 image "registry.test.local/$current" "$version" command_tree "/usr/bin/$current"
done
IMAGE_USER=107 image registry.test.local/cdi-importer "$version" importer_tree /usr/bin/cdi-importer
echo ok > "$dest/done"
echo "$dest"
