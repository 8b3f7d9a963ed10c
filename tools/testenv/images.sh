#!/usr/bin/env bash
# Builds the images the test node runs, as oci-archives for
# `ctr images import`, without a registry or a container engine (umoci only):
#
#   registry.test.local/pause:3.10                   the kubelet's sandbox image
#   registry.test.local/busybox:1.36                 Debian's busybox-static; test pods, local-path helper pods
#   registry.test.local/local-path-provisioner:v0.0.30
#
#   tools/testenv/images.sh BIN_DIR OUT_DIR   (BIN_DIR: what build.sh printed)
#
# Prints OUT_DIR. Nothing is rebuilt when OUT_DIR already holds the archives
# for the same inputs (the key is the hash of this script and the binaries).
set -euo pipefail
bin=${1:?usage: $0 BIN_DIR OUT_DIR}
out=${2:?usage: $0 BIN_DIR OUT_DIR}
busybox=/bin/busybox
for tool in umoci jq; do
  command -v "$tool" >/dev/null || { echo "images: $tool not found (apt-get install umoci jq)" >&2; exit 1; }
done
[ -x "$busybox" ] || { echo "images: $busybox not found (apt-get install busybox-static)" >&2; exit 1; }
key=$(cat "$0" "$(dirname "$0")/image-lib.sh" "$bin/pause" "$bin/local-path-provisioner" "$busybox" | sha256sum | cut -c1-12)
dest="$out/$key"
if [ -s "$dest/done" ]; then
  echo "$dest"
  exit 0
fi
mkdir -p "$dest"
arch=$(dpkg --print-architecture)
epoch=0

. "$(dirname "$0")/image-lib.sh"

pause_tree() { install -D -m 0755 "$bin/pause" "$1/pause"; }
lpp_tree() {
  busybox_tree "$1"
  install -D -m 0755 "$bin/local-path-provisioner" "$1/usr/bin/local-path-provisioner"
}

image registry.test.local/pause 3.10 pause_tree /pause
image registry.test.local/busybox 1.36 busybox_tree /bin/sh
image registry.test.local/local-path-provisioner v0.0.30 lpp_tree /usr/bin/local-path-provisioner
echo ok > "$dest/done"
echo "$dest"
