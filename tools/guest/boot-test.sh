#!/usr/bin/env bash
# Boots the images made by tools/guest/build.sh under QEMU (TCG software
# emulation, no KVM) and checks that they work:
#   bios.img   SeaBIOS, q35, virtio disk, one virtio-net NIC (user net with a
#              DHCP hostname), virtio-serial guest agent port. Waits for
#              "vmmigrate-guest: ready", fetches the page through a hostfwd,
#              queries qemu-ga, then shuts down with the agent's guest-shutdown.
#   efi.img    OVMF (secure boot off), the same plus data.img as a second
#              virtio disk and a second virtio-net NIC; the page must list vdb.
#              Shuts down with the ACPI power button (QMP system_powerdown).
#   secureboot.img (if present) OVMF with secure boot ON and Microsoft keys
#              enrolled (OVMF_CODE_4M.ms.fd, SMM, 512 MiB RAM): Debian's signed
#              shim -> GRUB -> kernel; the guest must report "secureboot on".
#   nodisk.img SeaBIOS; "vmmigrate-guest: booted" must NOT appear in 20 s.
# Prints boot times (QEMU start to "booted" and to "ready") and QEMU's RSS.
# Exits non-zero on any failure.
#
# Usage: tools/guest/boot-test.sh IMAGE_DIR
# Needs: qemu-system-x86 ovmf python3 curl (Debian packages).
# Network: QEMU user networking with restrict=on (the guest cannot reach the
# host or anything else); host forwards listen on 127.0.0.1 only.
set -euo pipefail

dir=${1:?usage: boot-test.sh IMAGE_DIR}
dir=$(cd "$dir" && pwd)
READY_TIMEOUT=${READY_TIMEOUT:-120}
NODISK_WAIT=${NODISK_WAIT:-20}
OVMF_CODE=${OVMF_CODE:-/usr/share/OVMF/OVMF_CODE.fd}
OVMF_VARS=${OVMF_VARS:-/usr/share/OVMF/OVMF_VARS.fd}
OVMF_SB_CODE=${OVMF_SB_CODE:-/usr/share/OVMF/OVMF_CODE_4M.ms.fd}
OVMF_SB_VARS=${OVMF_SB_VARS:-/usr/share/OVMF/OVMF_VARS_4M.ms.fd}

die() { echo "boot-test: FAIL: $*" >&2; exit 1; }
for t in qemu-system-x86_64 python3 curl; do
	command -v "$t" >/dev/null || die "missing tool $t (packages: qemu-system-x86 python3 curl)"
done
[ -f "$OVMF_CODE" ] || die "missing $OVMF_CODE (package: ovmf)"
for f in bios.img efi.img data.img nodisk.img; do
	[ -f "$dir/$f" ] || die "missing $dir/$f"
done

tmp=$(mktemp -d)
qpid=
cleanup() {
	if [ -n "$qpid" ] && kill -0 "$qpid" 2>/dev/null; then kill "$qpid" 2>/dev/null || true; fi
	rm -rf "$tmp"
}
trap cleanup EXIT

free_port() {
	python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
now() { date +%s.%N; }
elapsed() { python3 -c "import sys; print('%.2f' % (float(sys.argv[2]) - float(sys.argv[1])))" "$1" "$2"; }

# qga SOCKET: runs guest-sync and the commands KubeVirt uses; prints a summary.
qga() {
	python3 - "$1" <<'EOF'
import json, socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.settimeout(30)
buf = b""
def call(cmd, args=None):
    global buf
    req = {"execute": cmd}
    if args is not None:
        req["arguments"] = args
    s.sendall(json.dumps(req).encode() + b"\n")
    if cmd == "guest-shutdown":
        return None
    while True:
        while b"\n" not in buf:
            d = s.recv(65536)
            if not d:
                raise SystemExit("qga: connection closed during " + cmd)
            buf += d
        line, buf = buf.split(b"\n", 1)
        line = line.strip(b"\xff").strip()
        if not line:
            continue
        msg = json.loads(line)
        if cmd == "guest-sync" and msg.get("return") != args["id"]:
            continue  # stale reply
        if "error" in msg:
            raise SystemExit("qga: %s failed: %s" % (cmd, msg["error"]))
        return msg["return"]
sid = int(time.time()) % 100000
# The first guest-sync can time out if the agent has not opened the port yet.
for attempt in range(10):
    try:
        s.settimeout(3)
        if call("guest-sync", {"id": sid}) == sid:
            break
    except (socket.timeout, TimeoutError):
        sid += 1
else:
    raise SystemExit("qga: no reply to guest-sync")
s.settimeout(30)
info = call("guest-info")
print("qga: version", info["version"], "commands", len(info["supported_commands"]))
ifs = call("guest-network-get-interfaces")
addrs = ["%s=%s" % (i["name"], ",".join(a["ip-address"] for a in i.get("ip-addresses", [])
                                         if a["ip-address-type"] == "ipv4")) for i in ifs]
print("qga: interfaces", " ".join(addrs))
if not any(i["name"].startswith("eth") and i.get("ip-addresses") for i in ifs):
    raise SystemExit("qga: no eth interface with an address")
osi = call("guest-get-osinfo")
print("qga: osinfo", osi.get("id"), osi.get("kernel-release"))
print("qga: host-name", call("guest-get-host-name")["host-name"])
print("qga: users", len(call("guest-get-users")))
fs = call("guest-get-fsinfo")
print("qga: fsinfo", " ".join("%s:%s" % (f["mountpoint"], f["type"]) for f in fs))
print("qga: time", call("guest-get-time"))
EOF
}

# boot NAME IMAGE FIRMWARE(bios|efi|efi-sb) [extra qemu args...]: starts QEMU
# in the background.
boot() {
	local name=$1 img=$2 fw=$3
	shift 3
	log=$tmp/$name.serial
	qmp=$tmp/$name.qmp
	qsock=$tmp/$name.qga
	port=$(free_port)
	local fwargs=() machine=q35 mem=256
	if [ "$fw" = efi ]; then
		cp "$OVMF_VARS" "$tmp/$name.vars"
		fwargs=(-drive "if=pflash,format=raw,unit=0,readonly=on,file=$OVMF_CODE"
			-drive "if=pflash,format=raw,unit=1,file=$tmp/$name.vars")
	elif [ "$fw" = efi-sb ]; then
		# Secure-boot OVMF needs SMM; Debian's signed GRUB fails to start the
		# kernel with 256 MiB under secure boot (reset loop), 512 MiB works.
		cp "$OVMF_SB_VARS" "$tmp/$name.vars"
		machine=q35,smm=on
		mem=512
		fwargs=(-global driver=cfi.pflash01,property=secure,value=on
			-drive "if=pflash,format=raw,unit=0,readonly=on,file=$OVMF_SB_CODE"
			-drive "if=pflash,format=raw,unit=1,file=$tmp/$name.vars")
	fi
	: > "$log"
	t0=$(now)
	qemu-system-x86_64 -accel tcg -machine "$machine" -m "$mem" -smp 1 -nodefaults \
		-display none -serial "file:$log" -qmp "unix:$qmp,server=on,wait=off" \
		"${fwargs[@]}" \
		-drive "file=$img,format=raw,if=virtio,snapshot=on" \
		-netdev "user,id=n0,restrict=on,hostname=vmm-$name-test,hostfwd=tcp:127.0.0.1:$port-:80" \
		-device virtio-net-pci,netdev=n0 \
		-device virtio-serial \
		-chardev "socket,path=$qsock,server=on,wait=off,id=qga0" \
		-device virtserialport,chardev=qga0,name=org.qemu.guest_agent.0 \
		"$@" > "$tmp/$name.qemu.log" 2>&1 &
	qpid=$!
}

# wait_line PATTERN TIMEOUT: waits for PATTERN in the serial log; prints the
# seconds since QEMU start, or fails.
wait_line() {
	local deadline
	deadline=$(($(date +%s) + $2))
	while ! grep -q "$1" "$log"; do
		kill -0 "$qpid" 2>/dev/null || { cat "$tmp"/*.qemu.log >&2; die "qemu exited while waiting for '$1'"; }
		[ "$(date +%s)" -lt "$deadline" ] || { tail -n 30 "$log" >&2; die "timeout waiting for '$1'"; }
		sleep 0.05
	done
	elapsed "$t0" "$(now)"
}

wait_exit() { # wait_exit TIMEOUT: waits for QEMU to exit, prints seconds
	local t1 deadline
	t1=$(now)
	deadline=$(($(date +%s) + $1))
	while kill -0 "$qpid" 2>/dev/null; do
		[ "$(date +%s)" -lt "$deadline" ] || { tail -n 5 "$log" >&2; die "guest did not power off in $1 s"; }
		sleep 0.1
	done
	wait "$qpid" 2>/dev/null || true
	qpid=
	elapsed "$t1" "$(now)"
}

rss() { awk '/^VmRSS/ {printf "%d MiB", $2 / 1024}' "/proc/$qpid/status"; }

qmp_powerdown() {
	python3 - "$qmp" <<'EOF'
import json, socket, sys
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); f = s.makefile("rw")
f.readline()
for c in ("qmp_capabilities", "system_powerdown"):
    f.write(json.dumps({"execute": c}) + "\n"); f.flush()
    while "return" not in json.loads(f.readline()): pass
EOF
}

# test_guest NAME FIRMWARE(bios|efi|efi-sb) SHUTDOWN(qga|acpi) [extra qemu args]
test_guest() {
	local name=$1 fwmode=$2 how=$3 fw sb=off
	shift 3
	fw=${fwmode%-sb}
	[ "$fwmode" = efi-sb ] && sb=on
	echo "== $name ($fwmode)"
	boot "$name" "$dir/$name.img" "$fwmode" "$@"
	t_booted=$(wait_line 'vmmigrate-guest: booted' 60)
	t_ready=$(wait_line 'vmmigrate-guest: ready' "$READY_TIMEOUT")
	grep 'vmmigrate-guest:' "$log" | tr -d '\r' | sed 's/^/  console: /'
	grep -q "vmmigrate-guest: booted firmware $fw " "$log" || die "$name: firmware is not reported as $fw"
	page=$(curl -fsS --max-time 20 "http://127.0.0.1:$port/") || die "$name: GET / failed"
	echo "$page" | sed -n '/<pre>/,/<\/pre>/p' | grep -v 'pre>' | sed 's/^/  page: /'
	echo "$page" | grep -q "vmmigrate-guest vmm-$name-test" || die "$name: page lacks 'vmmigrate-guest vmm-$name-test'"
	echo "$page" | grep -q "firmware: $fw" || die "$name: page lacks 'firmware: $fw'"
	if [ "$fw" = efi ]; then
		grep -q "vmmigrate-guest: secureboot $sb" "$log" || die "$name: secure boot is not $sb"
		echo "$page" | grep -q "secureboot: $sb" || die "$name: page lacks 'secureboot: $sb'"
	fi
	if [ "$name" = efi ]; then
		echo "$page" | grep -q '^disks: vda vdb$' || die "$name: page lacks 'disks: vda vdb'"
		echo "$page" | grep -q 'data vdb: vmmigrate-data-disk v1' || die "$name: data disk content not reported"
		echo "$page" | grep -q '^net eth1: .*addr=10\.0\.3\.' || die "$name: eth1 has no address"
	fi
	qga "$qsock" | sed 's/^/  /' || die "$name: guest agent check failed"
	mem=$(rss)
	if [ "$how" = qga ]; then
		python3 - "$qsock" <<'EOF'
import json, socket, sys
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
s.sendall(json.dumps({"execute": "guest-shutdown", "arguments": {"mode": "powerdown"}}).encode() + b"\n")
EOF
	else
		qmp_powerdown
	fi
	t_off=$(wait_exit 30)
	grep -q 'vmmigrate-guest: shutdown' "$log" || die "$name: powered off without the guest's shutdown path"
	echo "RESULT $name: booted ${t_booted}s ready ${t_ready}s rss $mem poweroff($how) ${t_off}s"
	results+=("$name: booted ${t_booted}s ready ${t_ready}s qemu-rss $mem poweroff-via-$how ${t_off}s")
}

results=()
test_guest bios bios qga
test_guest efi efi acpi \
	-drive "file=$dir/data.img,format=raw,if=virtio,snapshot=on" \
	-netdev "user,id=n1,restrict=on,net=10.0.3.0/24" -device virtio-net-pci,netdev=n1
if [ -f "$dir/secureboot.img" ]; then
	[ -f "$OVMF_SB_CODE" ] || die "missing $OVMF_SB_CODE (package: ovmf)"
	test_guest secureboot efi-sb acpi
fi

echo "== nodisk (bios, expecting no boot for ${NODISK_WAIT}s)"
boot nodisk "$dir/nodisk.img" bios
sleep "$NODISK_WAIT"
kill -0 "$qpid" 2>/dev/null || die "nodisk: qemu exited"
if grep -q 'vmmigrate-guest: booted' "$log"; then die "nodisk: guest booted"; fi
mem=$(rss)
kill "$qpid"; wait "$qpid" 2>/dev/null || true; qpid=
results+=("nodisk: no boot in ${NODISK_WAIT}s (as expected) qemu-rss $mem")

echo "== summary"
printf '%s\n' "${results[@]}"
echo "boot-test: ${#results[@]} passed, 0 failed"
