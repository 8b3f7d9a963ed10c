#!/usr/bin/env bash
# Builds small bootable Linux guest disk images for vmmigrate's tests.
#
# Usage: tools/guest/build.sh [OUT_ROOT]
#   OUT_ROOT defaults to ${VMMIGRATE_CACHE:-$HOME/.cache/vmmigrate}/guest.
#   GUEST_SECUREBOOT=0 skips secureboot.img (it is part of the key).
#   The images go to OUT_ROOT/<key>/, where <key> is the first 12 hex digits of
#   a sha256 over this script and the files under tools/guest/rootfs/. If
#   OUT_ROOT/<key>/done exists nothing is rebuilt. The directory is printed as
#   the last line on stdout; progress goes to stderr.
#
# Output (all raw images, sizes multiples of 1 MiB):
#   bios.img    MBR, one bootable FAT partition, SYSLINUX; boots under SeaBIOS.
#   efi.img     GPT, one EFI System Partition, unsigned systemd-boot as
#               \EFI\BOOT\BOOTX64.EFI; boots under OVMF with secure boot off.
#   secureboot.img  GPT, ESP with Debian's signed shim (\EFI\BOOT\BOOTX64.EFI),
#               signed GRUB and the signed kernel; boots under OVMF with secure
#               boot ON (OVMF_CODE_4M.ms.fd + OVMF_VARS_4M.ms.fd, needs >= 512
#               MiB of guest RAM). Left out when GUEST_SECUREBOOT=0.
#   data.img    4 MiB ext4 file system (label "vmmdata") holding
#               vmmigrate-data.txt; the guest reports it as a second disk.
#   nodisk.img  same size as bios.img, zeros plus a text marker, no boot code:
#               the "guest that does not boot" case.
#   manifest.txt  sizes, sha256, package versions.
#
# The guest is Debian's linux-image-cloud-amd64 kernel plus an initramfs
# (zstd cpio) holding busybox-static, the real qemu-ga with the shared
# libraries it links, a few kernel modules, and tools/guest/rootfs/ (init
# script, udhcpc script, page generator). There is no root file system. The
# init logs "vmmigrate-guest: booted ..." and "vmmigrate-guest: ready" to the
# serial console, runs udhcpc on every ethernet interface, qemu-ga on the
# org.qemu.guest_agent.0 virtio-serial port and busybox httpd on port 80.
#
# Packages come from the configured Debian (bookworm) apt sources with
# "apt-get download" and are unpacked with dpkg-deb; nothing is installed on
# the host. No loop devices or mounts are used: partitions are written with
# sfdisk into the image file, FAT with mtools, ext4 with mke2fs -d (times
# pinned with debugfs).
#
# Host packages needed (Debian bookworm):
#   apt dpkg coreutils findutils util-linux fdisk mtools syslinux
#   syslinux-common systemd-boot-efi cpio zstd kmod e2fsprogs libc-bin
#   libglib2.0-0 libnuma1 liburing2 libudev1 libpcre2-8-0 (qemu-ga's libraries,
#   copied from the host; the host must be bookworm like the packages)
# boot-test.sh additionally needs: qemu-system-x86 ovmf curl python3.
#
# Reproducibility: file times are set to SOURCE_DATE_EPOCH (default fixed
# below), the cpio archive is written with --reproducible, FAT volume ids,
# disk ids and partition GUIDs are fixed. Package versions are whatever apt
# resolves at build time; they are recorded in manifest.txt (not in the key).
set -euo pipefail

log() { echo "build.sh: $*" >&2; }
die() { echo "build.sh: error: $*" >&2; exit 1; }

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out_root=${1:-${VMMIGRATE_CACHE:-$HOME/.cache/vmmigrate}/guest}

# Kernel modules loaded by the guest init (dependencies are added from
# modules.dep). e1000/e1000e and ahci (SATA) are not built for the cloud
# kernel at all; ata_piix (IDE) is left out to save 1 MiB.
MODULES="virtio_pci virtio_blk virtio_scsi sd_mod virtio_net virtio_console
virtio_rng virtio_balloon vmxnet3 vmw_pvscsi button evdev"

export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1704067200} # 2024-01-01T00:00:00Z
export TZ=UTC LC_ALL=C
GUEST_SECUREBOOT=${GUEST_SECUREBOOT:-1}

# ---- cache key --------------------------------------------------------------
key=$( {
	echo "secureboot=$GUEST_SECUREBOOT"
	sha256sum "$here/build.sh"
	(cd "$here/rootfs" && find . -type f | sort | xargs sha256sum)
} | sha256sum | cut -c1-12)
dest=$out_root/$key
if [ -e "$dest/done" ]; then
	log "up to date: $dest"
	echo "$dest"
	exit 0
fi

# ---- host tools -------------------------------------------------------------
need() { # need TOOL PACKAGE
	command -v "$1" >/dev/null 2>&1 || PATH=$PATH:/usr/sbin:/sbin command -v "$1" >/dev/null 2>&1 ||
		die "missing tool '$1' (Debian package: $2)"
}
export PATH=$PATH:/usr/sbin:/sbin
need apt-get apt
need dpkg-deb dpkg
need sha256sum coreutils
need truncate coreutils
need sfdisk fdisk
need mformat mtools
need mcopy mtools
need mmd mtools
need syslinux syslinux
need cpio cpio
need zstd zstd
need depmod kmod
need modprobe kmod
need mke2fs e2fsprogs
need debugfs e2fsprogs
need ldd libc-bin
SYSLINUX_MBR=/usr/lib/syslinux/mbr/mbr.bin
[ -f "$SYSLINUX_MBR" ] || die "missing $SYSLINUX_MBR (Debian package: syslinux-common)"
[ -f /usr/lib/syslinux/modules/bios/ldlinux.c32 ] ||
	die "missing /usr/lib/syslinux/modules/bios/ldlinux.c32 (Debian package: syslinux-common)"
SDBOOT=/usr/lib/systemd/boot/efi/systemd-bootx64.efi
[ -f "$SDBOOT" ] || die "missing $SDBOOT (Debian package: systemd-boot-efi)"

mkdir -p "$out_root"
work=$(mktemp -d "$out_root/.build.XXXXXX")
trap 'rm -rf "$work"' EXIT
log "building $dest (work dir $work)"

# ---- packages ---------------------------------------------------------------
apt_dl() { # apt_dl PACKAGE... (into $work/debs)
	local opts=()
	[ "$(id -u)" = 0 ] && opts=(-o APT::Sandbox::User=root)
	(cd "$work/debs" && apt-get -q "${opts[@]}" download "$@" >&2) ||
		die "apt-get download $* failed (run 'apt-get update'? bookworm sources configured?)"
}
mkdir -p "$work/debs"
apt_dl linux-image-cloud-amd64
meta=$(ls "$work"/debs/linux-image-cloud-amd64_*.deb)
kpkg=$(dpkg-deb -f "$meta" Depends | tr ',' '\n' | sed -n 's/^ *\(linux-image-[0-9][^ ]*\).*/\1/p' | head -n1)
[ -n "$kpkg" ] || die "cannot find the kernel package in the Depends of $meta"
apt_dl "$kpkg" qemu-guest-agent busybox-static
[ "$GUEST_SECUREBOOT" = 0 ] || apt_dl shim-signed grub-efi-amd64-signed
for d in "$work"/debs/*.deb; do
	log "package $(dpkg-deb -f "$d" Package) $(dpkg-deb -f "$d" Version)"
done
dpkg-deb -x "$(ls "$work"/debs/"$kpkg"_*.deb)" "$work/kernel"
dpkg-deb -x "$(ls "$work"/debs/qemu-guest-agent_*.deb)" "$work/qga"
dpkg-deb -x "$(ls "$work"/debs/busybox-static_*.deb)" "$work/busybox"
kver=$(ls "$work/kernel/lib/modules")
[ -f "$work/kernel/boot/vmlinuz-$kver" ] || die "no vmlinuz-$kver in $kpkg"
log "kernel $kver"

# ---- initramfs --------------------------------------------------------------
root=$work/initramfs
mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,lib,lib64,proc,sys,dev,run,tmp,mnt,www,root,var,etc/vmmigrate}
ln -s ../run "$root/var/run"
cp -a "$here/rootfs/." "$root/"
# Scripts get 0755, other files 0644, whatever the checkout did.
find "$root" -type f | while read -r f; do
	if [ "$(head -c2 "$f")" = '#!' ]; then chmod 0755 "$f"; else chmod 0644 "$f"; fi
done

install -m 0755 "$work/busybox/bin/busybox" "$root/bin/busybox"
for a in $("$root/bin/busybox" --list); do
	case "$a" in busybox) continue ;; esac
	[ -e "$root/bin/$a" ] || [ -e "$root/sbin/$a" ] || ln -s busybox "$root/bin/$a"
done

install -m 0755 "$work/qga/usr/sbin/qemu-ga" "$root/usr/sbin/qemu-ga"
ldd "$work/qga/usr/sbin/qemu-ga" > "$work/qga.ldd" || die "ldd on qemu-ga failed"
if grep -q 'not found' "$work/qga.ldd"; then
	die "qemu-ga libraries missing on the host: $(grep 'not found' "$work/qga.ldd" | awk '{print $1}' | tr '\n' ' ')(install libglib2.0-0 libnuma1 liburing2 libudev1 libpcre2-8-0)"
fi
for lib in $(awk '/=> \// {print $3} /^[[:space:]]*\/[^ ]*ld-linux/ {print $1}' "$work/qga.ldd"); do
	mkdir -p "$root$(dirname "$lib")"
	cp -L "$lib" "$root$lib"
	chmod 0755 "$root$lib"
done
mkdir -p "$root/etc/qemu"

# Kernel modules and their dependencies, resolved with the host's kmod.
kmods=$work/kernel/lib/modules/$kver
depmod -b "$work/kernel" "$kver"
mkdir -p "$root/lib/modules/$kver"
for m in $MODULES; do
	out=$(modprobe -d "$work/kernel" -S "$kver" --show-depends "$m") ||
		die "module $m not found for $kver"
	echo "$out" | awk '$1 == "insmod" {print $2}' | while read -r ko; do
		rel=${ko#"$work/kernel"}
		mkdir -p "$root$(dirname "$rel")"
		cp "$ko" "$root$rel"
	done
done
cp "$kmods"/modules.builtin "$kmods"/modules.builtin.modinfo "$kmods"/modules.order "$root/lib/modules/$kver/"
depmod -b "$root" "$kver"
echo $MODULES | tr ' ' '\n' > "$root/etc/vmmigrate/modules"
log "modules: $(find "$root/lib/modules" -name '*.ko' | wc -l) files, $(du -sk "$root/lib/modules" | cut -f1) KiB"

find "$root" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
(cd "$root" && find . -mindepth 1 | sort | cpio --quiet -o -H newc -R 0:0 --reproducible) |
	zstd -q -19 -T1 --no-progress > "$work/initrd.img"
cp "$work/kernel/boot/vmlinuz-$kver" "$work/vmlinuz"
touch -d "@$SOURCE_DATE_EPOCH" "$work/initrd.img" "$work/vmlinuz"
log "initrd.img $(du -k "$work/initrd.img" | cut -f1) KiB, vmlinuz $(du -k "$work/vmlinuz" | cut -f1) KiB"

# ---- boot images ------------------------------------------------------------
CMDLINE="console=tty0 console=ttyS0,115200 quiet panic=10 rdinit=/init"
MiB=1048576
payload=$(( $(stat -c %s "$work/vmlinuz") + $(stat -c %s "$work/initrd.img") ))
# FAT partition: payload + 5% + 512 KiB for FAT tables, boot loader and slack.
part_mib=$(( (payload + payload / 20 + MiB / 2 + MiB - 1) / MiB ))
# 1 MiB before the partition (MBR/GPT + alignment), 1 MiB after (GPT backup).
disk_mib=$(( part_mib + 2 ))
part_start=2048
part_sectors=$(( part_mib * 2048 ))
log "boot disks ${disk_mib} MiB, FAT partition ${part_mib} MiB"

export MTOOLS_SKIP_CHECK=1
fat_format() { # fat_format IMAGE VOLUME-ID LABEL [SECTORS]
	mformat -i "$1@@$((part_start * 512))" -T "${4:-$part_sectors}" -h 64 -s 32 \
		-H "$part_start" -N "$2" -v "$3" ::
}
fat_put() { # fat_put IMAGE SRC DEST
	mcopy -m -o -i "$1@@$((part_start * 512))" "$2" "::$3"
}
fat_mkdir() { # fat_mkdir IMAGE DIR
	mmd -i "$1@@$((part_start * 512))" "::$2"
}
stamp() { for f in "$@"; do touch -d "@$SOURCE_DATE_EPOCH" "$f"; done; }

# bios.img: MBR (syslinux mbr.bin), FAT16 partition marked active, SYSLINUX.
bios=$work/bios.img
truncate -s $((disk_mib * MiB)) "$bios"
sfdisk -q "$bios" >&2 <<EOF
label: dos
label-id: 0x766d6d67
unit: sectors
start=$part_start, size=$part_sectors, type=e, bootable
EOF
fat_format "$bios" 766d0001 VMMBIOS
cat > "$work/syslinux.cfg" <<EOF
SERIAL 0 115200
DEFAULT vmmigrate
PROMPT 0
TIMEOUT 0
LABEL vmmigrate
  LINUX /vmlinuz
  INITRD /initrd.img
  APPEND $CMDLINE
EOF
stamp "$work/syslinux.cfg"
fat_mkdir "$bios" /syslinux
fat_put "$bios" "$work/syslinux.cfg" /syslinux/syslinux.cfg
fat_put "$bios" "$work/vmlinuz" /vmlinuz
fat_put "$bios" "$work/initrd.img" /initrd.img
syslinux --install --offset $((part_start * 512)) --directory /syslinux "$bios" >&2
dd if="$SYSLINUX_MBR" of="$bios" bs=440 count=1 conv=notrunc status=none

# efi.img: GPT, EFI System Partition, systemd-boot with one loader entry.
efi=$work/efi.img
truncate -s $((disk_mib * MiB)) "$efi"
sfdisk -q "$efi" >&2 <<EOF
label: gpt
label-id: 766D6D67-0000-4000-8000-000000000001
unit: sectors
first-lba: 2048
start=$part_start, size=$part_sectors, type=C12A7328-F81F-11D2-BA4B-00A0C93EC93B, uuid=766D6D67-0000-4000-8000-000000000002, name="EFI System"
EOF
fat_format "$efi" 766d0002 VMMEFI
mkdir -p "$work/esp"
cat > "$work/esp/loader.conf" <<EOF
default vmmigrate.conf
timeout 0
editor no
EOF
cat > "$work/esp/vmmigrate.conf" <<EOF
title vmmigrate test guest
linux /vmlinuz
initrd /initrd.img
options $CMDLINE
EOF
cp "$SDBOOT" "$work/esp/BOOTX64.EFI"
stamp "$work"/esp/*
for d in /EFI /EFI/BOOT /loader /loader/entries; do fat_mkdir "$efi" "$d"; done
fat_put "$efi" "$work/esp/BOOTX64.EFI" /EFI/BOOT/BOOTX64.EFI
fat_put "$efi" "$work/esp/loader.conf" /loader/loader.conf
fat_put "$efi" "$work/esp/vmmigrate.conf" /loader/entries/vmmigrate.conf
fat_put "$efi" "$work/vmlinuz" /vmlinuz
fat_put "$efi" "$work/initrd.img" /initrd.img

# secureboot.img: GPT, ESP with signed shim -> signed GRUB -> signed kernel.
# Debian's signed GRUB is a monolithic image with prefix /EFI/debian.
images="bios.img efi.img"
if [ "$GUEST_SECUREBOOT" != 0 ]; then
	images="$images secureboot.img"
	for p in shim-signed grub-efi-amd64-signed; do
		dpkg-deb -x "$(ls "$work"/debs/${p}_*.deb)" "$work/sbpkgs"
	done
	shim=$work/sbpkgs/usr/lib/shim/shimx64.efi.signed
	grubefi=$work/sbpkgs/usr/lib/grub/x86_64-efi-signed/grubx64.efi.signed
	[ -f "$shim" ] && [ -f "$grubefi" ] || die "signed shim or grub missing from the packages"
	mkdir -p "$work/sb"
	cp "$shim" "$work/sb/BOOTX64.EFI"
	cp "$grubefi" "$work/sb/grubx64.efi"
	cat > "$work/sb/grub.cfg" <<EOF
set timeout=0
set default=0
menuentry "vmmigrate test guest (secure boot)" {
	linux /vmlinuz $CMDLINE
	initrd /initrd.img
}
EOF
	stamp "$work"/sb/*
	sbpayload=$(( payload + $(stat -c %s "$shim") + $(stat -c %s "$grubefi") ))
	sb_part_mib=$(( (sbpayload + sbpayload / 20 + MiB / 2 + MiB - 1) / MiB ))
	sbimg=$work/secureboot.img
	truncate -s $(( (sb_part_mib + 2) * MiB )) "$sbimg"
	sfdisk -q "$sbimg" >&2 <<EOF
label: gpt
label-id: 766D6D67-0000-4000-8000-000000000005
unit: sectors
first-lba: 2048
start=$part_start, size=$(( sb_part_mib * 2048 )), type=C12A7328-F81F-11D2-BA4B-00A0C93EC93B, uuid=766D6D67-0000-4000-8000-000000000006, name="EFI System"
EOF
	fat_format "$sbimg" 766d0003 VMMSB $(( sb_part_mib * 2048 ))
	for d in /EFI /EFI/BOOT /EFI/debian; do fat_mkdir "$sbimg" "$d"; done
	fat_put "$sbimg" "$work/sb/BOOTX64.EFI" /EFI/BOOT/BOOTX64.EFI
	fat_put "$sbimg" "$work/sb/grubx64.efi" /EFI/BOOT/grubx64.efi
	fat_put "$sbimg" "$work/sb/grub.cfg" /EFI/debian/grub.cfg
	fat_put "$sbimg" "$work/vmlinuz" /vmlinuz
	fat_put "$sbimg" "$work/initrd.img" /initrd.img
fi

# data.img: 4 MiB ext4, no partition table, with a marker file.
mkdir -p "$work/data"
echo "vmmigrate-data-disk v1" > "$work/data/vmmigrate-data.txt"
stamp "$work/data/vmmigrate-data.txt" "$work/data"
E2FSPROGS_FAKE_TIME=$SOURCE_DATE_EPOCH mke2fs -q -F -t ext4 -O ^has_journal -N 64 \
	-L vmmdata -U 766d6d67-0000-4000-8000-000000000003 \
	-E root_owner=0:0,hash_seed=766d6d67-0000-4000-8000-000000000004 \
	-d "$work/data" "$work/data.img" 4M >&2
# mke2fs -d copies the source files' ctime; pin every time field.
for f in / /lost+found /vmmigrate-data.txt; do
	for t in atime ctime mtime crtime; do
		E2FSPROGS_FAKE_TIME=$SOURCE_DATE_EPOCH debugfs -w \
			-R "set_inode_field $f $t @$SOURCE_DATE_EPOCH" "$work/data.img" >/dev/null 2>&1 ||
			die "debugfs could not set $t of $f in data.img"
	done
done

# nodisk.img: same size as bios.img, no partition table or boot signature.
nodisk=$work/nodisk.img
truncate -s $((disk_mib * MiB)) "$nodisk"
printf 'vmmigrate nodisk.img: this disk intentionally holds no operating system\n' |
	dd of="$nodisk" conv=notrunc status=none

# ---- manifest and publish ---------------------------------------------------
{
	echo "# vmmigrate test guest images, built by tools/guest/build.sh"
	echo "key: $key"
	echo "kernel: $kver"
	echo "cmdline: $CMDLINE"
	echo "source_date_epoch: $SOURCE_DATE_EPOCH"
	for d in "$work"/debs/*.deb; do
		echo "package: $(dpkg-deb -f "$d" Package) $(dpkg-deb -f "$d" Version)"
	done
	echo "# file bytes MiB sha256"
	for f in $images data.img nodisk.img; do
		s=$(stat -c %s "$work/$f")
		echo "$f $s $((s / MiB)) $(sha256sum "$work/$f" | cut -d' ' -f1)"
	done
} > "$work/manifest.txt"
cat "$work/manifest.txt" >&2

mkdir -p "$work/out"
# A directory without "done" is left over from an interrupted build.
if [ -d "$dest" ] && [ ! -e "$dest/done" ]; then rm -rf "$dest"; fi
for f in $images data.img nodisk.img manifest.txt; do mv "$work/$f" "$work/out/"; done
touch "$work/out/done"
if ! mv -T "$work/out" "$dest" 2>/dev/null; then
	# Another build finished first; keep its result.
	[ -e "$dest/done" ] || die "cannot move the result to $dest"
fi
log "done: $dest"
echo "$dest"
