#!/usr/bin/env bash
# Builds Debian guests shaped like guests that lived on VMware ESXi, for the
# tests that prove conversion: they boot on VMware's hardware (pvscsi,
# vmxnet3) and not on virtio until something converts them.
#
# Usage: tools/guest/vmware.sh [OUT_ROOT]
#   OUT_ROOT defaults to ${VMMIGRATE_CACHE:-$HOME/.cache/vmmigrate}/vmware-guest.
#   The images go to OUT_ROOT/<key>/, <key> being the first 12 hex digits of a
#   sha256 over this script and tools/guest/vmware/. Nothing is rebuilt when
#   OUT_ROOT/<key>/done exists. The directory is the last line on stdout;
#   progress goes to stderr.
#
# Output (raw, sparse):
#   vmware-bios.img       MBR, one ext4 root, GRUB for BIOS (grub-pc).
#   vmware-uefi.img       On NVMe, as ESXi gives recent guests (OVMF has no
#                         PVSCSI driver to boot from here): its initramfs
#                         holds nvme besides vmw_pvscsi.
#                         GPT, an EFI System Partition and an ext4 root.
#                         Shim and the signed GRUB where Debian's installer
#                         puts them (\EFI\debian, with the grub.cfg virt-v2v
#                         looks for) and at the removable path
#                         (\EFI\BOOT\BOOTX64.EFI: an ESXi guest's NVRAM boot
#                         entries do not come along).
#   vmware-uefi-data.img  GPT, one ext4 file system that the UEFI guest mounts
#                         at /srv/data by UUID from /etc/fstab.
#   manifest.txt          sizes, sha256, package versions, file system UUIDs.
#
# What makes them VMware-shaped (tools/guest/vmware/common):
#   - initramfs-tools with MODULES=list and only vmw_pvscsi, sd_mod and ext4:
#     a host-only initramfs as an install on VMware has (RHEL's dracut does
#     the same by default). On virtio the initramfs gives up on its root.
#   - /etc/network/interfaces configures ens192 (what ESXi names a vmxnet3
#     NIC) with the static address 10.0.2.2/24 via 10.0.2.1, which is
#     KubeVirt's masquerade binding.
#   - open-vm-tools installed and enabled.
#   - the guest's own service: busybox httpd on port 80 serving a page that
#     names the host, ens192's address, whether VMware Tools are installed
#     and the data disk's marker; the same line goes to the serial console
#     ("vmmigrate-guest: ready ...").
#   - the kernel and GRUB talk on ttyS0 as well, so KubeVirt's guest console
#     log has the initramfs's words when it gives up.
#
# The file systems get their UUIDs when they are made (mke2fs uuid:): one set
# afterwards (set-uuid) is not in the appliance's /dev/disk/by-uuid, and
# grub-install then looks for /boot on the appliance's own disk. Even so, it
# has once found no partition table on the disk (udev still busy with the
# disk's events): it runs after udev settles, and up to three times.
#
# How, without mounts or loop devices: mmdebstrap --mode=unshare makes each
# root file system as a tar; guestfish (libguestfs, in its own small VM)
# partitions the image, makes the file systems, unpacks the tar and runs
# grub-install and update-grub inside the guest's tree. libguestfs runs under
# TCG here (LIBGUESTFS_BACKEND_SETTINGS=force_tcg) because /dev/kvm cannot
# run guests on this machine kind.
#
# Host packages (Debian bookworm), as root: mmdebstrap guestfish
# linux-image-cloud-amd64 (libguestfs builds its appliance from a kernel in
# /boot). About 7 minutes on 2 cores; about 1 GiB of downloads and scratch.
set -euo pipefail

log() { echo "vmware.sh: $*" >&2; }
die() { echo "vmware.sh: error: $*" >&2; exit 1; }

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out_root=${1:-${VMMIGRATE_CACHE:-$HOME/.cache/vmmigrate}/vmware-guest}
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1704067200} # 2024-01-01T00:00:00Z
export TZ=UTC LC_ALL=C
export LIBGUESTFS_BACKEND=${LIBGUESTFS_BACKEND:-direct}
# Software emulation unless told otherwise: /dev/kvm here cannot run guests.
export LIBGUESTFS_BACKEND_SETTINGS=${LIBGUESTFS_BACKEND_SETTINGS-force_tcg}

# Fixed file system UUIDs: fstab and the tests name them.
BIOS_ROOT_UUID=766d6d67-b105-4000-8000-000000000001
UEFI_ROOT_UUID=766d6d67-0ef1-4000-8000-000000000002
UEFI_DATA_UUID=766d6d67-da7a-4000-8000-000000000003

key=$( {
	sha256sum "$here/vmware.sh"
	(cd "$here/vmware" && find . -type f | sort | xargs sha256sum)
} | sha256sum | cut -c1-12)
dest=$out_root/$key
if [ -e "$dest/done" ]; then
	log "up to date: $dest"
	echo "$dest"
	exit 0
fi

export PATH=$PATH:/usr/sbin:/sbin
for t in mmdebstrap:mmdebstrap guestfish:guestfish qemu-system-x86_64:qemu-system-x86 sha256sum:coreutils; do
	command -v "${t%%:*}" >/dev/null || die "missing tool ${t%%:*} (Debian package: ${t#*:})"
done
ls /boot/vmlinuz-* >/dev/null 2>&1 || die "libguestfs needs a kernel in /boot (Debian package: linux-image-cloud-amd64)"

mkdir -p "$out_root"
work=$(mktemp -d "$out_root/.build.XXXXXX")
trap 'rm -rf "$work"' EXIT
log "building $dest (work dir $work)"

# rootfs NAME GRUB-PACKAGE: the guest's tree as a tar.
rootfs() {
	local name=$1 grub=$2 started
	if [ -s "$tars/$name.tar" ]; then
		ln -f "$tars/$name.tar" "$work/$name.tar"
		return
	fi
	started=$(date +%s)
	mmdebstrap --mode=unshare --variant=minbase --quiet \
		--include="linux-image-cloud-amd64,$grub,initramfs-tools,systemd-sysv,udev,kmod,ifupdown,iproute2,netbase,open-vm-tools,busybox,e2fsprogs,util-linux" \
		--dpkgopt='path-exclude=/usr/share/man/*' \
		--dpkgopt='path-exclude=/usr/share/doc/*' \
		--dpkgopt='path-exclude=/usr/share/locale/*' \
		--dpkgopt='path-include=/usr/share/locale/locale.alias' \
		--customize-hook="sync-in '$here/vmware/common' /" \
		--customize-hook="echo $name > \"\$1/etc/hostname\"" \
		--customize-hook='chmod 0755 "$1/usr/local/sbin/vmmigrate-page"' \
		--customize-hook='chroot "$1" systemctl enable vmmigrate-page.service open-vm-tools.service' \
		--customize-hook='chroot "$1" update-initramfs -u -k all' \
		--customize-hook='chroot "$1" dpkg-query -W -f "\${Package} \${Version}\n" > "$1/root/packages.txt"' \
		--customize-hook='rm -f "$1/etc/machine-id" "$1/var/lib/dbus/machine-id"; touch "$1/etc/machine-id"' \
		bookworm "$tars/$name.partial.tar" >&2 || die "mmdebstrap for $name failed"
	mv "$tars/$name.partial.tar" "$tars/$name.tar"
	ln -f "$tars/$name.tar" "$work/$name.tar"
	log "$name root file system: $(du -m "$tars/$name.tar" | cut -f1) MiB in $(( $(date +%s) - started )) s"
}

# The root file systems are kept, under a key of their own (what makes them),
# until the images are done: a later step that fails does not cost their
# five minutes each again.
# GRUB as Debian's installer sets it up: grub-pc on BIOS; on UEFI shim and
# the signed GRUB, with which grub-install also writes the grub.cfg in
# \EFI\debian that virt-v2v looks for on UEFI guests.
BIOS_GRUB=grub-pc
UEFI_GRUB=grub-efi-amd64,grub-efi-amd64-signed,shim-signed
tars=$out_root/.rootfs-$( {
	declare -f rootfs
	echo "$BIOS_GRUB $UEFI_GRUB"
	(cd "$here/vmware" && find . -type f | sort | xargs sha256sum)
} | sha256sum | cut -c1-12)
mkdir -p "$tars"

rootfs vmware-bios "$BIOS_GRUB"
rootfs vmware-uefi "$UEFI_GRUB"

started=$(date +%s)
truncate -s 1536M "$work/vmware-bios.img"
guestfish --rw -a "$work/vmware-bios.img" >&2 <<EOF || die "guestfish for vmware-bios failed"
run
part-init /dev/sda mbr
part-add /dev/sda p 2048 -1
part-set-bootable /dev/sda 1 true
mke2fs /dev/sda1 fstype:ext4 label:vmmroot uuid:$BIOS_ROOT_UUID
mount /dev/sda1 /
tar-in $work/vmware-bios.tar / xattrs:true
write /etc/fstab "UUID=$BIOS_ROOT_UUID / ext4 errors=remount-ro 0 1\n"
-debug sh "udevadm settle --timeout=120"
command "sh -c 'for try in 1 2 3; do grub-install --target=i386-pc /dev/sda && exit 0; sleep 5; done; exit 1'"
command "update-grub"
umount-all
EOF
log "vmware-bios.img in $(( $(date +%s) - started )) s"

started=$(date +%s)
truncate -s 1536M "$work/vmware-uefi.img"
truncate -s 64M "$work/vmware-uefi-data.img"
guestfish --rw -a "$work/vmware-uefi.img" -a "$work/vmware-uefi-data.img" >&2 <<EOF || die "guestfish for vmware-uefi failed"
run
part-init /dev/sda gpt
part-add /dev/sda p 2048 133119
part-set-gpt-type /dev/sda 1 C12A7328-F81F-11D2-BA4B-00A0C93EC93B
part-add /dev/sda p 133120 -34
mkfs vfat /dev/sda1 label:VMMESP
mke2fs /dev/sda2 fstype:ext4 label:vmmroot uuid:$UEFI_ROOT_UUID
part-init /dev/sdb gpt
part-add /dev/sdb p 2048 -34
mke2fs /dev/sdb1 fstype:ext4 label:vmmdata uuid:$UEFI_DATA_UUID
mount /dev/sda2 /
tar-in $work/vmware-uefi.tar / xattrs:true
mkdir-p /boot/efi
mount /dev/sda1 /boot/efi
mkdir-p /srv/data
mount /dev/sdb1 /srv/data
write /srv/data/vmmigrate-data.txt "vmmigrate-data-disk-$UEFI_DATA_UUID"
write /etc/initramfs-tools/modules "vmw_pvscsi\nnvme\nsd_mod\next4\n"
command "update-initramfs -u -k all"
# The ESP by its label: blkid run in the guest's tree here once named the
# data disk's file system for /dev/sda1, and the guest then failed to mount
# it ("bogus number of reserved sectors") and virt-v2v found no /boot/efi.
write /etc/fstab "UUID=$UEFI_ROOT_UUID / ext4 errors=remount-ro 0 1\nUUID=$UEFI_DATA_UUID /srv/data ext4 defaults 0 2\nLABEL=VMMESP /boot/efi vfat umask=0077 0 1\n"
-debug sh "udevadm settle --timeout=120"
command "grub-install --target=x86_64-efi --efi-directory=/boot/efi --bootloader-id=debian --no-nvram"
command "grub-install --target=x86_64-efi --efi-directory=/boot/efi --removable --no-nvram"
command "test -f /boot/efi/EFI/debian/grub.cfg -a -f /boot/efi/EFI/debian/shimx64.efi"
command "update-grub"
umount-all
EOF
log "vmware-uefi.img in $(( $(date +%s) - started )) s"

MiB=1048576
images="vmware-bios.img vmware-uefi.img vmware-uefi-data.img"
{
	echo "# VMware-shaped guest images, built by tools/guest/vmware.sh"
	echo "key: $key"
	echo "bios_root_uuid: $BIOS_ROOT_UUID"
	echo "uefi_root_uuid: $UEFI_ROOT_UUID"
	echo "uefi_data_uuid: $UEFI_DATA_UUID"
	echo "libguestfs: ${LIBGUESTFS_BACKEND_SETTINGS:-kvm}"
	echo "# file bytes allocated-MiB sha256"
	for f in $images; do
		echo "$f $(stat -c %s "$work/$f") $(( $(du -k "$work/$f" | cut -f1) / 1024 )) $(sha256sum "$work/$f" | cut -d' ' -f1)"
	done
	tar -xOf "$work/vmware-bios.tar" ./root/packages.txt | grep -E '^(linux-image-[0-9]|open-vm-tools|grub-pc|initramfs-tools|systemd) ' | sed 's/^/package: /'
} > "$work/manifest.txt"
cat "$work/manifest.txt" >&2

mkdir -p "$work/out"
if [ -d "$dest" ] && [ ! -e "$dest/done" ]; then rm -rf "$dest"; fi
for f in $images manifest.txt; do mv "$work/$f" "$work/out/"; done
touch "$work/out/done"
# Only the current root file systems are kept (700 MiB).
for old in "$out_root"/.rootfs-*; do [ "$old" = "$tars" ] || rm -rf "$old"; done
if ! mv -T "$work/out" "$dest" 2>/dev/null; then
	[ -e "$dest/done" ] || die "cannot move the result to $dest"
fi
log "done: $dest"
echo "$dest"
