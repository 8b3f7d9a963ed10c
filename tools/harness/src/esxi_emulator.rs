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

// ---------------------------------------------------------------------------
// The system user

/// Creates the shared user once (idempotent, safe across parallel test
/// processes thanks to a file lock) and returns its uid and gid.
fn ensure_user() -> anyhow::Result<(u32, u32)> {
    let base = Path::new(RUN_BASE);
    ensure_dir_root(base)?;
    let lock = fs::File::create(base.join("user.lock"))?;
    lock.lock()?;
    let exists =
        Command::new("id").arg(ESXI_USER).stdout(Stdio::null()).stderr(Stdio::null()).status()?.success();
    let marker = base.join("user-password");
    if !exists {
        let out = Command::new("useradd")
            .args(["--system", "--user-group", "--no-create-home", "--home-dir", "/", "--shell", "/bin/sh"])
            .args(["--comment", "vmmigrate ESXi emulator", ESXI_USER])
            .output()
            .context("useradd")?;
        // 9: the user exists already (made by someone not holding our lock).
        ensure!(
            out.status.success() || out.status.code() == Some(9),
            "useradd {ESXI_USER} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let _ = fs::remove_file(&marker);
    }
    if fs::read_to_string(&marker).ok().as_deref() != Some(ESXI_PASSWORD) {
        let mut child = Command::new("chpasswd").stdin(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
        child.stdin.take().expect("stdin").write_all(format!("{ESXI_USER}:{ESXI_PASSWORD}\n").as_bytes())?;
        let out = child.wait_with_output()?;
        ensure!(out.status.success(), "chpasswd failed: {}", String::from_utf8_lossy(&out.stderr));
        fs::write(&marker, ESXI_PASSWORD)?;
    }
    let id = |flag: &str| -> anyhow::Result<u32> {
        let out = Command::new("id").arg(flag).arg(ESXI_USER).output()?;
        ensure!(out.status.success(), "id {flag} {ESXI_USER} failed");
        Ok(String::from_utf8(out.stdout)?.trim().parse()?)
    };
    Ok((id("-u")?, id("-g")?))
}

// ---------------------------------------------------------------------------
// The chroot

/// `/run/vmmigrate-esxi`: sshd wants every component of a chroot's path
/// root-owned and not group/world-writable, which a temp or target directory
/// need not be.
fn chroot_base() -> anyhow::Result<PathBuf> {
    let base = PathBuf::from(RUN_BASE);
    ensure_dir_root(&base)?;
    Ok(base)
}

/// Removes the chroot when dropped or when the test process exits (a shell
/// waiting on a pipe only we hold, like `Janitor`). It first kills what still
/// runs inside the chroot (session shells, dd) and the session processes of
/// this emulator's sshd listeners.
struct ChrootGuard {
    pipe: Option<ChildStdin>,
    child: Child,
}

const CHROOT_CLEANUP_SCRIPT: &str = r#"
root=$1; keep=$2
cat >/dev/null
for l in $(cat "$root/.emulator/sshd.pids" 2>/dev/null); do
  for s in /proc/[0-9]*/stat; do
    read -r pid comm state ppid rest < "$s" 2>/dev/null || continue
    [ "$ppid" = "$l" ] && kill -KILL "$pid" 2>/dev/null
  done
done
for p in /proc/[0-9]*; do
  [ "$p/root" -ef "$root" ] && kill -KILL "${p#/proc/}" 2>/dev/null
done
case $root in /*/esxi-emu-*) [ "$keep" = 1 ] || rm -rf "$root" ;; esac
"#;

impl ChrootGuard {
    fn new(root: &Path) -> anyhow::Result<ChrootGuard> {
        let keep = if std::env::var_os("VMMIGRATE_TEST_KEEP").is_some() { "1" } else { "0" };
        let mut child = Command::new("sh")
            .args(["-c", CHROOT_CLEANUP_SCRIPT, "esxi-chroot-janitor"])
            .arg(root)
            .arg(keep)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        Ok(ChrootGuard { pipe: child.stdin.take(), child })
    }
}

impl Drop for ChrootGuard {
    fn drop(&mut self) {
        self.pipe.take();
        let _ = self.child.wait();
    }
}

fn build_chroot(root: &Path, uid: u32, gid: u32, opts: &EsxiOptions) -> anyhow::Result<()> {
    for d in ["bin", "dev", "etc", "usr", "usr/lib", "usr/lib/esxi-emu", "var", "var/lib", "var/log", "vmfs"]
    {
        mkdir_mode(&root.join(d), 0o755)?;
    }
    mkdir_mode(&root.join(".emulator"), 0o700)?;
    mkdir_mode(&root.join("tmp"), 0o1777)?;
    for d in ["var/lib/esxi-emu", "var/lib/esxi-emu/vms", "var/log/esxi-emu"] {
        mkdir_mode(&root.join(d), 0o755)?;
        chown(root.join(d), Some(uid), Some(gid))?;
    }
    for f in ["vimcmd.log", "reads.log"] {
        put_user_file(&root.join("var/log/esxi-emu").join(f), "", uid, gid)?;
    }

    // BusyBox: applets are links to an unmodified copy; the shell is a copy
    // whose applet table is patched so that ash finds commands through PATH
    // only (Debian's build runs any applet by name, even without a link).
    let bin = root.join("bin");
    write_mode(
        &bin.join("busybox"),
        &fs::read("/bin/busybox").context("busybox-static is not installed")?,
        0o755,
    )?;
    write_mode(&bin.join("sh"), patched_shell()?, 0o755)?;
    symlink("sh", bin.join("ash"))?;
    for applet in APPLETS {
        symlink("busybox", bin.join(applet))?;
    }
    if opts.with_sha256sum {
        symlink("busybox", bin.join("sha256sum"))?;
    }
    for (name, text) in SCRIPTS_BIN {
        write_mode(&bin.join(name), text.as_bytes(), 0o755)?;
    }
    if opts.with_openssl {
        install_with_libraries(root, Path::new("/usr/bin/openssl"), &bin.join("openssl"))?;
    }
    // SFTP, which ESXi offers: the distribution's sftp-server and the two
    // libraries it needs (it is only used by the scp baseline of the benchmark).
    for file in
        ["/usr/lib/openssh/sftp-server", "/lib/x86_64-linux-gnu/libc.so.6", "/lib64/ld-linux-x86-64.so.2"]
    {
        if let Ok(bytes) = fs::read(file) {
            let dest = root.join(file.trim_start_matches('/'));
            if let Some(parent) = dest.parent() {
                fs::create_dir_all(parent)?;
            }
            write_mode(&dest, &bytes, 0o755)?;
        }
    }
    write_mode(&root.join("usr/lib/esxi-emu/session"), SESSION_SCRIPT.as_bytes(), 0o755)?;
    write_mode(&root.join("usr/lib/esxi-emu/common.sh"), COMMON_SH.as_bytes(), 0o644)?;

    for (name, minor) in [("null", 3), ("zero", 5), ("random", 8), ("urandom", 9)] {
        let path = root.join("dev").join(name);
        let status = Command::new("mknod").arg(&path).args(["c", "1", &minor.to_string()]).status()?;
        ensure!(status.success(), "mknod {} failed (the emulator needs CAP_MKNOD)", path.display());
        set_mode(&path, 0o666)?;
    }

    write_mode(
        &root.join("etc/passwd"),
        format!(
            "root:x:0:0:Administrator:/:/bin/sh\n{ESXI_USER}:x:{uid}:{gid}:ESXi emulator user:/:/bin/sh\n"
        )
        .as_bytes(),
        0o644,
    )?;
    write_mode(&root.join("etc/group"), format!("root:x:0:\n{ESXI_USER}:x:{gid}:\n").as_bytes(), 0o644)?;
    write_mode(&root.join("etc/vmware-release"), b"VMware ESXi 8.0.3 GA\n", 0o644)?;
    Ok(())
}

/// Copies a dynamically linked program into the chroot at `dest`, with the
/// libraries `ldd` names for it at their own paths.
fn install_with_libraries(root: &Path, program: &Path, dest: &Path) -> anyhow::Result<()> {
    write_mode(dest, &fs::read(program).with_context(|| program.display().to_string())?, 0o755)?;
    let out = Command::new("ldd").arg(program).output().context("ldd")?;
    ensure!(out.status.success(), "ldd {}", program.display());
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        // `libx.so => /lib/.../libx.so (0x...)` or `/lib64/ld-linux-x86-64.so.2 (0x...)`.
        let path = line.split("=>").last().unwrap_or_default().split_whitespace().next().unwrap_or_default();
        if !path.starts_with('/') {
            continue;
        }
        let target = root.join(path.trim_start_matches('/'));
        if target.exists() {
            continue;
        }
        if let Some(parent) = target.parent() {
            fs::create_dir_all(parent)?;
        }
        write_mode(&target, &fs::read(path).with_context(|| path.to_owned())?, 0o755)?;
    }
    Ok(())
}

/// The BusyBox binary with every applet name except `sh`, `ash`, `[` and `w`
/// replaced by an unreachable name of the same length, keeping the table
/// sorted (BusyBox looks names up by ordered search).
fn patched_shell() -> anyhow::Result<&'static [u8]> {
    static PATCHED: OnceLock<Result<Vec<u8>, String>> = OnceLock::new();
    PATCHED
        .get_or_init(|| patch_busybox().map_err(|e| format!("{e:#}")))
        .as_deref()
        .map_err(|e| anyhow::anyhow!("{e}"))
}

fn patch_busybox() -> anyhow::Result<Vec<u8>> {
    let mut binary = fs::read("/bin/busybox").context("busybox-static is not installed")?;
    let out = Command::new("/bin/busybox").arg("--list").output()?;
    let names: Vec<Vec<u8>> =
        out.stdout.split(|b| *b == b'\n').filter(|n| !n.is_empty()).map(<[u8]>::to_vec).collect();
    let mut table: Vec<u8> = names.join(&0u8);
    table.push(0);
    let at = binary
        .windows(table.len())
        .position(|w| w == table.as_slice())
        .context("BusyBox applet table not found in /bin/busybox")?;

    const KEEP: [&[u8]; 4] = [b"sh", b"ash", b"[", b"w"];
    let successor = |s: &[u8]| -> Vec<u8> {
        let mut s = s.to_vec();
        for i in (0..s.len()).rev() {
            if s[i] < 0x7e {
                s[i] += 1;
                return s;
            }
            s[i] = 1;
        }
        panic!("no successor");
    };
    let mut patched: Vec<Vec<u8>> = Vec::with_capacity(names.len());
    for name in &names {
        if KEEP.contains(&name.as_slice()) {
            patched.push(name.clone());
            continue;
        }
        let prev = patched.last().cloned().unwrap_or_default();
        let len = name.len();
        let mut cand = [&name[..1], &vec![1u8; len - 1][..]].concat();
        if cand <= prev {
            cand = if prev.len() < len {
                [&prev[..], &vec![1u8; len - prev.len()][..]].concat()
            } else {
                successor(&prev[..len])
            };
        }
        while &cand == name || names.contains(&cand) {
            cand = successor(&cand);
        }
        patched.push(cand);
    }
    ensure!(patched.windows(2).all(|w| w[0] < w[1]), "patched BusyBox applet table is not sorted");
    let mut new_table: Vec<u8> = patched.join(&0u8);
    new_table.push(0);
    ensure!(new_table.len() == table.len(), "patched applet table changed size");
    binary[at..at + table.len()].copy_from_slice(&new_table);
    Ok(binary)
}

// ---------------------------------------------------------------------------
// The VMs and the datastore

struct VmSpec {
    id: &'static str,
    name: String,
    /// Directory and file stem on the datastore (`/` in names becomes `%2f`).
    dir: String,
    guest_os: &'static str,
    guest_id: &'static str,
    guest_full: &'static str,
    hw_version: u32,
    memory_mb: u32,
    cpus: Option<u32>,
    efi: bool,
    /// `uefi.secureBoot.enabled` (with `efi`).
    secure_boot: bool,
    power_on: bool,
    tools: &'static str,
    hostname: &'static str,
    ip: Option<&'static str>,
    annotation: &'static str,
    controllers: Vec<(&'static str, &'static str)>,
    disks: Vec<DiskSpec>,
    cdrom: Option<(&'static str, &'static str)>,
    nics: Vec<NicSpec>,
    snapshot: bool,
    question: Option<&'static str>,
    /// The BIOS UUID's last three bytes, when the vmid's byte is not enough
    /// (a fleet VM: unique across emulators, as on real hosts).
    uuid_tail: Option<[u8; 3]>,
}

impl VmSpec {
    /// `uuid.bios` as the .vmx writes it, and as vim-cmd prints it.
    fn uuids(&self) -> (String, String) {
        let n: u32 = self.id.parse().expect("numeric vmid");
        match self.uuid_tail {
            Some([a, b, c]) => (
                format!("42 1b 4b 87 e6 b7 d8 81-07 a0 c9 d2 21 {a:02x} {b:02x} {c:02x}"),
                format!("421b4b87-e6b7-d881-07a0-c9d221{a:02x}{b:02x}{c:02x}"),
            ),
            None => (
                format!("42 1b 4b 87 e6 b7 d8 81-07 a0 c9 d2 21 cd 3c {n:02x}"),
                format!("421b4b87-e6b7-d881-07a0-c9d221cd3c{n:02x}"),
            ),
        }
    }
}

struct DiskSpec {
    node: &'static str,
    /// Descriptor file name in the VM directory.
    file: String,
    size_mib: u64,
    adapter: &'static str,
    thin: bool,
    /// Write an absolute `/vmfs/volumes/datastore1/...` path into the .vmx.
    absolute: bool,
    /// The flat file's bytes come from this image (its size, not `size_mib`).
    image: Option<PathBuf>,
}

struct NicSpec {
    device: &'static str,
    network: &'static str,
    address_type: &'static str,
    mac: &'static str,
    ips: &'static [&'static str],
}

fn disk(node: &'static str, file: &str, size_mib: u64, adapter: &'static str) -> DiskSpec {
    DiskSpec { node, file: file.to_owned(), size_mib, adapter, thin: false, absolute: false, image: None }
}

fn vm_specs(opts: &EsxiOptions) -> Vec<VmSpec> {
    let hostile = "x'; rm -rf /; '";
    let hostile_dir = hostile.replace('/', "%2f");
    let mut vms = vec![
        VmSpec {
            id: "1",
            name: "web 01".into(),
            dir: "web 01".into(),
            guest_os: "ubuntu-64",
            guest_id: "ubuntu64Guest",
            guest_full: "Ubuntu Linux (64-bit)",
            hw_version: 21,
            memory_mb: 2048,
            cpus: Some(2),
            efi: false,
            secure_boot: false,
            power_on: true,
            tools: "running",
            hostname: "web01",
            ip: Some("192.168.10.21"),
            annotation: "Public web server",
            controllers: vec![("scsi0", "pvscsi")],
            disks: vec![DiskSpec { thin: true, ..disk("scsi0:0", "web 01.vmdk", 64, "lsilogic") }],
            cdrom: None,
            nics: vec![NicSpec {
                device: "vmxnet3",
                network: "VM Network",
                address_type: "generated",
                mac: "00:0c:29:aa:bb:01",
                ips: &["192.168.10.21", "fe80::20c:29ff:feaa:bb01"],
            }],
            snapshot: false,
            question: None,
            uuid_tail: None,
        },
        VmSpec {
            id: "2",
            name: "db-02".into(),
            dir: "db-02".into(),
            guest_os: "debian11-64",
            guest_id: "debian11_64Guest",
            guest_full: "Debian GNU/Linux 11 (64-bit)",
            hw_version: 21,
            memory_mb: 4096,
            cpus: Some(4),
            efi: true,
            secure_boot: false,
            power_on: true,
            tools: "running",
            hostname: "db-02.internal",
            ip: Some("10.0.0.12"),
            annotation: "PostgreSQL primary\nowner: dba team",
            controllers: vec![("scsi0", "pvscsi"), ("nvme0", ""), ("sata0", "")],
            disks: vec![
                disk("scsi0:0", "db-02.vmdk", 32, "lsilogic"),
                DiskSpec { absolute: true, ..disk("nvme0:0", "db-02_1.vmdk", 16, "lsilogic") },
            ],
            cdrom: Some(("sata0:0", "/vmfs/volumes/datastore1/ISOs/debian-12.5.0-amd64-netinst.iso")),
            nics: vec![
                NicSpec {
                    device: "vmxnet3",
                    network: "VM Network",
                    address_type: "vpx",
                    mac: "00:50:56:9b:5f:0d",
                    ips: &["10.0.0.12"],
                },
                NicSpec {
                    device: "e1000",
                    network: "DMZ",
                    address_type: "static",
                    mac: "00:50:56:01:02:03",
                    ips: &["172.16.5.12"],
                },
            ],
            snapshot: false,
            question: None,
            uuid_tail: None,
        },
        VmSpec {
            id: "3",
            name: "snap-vm".into(),
            dir: "snap-vm".into(),
            guest_os: "rhel8-64",
            guest_id: "rhel8_64Guest",
            guest_full: "Red Hat Enterprise Linux 8 (64-bit)",
            hw_version: 19,
            memory_mb: 1024,
            cpus: Some(1),
            efi: false,
            secure_boot: false,
            power_on: false,
            tools: "running",
            hostname: "snap-vm",
            ip: Some("192.168.10.23"),
            annotation: "",
            controllers: vec![("scsi0", "lsilogic")],
            disks: vec![disk("scsi0:0", "snap-vm.vmdk", 16, "lsilogic")],
            cdrom: None,
            nics: vec![NicSpec {
                device: "vmxnet3",
                network: "VM Network",
                address_type: "generated",
                mac: "00:0c:29:aa:bb:03",
                ips: &["192.168.10.23"],
            }],
            snapshot: true,
            question: None,
            uuid_tail: None,
        },
        VmSpec {
            id: "4",
            name: "question-vm".into(),
            dir: "question-vm".into(),
            guest_os: "windows2019srv-64",
            guest_id: "windows2019srv_64Guest",
            guest_full: "Microsoft Windows Server 2019 (64-bit)",
            hw_version: 19,
            memory_mb: 1024,
            cpus: None,
            efi: false,
            secure_boot: false,
            power_on: true,
            tools: "notrunning",
            hostname: "question-vm",
            ip: None,
            annotation: "",
            controllers: vec![("sata0", "")],
            disks: vec![disk("sata0:0", "question-vm.vmdk", 8, "ide")],
            cdrom: None,
            nics: vec![NicSpec {
                device: "e1000e",
                network: "VM Network",
                address_type: "generated",
                mac: "00:0c:29:aa:bb:04",
                ips: &[],
            }],
            snapshot: false,
            question: Some(
                "Virtual machine message 12: msg.uuid.altered:This virtual machine may have been moved or copied.\n\
                 0. Cancel (Cancel) 1. I _moved it (I _moved it) 2. I _copied it (I _copied it) [default]",
            ),
            uuid_tail: None,
        },
        VmSpec {
            id: "5",
            name: hostile.into(),
            dir: hostile_dir.clone(),
            guest_os: "other4xlinux-64",
            guest_id: "other4xLinux64Guest",
            guest_full: "Other 4.x or later Linux (64-bit)",
            hw_version: 21,
            memory_mb: 512,
            cpus: Some(1),
            efi: false,
            secure_boot: false,
            power_on: false,
            tools: "running",
            hostname: "hostile",
            ip: Some("192.168.10.25"),
            annotation: "",
            controllers: vec![("scsi0", "lsilogic")],
            disks: vec![disk("scsi0:0", &format!("{hostile_dir}.vmdk"), 8, "lsilogic")],
            cdrom: None,
            nics: vec![NicSpec {
                device: "vmxnet3",
                network: "VM Network",
                address_type: "generated",
                mac: "00:0c:29:aa:bb:05",
                ips: &["192.168.10.25"],
            }],
            snapshot: false,
            question: None,
            uuid_tail: None,
        },
        VmSpec {
            id: "6",
            name: "no-tools".into(),
            dir: "no-tools".into(),
            guest_os: "centos7-64",
            guest_id: "centos7_64Guest",
            guest_full: "CentOS 7 (64-bit)",
            hw_version: 21,
            memory_mb: 1024,
            cpus: Some(2),
            efi: false,
            secure_boot: false,
            power_on: true,
            tools: "notinstalled",
            hostname: "no-tools",
            ip: None,
            annotation: "no VMware Tools",
            controllers: vec![("scsi0", "pvscsi")],
            disks: vec![DiskSpec { thin: true, ..disk("scsi0:0", "no-tools.vmdk", 8, "lsilogic") }],
            cdrom: None,
            nics: vec![NicSpec {
                device: "vmxnet3",
                network: "VM Network",
                address_type: "generated",
                mac: "00:0c:29:aa:bb:06",
                ips: &[],
            }],
            snapshot: false,
            question: None,
            uuid_tail: None,
        },
    ];
    if let Some(images) = &opts.guests {
        vms.extend(guest_vms(images));
    }
    if let Some((n, mib)) = opts.fleet {
        // Each emulator's fleet has BIOS UUIDs of its own.
        static HOSTS: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);
        let host = HOSTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        vms.extend((1..=n).map(|i| fleet_vm(host, i, mib)));
    }
    if let Some((first, second)) = opts.pair_disk_mib {
        let mut pair = fleet_vm(0, 0, first);
        pair.id = "12";
        pair.name = "pair".into();
        pair.dir = "pair".into();
        pair.hostname = "pair";
        pair.uuid_tail = None;
        pair.disks = vec![disk("scsi0:0", "pair.vmdk", first, "lsilogic")];
        if second > 0 {
            pair.disks.push(disk("scsi0:1", "pair_1.vmdk", second, "lsilogic"));
        }
        pair.nics[0].mac = "00:0c:29:aa:bb:0c";
        vms.push(pair);
    }
    if let Some(mib) = opts.big_disk_mib {
        vms.push(VmSpec {
            id: "7",
            name: "big".into(),
            dir: "big".into(),
            guest_os: "debian12-64",
            guest_id: "debian12_64Guest",
            guest_full: "Debian GNU/Linux 12 (64-bit)",
            hw_version: 21,
            memory_mb: 2048,
            cpus: Some(2),
            efi: true,
            secure_boot: false,
            power_on: false,
            tools: "running",
            hostname: "big",
            ip: Some("192.168.10.27"),
            annotation: "",
            controllers: vec![("scsi0", "pvscsi")],
            disks: vec![DiskSpec { thin: true, ..disk("scsi0:0", "big.vmdk", mib, "lsilogic") }],
            cdrom: None,
            nics: vec![NicSpec {
                device: "vmxnet3",
                network: "VM Network",
                address_type: "generated",
                mac: "00:0c:29:aa:bb:07",
                ips: &["192.168.10.27"],
            }],
            snapshot: false,
            question: None,
            uuid_tail: None,
        });
    }
    vms
}

/// VM `vm-<i>` of [`EsxiOptions::fleet`]. Its strings live as long as the
/// process (a few bytes per VM of a test's fleet).
fn fleet_vm(host: u8, i: usize, mib: u64) -> VmSpec {
    let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
    let name = format!("vm-{i:03}");
    VmSpec {
        id: leak(format!("{}", 100 + i)),
        name: name.clone(),
        dir: name.clone(),
        guest_os: "debian12-64",
        guest_id: "debian12_64Guest",
        guest_full: "Debian GNU/Linux 12 (64-bit)",
        hw_version: 21,
        memory_mb: 512,
        cpus: Some(1),
        efi: false,
        secure_boot: false,
        power_on: true,
        tools: "running",
        hostname: leak(name.clone()),
        ip: None,
        annotation: "",
        controllers: vec![("scsi0", "pvscsi")],
        disks: vec![disk("scsi0:0", &format!("{name}.vmdk"), mib, "lsilogic")],
        cdrom: None,
        nics: vec![NicSpec {
            device: "vmxnet3",
            network: "VM Network",
            address_type: "generated",
            mac: leak(format!("00:0c:29:f1:{:02x}:{:02x}", i / 256, i % 256)),
            ips: &[],
        }],
        snapshot: false,
        question: None,
        uuid_tail: Some([host, (i >> 8) as u8, i as u8]),
    }
}

/// The VMs of [`GUEST_VMS`], on the images in `images`.
fn guest_vms(images: &Path) -> Vec<VmSpec> {
    let image = |node, file: &str, name: &str| DiskSpec {
        thin: true,
        image: Some(images.join(name)),
        ..disk(node, file, 0, "lsilogic")
    };
    let nic = |network, mac| NicSpec { device: "vmxnet3", network, address_type: "generated", mac, ips: &[] };
    let guest = |id, name: &'static str, efi, disks, nics| VmSpec {
        id,
        name: name.into(),
        dir: name.into(),
        guest_os: "debian12-64",
        guest_id: "debian12_64Guest",
        guest_full: "Debian GNU/Linux 12 (64-bit)",
        hw_version: 21,
        memory_mb: 256,
        cpus: Some(1),
        efi,
        secure_boot: false,
        power_on: true,
        tools: "running",
        hostname: name,
        ip: None,
        annotation: "",
        controllers: vec![("scsi0", "pvscsi")],
        disks,
        cdrom: None,
        nics,
        snapshot: false,
        question: None,
        uuid_tail: None,
    };
    vec![
        guest(
            "8",
            "app-bios",
            false,
            vec![image("scsi0:0", "app-bios.vmdk", "bios.img")],
            vec![nic("VM Network", "00:0c:29:aa:bb:08")],
        ),
        guest(
            "9",
            "app-efi",
            true,
            vec![image("scsi0:0", "app-efi.vmdk", "efi.img"), image("scsi0:1", "app-efi_1.vmdk", "data.img")],
            vec![nic("VM Network", "00:0c:29:aa:bb:09")],
        ),
        guest(
            "10",
            "no-os",
            false,
            vec![image("scsi0:0", "no-os.vmdk", "nodisk.img")],
            vec![nic("VM Network", "00:0c:29:aa:bb:10")],
        ),
        // Debian's signed shim and GRUB start the kernel under secure boot
        // only with 512 MiB or more (tools/guest/build.sh).
        VmSpec {
            secure_boot: true,
            memory_mb: 512,
            ..guest(
                "11",
                "app-secure",
                true,
                vec![image("scsi0:0", "app-secure.vmdk", "secureboot.img")],
                vec![nic("VM Network", "00:0c:29:aa:bb:11")],
            )
        },
    ]
}

fn stem(file: &str) -> &str {
    file.strip_suffix(".vmdk").unwrap_or(file)
}

fn vmx_text(vm: &VmSpec) -> String {
    let n: u32 = vm.id.parse().expect("numeric vmid");
    let mut lines: Vec<(String, String)> = vec![
        (".encoding".into(), "UTF-8".into()),
        ("config.version".into(), "8".into()),
        ("virtualHW.version".into(), vm.hw_version.to_string()),
        ("displayName".into(), vm.name.clone()),
        ("guestOS".into(), vm.guest_os.into()),
        ("memSize".into(), vm.memory_mb.to_string()),
    ];
    if let Some(cpus) = vm.cpus {
        lines.push(("numvcpus".into(), cpus.to_string()));
    }
    if vm.efi {
        lines.push(("firmware".into(), "efi".into()));
        lines.push(("nvram".into(), format!("{}.nvram", vm.dir)));
        if vm.secure_boot {
            lines.push(("uefi.secureBoot.enabled".into(), "TRUE".into()));
        }
    }
    lines.push(("uuid.bios".into(), vm.uuids().0));
    lines.push(("vc.uuid".into(), format!("52 7a 10 93 5e 44 c1 0f-9a 61 0b 3d 7e 22 a4 {n:02x}")));
    if !vm.annotation.is_empty() {
        lines.push(("annotation".into(), vm.annotation.replace('\n', "|0A")));
    }
    lines.push(("tools.syncTime".into(), "FALSE".into()));
    for (ctrl, dev) in &vm.controllers {
        lines.push((format!("{ctrl}.present"), "TRUE".into()));
        if !dev.is_empty() {
            lines.push((format!("{ctrl}.virtualDev"), (*dev).into()));
        }
    }
    for d in &vm.disks {
        let file = if vm.snapshot { format!("{}-000001.vmdk", stem(&d.file)) } else { d.file.clone() };
        let file = if d.absolute { format!("/vmfs/volumes/datastore1/{}/{file}", vm.dir) } else { file };
        lines.push((format!("{}.present", d.node), "TRUE".into()));
        if d.node.starts_with("scsi") {
            lines.push((format!("{}.deviceType", d.node), "scsi-hardDisk".into()));
        }
        lines.push((format!("{}.fileName", d.node), file));
    }
    if let Some((node, iso)) = vm.cdrom {
        lines.push((format!("{node}.present"), "TRUE".into()));
        lines.push((format!("{node}.deviceType"), "cdrom-image".into()));
        lines.push((format!("{node}.fileName"), iso.into()));
    }
    for (i, nic) in vm.nics.iter().enumerate() {
        lines.push((format!("ethernet{i}.present"), "TRUE".into()));
        lines.push((format!("ethernet{i}.virtualDev"), nic.device.into()));
        lines.push((format!("ethernet{i}.networkName"), nic.network.into()));
        lines.push((format!("ethernet{i}.addressType"), nic.address_type.into()));
        let key = if nic.address_type == "static" { "address" } else { "generatedAddress" };
        lines.push((format!("ethernet{i}.{key}"), nic.mac.into()));
    }
    lines.push((
        "sched.swap.derivedName".into(),
        format!("/vmfs/volumes/{DATASTORE_UUID}/{}/{}.vswp", vm.dir, vm.dir),
    ));
    let mut text = String::new();
    for (k, v) in lines {
        text.push_str(&format!("{k} = \"{}\"\n", v.replace('"', "|22")));
    }
    text
}

fn flat_descriptor(file_stem: &str, sectors: u64, adapter: &str, thin: bool, cid: u32) -> String {
    let cylinders = (sectors / (255 * 63)).max(1);
    format!(
        "# Disk DescriptorFile\nversion=1\nencoding=\"UTF-8\"\nCID={cid:08x}\nparentCID=ffffffff\n\
         createType=\"vmfs\"\n\n# Extent description\nRW {sectors} VMFS \"{file_stem}-flat.vmdk\"\n\n\
         # The Disk Data Base\n#DDB\n\nddb.adapterType = \"{adapter}\"\nddb.geometry.cylinders = \"{cylinders}\"\n\
         ddb.geometry.heads = \"255\"\nddb.geometry.sectors = \"63\"\nddb.longContentID = \"{cid:08x}5c2e9f0a1b3d4e6f{cid:08x}\"\n\
         {}ddb.uuid = \"60 00 C2 9a 3b 1c 5d 7e-8f 90 a1 b2 c3 d4 {:02x} {:02x}\"\nddb.virtualHWVersion = \"21\"\n",
        if thin { "ddb.thinProvisioned = \"1\"\n" } else { "" },
        cid >> 8 & 0xff,
        cid & 0xff,
    )
}

fn delta_descriptor(file_stem: &str, parent: &str, sectors: u64, parent_cid: u32) -> String {
    format!(
        "# Disk DescriptorFile\nversion=1\nencoding=\"UTF-8\"\nCID=fffffffe\nparentCID={parent_cid:08x}\n\
         createType=\"vmfsSparse\"\nparentFileNameHint=\"{parent}\"\n# Extent description\n\
         RW {sectors} VMFSSPARSE \"{file_stem}-delta.vmdk\"\n\n# The Disk Data Base\n#DDB\n\n\
         ddb.longContentID = \"0d8c4a2e71f35b96a4e1c7d2fffffffe\"\n"
    )
}

/// Builds `/vmfs/volumes/<uuid>` (+ the `datastore1` link) with every VM's
/// files; returns the flat disk files per vmid.
fn build_datastore(root: &Path, vms: &[VmSpec]) -> anyhow::Result<BTreeMap<String, Vec<DiskFile>>> {
    let volumes = root.join("vmfs/volumes");
    let store = volumes.join(DATASTORE_UUID);
    mkdir_mode(&volumes, 0o755)?;
    mkdir_mode(&store, 0o755)?;
    symlink(DATASTORE_UUID, volumes.join("datastore1"))?;
    mkdir_mode(&store.join("ISOs"), 0o755)?;
    write_mode(&store.join("ISOs/debian-12.5.0-amd64-netinst.iso"), &[0u8; 4096], 0o644)?;

    let mut disks: BTreeMap<String, Vec<DiskFile>> =
        vms.iter().map(|vm| (vm.id.to_owned(), Vec::new())).collect();
    for vm in vms {
        let vm_dir = store.join(&vm.dir);
        mkdir_mode(&vm_dir, 0o755)?;
        write_mode(&vm_dir.join(format!("{}.vmx", vm.dir)), vmx_text(vm).as_bytes(), 0o644)?;
        if vm.efi {
            write_mode(&vm_dir.join(format!("{}.nvram", vm.dir)), &[0x4e; 8192], 0o644)?;
        }
        for (i, d) in vm.disks.iter().enumerate() {
            let file_stem = stem(&d.file);
            let size = match &d.image {
                Some(image) => fs::metadata(image).with_context(|| image.display().to_string())?.len(),
                None => d.size_mib * MIB,
            };
            let cid = 0x3c5a_0000 | (vm.id.parse::<u32>()? << 8) | i as u32;
            write_mode(
                &vm_dir.join(&d.file),
                flat_descriptor(file_stem, size / 512, d.adapter, d.thin, cid).as_bytes(),
                0o644,
            )?;
            let flat = vm_dir.join(format!("{file_stem}-flat.vmdk"));
            let digest = match &d.image {
                Some(image) => copy_flat(image, &flat)?,
                None => write_flat(&flat, size, &format!("{}/{file_stem}", vm.dir))?,
            };
            let esxi_path = format!("/vmfs/volumes/datastore1/{}/{file_stem}-flat.vmdk", vm.dir);
            disks.get_mut(vm.id).expect("vm").push((esxi_path, flat, digest, size));
            if vm.snapshot {
                let delta_stem = format!("{file_stem}-000001");
                write_mode(
                    &vm_dir.join(format!("{delta_stem}.vmdk")),
                    delta_descriptor(&delta_stem, &d.file, size / 512, cid).as_bytes(),
                    0o644,
                )?;
                // Not a valid COWD extent: only the magic and a little data.
                let mut delta = b"COWD\x01\x00\x00\x00\x03\x00\x00\x00".to_vec();
                delta.resize(64 * 1024, 0);
                write_mode(&vm_dir.join(format!("{delta_stem}-delta.vmdk")), &delta, 0o644)?;
                write_mode(&vm_dir.join(format!("{}.vmsd", vm.dir)), vmsd_text(vm, d).as_bytes(), 0o644)?;
                write_mode(&vm_dir.join(format!("{}-Snapshot1.vmsn", vm.dir)), &[0x53; 4096], 0o644)?;
            }
        }
    }

    Ok(disks)
}

fn vmsd_text(vm: &VmSpec, d: &DiskSpec) -> String {
    format!(
        ".encoding = \"UTF-8\"\nsnapshot.lastUID = \"1\"\nsnapshot.current = \"1\"\n\
         snapshot0.uid = \"1\"\nsnapshot0.filename = \"{dir}-Snapshot1.vmsn\"\n\
         snapshot0.displayName = \"before-upgrade\"\nsnapshot0.description = \"clean install|0Apackages held at 8.6\"\n\
         snapshot0.createTimeHigh = \"395823\"\nsnapshot0.createTimeLow = \"-1489273952\"\n\
         snapshot0.numDisks = \"1\"\nsnapshot0.disk0.fileName = \"{file}\"\nsnapshot0.disk0.node = \"{node}\"\n\
         snapshot.numSnapshots = \"1\"\n",
        dir = vm.dir,
        file = d.file,
        node = d.node,
    )
}

/// The 1 MiB block all disk data derives from: deterministic, no zero bytes.
fn pattern_block() -> &'static [u8] {
    static BLOCK: OnceLock<Vec<u8>> = OnceLock::new();
    BLOCK.get_or_init(|| {
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut block = Vec::with_capacity(MIB as usize);
        while block.len() < MIB as usize {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            block.extend(state.to_le_bytes().iter().map(|b| if *b == 0 { 0x5a } else { *b }));
        }
        block
    })
}

/// Block `i` of the disk labelled `label`, into `buf` (the block's length):
/// the pattern with a header naming the disk and the block, or zeros for the
/// blocks with `i % 4 == 2` (left unwritten, so they stay sparse).
fn disk_block(label: &str, i: u64, buf: &mut [u8]) -> bool {
    if i % 4 == 2 {
        buf.fill(0);
        return false;
    }
    buf.copy_from_slice(&pattern_block()[..buf.len()]);
    let header = format!("vmmigrate ESXi emulator disk {label} block {i:08}\n");
    let n = header.len().min(buf.len());
    buf[..n].copy_from_slice(&header.as_bytes()[..n]);
    true
}

/// Copies a guest image into place as a flat disk (holes stay holes) and
/// returns its sha256.
fn copy_flat(image: &Path, path: &Path) -> anyhow::Result<String> {
    let status = Command::new("cp").arg("--sparse=always").arg(image).arg(path).status()?;
    ensure!(status.success(), "cp {} {} failed", image.display(), path.display());
    set_mode(path, 0o644)?;
    let out = Command::new("sha256sum").arg(path).output()?;
    ensure!(out.status.success(), "sha256sum {} failed", path.display());
    let text = String::from_utf8(out.stdout)?;
    Ok(text.split_whitespace().next().unwrap_or_default().to_owned())
}

/// Creates a raw disk with `qemu-img create -f raw`, fills it block by block
/// (see `disk_block`) and returns its sha256. The digest is computed by
/// `openssl dgst` (fast) from the same generator, on a second thread while the
/// file is written, and cached per (label, size) within the process.
fn write_flat(path: &Path, size: u64, label: &str) -> anyhow::Result<String> {
    static DIGESTS: OnceLock<Mutex<HashMap<(String, u64), String>>> = OnceLock::new();
    let digests = DIGESTS.get_or_init(Default::default);
    let key = (label.to_owned(), size);
    let cached = digests.lock().expect("digest cache").get(&key).cloned();

    let status = Command::new("qemu-img")
        .args(["create", "-q", "-f", "raw"])
        .arg(path)
        .arg(size.to_string())
        .status()?;
    ensure!(status.success(), "qemu-img create {} failed", path.display());
    let digest = std::thread::scope(|scope| -> anyhow::Result<String> {
        let hasher = cached.is_none().then(|| scope.spawn(|| hash_disk(size, label)));
        let file = fs::OpenOptions::new().write(true).open(path)?;
        let mut buf = vec![0u8; MIB as usize];
        for i in 0..size.div_ceil(MIB) {
            let len = (size - i * MIB).min(MIB) as usize;
            if disk_block(label, i, &mut buf[..len]) {
                file.write_all_at(&buf[..len], i * MIB)?;
            }
        }
        match hasher {
            Some(hasher) => hasher.join().map_err(|_| anyhow::anyhow!("the hashing thread panicked"))?,
            None => Ok(cached.clone().expect("cached digest")),
        }
    })?;
    digests.lock().expect("digest cache").insert(key, digest.clone());
    set_mode(path, 0o644)?;
    Ok(digest)
}

fn hash_disk(size: u64, label: &str) -> anyhow::Result<String> {
    let mut child = Command::new("openssl")
        .args(["dgst", "-sha256", "-r"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("openssl")?;
    let mut stdin = child.stdin.take().expect("stdin");
    let mut buf = vec![0u8; MIB as usize];
    for i in 0..size.div_ceil(MIB) {
        let len = (size - i * MIB).min(MIB) as usize;
        disk_block(label, i, &mut buf[..len]);
        stdin.write_all(&buf[..len])?;
    }
    drop(stdin);
    let out = child.wait_with_output()?;
    ensure!(out.status.success(), "openssl dgst failed");
    let digest = String::from_utf8(out.stdout)?.split_whitespace().next().unwrap_or_default().to_owned();
    ensure!(digest.len() == 64, "unexpected openssl dgst output {digest:?}");
    Ok(digest)
}

/// The state vim-cmd works on (see the header of `tools/esxi-emulator/vim-cmd`).
fn write_state(
    root: &Path,
    uid: u32,
    gid: u32,
    vms: &[VmSpec],
    disks: &BTreeMap<String, Vec<DiskFile>>,
) -> anyhow::Result<()> {
    let st = root.join("var/lib/esxi-emu");
    let put = |rel: &str, value: &str| -> anyhow::Result<()> {
        let value =
            if value.is_empty() || value.ends_with('\n') { value.to_owned() } else { format!("{value}\n") };
        put_user_file(&st.join(rel), &value, uid, gid)
    };
    put("invalid", "99")?;
    put("shutdown_hangs", "0")?;
    put("shutdown_getstate_calls", &DEFAULT_SHUTDOWN_GETSTATE_CALLS.to_string())?;
    for vm in vms {
        let dir = st.join("vms").join(vm.id);
        mkdir_mode(&dir, 0o755)?;
        chown(&dir, Some(uid), Some(gid))?;
        let n: u32 = vm.id.parse()?;
        let committed: u64 = disks[vm.id].iter().map(|d| d.3).sum();
        let f = |name: &str, value: &str| put(&format!("vms/{}/{name}", vm.id), value);
        f("name", &vm.name)?;
        f("vmx", &format!("[datastore1] {}/{}.vmx", vm.dir, vm.dir))?;
        f("guest_id", vm.guest_id)?;
        f("guest_full", vm.guest_full)?;
        f("version", &format!("vmx-{}", vm.hw_version))?;
        f("annotation", vm.annotation)?;
        f("memory_mb", &vm.memory_mb.to_string())?;
        f("cpus", &vm.cpus.unwrap_or(1).to_string())?;
        f("uuid", &vm.uuids().1)?;
        f("instance_uuid", &format!("527a1093-5e44-c10f-9a61-0b3d7e22a4{n:02x}"))?;
        f("hostname", vm.hostname)?;
        f("ip", vm.ip.unwrap_or(""))?;
        let nics: String = vm
            .nics
            .iter()
            .map(|nic| format!("{}\t{}\t{}\n", nic.network, nic.mac, nic.ips.join(",")))
            .collect();
        f("nics", &nics)?;
        f("num_disks", &vm.disks.len().to_string())?;
        f("committed", &committed.to_string())?;
        f("uncommitted", "0")?;
        f("power", if vm.power_on { "on" } else { "off" })?;
        f("tools", vm.tools)?;
        f("poweroffs", "0")?;
        if let Some(q) = vm.question {
            f("question", q)?;
        }
        if vm.snapshot {
            f(
                "snapshots",
                "|-ROOT\n--Snapshot Name        : before-upgrade\n--Snapshot Id        : 1\n\
                 --Snapshot Desciption  : clean install\npackages held at 8.6\n\
                 --Snapshot Created On  : 3/4/2024 9:5:7\n--Snapshot State       : powered off",
            )?;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Keys and files

fn keygen(path: &Path, args: &[&str]) -> anyhow::Result<Child> {
    Ok(Command::new("ssh-keygen")
        .args(["-q", "-N", "", "-C", "vmmigrate-esxi-emulator"])
        .args(args)
        .arg("-f")
        .arg(path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()?)
}

trait WaitOk {
    fn wait_ok(self, what: &str) -> anyhow::Result<()>;
}

impl WaitOk for Child {
    fn wait_ok(mut self, what: &str) -> anyhow::Result<()> {
        let status = self.wait()?;
        ensure!(status.success(), "{what} failed ({status})");
        Ok(())
    }
}

/// The ECDSA host key and the two client keys, generated concurrently.
fn generate_keys(dir: &Path) -> anyhow::Result<()> {
    let children = [
        keygen(&dir.join("ssh_host_ecdsa_key"), &["-t", "ecdsa", "-b", "256"])?,
        keygen(&dir.join("id_rsa"), &["-t", "rsa", "-b", "3072"])?,
        keygen(&dir.join("id_ed25519"), &["-t", "ed25519"])?,
    ];
    for child in children {
        child.wait_ok("ssh-keygen")?;
    }
    Ok(())
}

fn set_mode(path: &Path, mode: u32) -> anyhow::Result<()> {
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .with_context(|| format!("chmod {}", path.display()))
}

fn mkdir_mode(path: &Path, mode: u32) -> anyhow::Result<()> {
    match fs::create_dir(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e).with_context(|| format!("mkdir {}", path.display())),
    }
    set_mode(path, mode)
}

/// A root-owned directory, 0755, created if missing.
fn ensure_dir_root(path: &Path) -> anyhow::Result<()> {
    fs::create_dir_all(path).with_context(|| format!("mkdir -p {}", path.display()))?;
    set_mode(path, 0o755)
}

fn write_mode(path: &Path, contents: &[u8], mode: u32) -> anyhow::Result<()> {
    fs::write(path, contents).with_context(|| format!("write {}", path.display()))?;
    set_mode(path, mode)
}

/// Replaces a file atomically and gives it to the emulator's user, so the
/// scripts running as that user can change it.
fn put_user_file(path: &Path, contents: &str, uid: u32, gid: u32) -> anyhow::Result<()> {
    let Some(name) = path.file_name() else { bail!("no file name in {}", path.display()) };
    let tmp = path.with_file_name(format!(".{}.harness-tmp", name.to_string_lossy()));
    write_mode(&tmp, contents.as_bytes(), 0o644)?;
    chown(&tmp, Some(uid), Some(gid))?;
    fs::rename(&tmp, path).with_context(|| format!("rename to {}", path.display()))?;
    Ok(())
}
