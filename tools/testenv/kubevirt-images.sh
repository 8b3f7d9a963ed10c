#!/usr/bin/env bash
# Builds the images of KubeVirt v1.8.0 for the test node, as oci-archives for
# `ctr images import`, from the commands tools/testenv/kubevirt.sh built from
# KubeVirt's Go module (umoci only, no registry, no container engine):
#
#   registry.test.local/virt-{operator,api,controller}:v1.8.0
#       the static command on a BusyBox tree, user 1001 (their Deployments
#       run as non-root)
#   registry.test.local/virt-handler:v1.8.0
#       Debian trixie with what virt-handler calls: qemu-img, nftables,
#       iproute2, findmnt/mount (util-linux), xorriso (cloud-init disks),
#       plus virt-handler and virt-chroot
#   registry.test.local/virt-launcher:v1.8.0
#       Debian trixie with libvirt 11.3 and QEMU 10.0 (closest Debian has to
#       the libvirt 11.9 / QEMU 10.1 KubeVirt v1.8.0 ships), OVMF, SeaBIOS,
#       iPXE ROMs, passt; virt-launcher, virt-launcher-monitor (with
#       cap_net_bind_service, as upstream), container-disk, virt-freezer,
#       virt-probe, virt-tail, node-labeller.sh; KubeVirt's qemu.conf and
#       virtqemud.conf. What differs from upstream's CentOS Stream image:
#       - Debian builds libvirt as one daemon (libvirtd), while
#         virt-launcher and node-labeller.sh start /usr/sbin/virtqemud and
#         talk to its socket `virtqemud-sock`: /usr/sbin/virtqemud here is a
#         wrapper that runs libvirtd with the same arguments and links
#         `virtqemud-sock` to libvirtd's socket.
#       - Debian names OVMF's 4 MiB builds OVMF_CODE_4M*.fd; KubeVirt looks
#         for OVMF_CODE.fd, OVMF_CODE.secboot.fd and OVMF_VARS*.fd: links
#         (the secure-boot variables are Debian's with Microsoft's keys
#         enrolled, as upstream's).
#
#   tools/testenv/kubevirt-images.sh KUBEVIRT_DIR OUT_DIR  (KUBEVIRT_DIR: what kubevirt.sh printed)
#
# Prints the directory of the archives. Nothing is rebuilt for the same
# inputs; the Debian root file systems are cached beside them.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
kubevirt=${1:?usage: $0 KUBEVIRT_DIR OUT_DIR}
out=${2:?usage: $0 KUBEVIRT_DIR OUT_DIR}
version=v1.8.0
busybox=/bin/busybox
for tool in umoci jq mmdebstrap setcap; do
  command -v "$tool" >/dev/null || { echo "kubevirt-images: $tool not found (apt-get install umoci jq mmdebstrap libcap2-bin)" >&2; exit 1; }
done
key=$(cat "$0" "$here/image-lib.sh" "$busybox" "$kubevirt"/bin/* "$kubevirt"/share/*.conf | sha256sum | cut -c1-12)
dest="$out/$key"
if [ -s "$dest/done" ]; then
  echo "$dest"
  exit 0
fi
mkdir -p "$dest"
arch=$(dpkg --print-architecture)
epoch=0
. "$here/image-lib.sh"

# rootfs NAME PACKAGES: a Debian trixie root file system as a tar, once per
# package list.
rootfs() {
  local tar
  tar="$out/$1-trixie-$(echo "$2" | sha256sum | cut -c1-12).tar"
  if [ ! -s "$tar" ]; then
    mmdebstrap --quiet --format=tar --variant=essential --include="$2" --mode=root \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
      --dpkgopt='path-exclude=/usr/share/locale/*' \
      trixie "$tar.part" >&2
    mv "$tar.part" "$tar"
  fi
  echo "$tar"
}
handler_base=$(rootfs handler qemu-utils,nftables,iptables,iproute2,util-linux,mount,procps,xorriso,findutils,kmod)
launcher_base=$(rootfs launcher libvirt-daemon,libvirt-daemon-driver-qemu,libvirt-clients,qemu-system-x86,qemu-utils,ovmf,seabios,ipxe-qemu,passt,iproute2,nftables,procps,util-linux,findutils,xorriso)

users() { # the qemu user (107) KubeVirt runs guests as, beside root
  grep -q '^qemu:' "$1/etc/passwd" || echo 'qemu:x:107:107:qemu:/home/qemu:/bin/bash' >> "$1/etc/passwd"
  grep -q '^qemu:' "$1/etc/group" || echo 'qemu:x:107:' >> "$1/etc/group"
  sed -i 's/^qemu:x:[0-9]*:[0-9]*:/qemu:x:107:107:/' "$1/etc/passwd"
  sed -i 's/^qemu:x:[0-9]*:/qemu:x:107:/' "$1/etc/group"
  install -d -o 107 -g 107 "$1/home/qemu"
}

command_tree() {
  busybox_tree "$1"
  echo 'kubevirt:x:1001:1001::/tmp:/bin/sh' >> "$1/etc/passwd"
  install -D -m 0755 "$kubevirt/bin/$current" "$1/usr/bin/$current"
}
handler_tree() {
  tar -C "$1" -xf "$handler_base"
  users "$1"
  install -m 0644 "$kubevirt/share/nsswitch.conf" "$1/etc/nsswitch.conf"
  install -m 0755 "$kubevirt/bin/virt-handler" "$kubevirt/bin/virt-chroot" "$1/usr/bin/"
}
launcher_tree() {
  local r=$1
  tar -C "$r" -xf "$launcher_base"
  users "$r"
  install -m 0644 "$kubevirt/share/nsswitch.conf" "$r/etc/nsswitch.conf"
  install -m 0644 "$kubevirt/share/qemu.conf" "$kubevirt/share/virtqemud.conf" "$r/etc/libvirt/"
  for cmd in virt-launcher virt-launcher-monitor container-disk virt-freezer virt-probe virt-tail node-labeller.sh; do
    install -m 0755 "$kubevirt/bin/$cmd" "$r/usr/bin/$cmd"
  done
  setcap cap_net_bind_service=+ep "$r/usr/bin/virt-launcher-monitor"
  cat > "$r/usr/sbin/virtqemud" <<'EOF'
#!/bin/bash
# KubeVirt starts virtqemud (libvirt's modular QEMU daemon); Debian builds
# the monolithic libvirtd, which serves the same QEMU driver. Run it with the
# same arguments and give its socket the name KubeVirt connects to.
dir=${XDG_RUNTIME_DIR:-/run}/libvirt
[ "$(id -u)" = 0 ] && dir=/run/libvirt
mkdir -p "$dir"
link() {
  for _ in $(seq 1 600); do
    if [ -S "$dir/libvirt-sock" ]; then
      ln -sfn libvirt-sock "$dir/virtqemud-sock"
      [ -S "$dir/libvirt-sock-ro" ] && ln -sfn libvirt-sock-ro "$dir/virtqemud-sock-ro"
      return 0
    fi
    sleep 0.05
  done
  echo "virtqemud wrapper: no libvirtd socket in $dir after 30 s" >&2
  return 1
}
case " $* " in
  *" -d "*|*" --daemon "*)
    /usr/sbin/libvirtd "$@" || exit $?
    link
    ;;
  *)
    /usr/sbin/libvirtd "$@" &
    pid=$!
    trap 'kill -TERM $pid 2>/dev/null' TERM INT
    link || { kill $pid; exit 1; }
    wait $pid
    ;;
esac
EOF
  chmod 0755 "$r/usr/sbin/virtqemud"
  local ovmf=$r/usr/share/OVMF
  ln -sfn OVMF_CODE_4M.fd "$ovmf/OVMF_CODE.fd"
  ln -sfn OVMF_VARS_4M.fd "$ovmf/OVMF_VARS.fd"
  ln -sfn OVMF_CODE_4M.secboot.fd "$ovmf/OVMF_CODE.secboot.fd"
  ln -sfn OVMF_VARS_4M.ms.fd "$ovmf/OVMF_VARS.secboot.fd"
  for f in OVMF_CODE.fd OVMF_VARS.fd OVMF_CODE.secboot.fd OVMF_VARS.secboot.fd; do
    [ -e "$ovmf/$f" ] || { echo "kubevirt-images: $ovmf/$f points nowhere" >&2; ls -l "$ovmf" >&2; exit 1; }
  done
  # KubeVirt's images carry these directories; the launcher writes into them
  # as user 107.
  # (/var/run is a link to /run: name /run itself, or install follows the
  # link out of the tree.)
  install -d -m 0755 -o 107 -g 107 "$r/run/kubevirt-private" "$r/var/lib/libvirt/qemu/nvram" "$r/var/cache/libvirt" "$r/var/lib/swtpm-localca"
  chmod 0644 "$r/etc/libvirt/qemu.conf"
}

for current in virt-operator virt-api virt-controller; do
  IMAGE_USER=1001 image "registry.test.local/$current" "$version" command_tree "/usr/bin/$current"
done
# Debian's tools are in sbin too (libvirtd, nft, ip).
export IMAGE_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
image registry.test.local/virt-handler "$version" handler_tree /usr/bin/virt-handler
image registry.test.local/virt-launcher "$version" launcher_tree /usr/bin/virt-launcher
echo ok > "$dest/done"
echo "$dest"
