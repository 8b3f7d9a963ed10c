# Shared by the test node's image scripts (sourced, not run): umoci only, no
# registry and no container engine. The caller sets `dest` (output dir),
# `arch` (dpkg architecture) and `epoch` (timestamps in the layers); an
# image's user comes from IMAGE_USER and its PATH from IMAGE_PATH when set.

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
  umoci repack --image "$tmp/layout:$tag" --history.created_by "tools/testenv/$(basename "$0") $name" "$tmp/bundle"
  local cfg=()
  [ -n "${IMAGE_USER:-}" ] && cfg+=(--config.user "$IMAGE_USER")
  for arg in "$@"; do cfg+=(--config.entrypoint "$arg"); done
  umoci config --image "$tmp/layout:$tag" --os linux --architecture "$arch" "${cfg[@]}" \
    --config.env "PATH=${IMAGE_PATH:-/usr/local/bin:/usr/bin:/bin}"
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
