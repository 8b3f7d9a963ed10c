//! An emulated VMware ESXi 8 host for the SSH client's tests: a real OpenSSH
//! `sshd` on a loopback port whose one user is locked into a chroot that
//! looks like an ESXi shell (BusyBox ash, `vim-cmd`, `vmware -v`, a VMFS
//! datastore with real `.vmx` files and VMDK descriptor + flat pairs made
//! with `qemu-img`). Output formats follow `esxi-facts.md`; the shell
//! scripts are in `tools/esxi-emulator/` (see its README).
//!
//! Each `EsxiEmulator::start` builds its own chroot, keys and sshd, so
//! emulators can run side by side in one test process. The only shared
//! thing is the system user `vmmigrate-esxi` (created once, under a file lock).
//! sshd is started through a [`Janitor`]; the chroot (which cannot live under
//! /tmp: every component of a chroot path must be root-owned and not
//! group/world-writable) is removed by a second janitor-like shell when the
//! emulator is dropped or the test process exits. `VMMIGRATE_TEST_KEEP=1`
//! keeps both.
//!
//! Needs root and the Debian packages openssh-server, openssh-client,
//! busybox-static, qemu-utils (and openssl, for hashing).

use crate::process::{Janitor, free_port, wait_until};
use anyhow::{Context, bail, ensure};
use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::{FileExt, PermissionsExt, chown, symlink};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

mod chroot;
mod datastore;
mod keys;

use chroot::*;
use datastore::*;
use keys::*;

/// The system user the SSH client logs in as.
pub const ESXI_USER: &str = "vmmigrate-esxi";
/// Its password (keyboard-interactive through PAM). Fixed: the user is shared.
pub const ESXI_PASSWORD: &str = "Esxi-Emulator-Pw-8";
/// Where the datastore is mounted, as on a real host.
pub const DATASTORE_UUID: &str = "65f1a2b3-4c5d6e7f-8a9b-000c29aabbcc";
/// Number of `power.getstate` calls after which a guest shutdown completes.
pub const DEFAULT_SHUTDOWN_GETSTATE_CALLS: u32 = 2;

/// Shared state outside any one emulator: the user lock, and the chroot base
/// when the target directory does not qualify as a chroot parent.
const RUN_BASE: &str = "/run/vmmigrate-esxi";
const MIB: u64 = 1024 * 1024;

macro_rules! tool {
    ($name:literal) => {
        include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../esxi-emulator/", $name))
    };
}
const SSHD_CONFIG_TEMPLATE: &str = tool!("sshd_config.template");
const SCRIPTS_BIN: [(&str, &str); 5] = [
    ("vim-cmd", tool!("vim-cmd")),
    ("vmware", tool!("vmware")),
    ("esxcli", tool!("esxcli")),
    ("dd", tool!("dd")),
    ("cat", tool!("cat")),
];
const SESSION_SCRIPT: &str = tool!("session");
const COMMON_SH: &str = tool!("common.sh");

/// BusyBox applets linked into `/bin` (dd and cat are wrappers, sh is the
/// patched shell). Deliberately no bash, tr, python or md5sum.
const APPLETS: &[&str] = &[
    "ls", "head", "tail", "sed", "awk", "grep", "stat", "wc", "sleep", "kill", "mkdir", "rm", "printf",
    "echo", "test", "[", "expr", "cut", "date", "mv", "cp", "touch", "env",
];

pub struct EsxiOptions {
    /// Adds VM 7 `big` with one disk of this size.
    pub big_disk_mib: Option<u64>,
    /// The delta format of snapshots taken on this host: seSparse (VMFS6,
    /// the default of ESXi 8) or vmfsSparse (VMFS5).
    pub snapshot_format: crate::vmdk_delta::DeltaFormat,
    /// Adds VM 12 `pair`, powered on with Tools running, with two thick
    /// disks of these sizes (scsi0:0 and scsi0:1; a second size of 0: one disk).
    pub pair_disk_mib: Option<(u64, u64)>,
    /// Whether the shell has `sha256sum`.
    pub with_sha256sum: bool,
    /// Whether the shell has `openssl` (the distribution's, with its
    /// libraries), which ESXi hosts have and hash with.
    pub with_openssl: bool,
    /// An address sshd listens on besides 127.0.0.1, on the same port: the
    /// host end of the test node's veth, where pods reach the host.
    pub also_listen: Option<std::net::Ipv4Addr>,
    /// `(n, mib)`: adds `n` plain VMs `vm-001`… (vmids from 101), each
    /// powered on with Tools running, one disk of `mib` MiB and one vmxnet3
    /// NIC on "VM Network": a host of a fleet.
    pub fleet: Option<(usize, u64)>,
    /// The guest images of `tools/guest/build.sh` (`setup::guest_images`):
    /// adds the VMs whose disks are real bootable guests, [`GUEST_VMS`].
    pub guests: Option<PathBuf>,
    /// The guests of `tools/guest/vmware.sh` (`setup::vmware_guest_images`),
    /// shaped like guests installed on ESXi: adds [`VMWARE_GUEST_VMS`].
    pub vmware_guests: Option<PathBuf>,
    /// With [`Self::guests`]: a second disk for `app-bios` (`scsi0:1`,
    /// thick), this image's bytes: a data disk of a chosen size.
    pub guest_data_disk: Option<PathBuf>,
}

/// The VMs [`EsxiOptions::guests`] adds, by vmid and name: `app-bios` (8,
/// SeaBIOS, one disk: `bios.img`, one vmxnet3 NIC), `app-efi` (9, UEFI
/// without secure boot, two disks: `efi.img` and `data.img`, one NIC),
/// `no-os` (10, SeaBIOS, one disk holding no OS: `nodisk.img`) and
/// `app-secure` (11, UEFI with secure boot, 512 MiB: `secureboot.img`,
/// Debian's signed shim, GRUB and kernel). Each is 1 vCPU and 256 MiB unless
/// said, powered on, Tools running, one vmxnet3 NIC.
pub const GUEST_VMS: [(&str, &str); 4] =
    [("8", "app-bios"), ("9", "app-efi"), ("10", "no-os"), ("11", "app-secure")];

/// The VMs [`EsxiOptions::vmware_guests`] adds, by vmid and name, each
/// named as its guest calls itself: `vmware-bios` (13, SeaBIOS, its disk on
/// PVSCSI) and `vmware-uefi` (14, UEFI without secure boot, two disks on
/// NVMe). Each is `debian12-64`, 1 vCPU and 1 GiB, powered on with Tools
/// running, one vmxnet3 NIC in PCI slot 192 (`ens192` in the guest).
pub const VMWARE_GUEST_VMS: [(&str, &str); 2] = [("13", "vmware-bios"), ("14", "vmware-uefi")];

impl Default for EsxiOptions {
    fn default() -> Self {
        EsxiOptions {
            big_disk_mib: None,
            snapshot_format: crate::vmdk_delta::DeltaFormat::SeSparse,
            pair_disk_mib: None,
            with_sha256sum: true,
            with_openssl: true,
            also_listen: None,
            fleet: None,
            guests: None,
            vmware_guests: None,
            guest_data_disk: None,
        }
    }
}

/// One disk data file: the path the ESXi host shows, the real path here,
/// its sha256 (hex) and its size in bytes.
pub type DiskFile = (String, PathBuf, String, u64);

/// One recorded read of a disk extent by the `dd` or `cat` wrapper.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskRead {
    /// `dd` or `cat`.
    pub tool: String,
    /// The absolute path as the client named it (under `/vmfs`).
    pub path: String,
    pub offset: u64,
    /// Requested length; `None` means "to the end of the file".
    pub length: Option<u64>,
    /// Bytes delivered (see `tools/esxi-emulator/common.sh`).
    pub delivered: u64,
    /// `ok`, `cut` (the cut fault fired) or `error`.
    pub outcome: String,
}

pub struct EsxiEmulator {
    pub port: u16,
    pub username: String,
    pub password: String,
    /// RSA 3072 client key (accepted), OpenSSH private key format.
    pub rsa_key_openssh: String,
    /// ed25519 client key (in authorized_keys, refused by the algorithm list).
    pub ed25519_key_openssh: String,
    /// The chroot: the ESXi host's `/`.
    pub root: PathBuf,
    // Dropped in this order: sshd first, then the chroot.
    janitor: Janitor,
    _chroot: ChrootGuard,
    dir: PathBuf,
    sshd: Mutex<SshdState>,
    disks: BTreeMap<String, Vec<DiskFile>>,
    uid: u32,
    gid: u32,
    also_listen: Option<std::net::Ipv4Addr>,
    snapshots: std::sync::Arc<crate::esxi_snapshots::Engine>,
}

/// A running guest's writer ([`EsxiEmulator::start_guest_writes`]); dropping it stops the writes.
pub struct GuestWriter {
    running: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for GuestWriter {
    fn drop(&mut self) {
        self.running.store(false, std::sync::atomic::Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

struct SshdState {
    generation: u32,
    refuse: bool,
    /// sshd's `MaxStartups` (unauthenticated connections it keeps before
    /// dropping new ones); 50 unless a test lowers it.
    max_startups: Option<u32>,
    /// Set for one restart: kill every session's sshd with the listener.
    drop_sessions: bool,
    /// The listener's pid.
    pid: u32,
    name: String,
    fingerprint: String,
    host_public: String,
}

impl EsxiEmulator {
    pub fn start(opts: EsxiOptions) -> anyhow::Result<EsxiEmulator> {
        crate::setup::packages()?;
        let (uid, gid) = ensure_user()?;
        ensure_dir_root(Path::new("/run/sshd"))?; // sshd's privilege separation directory

        let base = chroot_base()?;
        let root = tempfile::Builder::new().prefix("esxi-emu-").tempdir_in(&base)?.keep();
        let chroot = ChrootGuard::new(&root)?;
        set_mode(&root, 0o755)?;

        let janitor = Janitor::new("vmmigrate-esxi-")?;
        let dir = janitor.dir().to_path_buf();
        // The user reads authorized_keys from here (before the chroot): traverse only.
        set_mode(&dir, 0o711)?;

        generate_keys(&dir)?;
        let rsa_key_openssh = fs::read_to_string(dir.join("id_rsa"))?;
        let ed25519_key_openssh = fs::read_to_string(dir.join("id_ed25519"))?;
        let authorized =
            fs::read_to_string(dir.join("id_rsa.pub"))? + &fs::read_to_string(dir.join("id_ed25519.pub"))?;
        write_mode(&dir.join("authorized_keys"), authorized.as_bytes(), 0o644)?;

        let vms = vm_specs(&opts);
        build_chroot(&root, uid, gid, &opts)?;
        let disks = build_datastore(&root, &vms)?;
        write_state(&root, uid, gid, &vms, &disks)?;
        let store = root.join("vmfs/volumes").join(DATASTORE_UUID);
        let engine_vms = vms
            .iter()
            .filter(|vm| !vm.snapshot)
            .map(|vm| {
                let n: u32 = vm.id.parse().expect("numeric vmid");
                let files = &disks[vm.id];
                let list = vm
                    .disks
                    .iter()
                    .enumerate()
                    .map(|(i, d)| {
                        let cid = 0x3c5a_0000 | (n << 8) | i as u32;
                        (d.node.to_owned(), d.file.clone(), files[i].1.clone(), files[i].3 / 512, cid)
                    })
                    .collect();
                let vm_state =
                    crate::esxi_snapshots::Vm::new(store.join(&vm.dir), format!("{}.vmx", vm.dir), list);
                (vm.id.to_owned(), vm_state)
            })
            .collect();
        let snapshots = crate::esxi_snapshots::Engine::start(
            root.join("var/lib/esxi-emu"),
            opts.snapshot_format,
            engine_vms,
        );

        let mut emulator = EsxiEmulator {
            port: 0,
            username: ESXI_USER.to_owned(),
            password: ESXI_PASSWORD.to_owned(),
            rsa_key_openssh,
            ed25519_key_openssh,
            root,
            janitor,
            _chroot: chroot,
            dir,
            sshd: Mutex::new(SshdState {
                generation: 0,
                refuse: false,
                max_startups: None,
                drop_sessions: false,
                pid: 0,
                name: String::new(),
                fingerprint: String::new(),
                host_public: String::new(),
            }),
            disks,
            uid,
            gid,
            also_listen: opts.also_listen,
            snapshots,
        };
        // A free port can be taken by someone else before sshd binds it: retry.
        let mut last_err = None;
        for _ in 0..5 {
            emulator.port = free_port()?;
            match emulator.restart_sshd(|_| {}) {
                Ok(()) => return Ok(emulator),
                Err(err) => last_err = Some(err),
            }
        }
        Err(last_err.expect("at least one attempt"))
    }

    /// `SHA256:<43 base64 chars>`, as `ssh-keygen -lf` prints it.
    pub fn host_key_fingerprint(&self) -> String {
        self.sshd.lock().expect("sshd lock").fingerprint.clone()
    }

    /// The host's public key, `ecdsa-sha2-nistp256 AAAA…`.
    pub fn host_public_key(&self) -> String {
        self.sshd.lock().expect("sshd lock").host_public.clone()
    }

    /// A known_hosts line for the current host key.
    pub fn known_hosts_line(&self) -> String {
        format!("[127.0.0.1]:{} {}", self.port, self.host_public_key())
    }

    /// A known_hosts file for the current host key (rewritten on `change_host_key`).
    pub fn known_hosts_path(&self) -> PathBuf {
        self.dir.join("known_hosts")
    }

    /// The RSA client key as a file (mode 0600), for the system ssh client.
    pub fn rsa_key_path(&self) -> PathBuf {
        self.dir.join("id_rsa")
    }

    pub fn ed25519_key_path(&self) -> PathBuf {
        self.dir.join("id_ed25519")
    }

    /// The system OpenSSH client, ready to run one remote command (append it
    /// with `.arg(...)`): RSA key, this host's known_hosts, strict checking,
    /// batch mode, no user configuration.
    pub fn ssh_command(&self) -> Command {
        let mut cmd = Command::new("ssh");
        cmd.args(["-F", "/dev/null", "-p", &self.port.to_string(), "-i"])
            .arg(self.rsa_key_path())
            .arg("-o")
            .arg(format!("UserKnownHostsFile={}", self.known_hosts_path().display()))
            .args([
                "-o",
                "StrictHostKeyChecking=yes",
                "-o",
                "BatchMode=yes",
                "-o",
                "IdentitiesOnly=yes",
                "-o",
                "IdentityAgent=none",
                "-o",
                "ConnectTimeout=10",
                "-o",
                "LogLevel=ERROR",
            ])
            .arg(format!("{}@127.0.0.1", self.username))
            .stdin(Stdio::null());
        cmd
    }

    /// `"on"` or `"off"`. Panics on an unknown vmid.
    pub fn vm_power(&self, vmid: &str) -> String {
        self.read_vm_file(vmid, "power")
    }

    /// on→off transitions made through vim-cmd (`power.off`, completed
    /// `power.shutdown`); `set_power` does not count.
    pub fn power_off_transitions(&self, vmid: &str) -> u32 {
        let text = self.read_vm_file(vmid, "poweroffs");
        if text.is_empty() { 0 } else { text.parse().expect("poweroffs is a number") }
    }

    /// Each vim-cmd call's argv after `vim-cmd`, in call order.
    pub fn vimcmd_invocations(&self) -> Vec<Vec<String>> {
        let bytes = fs::read(self.root.join("var/log/esxi-emu/vimcmd.log")).unwrap_or_default();
        let mut fields = bytes.split(|b| *b == 0).map(|f| String::from_utf8_lossy(f).into_owned());
        let mut calls = Vec::new();
        while let Some(argc) = fields.next() {
            if argc.is_empty() {
                break; // the empty tail after the last NUL
            }
            let argc: usize = argc.parse().expect("vimcmd.log: argc");
            calls.push((0..argc).map(|_| fields.next().expect("vimcmd.log: truncated record")).collect());
        }
        calls
    }

    /// The power actions asked of `vmid` through vim-cmd, in order
    /// (`power.off`, `power.shutdown`, `power.on`): every call counts,
    /// whether or not it changed the power state.
    pub fn power_calls(&self, vmid: &str) -> Vec<String> {
        self.vimcmd_invocations()
            .into_iter()
            .filter(|argv| argv.get(1).map(String::as_str) == Some(vmid))
            .filter_map(|argv| argv.first()?.strip_prefix("vmsvc/power.").map(str::to_owned))
            .filter(|op| op != "getstate")
            .collect()
    }

    /// Runs `vim-cmd` with `args` on the host over SSH, as a person at the
    /// host's shell (or a backup tool) would; returns what it printed.
    pub fn vim_cmd_by_hand(&self, args: &[&str]) -> anyhow::Result<String> {
        let quoted: Vec<String> = args.iter().map(|a| format!("'{}'", a.replace('\'', "'\\''"))).collect();
        let mut cmd = self.ssh_command();
        cmd.arg(format!("vim-cmd {}", quoted.join(" ")));
        let out = cmd.output()?;
        anyhow::ensure!(out.status.success(), "vim-cmd {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Every read of a disk extent through `dd` or `cat`, in order.
    pub fn disk_reads(&self) -> Vec<DiskRead> {
        let text = fs::read_to_string(self.root.join("var/log/esxi-emu/reads.log")).unwrap_or_default();
        Self::parse_reads(&text)
    }

    /// The reads of disk extents logged after `vmid`'s last power-off
    /// through vim-cmd (`power.off`, or a completed `power.shutdown`).
    pub fn disk_reads_after_power_off(&self, vmid: &str) -> Vec<DiskRead> {
        let text = fs::read_to_string(self.root.join("var/log/esxi-emu/reads.log")).unwrap_or_default();
        let marker = format!("power-off\t{vmid}");
        let lines: Vec<&str> = text.lines().collect();
        let after = lines.iter().rposition(|l| *l == marker).map_or(0, |i| i + 1);
        Self::parse_reads(&lines[after..].join("\n"))
    }

    fn parse_reads(text: &str) -> Vec<DiskRead> {
        text.lines()
            .filter_map(|line| {
                let f: Vec<&str> = line.split('\t').collect();
                (f.len() == 6).then(|| DiskRead {
                    tool: f[0].to_owned(),
                    path: f[1].to_owned(),
                    offset: f[2].parse().unwrap_or(0),
                    length: f[3].parse().ok(),
                    delivered: f[4].parse().unwrap_or(0),
                    outcome: f[5].to_owned(),
                })
            })
            .collect()
    }

    /// Bytes of disk extents delivered to clients so far.
    pub fn bytes_served(&self) -> u64 {
        self.disk_reads().iter().map(|r| r.delivered).sum()
    }

    /// The disk data files of a VM in .vmx order. For `snap-vm` that is the
    /// base's flat extent (the snapshot delta is not a flat file). Panics on
    /// an unknown vmid.
    pub fn disk_files(&self, vmid: &str) -> Vec<DiskFile> {
        self.disks.get(vmid).unwrap_or_else(|| panic!("no VM with vmid {vmid:?}")).clone()
    }

    /// The real path of a `/vmfs/...` path of the emulated host.
    pub fn host_path(&self, esxi_path: &str) -> PathBuf {
        self.root.join(esxi_path.trim_start_matches('/'))
    }

    /// Restarts sshd with a new host key: the fingerprint changes.
    pub fn change_host_key(&mut self) -> anyhow::Result<()> {
        let dir = self.dir.clone();
        for f in ["ssh_host_ecdsa_key", "ssh_host_ecdsa_key.pub"] {
            let _ = fs::remove_file(dir.join(f));
        }
        keygen(&dir.join("ssh_host_ecdsa_key"), &["-t", "ecdsa", "-b", "256"])?.wait_ok("ssh-keygen")?;
        self.restart_sshd(|_| {})
    }

    /// Restarts sshd so that every login is refused (`DenyUsers *`), or allowed again.
    pub fn refuse_logins(&self, refuse: bool) -> anyhow::Result<()> {
        self.restart_sshd(|state| state.refuse = refuse)
    }

    /// Restarts sshd the way a host's `services.sh restart` does: the
    /// listener and every session's sshd are killed (each open connection
    /// ends mid-stream), and a new listener starts with the same key.
    pub fn restart_sshd_dropping_sessions(&self) -> anyhow::Result<()> {
        self.restart_sshd(|state| state.drop_sessions = true)
    }

    /// Restarts sshd (its sessions with it) with `MaxStartups n` (or the
    /// default back): beyond `n` connections that have not logged in yet,
    /// sshd drops new ones before its banner ("past MaxStartups"), as a
    /// host hammered by other tools does.
    pub fn set_max_startups(&self, n: Option<u32>) -> anyhow::Result<()> {
        self.restart_sshd(|state| {
            state.max_startups = n;
            state.drop_sessions = true;
        })
    }

    /// How many connections sshd dropped for `MaxStartups` so far (its log).
    pub fn dropped_for_max_startups(&self) -> usize {
        let log = std::fs::read_dir(self.janitor.dir())
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("sshd-"))
            .map(|e| std::fs::read_to_string(e.path()).unwrap_or_default())
            .collect::<String>();
        log.matches("past MaxStartups").count() + log.matches("exceeded MaxStartups").count()
    }

    pub fn set_shutdown_hangs(&self, hang: bool) {
        self.put_state("shutdown_hangs", if hang { "1" } else { "0" });
    }

    /// `power.getstate` prints `bytes` of noise and no state (a broken or
    /// hostile host); 0 for the real answer again.
    pub fn set_getstate_garbage(&self, bytes: u64) {
        self.put_state("getstate_garbage", &bytes.to_string());
    }

    /// A guest shutdown completes on the Nth `power.getstate` call after it
    /// (default [`DEFAULT_SHUTDOWN_GETSTATE_CALLS`]).
    pub fn set_shutdown_getstate_calls(&self, calls: u32) {
        self.put_state("shutdown_getstate_calls", &calls.max(1).to_string());
    }

    /// Arms (or disarms) the cut fault: after `n` more bytes of disk reads
    /// the SSH connection is killed. Reads that fit in the budget are served
    /// whole (and use it up); the read that reaches it delivers only the rest,
    /// then the session's sshd is killed (all channels of that connection
    /// drop). One-shot: cleared when it fires. A single read of a whole disk
    /// therefore gets `n` bytes, then the cut.
    pub fn set_cut_after_bytes(&self, n: Option<u64>) {
        match n {
            Some(n) => self.put_state("cut_after_bytes", &n.to_string()),
            None => {
                let _ = fs::remove_file(self.state_dir().join("cut_after_bytes"));
            }
        }
    }

    /// Makes every disk read wait `seconds` before it is served (`None`:
    /// full speed), so a copy can be interrupted mid-way on purpose.
    pub fn set_read_delay(&self, seconds: Option<f64>) {
        match seconds {
            Some(s) => self.put_state("read_delay", &format!("{s:.3}")),
            None => {
                let _ = fs::remove_file(self.state_dir().join("read_delay"));
            }
        }
    }

    /// Serves every disk read at about `bytes_per_second`, in pieces of
    /// 1 MiB (`None`: full speed), so a copy is still running when a test
    /// kills its reader.
    pub fn set_read_rate(&self, bytes_per_second: Option<u64>) {
        match bytes_per_second {
            Some(rate) => self.put_state("read_rate", &rate.max(1).to_string()),
            None => {
                let _ = fs::remove_file(self.state_dir().join("read_rate"));
            }
        }
    }

    /// Starts a guest on `vmid` that writes to its disks while the VM is
    /// powered on (into the top of each disk's chain: the delta once a
    /// snapshot exists). Stops when the returned writer is dropped.
    pub fn start_guest_writes(&self, vmid: &str, writes: crate::esxi_snapshots::GuestWrites) -> GuestWriter {
        let running = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let thread = self.snapshots.start_guest(vmid, writes, running.clone());
        GuestWriter { running, thread: Some(thread) }
    }

    /// Takes `vmid`'s power lock (what `vim-cmd`'s power-off and the guest
    /// writer share) until the guard is dropped: a test's hand on the power
    /// switch, to see that both wait for it.
    pub fn hold_power_lock(&self, vmid: &str) -> impl Drop {
        crate::esxi_snapshots::PowerLock::take(&self.vm_dir(vmid).join("power.lock"))
    }

    /// Blocks written by guest writers so far, all VMs.
    pub fn guest_blocks_written(&self) -> u64 {
        self.snapshots.guest_blocks.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The top descriptor of each disk of `vmid` (host paths): `qemu-img`
    /// opens it as the VM's disk as it is now (its whole snapshot chain).
    pub fn disk_tops(&self, vmid: &str) -> Vec<PathBuf> {
        self.snapshots.tops(vmid)
    }

    /// The delta extents of each disk of `vmid` (host paths), lowest first.
    pub fn delta_files(&self, vmid: &str) -> Vec<Vec<PathBuf>> {
        self.snapshots.delta_files(vmid)
    }

    pub fn set_tools_running(&self, vmid: &str, running: bool) {
        self.vm_dir(vmid);
        self.put_state(&format!("vms/{vmid}/tools"), if running { "running" } else { "notrunning" });
    }

    /// Sets the power state directly (a knob: not counted as a transition,
    /// cancels a pending guest shutdown).
    pub fn set_power(&self, vmid: &str, on: bool) {
        let dir = self.vm_dir(vmid);
        if !on {
            let _ = fs::remove_file(dir.join("shutdown_left"));
        }
        self.put_state(&format!("vms/{vmid}/power"), if on { "on" } else { "off" });
    }

    /// The last lines of the sshd log, for failure messages.
    pub fn sshd_log_tail(&self) -> String {
        let name = self.sshd.lock().expect("sshd lock").name.clone();
        self.janitor.log_tail(&name)
    }

    fn state_dir(&self) -> PathBuf {
        self.root.join("var/lib/esxi-emu")
    }

    fn vm_dir(&self, vmid: &str) -> PathBuf {
        let dir = self.state_dir().join("vms").join(vmid);
        assert!(
            !vmid.is_empty() && vmid.bytes().all(|b| b.is_ascii_digit()) && dir.is_dir(),
            "no VM with vmid {vmid:?}"
        );
        dir
    }

    fn read_vm_file(&self, vmid: &str, file: &str) -> String {
        fs::read_to_string(self.vm_dir(vmid).join(file)).unwrap_or_default().trim().to_owned()
    }

    fn put_state(&self, rel: &str, value: &str) {
        put_user_file(&self.state_dir().join(rel), &format!("{value}\n"), self.uid, self.gid)
            .unwrap_or_else(|e| panic!("cannot write emulator state {rel}: {e:#}"));
    }

    /// Stops the running sshd (if any) and starts one with the current key
    /// and `change` applied to the settings, on the same port.
    fn restart_sshd(&self, change: impl FnOnce(&mut SshdState)) -> anyhow::Result<()> {
        let mut state = self.sshd.lock().expect("sshd lock");
        change(&mut state);
        if std::mem::take(&mut state.drop_sessions) && state.pid != 0 {
            // Each connection's sshd is a child of the listener.
            let _ = Command::new("pkill").args(["-KILL", "-P", &state.pid.to_string()]).status();
        }
        if !state.name.is_empty() {
            self.janitor.stop(&state.name)?;
        }
        state.generation += 1;
        state.name = format!("sshd-{}", state.generation);

        let host_key = self.dir.join("ssh_host_ecdsa_key");
        let public = fs::read_to_string(host_key.with_extension("pub"))?;
        state.host_public = public.split_whitespace().take(2).collect::<Vec<_>>().join(" ");
        state.fingerprint = fingerprint(&host_key.with_extension("pub"))?;
        fs::write(self.known_hosts_path(), format!("[127.0.0.1]:{} {}\n", self.port, state.host_public))?;

        let config = SSHD_CONFIG_TEMPLATE
            .replace(
                "@ALSO_LISTEN@",
                &self.also_listen.map(|ip| format!("ListenAddress {ip}:{}", self.port)).unwrap_or_default(),
            )
            .replace("@PORT@", &self.port.to_string())
            .replace("@HOST_KEY@", &host_key.display().to_string())
            .replace("@AUTHORIZED_KEYS@", &self.dir.join("authorized_keys").display().to_string())
            .replace("@USER@", ESXI_USER)
            .replace("@ROOT@", &self.root.display().to_string())
            .replace("@MAX_STARTUPS@", &state.max_startups.unwrap_or(50).to_string())
            .replace("@EXTRA@", if state.refuse { "DenyUsers *" } else { "" });
        let config_path = self.dir.join(format!("sshd_config.{}", state.generation));
        fs::write(&config_path, config)?;

        let pid = self.janitor.spawn(
            &state.name,
            Command::new("/usr/sbin/sshd").arg("-D").arg("-e").arg("-f").arg(&config_path),
        )?;
        state.pid = pid;
        // For the chroot cleanup: session processes of this listener.
        let mut pids =
            fs::OpenOptions::new().create(true).append(true).open(self.root.join(".emulator/sshd.pids"))?;
        writeln!(pids, "{pid}")?;

        let port = self.port;
        let name = state.name.clone();
        let ready = wait_until(Duration::from_secs(20), "the emulated ESXi sshd's SSH banner", || {
            self.janitor.check_alive()?;
            Ok(ssh_banner(port).is_some_and(|b| b.starts_with("SSH-2.0-")))
        });
        if let Err(err) = ready {
            let log = self.janitor.log_tail(&name);
            let _ = self.janitor.stop(&name);
            state.name.clear();
            return Err(err.context(format!("sshd on port {port} did not come up; log:\n{log}")));
        }
        Ok(())
    }
}

impl Drop for EsxiEmulator {
    fn drop(&mut self) {
        self.snapshots.stop();
        // Stop and reap sshd here: the janitor would otherwise see the
        // unreaped (zombie) process as alive and wait five seconds for it.
        let name = std::mem::take(&mut self.sshd.get_mut().unwrap_or_else(|p| p.into_inner()).name);
        if !name.is_empty() {
            let _ = self.janitor.stop(&name);
        }
    }
}

/// Reads the SSH identification line of a server, if one answers.
fn ssh_banner(port: u16) -> Option<String> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() < 255 {
        match stream.read(&mut byte) {
            Ok(1) if byte[0] == b'\n' => break,
            Ok(1) => line.push(byte[0]),
            _ => return None,
        }
    }
    // Be polite so sshd does not log a protocol error.
    let _ = stream.write_all(b"SSH-2.0-readiness-probe\r\n");
    Some(String::from_utf8_lossy(&line).trim_end().to_owned())
}

fn fingerprint(public_key: &Path) -> anyhow::Result<String> {
    let out = Command::new("ssh-keygen").arg("-lf").arg(public_key).output()?;
    ensure!(out.status.success(), "ssh-keygen -lf failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout)?;
    let fp = text.split_whitespace().nth(1).context("ssh-keygen -lf printed no fingerprint")?;
    ensure!(fp.starts_with("SHA256:") && fp.len() == 7 + 43, "unexpected fingerprint {fp:?}");
    Ok(fp.to_owned())
}
