//! The emulated host's snapshot engine and running guests: what ESXi does
//! below `vim-cmd vmsvc/snapshot.create` / `snapshot.remove` and what a
//! running VM does to its disks.
//!
//! - `snapshot.create` freezes every disk of the VM: a delta extent in the
//!   datastore's format (seSparse on VMFS6, vmfsSparse on VMFS5, see
//!   [`crate::vmdk_delta`]) with its descriptor on top of the disk's current
//!   top, the `.vmx` pointing at the new descriptors, the snapshot listed by
//!   `snapshot.get` and in the `.vmsd`.
//! - `snapshot.remove` consolidates that snapshot's deltas into their
//!   parents (the base `-flat.vmdk` for the first one) and removes them, as
//!   the host does; the `.vmx` points at what is then the top.
//! - A guest writer, while the VM is powered on, writes blocks at a set rate
//!   to the top of each disk's chain (the flat extent when there is no
//!   snapshot): the changing data a warm migration copies under.
//!
//! The shell side (`vim-cmd`) hands a request to this engine through the
//! state directory (`requests/<pid>.req`, answered by `<pid>.out` and
//! `<pid>.rc`): the formats are written here, in Rust, not in BusyBox ash.

use crate::vmdk_delta::{self, Delta, DeltaFormat};
use anyhow::{Context, bail};
use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One level of a disk's chain: the base or a delta.
struct Level {
    /// Descriptor file name in the VM directory.
    descriptor: String,
    cid: u32,
    /// The delta extent; `None` for the base (its `-flat.vmdk`).
    delta: Option<Delta>,
}

/// One disk: its `.vmx` node, its flat extent, and its chain, base first.
struct Disk {
    node: String,
    flat: PathBuf,
    sectors: u64,
    chain: Vec<Level>,
}

struct Snapshot {
    id: u32,
    name: String,
    description: String,
    created: String,
    powered_on: bool,
}

/// A VM the engine knows.
pub(crate) struct Vm {
    dir: PathBuf,
    /// The `.vmx` file name in `dir`.
    vmx: String,
    disks: Vec<Disk>,
    snapshots: Vec<Snapshot>,
}

impl Vm {
    /// `disks`: `(node, descriptor file name, flat extent, sectors, CID)` of each disk.
    pub(crate) fn new(dir: PathBuf, vmx: String, disks: Vec<(String, String, PathBuf, u64, u32)>) -> Vm {
        let disks = disks
            .into_iter()
            .map(|(node, descriptor, flat, sectors, cid)| Disk {
                node,
                flat,
                sectors,
                chain: vec![Level { descriptor, cid, delta: None }],
            })
            .collect();
        Vm { dir, vmx, disks, snapshots: Vec::new() }
    }
}

/// A running guest's writes: `blocks_per_second` blocks of 4 KiB at
/// pseudo-random block-aligned offsets of each disk in turn, or of disk
/// `only_disk` alone (a data disk, when the others hold a guest that boots);
/// at most `at_most` blocks in all, if given (then the guest is idle).
#[derive(Clone, Copy, Debug, Default)]
pub struct GuestWrites {
    pub blocks_per_second: u32,
    pub seed: u64,
    pub only_disk: Option<usize>,
    pub at_most: Option<u64>,
}

pub(crate) struct Engine {
    state: PathBuf,
    format: DeltaFormat,
    vms: Mutex<BTreeMap<String, Vm>>,
    next_id: AtomicU64,
    stop: AtomicBool,
    /// Blocks written by guest writers, all VMs.
    pub(crate) guest_blocks: AtomicU64,
}

const GUEST_BLOCK: u64 = 4096;

/// A VM's power lock: a directory made atomically, shared with `vim-cmd`'s
/// `power_off_now` (BusyBox has no `flock`), held for one write or one
/// power-off. One older than two seconds was left by a holder that was
/// killed (a test drops the host's sessions) and is taken over.
pub(crate) struct PowerLock(PathBuf);

impl PowerLock {
    pub(crate) fn take(path: &Path) -> PowerLock {
        let mut waited = Duration::ZERO;
        let tick = Duration::from_millis(1);
        loop {
            match fs::create_dir(path) {
                Ok(()) => return PowerLock(path.to_owned()),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                // No VM directory (a VM being removed): nothing to hold.
                Err(_) => return PowerLock(PathBuf::new()),
            }
            if waited >= Duration::from_secs(2) {
                let _ = fs::remove_dir(path);
                waited = Duration::ZERO;
            }
            // The holder's turn (a lock, not a wait for readiness).
            std::thread::sleep(tick);
            waited += tick;
        }
    }
}

impl Drop for PowerLock {
    fn drop(&mut self) {
        if !self.0.as_os_str().is_empty() {
            let _ = fs::remove_dir(&self.0);
        }
    }
}

impl Engine {
    /// Serves requests from `state/requests` until dropped.
    pub(crate) fn start(state: PathBuf, format: DeltaFormat, vms: BTreeMap<String, Vm>) -> Arc<Engine> {
        let engine = Arc::new(Engine {
            state,
            format,
            vms: Mutex::new(vms),
            next_id: AtomicU64::new(1),
            stop: AtomicBool::new(false),
            guest_blocks: AtomicU64::new(0),
        });
        let weak = Arc::downgrade(&engine);
        std::thread::spawn(move || {
            while let Some(engine) = weak.upgrade() {
                if engine.stop.load(Ordering::Relaxed) {
                    break;
                }
                engine.serve_requests();
                drop(engine);
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        engine
    }

    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    fn serve_requests(&self) {
        let dir = self.state.join("requests");
        let Ok(entries) = fs::read_dir(&dir) else { return };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().is_none_or(|e| e != "req") {
                continue;
            }
            let args: Vec<String> =
                fs::read_to_string(&path).unwrap_or_default().lines().map(str::to_owned).collect();
            let _ = fs::remove_file(&path);
            let (out, rc) = match self.handle(&args) {
                Ok(out) => (out, 0),
                Err(err) => (format!("(vim.fault.GenericVmConfigFault) {{\n   msg = \"{err:#}\"\n}}\n"), 1),
            };
            let stem = path.with_extension("");
            // The answer's output first, its exit code last: the shell waits for the code.
            let _ = fs::write(stem.with_extension("out"), out);
            let _ = fs::write(stem.with_extension("rc.tmp"), rc.to_string());
            let _ = fs::rename(stem.with_extension("rc.tmp"), stem.with_extension("rc"));
        }
    }

    fn handle(&self, args: &[String]) -> anyhow::Result<String> {
        let arg = |i: usize| args.get(i).map(String::as_str).unwrap_or("");
        match arg(0) {
            "create" => {
                let (vmid, name, description) = (arg(1), arg(2), arg(3));
                let memory = arg(4) == "1" || arg(4).eq_ignore_ascii_case("true");
                let quiesce = arg(5) == "1" || arg(5).eq_ignore_ascii_case("true");
                self.create(vmid, name, description, memory, quiesce)?;
                Ok("Create Snapshot:\n".into())
            }
            "remove" => {
                let id: u32 = arg(2).parse().with_context(|| format!("snapshot id {:?}", arg(2)))?;
                self.remove(arg(1), id)?;
                Ok("Remove Snapshot:\n".into())
            }
            other => bail!("unknown request {other:?}"),
        }
    }

    fn power_on(&self, vmid: &str) -> bool {
        fs::read_to_string(self.state.join("vms").join(vmid).join("power")).is_ok_and(|p| p.trim() == "on")
    }

    fn tools_running(&self, vmid: &str) -> bool {
        fs::read_to_string(self.state.join("vms").join(vmid).join("tools"))
            .is_ok_and(|p| p.trim() == "running")
    }

    fn create(
        &self,
        vmid: &str,
        name: &str,
        description: &str,
        memory: bool,
        quiesce: bool,
    ) -> anyhow::Result<()> {
        let powered_on = self.power_on(vmid);
        if quiesce && powered_on && !self.tools_running(vmid) {
            bail!("Cannot quiesce: VMware Tools is not running in this virtual machine");
        }
        let _ = memory; // No memory file: the emulator has no guest memory to save.
        let mut vms = self.vms.lock().unwrap_or_else(|e| e.into_inner());
        let vm = vms.get_mut(vmid).with_context(|| format!("no VM {vmid}"))?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) as u32;
        for (d, disk) in vm.disks.iter_mut().enumerate() {
            let level = disk.chain.len();
            let parent = disk.chain.last().expect("a base");
            let base_stem = disk.chain[0].descriptor.trim_end_matches(".vmdk").to_owned();
            let stem = format!("{base_stem}-{level:06}");
            let cid = 0x5e00_0000 | (id << 8) | d as u32;
            let data = vm.dir.join(format!("{stem}{}", self.format.suffix()));
            let delta = Delta::create(&data, self.format, disk.sectors)?;
            let text =
                vmdk_delta::descriptor(self.format, &stem, &parent.descriptor, disk.sectors, cid, parent.cid);
            fs::write(vm.dir.join(format!("{stem}.vmdk")), text)?;
            disk.chain.push(Level { descriptor: format!("{stem}.vmdk"), cid, delta: Some(delta) });
        }
        vm.snapshots.push(Snapshot {
            id,
            name: name.to_owned(),
            description: description.to_owned(),
            created: created_now(),
            powered_on,
        });
        self.rewrite(vmid, vm)
    }

    fn remove(&self, vmid: &str, id: u32) -> anyhow::Result<()> {
        let mut vms = self.vms.lock().unwrap_or_else(|e| e.into_inner());
        let vm = vms.get_mut(vmid).with_context(|| format!("no VM {vmid}"))?;
        let Some(k) = vm.snapshots.iter().position(|s| s.id == id) else {
            bail!("snapshot {id} does not exist");
        };
        // Snapshot k froze level k; its changes since are level k + 1: merged down.
        for disk in &mut vm.disks {
            let level = k + 1;
            let merged = disk.chain.remove(level);
            let delta = merged.delta.expect("a snapshot's level is a delta");
            let parent = &mut disk.chain[level - 1];
            match &mut parent.delta {
                None => {
                    delta.consolidate_into(&disk.flat)?;
                }
                Some(parent_delta) => {
                    let mut buf = vec![0u8; self.format.grain_bytes() as usize];
                    for (disk_at, _) in delta.mapped() {
                        delta.read_disk(disk_at, &mut buf)?;
                        parent_delta.write(disk_at, &buf)?;
                    }
                }
            }
            let (parent_name, parent_cid) = (parent.descriptor.clone(), parent.cid);
            // The level above (if any) now sits on the parent.
            if let Some(child) = disk.chain.get(level) {
                let path = vm.dir.join(&child.descriptor);
                let text = fs::read_to_string(&path)?;
                let text = text
                    .lines()
                    .map(|l| {
                        if l.starts_with("parentCID=") {
                            format!("parentCID={parent_cid:08x}")
                        } else if l.starts_with("parentFileNameHint=") {
                            format!("parentFileNameHint=\"{parent_name}\"")
                        } else {
                            l.to_owned()
                        }
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
                    + "\n";
                fs::write(&path, text)?;
            }
            let stem = merged.descriptor.trim_end_matches(".vmdk");
            fs::remove_file(vm.dir.join(format!("{stem}{}", self.format.suffix())))?;
            fs::remove_file(vm.dir.join(&merged.descriptor))?;
        }
        vm.snapshots.remove(k);
        self.rewrite(vmid, vm)
    }

    /// The `.vmx` disk keys, `snapshot.get`'s tree and the `.vmsd`, from `vm`.
    fn rewrite(&self, vmid: &str, vm: &Vm) -> anyhow::Result<()> {
        let vmx_path = vm.dir.join(&vm.vmx);
        let vmx = fs::read_to_string(&vmx_path)?;
        let vmx: String = vmx
            .lines()
            .map(|line| {
                for disk in &vm.disks {
                    let key = format!("{}.fileName = ", disk.node);
                    if let Some(value) = line.strip_prefix(&key) {
                        let top = &disk.chain.last().expect("a base").descriptor;
                        // Keep an absolute path absolute.
                        let value = value.trim_matches('"');
                        let new = match value.rsplit_once('/') {
                            Some((dir, _)) => format!("{dir}/{top}"),
                            None => top.clone(),
                        };
                        return format!("{key}\"{new}\"\n");
                    }
                }
                format!("{line}\n")
            })
            .collect();
        write_replacing(&vmx_path, &vmx)?;
        let mut tree = String::new();
        for (depth, s) in vm.snapshots.iter().enumerate() {
            let dashes = "--".repeat(depth + 1);
            let label =
                if depth == 0 { "|-ROOT".to_owned() } else { format!("{}|-CHILD", "--".repeat(depth)) };
            tree.push_str(&format!(
                "{label}\n{dashes}Snapshot Name        : {}\n{dashes}Snapshot Id        : {}\n\
                 {dashes}Snapshot Desciption  : {}\n{dashes}Snapshot Created On  : {}\n\
                 {dashes}Snapshot State       : {}\n",
                s.name,
                s.id,
                s.description,
                s.created,
                if s.powered_on { "powered on" } else { "powered off" }
            ));
        }
        let snapshots = self.state.join("vms").join(vmid).join("snapshots");
        if tree.is_empty() {
            let _ = fs::remove_file(&snapshots);
        } else {
            write_replacing(&snapshots, &tree)?;
        }
        let mut vmsd = String::from(".encoding = \"UTF-8\"\n");
        if let Some(last) = vm.snapshots.last() {
            vmsd.push_str(&format!(
                "snapshot.lastUID = \"{}\"\nsnapshot.current = \"{}\"\n",
                last.id, last.id
            ));
        }
        for (i, s) in vm.snapshots.iter().enumerate() {
            vmsd.push_str(&format!(
                "snapshot{i}.uid = \"{}\"\nsnapshot{i}.displayName = \"{}\"\nsnapshot{i}.numDisks = \"{}\"\n",
                s.id,
                s.name,
                vm.disks.len()
            ));
            for (d, disk) in vm.disks.iter().enumerate() {
                vmsd.push_str(&format!(
                    "snapshot{i}.disk{d}.fileName = \"{}\"\nsnapshot{i}.disk{d}.node = \"{}\"\n",
                    disk.chain[i].descriptor, disk.node
                ));
            }
        }
        vmsd.push_str(&format!("snapshot.numSnapshots = \"{}\"\n", vm.snapshots.len()));
        let vmsd_path = vm.dir.join(vm.vmx.replace(".vmx", ".vmsd"));
        write_replacing(&vmsd_path, &vmsd)?;
        Ok(())
    }

    /// Writes one guest block to disk `d` of `vmid` at `offset`: into the top of its chain.
    fn guest_write(&self, vmid: &str, d: usize, offset: u64, block: &[u8]) -> anyhow::Result<()> {
        // The power lock `vim-cmd` holds while it powers the VM off: a write
        // begun while the VM ran has landed before the power-off is
        // recorded, and none lands after it (a stalled thread here must not
        // write into a disk the migration has already read as final).
        let _power = PowerLock::take(&self.state.join("vms").join(vmid).join("power.lock"));
        let mut vms = self.vms.lock().unwrap_or_else(|e| e.into_inner());
        // Looked at again under the locks: a guest of a VM powered off in between writes nothing.
        if !self.power_on(vmid) {
            return Ok(());
        }
        let vm = vms.get_mut(vmid).with_context(|| format!("no VM {vmid}"))?;
        let disk = &mut vm.disks[d];
        match &mut disk.chain.last_mut().expect("a base").delta {
            Some(delta) => delta.write(offset, block)?,
            None => {
                let flat = fs::OpenOptions::new().write(true).open(&disk.flat)?;
                flat.write_all_at(block, offset)?;
            }
        }
        self.guest_blocks.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Starts a guest writer on `vmid`; it writes while the VM is powered on
    /// and ends when `running` is cleared or the engine goes.
    pub(crate) fn start_guest(
        self: &Arc<Self>,
        vmid: &str,
        writes: GuestWrites,
        running: Arc<AtomicBool>,
    ) -> std::thread::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        let vmid = vmid.to_owned();
        std::thread::spawn(move || {
            let mut rng = writes.seed | 1;
            let mut n: u64 = 0;
            // The guest's pace: a tick of at least 5 ms (what a sleep can
            // keep to), with as many blocks in each as the rate asks.
            let rate = writes.blocks_per_second.max(1) as f64;
            let pause = Duration::from_secs_f64((1.0 / rate).max(0.005));
            let per_tick = (rate * pause.as_secs_f64()).round().max(1.0) as u64;
            'ticks: while running.load(Ordering::Relaxed) {
                let Some(engine) = weak.upgrade() else { break };
                if engine.stop.load(Ordering::Relaxed) {
                    break;
                }
                for _ in 0..per_tick {
                    if !engine.power_on(&vmid) {
                        break;
                    }
                    if writes.at_most.is_some_and(|most| n >= most) {
                        break 'ticks;
                    }
                    let sizes: Vec<u64> = {
                        let vms = engine.vms.lock().unwrap_or_else(|e| e.into_inner());
                        vms.get(&vmid)
                            .map(|vm| vm.disks.iter().map(|d| d.sectors * 512).collect())
                            .unwrap_or_default()
                    };
                    let d = match writes.only_disk {
                        Some(d) => d,
                        None => (n % sizes.len().max(1) as u64) as usize,
                    };
                    if d >= sizes.len() {
                        break 'ticks;
                    }
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    let offset = (rng % (sizes[d] / GUEST_BLOCK)) * GUEST_BLOCK;
                    let mut block = vec![0u8; GUEST_BLOCK as usize];
                    let header = format!("guest write {n} seed {} disk {d} at {offset}\n", writes.seed);
                    for (i, b) in block.iter_mut().enumerate() {
                        *b = (n as u8).wrapping_mul(31).wrapping_add(i as u8) | 1;
                    }
                    block[..header.len()].copy_from_slice(header.as_bytes());
                    if let Err(err) = engine.guest_write(&vmid, d, offset, &block) {
                        eprintln!("guest writer of VM {vmid}: {err:#}");
                        break 'ticks;
                    }
                    n += 1;
                }
                drop(engine);
                // The guest's pace (a rate, not a wait for anything).
                std::thread::sleep(pause);
            }
        })
    }

    /// The top descriptor of each disk of `vmid` (host paths): what `qemu-img` opens as the VM's disks now.
    pub(crate) fn tops(&self, vmid: &str) -> Vec<PathBuf> {
        let vms = self.vms.lock().unwrap_or_else(|e| e.into_inner());
        vms.get(vmid)
            .map(|vm| {
                vm.disks.iter().map(|d| vm.dir.join(&d.chain.last().expect("a base").descriptor)).collect()
            })
            .unwrap_or_default()
    }

    /// The delta data files of `vmid`, per disk, lowest first.
    pub(crate) fn delta_files(&self, vmid: &str) -> Vec<Vec<PathBuf>> {
        let vms = self.vms.lock().unwrap_or_else(|e| e.into_inner());
        vms.get(vmid)
            .map(|vm| {
                vm.disks
                    .iter()
                    .map(|d| {
                        d.chain[1..]
                            .iter()
                            .map(|l| {
                                let stem = l.descriptor.trim_end_matches(".vmdk");
                                vm.dir.join(format!("{stem}{}", self.format.suffix()))
                            })
                            .collect()
                    })
                    .collect()
            })
            .unwrap_or_default()
    }
}

fn write_replacing(path: &Path, text: &str) -> anyhow::Result<()> {
    let tmp = path.with_extension("engine-tmp");
    fs::write(&tmp, text)?;
    fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
    fs::rename(&tmp, path)?;
    Ok(())
}

/// "M/D/YYYY H:M:S", not zero-padded, as `snapshot.get` prints it.
fn created_now() -> String {
    let out = std::process::Command::new("date").args(["-u", "+%-m/%-d/%Y %-H:%-M:%-S"]).output();
    out.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned()).unwrap_or_default()
}
