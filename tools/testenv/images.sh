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
key=$(cat "$0" "$bin/pause" "$bin/local-path-provisioner" "$busybox" | sha256sum | cut -c1-12)
dest="$out/$key"
if [ -s "$dest/done" ]; then
  echo "$dest"
  exit 0
fi
mkdir -p "$dest"
arch=$(dpkg --print-architecture)
epoch=0

# image NAME TAG FILL_FUNCTION ENTRYPOINT...: an image whose rootfs FILL_FUNCTION fills.
image() {
  local name=$1 tag=$2 fill=$3
  shift 3
  local tmp
  tmp=$(mktemp -d "$dest/.build.XXXXXX")
  umoci init --layout "$tmp/layout"
  umoci new --image "$tmp/layout:$tag"
  umoci unpack --image "$tmp/layout:$tag" "$tmp/bundle" >/dev/null
  "$fill" "$tmp/bundle/rootfs"
  find "$tmp/bundle/rootfs" -exec touch -h -d "@$epoch" {} +
  umoci repack --image "$tmp/layout:$tag" --history.created_by "tools/testenv/images.sh $name" "$tmp/bundle"
  local cfg=()
  for arg in "$@"; do cfg+=(--config.entrypoint "$arg"); done
  umoci config --image "$tmp/layout:$tag" --os linux --architecture "$arch" "${cfg[@]}" \
    --config.env PATH=/usr/local/bin:/usr/bin:/bin
  umoci gc --layout "$tmp/layout"
  jq --arg n "$name:$tag" --arg t "$tag" \
    '.manifests |= map(.annotations += {"io.containerd.image.name": $n, "org.opencontainers.image.ref.name": $t})' \
    "$tmp/layout/index.json" > "$tmp/index.json"
  mv "$tmp/index.json" "$tmp/layout/index.json"
  local file
  file="$dest/$(basename "$name")-$tag.oci.tar"
  tar -C "$tmp/layout" -cf "$file" oci-layout index.json blobs
  rm -rf "$tmp"
  echo "images: $name:$tag ($(stat -c %s "$file") bytes)" >&2
}

busybox_tree() {
  install -d "$1/bin" "$1/tmp" "$1/etc"
  install -m 0755 "$busybox" "$1/bin/busybox"
  for applet in $("$busybox" --list); do
    [ "$applet" = busybox ] || ln -sf busybox "$1/bin/$applet"
  done
  chmod 1777 "$1/tmp"
  echo 'root:x:0:0:root:/root:/bin/sh' > "$1/etc/passwd"
  echo 'root:x:0:' > "$1/etc/group"
}
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
