# Shared by the dd and cat wrappers of the emulated ESXi host.
#
# Reads of disk extents (*-flat.vmdk, *-delta.vmdk, *-sesparse.vmdk under
# /vmfs) are served by BusyBox dd and recorded, one line each, in
# /var/log/esxi-emu/reads.log:
#   tool <TAB> path <TAB> offset <TAB> length|- <TAB> bytes delivered <TAB> ok|cut|error
# BusyBox dd prints no byte count, so "delivered" is the part of the range
# the file holds when dd succeeds (the bytes it wrote), and full blocks
# written when it fails.
#
# The cut fault: /var/lib/esxi-emu/cut_after_bytes holds a budget of N
# bytes. Disk reads that fit in what is left of it are served whole and take
# their size out of it; the read that reaches it delivers only the rest, the
# knob is removed (one-shot) and this session's sshd is killed, which drops
# the TCP connection with every channel on it. With one read of the whole
# disk, that is "N bytes, then the cut".

EMU_ST=/var/lib/esxi-emu
EMU_LOG=/var/log/esxi-emu
bb=/bin/busybox

# The absolute form of a path (no normalisation beyond prefixing $PWD).
emu_abs() {
    case $1 in
        /*) printf '%s' "$1" ;;
        *) printf '%s/%s' "${PWD%/}" "$1" ;;
    esac
}

emu_is_disk() {
    case $1 in
        /vmfs/*-flat.vmdk | /vmfs/*-delta.vmdk | /vmfs/*-sesparse.vmdk) return 0 ;;
    esac
    return 1
}

# A dd size operand (BusyBox suffixes) in bytes; fails when it is not one.
emu_bytes() {
    local n=$1 m=1
    case $n in
        *kB) n=${n%kB}; m=1000 ;;
        *MB) n=${n%MB}; m=1000000 ;;
        *GB) n=${n%GB}; m=1000000000 ;;
        *k | *K) n=${n%?}; m=1024 ;;
        *M) n=${n%M}; m=1048576 ;;
        *G) n=${n%G}; m=1073741824 ;;
        *w) n=${n%w}; m=2 ;;
        *b) n=${n%b}; m=512 ;;
        *c) n=${n%c}; m=1 ;;
    esac
    case $n in
        '' | *[!0-9]*) return 1 ;;
    esac
    echo $((n * m))
}

# The slow-disk knob: /var/lib/esxi-emu/read_delay holds seconds (BusyBox
# sleep takes fractions); every disk read waits that long before it is served,
# so that a copy lasts long enough to be interrupted on purpose.
emu_throttle() {
    local delay=
    read -r delay 2>/dev/null <"$EMU_ST/read_delay"
    [ -n "$delay" ] && $bb sleep "$delay"
    return 0
}

# The slow-link knob: /var/lib/esxi-emu/read_rate holds bytes per second;
# every disk read is then served in pieces of 1 MiB with a pause after
# each, so that a copy is still running when a test kills its reader.
emu_rate() {
    local rate=
    read -r rate 2>/dev/null <"$EMU_ST/read_rate"
    case $rate in
        '' | *[!0-9]* | 0) return 1 ;;
    esac
    echo "$rate"
}

# emu_serve_slowly TOOL PATH OFFSET LENGTH EXPECTED RATE: serves the read
# at RATE and records it.
emu_serve_slowly() {
    local tool=$1 path=$2 off=$3 len=$4 expect=$5 rate=$6 at end n piece=1048576 pause
    at=$off
    end=$((off + expect))
    pause=$($bb awk -v p="$piece" -v r="$rate" 'BEGIN { printf "%.3f", p / r }')
    while [ "$at" -lt "$end" ]; do
        n=$piece
        [ $((end - at)) -lt "$n" ] && n=$((end - at))
        if ! $bb dd if="$path" bs=65536 skip="$at" count="$n" iflag=skip_bytes,count_bytes 2>/dev/null; then
            emu_record "$tool" "$path" "$off" "$len" $((at - off)) error
            return 1
        fi
        at=$((at + n))
        $bb sleep "$pause"
    done
    emu_record "$tool" "$path" "$off" "$len" "$expect" ok
}

emu_record() {
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" "$6" >>"$EMU_LOG/reads.log"
}

emu_lock() {
    local holder tries=0
    while ! $bb mkdir "$EMU_ST/cut.lock" 2>/dev/null; do
        holder=
        read -r holder 2>/dev/null <"$EMU_ST/cut.lock/pid"
        if [ -n "$holder" ] && ! kill -0 "$holder" 2>/dev/null; then
            $bb rm -rf "$EMU_ST/cut.lock"
            continue
        fi
        tries=$((tries + 1))
        [ "$tries" -gt 500 ] && { $bb rm -rf "$EMU_ST/cut.lock"; tries=0; }
        $bb sleep 0.01
    done
    echo $$ >"$EMU_ST/cut.lock/pid"
}

emu_unlock() {
    $bb rm -rf "$EMU_ST/cut.lock"
}

# emu_take_cut WANT: takes a read of WANT bytes out of the armed budget.
# When the read fits, the budget shrinks and this fails (serve normally);
# otherwise the fault fires: the knob is removed and this prints the bytes
# still to deliver before the cut.
emu_take_cut() {
    local want=$1 left=
    [ -e "$EMU_ST/cut_after_bytes" ] || return 1
    emu_lock
    read -r left 2>/dev/null <"$EMU_ST/cut_after_bytes"
    case $left in
        '' | *[!0-9]*) emu_unlock; return 1 ;;
    esac
    if [ "$want" -lt "$left" ]; then
        printf '%s\n' $((left - want)) >"$EMU_ST/cut_after_bytes.new.$$"
        $bb mv -f "$EMU_ST/cut_after_bytes.new.$$" "$EMU_ST/cut_after_bytes"
        emu_unlock
        return 1
    fi
    $bb rm -f "$EMU_ST/cut_after_bytes"
    emu_unlock
    printf '%s' "$left"
}

# emu_serve TOOL PATH OFFSET LENGTH EXPECTED STDERR-MODE DD-ARGS...
# Runs `busybox dd DD-ARGS...` to stdout and records the read.
emu_serve() {
    emu_throttle
    local tool=$1 path=$2 off=$3 len=$4 expect=$5 mode=$6 cut err rc full line rate
    shift 6
    if rate=$(emu_rate); then
        emu_serve_slowly "$tool" "$path" "$off" "$len" "$expect" "$rate"
        return
    fi
    if cut=$(emu_take_cut "$expect"); then
        $bb dd "$@" 2>/dev/null | $bb head -c "$cut"
        emu_record "$tool" "$path" "$off" "$len" "$cut" cut
        # Let sshd forward what was written, then drop the connection.
        $bb sleep 0.3
        [ -n "$ESXI_SSHD_PID" ] && kill -9 "$ESXI_SSHD_PID"
        exit 1
    fi
    # stdout goes to the client (fd 3), stderr is captured for the record.
    exec 3>&1
    err=$($bb dd "$@" 2>&1 1>&3 3>&-)
    rc=$?
    exec 3>&-
    if [ "$rc" = 0 ]; then
        emu_record "$tool" "$path" "$off" "$len" "$expect" ok
    else
        full=0
        for line in $(printf '%s\n' "$err" | $bb sed -n 's/^\([0-9]*\)+[0-9]* records out$/\1/p'); do
            full=$line
        done
        emu_record "$tool" "$path" "$off" "$len" $((full * ${EMU_OBS:-512})) error
    fi
    case $mode in
        all) [ -n "$err" ] && printf '%s\n' "$err" >&2 ;;
        errors) [ -n "$err" ] && printf '%s\n' "$err" | $bb grep -v ' records \(in\|out\)$' >&2 ;;
    esac
    return "$rc"
}

# Bytes of [OFFSET, OFFSET+LENGTH) that a file of SIZE bytes holds.
emu_expected() {
    local size=$1 off=$2 len=$3
    if [ "$off" -ge "$size" ]; then
        echo 0
    elif [ "$len" = - ] || [ $((size - off)) -le "$len" ]; then
        echo $((size - off))
    else
        echo "$len"
    fi
}
