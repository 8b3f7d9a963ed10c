#!/usr/bin/env bash
# Runs the image built by tools/image/build.sh once, the way the Deployment
# runs it (uid 65532, read-only root, /tmp a tmpfs, no capabilities, no
# network but loopback), and checks that vmmigrate starts and finds every
# program it runs: git, ssh, qemu-img, virt-v2v and guestfish (whose
# appliance it boots once).
#
#   tools/image/check.sh [LAYOUT[:TAG]]   default ~/.cache/vmmigrate/image/vmmigrate,
#                                         its first tag (build.sh's OUT_DIR works too)
#   VMMIGRATE_IMAGE_CHECK=containerd ...  import the oci-archive next to LAYOUT
#                                         into a throwaway containerd and use
#                                         `ctr run` instead of runc directly
#
# runc, not crun: crun fails in this machine's cgroup mode. No Docker needed.
set -euo pipefail

image=${1:-$HOME/.cache/vmmigrate/image/vmmigrate}
layout=${image%%:*}
tag=${image#"$layout"}; tag=${tag#:}
# build.sh's output directory works too.
[ -f "$layout/vmmigrate/index.json" ] && layout="$layout/vmmigrate"
[ -f "$layout/index.json" ] || { echo "check: $layout is not an OCI layout (run tools/image/build.sh)" >&2; exit 1; }
[ -n "$tag" ] || tag=$(jq -r '.manifests[0].annotations["org.opencontainers.image.ref.name"]' "$layout/index.json")
mode=${VMMIGRATE_IMAGE_CHECK:-runc}
manifest=$(jq -r --arg t "$tag" '.manifests[] | select(.annotations["org.opencontainers.image.ref.name"] == $t) | .digest' "$layout/index.json" | cut -d: -f2)
[ -n "$manifest" ] || { echo "check: no tag $tag in $layout" >&2; exit 1; }
config=$(jq -r .config.digest "$layout/blobs/sha256/$manifest" | cut -d: -f2)
version=$(jq -r '.config.Labels["org.opencontainers.image.version"]' "$layout/blobs/sha256/$config")
entrypoint=$(jq -r '.config.Entrypoint[0]' "$layout/blobs/sha256/$config")

# One shell in the container runs every probe, so one run covers them all.
# "$1" is the image's entrypoint, "$2" the version its label promises.
# shellcheck disable=SC2016
probe='
fails=0
pass() { echo "  ok    $1"; }
fail() { echo "  FAIL  $1"; fails=$((fails + 1)); }
try() { what=$1; shift; if out=$("$@" 2>&1); then pass "$what: $(echo "$out" | head -n1)"; else fail "$what: $(echo "$out" | head -n3)"; fi; }
[ "$(id -u):$(id -g)" = 65532:65532 ] && pass "runs as 65532:65532 ($(id -un))" || fail "runs as $(id -u):$(id -g), want 65532:65532"
grep -q "^CapEff:[[:space:]]*0*$" /proc/self/status && pass "no effective capabilities" || fail "effective capabilities: $(grep CapEff /proc/self/status)"
[ "$HOME" = /tmp ] && pass "HOME=/tmp" || fail "HOME=$HOME, want /tmp"
out=$("$1" --version 2>&1) && [ "$out" = "vmmigrate $2" ] && pass "$1 --version: $out" || fail "$1 --version printed \"$out\", want \"vmmigrate $2\""
for p in git ssh qemu-img; do
  command -v "$p" >/dev/null && pass "$p on PATH at $(command -v "$p")" || fail "$p not on PATH ($PATH)"
done
try "git --version" git --version
try "ssh -V" ssh -V
try "qemu-img --version" qemu-img --version
# Beyond --version: ssh needs a passwd entry for the uid, git a writable HOME,
# qemu-img all its libraries. None of it touches the network.
try "ssh -G (passwd entry, config parsing)" sh -c "ssh -G -T -F none git.example.invalid </dev/null | grep -m1 \"^user \""
try "git init and commit in /tmp" sh -c "git init -q /tmp/probe && git -C /tmp/probe -c user.name=probe -c user.email=probe@example.invalid commit -q --allow-empty -m probe && git -C /tmp/probe rev-parse HEAD"
try "qemu-img create and info" sh -c "qemu-img create -q -f qcow2 /tmp/probe.qcow2 1M && qemu-img info /tmp/probe.qcow2 | grep -m1 \"file format\""
try "virt-v2v --version" virt-v2v --version
try "guestfish --version" guestfish --version
[ -f /usr/share/OVMF/OVMF_CODE.fd ] && pass "OVMF for converting UEFI guests" || fail "no /usr/share/OVMF/OVMF_CODE.fd (virt-v2v cannot finish a UEFI guest)"
# What converting a guest needs beyond --version: libguestfs builds its
# appliance from the image (supermin, the kernel in /boot) and boots it,
# under TCG here as where /dev/kvm cannot run guests.
try "libguestfs appliance boots as 65532" sh -c "LIBGUESTFS_BACKEND=direct LIBGUESTFS_BACKEND_SETTINGS=force_tcg LIBGUESTFS_CACHEDIR=/tmp TMPDIR=/tmp timeout 600 guestfish -a /dev/null run : version | grep -m1 major"
[ -s /etc/ssl/certs/ca-certificates.crt ] && pass "CA bundle present" || fail "no /etc/ssl/certs/ca-certificates.crt"
touch /probe 2>/dev/null && fail "root filesystem is writable" || pass "root filesystem is read-only"
for d in /var/lib/vmmigrate /var/cache/vmmigrate; do
  [ -d "$d" ] && [ "$(stat -c %u:%g "$d")" = 65532:65532 ] && pass "$d owned by 65532" || fail "$d missing or not owned by 65532"
done
nics=$(ls /sys/class/net | tr "\n" " ")
[ "$nics" = "lo " ] && pass "network: loopback only" || fail "network interfaces: $nics"
[ "$fails" -eq 0 ] || { echo "  $fails check(s) failed"; exit 1; }
echo "probe: all passed"
'
cmd=(/bin/sh -c "$probe" probe "$entrypoint" "$version")

work=$(mktemp -d "${TMPDIR:-/tmp}/vmmigrate-image-check.XXXXXX")
id="vmmigrate-check-$$"
ctrd_pid=
run_created=
cleanup() {
  rc=$?
  set +e
  if [ "$mode" = runc ]; then
    runc --root "$work/runc" delete --force "$id" >/dev/null 2>&1
  elif [ -n "$ctrd_pid" ]; then
    command ctr -a "$work/containerd.sock" -n vmmigrate-check task kill -s KILL "$id" >/dev/null 2>&1
    command ctr -a "$work/containerd.sock" -n vmmigrate-check container delete "$id" >/dev/null 2>&1
    kill "$ctrd_pid" 2>/dev/null; wait "$ctrd_pid" 2>/dev/null
    # The shim's socket directory is fixed at /run/containerd/s; leave no
    # trace if this script created it.
    [ -n "$run_created" ] && rm -rf /run/containerd
  fi
  # Snapshots or rootfs mounts left by a failed run would defeat rm -rf.
  findmnt -rn -o TARGET | grep "^$work/" | sort -r | xargs -r umount -l
  rm -rf "$work"
  [ "$rc" -eq 0 ] || echo "check: FAILED ($layout:$tag, $mode)" >&2
  exit "$rc"
}
trap cleanup EXIT

echo "check: $layout:$tag (vmmigrate $version) with $mode" >&2
case "$mode" in
runc)
  umoci unpack --image "$layout:$tag" "$work/bundle" >/dev/null
  # As the Deployment: readOnlyRootFilesystem, /tmp an emptyDir, capabilities
  # dropped, no privilege escalation. The network namespace umoci configures
  # has loopback only.
  jq --arg probe "$probe" --arg ep "$entrypoint" --arg v "$version" '
    .root.readonly = true
    | .process.terminal = false
    | .process.args = ["/bin/sh", "-c", $probe, "probe", $ep, $v]
    | .process.user = {uid: 65532, gid: 65532}
    | .process.noNewPrivileges = true
    | .process.capabilities = {bounding: [], effective: [], inheritable: [], permitted: [], ambient: []}
    | .mounts += [{destination: "/tmp", type: "tmpfs", source: "tmpfs", options: ["nosuid", "nodev", "mode=1777", "size=2g"]}]
    | if any(.linux.namespaces[]; .type == "network") then . else error("no network namespace") end
  ' "$work/bundle/config.json" > "$work/config.json"
  mv "$work/config.json" "$work/bundle/config.json"
  runc --root "$work/runc" run --bundle "$work/bundle" "$id" </dev/null | tee "$work/out"
  ;;
containerd)
  archive="$(dirname "$layout")/vmmigrate-$version.oci.tar"
  [ -f "$archive" ] || { echo "check: $archive not found" >&2; exit 1; }
  # A private containerd: its own root, state and socket; CRI off; no
  # metrics or debug listeners.
  cat > "$work/containerd.toml" <<TOML
version = 2
root = "$work/root"
state = "$work/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "$work/containerd.sock"
[ttrpc]
  address = "$work/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "$work/opt"
TOML
  [ -e /run/containerd ] || run_created=1
  containerd --config "$work/containerd.toml" > "$work/containerd.log" 2>&1 &
  ctrd_pid=$!
  ctr() { command ctr -a "$work/containerd.sock" -n vmmigrate-check "$@"; }
  for _ in $(seq 50); do ctr version >/dev/null 2>&1 && break; sleep 0.2; done
  ctr version >/dev/null || { cat "$work/containerd.log" >&2; exit 1; }
  ctr image import --all-platforms "$archive" >&2
  ref=$(ctr image ls -q | head -n1)
  [ -n "$ref" ] || { echo "check: ctr import named no image (missing ref.name annotation?)" >&2; exit 1; }
  echo "check: imported as $ref" >&2
  # ctr 1.6 has no --user: the image's User applies, and the probe checks it
  # (and that a non-root uid has no effective capabilities).
  ctr run --rm --read-only --seccomp --runc-root "$work/runc" --fifo-dir "$work/fifo" \
    --mount type=tmpfs,src=tmpfs,dst=/tmp,options=nosuid:nodev:mode=1777 \
    "$ref" "$id" "${cmd[@]}" </dev/null | tee "$work/out"
  ;;
*) echo "check: VMMIGRATE_IMAGE_CHECK=$mode: want runc or containerd" >&2; exit 1 ;;
esac
# A probe that never ran (wrong args) must not pass silently.
grep -qx 'probe: all passed' "$work/out" || { echo "check: the probe did not complete" >&2; exit 1; }
echo "check: passed" >&2
