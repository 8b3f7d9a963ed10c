#!/usr/bin/env bash
# Builds the release OCI image of vmmigrate without a container engine or a
# registry: Debian bookworm packages via mmdebstrap for the base, umoci for the
# image. Same contents as the repository's Dockerfile.
#
#   tools/image/build.sh BINARY [OUT_DIR]   (OUT_DIR default ~/.cache/vmmigrate/image)
#
# Produces OUT_DIR/vmmigrate (OCI layout, tag <version>) and
# OUT_DIR/vmmigrate-<version>.oci.tar (the same layout as an oci-archive, for
# `ctr image import`, `skopeo copy oci-archive:...`, `podman load`).
#
# Why umoci and not buildah: umoci only reads and writes the OCI layout
# directory. It needs no storage driver, no containers/storage under
# /var/lib/containers and no daemon, and its layers are plain diffs of a
# directory we fill with tar and install(1), so the result depends only on the
# inputs. buildah would work too (vfs as root) but copies every layer through
# its own store first.
#
# Environment:
#   VMMIGRATE_IMAGE_CACHE     base rootfs cache (default ~/.cache/vmmigrate/image)
#   VMMIGRATE_IMAGE_NAME      name containerd gives the archive on import
#                             (default registry.example.net/platform/vmmigrate,
#                             the name deploy/ uses)
#   VMMIGRATE_IMAGE_SOURCE    org.opencontainers.image.source label
#   VMMIGRATE_IMAGE_REFRESH=1 rebuild the base even if cached (security updates)
#   SOURCE_DATE_EPOCH         timestamps in the image (default: commit times, below)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
bin=${1:?usage: $0 BINARY [OUT_DIR]}
out=${2:-$HOME/.cache/vmmigrate/image}
cache=${VMMIGRATE_IMAGE_CACHE:-$HOME/.cache/vmmigrate/image}
name=${VMMIGRATE_IMAGE_NAME:-registry.example.net/platform/vmmigrate}
source_url=${VMMIGRATE_IMAGE_SOURCE:-$(git -C "$repo" remote get-url origin 2>/dev/null || echo https://git.example.net/platform/vmmigrate)}

for tool in mmdebstrap umoci jq; do
  command -v "$tool" >/dev/null || { echo "image: $tool not found (apt-get install mmdebstrap umoci jq)" >&2; exit 1; }
done
[ -x "$bin" ] || { echo "image: $bin is not an executable" >&2; exit 1; }
version=$("$bin" --version | awk '$1 == "vmmigrate" {print $2; exit}')
[ -n "$version" ] || { echo "image: '$bin --version' did not print 'vmmigrate <version>'" >&2; exit 1; }
# Timestamps: the image's from HEAD, the base's from the last change to this
# script (its recipe), so two machines at different commits build the same
# base layer from the same mirror content. SOURCE_DATE_EPOCH overrides both.
base_epoch=${SOURCE_DATE_EPOCH:-$(git -C "$repo" log -1 --format=%ct -- tools/image/build.sh 2>/dev/null || true)}
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git -C "$repo" log -1 --format=%ct 2>/dev/null || echo 0)}
base_epoch=${base_epoch:-$SOURCE_DATE_EPOCH}
created=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)

# --- base root file system, cached by everything that decides its contents ---
# What the binary runs: git (status branch pushes, ssh:// and file://
# repositories), ssh (git over ssh), qemu-img (conversion), CA roots (HTTPS),
# and for converting whole guests virt-v2v with guestfish, the nbdkit and
# nbdcopy it runs, a kernel for libguestfs's appliance (supermin builds
# the appliance from the image's own files at first use, under $TMPDIR), and
# OVMF, whose files virt-v2v names when it describes a UEFI guest's output.
packages=(ca-certificates git openssh-client qemu-utils virt-v2v guestfish nbdkit libnbd-bin linux-image-cloud-amd64 ovmf)
suite=bookworm
# essential: dpkg, coreutils, a shell; no apt (nothing installs at run time).
variant=essential
# Left out at unpack time. Copyright files stay: the image redistributes the
# packages.
dpkgopts=(
  'path-exclude=/usr/share/doc/*' 'path-include=/usr/share/doc/*/copyright'
  'path-exclude=/usr/share/man/*' 'path-exclude=/usr/share/info/*'
  'path-exclude=/usr/share/locale/*' 'path-exclude=/usr/share/lintian/*'
  'path-exclude=/usr/share/bash-completion/*' 'path-exclude=/usr/share/zsh/*'
)
# Run on the finished tree ($1). resolv.conf and hostname are the host's
# otherwise; runtimes mount their own over them. /var/tmp is /tmp (the one
# writable directory): QEMU puts libguestfs's appliance overlay there.
# shellcheck disable=SC2016
cleanup='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/* "$1"/var/cache/debconf/*-old \
  "$1"/var/lib/dpkg/*-old "$1"/var/log/*.log "$1"/var/log/apt/* "$1"/usr/share/info/* \
  "$1"/usr/share/doc/*/README* && : > "$1"/etc/resolv.conf && : > "$1"/etc/hostname \
  && rm -rf "$1"/var/tmp && ln -s /tmp "$1"/var/tmp'
recipe=$(printf '%s\n' "suite=$suite" "variant=$variant" "arch=$(dpkg --print-architecture)" \
  "packages=${packages[*]}" "dpkgopts=${dpkgopts[*]}" "cleanup=$cleanup" "mmdebstrap=$(mmdebstrap --version)")
key=$(printf '%s' "$recipe" | sha256sum | cut -c1-12)
base="$cache/base/$suite-$key.tar"

mkdir -p "$cache/base" "$out"
if [ ! -s "$base" ] || [ -n "${VMMIGRATE_IMAGE_REFRESH:-}" ]; then
  echo "image: building base rootfs ($suite, ${packages[*]}) from the Debian mirror..." >&2
  start=$(date +%s)
  opts=()
  for o in "${dpkgopts[@]}"; do opts+=(--dpkgopt="$o"); done
  # No mirror argument: deb.debian.org with bookworm-updates and -security.
  SOURCE_DATE_EPOCH=$base_epoch mmdebstrap --quiet --mode=root --format=tar --variant="$variant" --include="$(IFS=,; echo "${packages[*]}")" \
    "${opts[@]}" --customize-hook="$cleanup" \
    --customize-hook="dpkg-query --admindir=\"\$1\"/var/lib/dpkg -W -f='\${Package} \${Version}\n' > '$base.packages.tmp.$$'" \
    "$suite" "$base.tmp.$$"
  printf '%s\n' "$recipe" > "$base.recipe"
  mv "$base.packages.tmp.$$" "$base.packages"
  mv "$base.tmp.$$" "$base"
  echo "image: base built in $(( $(date +%s) - start ))s: $base" >&2
else
  echo "image: base cached: $base" >&2
fi

# --- the image ---
tmp=$(mktemp -d "$out/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
layout="$tmp/vmmigrate"
bundle="$tmp/bundle"
rootfs="$bundle/rootfs"
hist=(--history.created "$created")

umoci init --layout "$layout"
umoci new --image "$layout:$version"
umoci unpack --image "$layout:$version" "$bundle" >/dev/null
# /dev is the runtime's; device nodes in a layer only get in the way.
tar -xpf "$base" -C "$rootfs" --numeric-owner --exclude='./dev/*'
umoci repack --refresh-bundle --image "$layout:$version" "${hist[@]}" \
  --history.created_by "mmdebstrap --variant=$variant $suite (${packages[*]})" "$bundle"

# Non-root, numeric so runAsNonRoot can verify it. ssh refuses a uid without a
# passwd entry, hence the user; its home is /tmp (an emptyDir in the
# Deployment, the root filesystem is read-only there). The work and cache
# directories are volumes in the Deployment; these make the image usable alone.
install -m 0755 -o 0 -g 0 "$bin" "$rootfs/usr/local/bin/vmmigrate"
echo 'vmmigrate:x:65532:65532:vmmigrate:/tmp:/usr/sbin/nologin' >> "$rootfs/etc/passwd"
echo 'vmmigrate:x:65532:' >> "$rootfs/etc/group"
install -d -m 0755 -o 65532 -g 65532 "$rootfs/var/lib/vmmigrate" "$rootfs/var/cache/vmmigrate"
for p in usr/local/bin/vmmigrate usr/local/bin etc/passwd etc/group etc \
         var/lib/vmmigrate var/cache/vmmigrate var/lib var/cache; do
  touch -h -d "@$SOURCE_DATE_EPOCH" "$rootfs/$p"
done
umoci repack --image "$layout:$version" "${hist[@]}" \
  --history.created_by "vmmigrate $version binary, user 65532, /var/lib/vmmigrate, /var/cache/vmmigrate" "$bundle"

cfg=(--config.user 65532:65532 --config.entrypoint /usr/local/bin/vmmigrate
  --config.env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
  --config.env HOME=/tmp
  --config.label org.opencontainers.image.title=vmmigrate
  --config.label org.opencontainers.image.version="$version"
  --config.label org.opencontainers.image.source="$source_url"
  --config.label org.opencontainers.image.licenses=Apache-2.0)
umoci config --image "$layout:$version" --created "$created" --os linux \
  --architecture "$(dpkg --print-architecture)" "${cfg[@]}" "${hist[@]}" \
  --history.created_by "config: user 65532:65532, entrypoint /usr/local/bin/vmmigrate, HOME=/tmp"
umoci gc --layout "$layout"

# containerd names an imported image after io.containerd.image.name (what
# `ctr export` writes), then ref.name; OCI tools read the tag from ref.name.
jq --arg n "$name:$version" --arg t "$version" -S \
  '.manifests |= map(.annotations += {"io.containerd.image.name": $n, "org.opencontainers.image.ref.name": $t})' \
  "$layout/index.json" > "$tmp/index.json"
mv "$tmp/index.json" "$layout/index.json"
find "$layout" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
# The oci-archive is the layout as a tar, index.json at the top.
tar -C "$layout" --sort=name --mtime="@$SOURCE_DATE_EPOCH" --owner=0 --group=0 --numeric-owner \
  --format=posix --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
  -cf "$tmp/archive.tar" oci-layout index.json blobs

manifest=$(jq -r '.manifests[0].digest' "$layout/index.json" | sed 's/^sha256://')
layers=$(jq '[.layers[].size] | add' "$layout/blobs/sha256/$manifest")
unpacked=$(du -sb --apparent-size "$rootfs" | cut -f1)
binsize=$(stat -c %s "$bin")

rm -rf "$out/vmmigrate"
mv "$layout" "$out/vmmigrate"
mv "$tmp/archive.tar" "$out/vmmigrate-$version.oci.tar"
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
echo "image: $out/vmmigrate:$version (containerd name $name:$version)" >&2
echo "image: archive $out/vmmigrate-$version.oci.tar ($(mib "$(stat -c %s "$out/vmmigrate-$version.oci.tar")"))" >&2
echo "image: layers $(mib "$layers") compressed, rootfs $(mib "$unpacked") unpacked (binary $(mib "$binsize"))" >&2
echo "$out/vmmigrate:$version"
