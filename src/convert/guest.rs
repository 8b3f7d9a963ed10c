//! Whole-guest conversion: virt-v2v over the acquired copies of all of a
//! guest's disks at once, described by a libvirt domain written from the
//! inventory (each disk on its bus and controller, each NIC with its MAC and
//! model), then each NIC's name inside the guest pinned to its MAC, so that
//! address configuration written for `ens192` still applies on virtio.
//!
//! virt-v2v puts virtio drivers into the guest (for Linux, into its
//! initramfs), removes VMware Tools and rewrites what boots it; it writes new
//! disks and leaves the copies alone, so the copies keep the checksums
//! recorded while copying. It runs libguestfs's appliance under KVM where
//! `/dev/kvm` is there, and under TCG where it is not or where the caller
//! (or `LIBGUESTFS_BACKEND_SETTINGS=force_tcg`) says KVM cannot run guests.
//!
//! The NIC names: ESXi puts a VM's NICs in PCI slots 192, 224, ... (the
//! `.vmx`'s `pciSlotNumber`), so a guest with predictable interface names
//! calls them `ens192`, `ens224`, ...; on KubeVirt they would become
//! `enp1s0`. A systemd `.link` file per NIC, matching its MAC (which the new
//! VM keeps), gives the old name back, as Forklift does. It is not written
//! for a guest without systemd or one that turned predictable names off
//! (`net.ifnames=0`): those name NICs by MAC or order already.

use super::produce::OutputFormat;
use crate::api::{Firmware, GuestConversion, SourceInventory};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Instant;

/// At most this much of virt-v2v's or guestfish's output is quoted in an
/// error: its last lines, so that with the log's path the message fits a
/// status message (1 KiB) and the line that says what went wrong is kept.
const ERROR_TAIL: usize = 600;
/// At most this much of a log is read back (virt-v2v writes a few KiB).
const LOG_READ_LIMIT: u64 = 1 << 20;
/// At most this much of a log's end is read for an error's last words.
const ERROR_READ_LIMIT: u64 = 64 << 10;

/// A guest to convert: its inventory and the acquired copies of its disks,
/// in the inventory's disk order.
pub(crate) struct GuestInput<'a> {
    /// The domain's name (and the output files' stem): lowercase letters,
    /// digits and `-`.
    pub name: &'a str,
    pub inventory: &'a SourceInventory,
    pub disks: &'a [PathBuf],
    /// virt-v2v's output format.
    pub format: OutputFormat,
    /// Run libguestfs's appliance under software emulation (TCG) even where
    /// `/dev/kvm` exists: on nodes whose `/dev/kvm` opens but cannot run a
    /// guest (this machine kind), KVM would hang the conversion.
    pub force_tcg: bool,
}

/// What [`convert_guest`] made: one disk per input disk, in order, and what
/// it did.
#[derive(Debug)]
pub(crate) struct ConvertedGuest {
    pub disks: Vec<PathBuf>,
    pub report: GuestConversion,
}

#[derive(Debug, thiserror::Error)]
pub enum GuestConversionError {
    #[error("virt-v2v is not installed where conversions run")]
    NotInstalled,
    #[error("the guest cannot be described to virt-v2v: {0}")]
    Undescribable(String),
    #[error("virt-v2v failed (its log: {log}): {tail}")]
    Failed { log: String, tail: String },
    #[error("virt-v2v did not write {0}")]
    MissingOutput(String),
    #[error("pinning the guest's interface names failed: {0}")]
    Pinning(String),
    #[error("conversion I/O error: {0}")]
    Io(#[from] io::Error),
}

/// Converts the guest into `work` (emptied first): virt-v2v's disks, its
/// domain description and log (`virt-v2v.log`), then the interface names.
pub(crate) async fn convert_guest(
    virt_v2v: &Path,
    input: &GuestInput<'_>,
    work: &Path,
) -> Result<ConvertedGuest, GuestConversionError> {
    let xml = libvirt_xml(input)?;
    // A conversion whose process was killed (the controller's, the
    // worker's) left its virt-v2v and appliance running: they go first.
    reap_orphans(&work.join(PGID_FILE));
    match tokio::fs::remove_dir_all(work).await {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e.into()),
        _ => {}
    }
    std::fs::DirBuilder::new().recursive(true).mode(0o750).create(work)?;
    let source = work.join("source.xml");
    tokio::fs::write(&source, xml).await?;
    let log = work.join("virt-v2v.log");
    let started = Instant::now();

    let mut cmd = tokio::process::Command::new(virt_v2v);
    cmd.arg("-i").arg("libvirtxml").arg(&source);
    cmd.args(["-o", "local", "-os"]).arg(work.join("out"));
    cmd.args(["-of", input.format.as_str(), "-on", input.name]);
    std::fs::DirBuilder::new().mode(0o750).create(work.join("out"))?;
    let output = run_logged(cmd, input.force_tcg, &log).await?;
    if !output.success {
        return Err(GuestConversionError::Failed {
            log: log.display().to_string(),
            tail: last_words(&output.end, ERROR_TAIL),
        });
    }
    let disks: Vec<PathBuf> = (0..input.disks.len())
        .map(|i| work.join("out").join(format!("{}-{}", input.name, disk_letter_name("sd", i))))
        .collect();
    for disk in &disks {
        if !disk.is_file() {
            return Err(GuestConversionError::MissingOutput(disk.display().to_string()));
        }
    }
    let domain = tokio::fs::read_to_string(work.join("out").join(format!("{}.xml", input.name)))
        .await
        .unwrap_or_default();
    let mut report = GuestConversion {
        tool: tool_version(virt_v2v).await,
        guest: guest_name(&domain, &output.text),
        drivers: drivers(&domain),
        accelerator: accelerator(input.force_tcg).to_owned(),
        ..Default::default()
    };
    let after = pin_interface_names(input, &disks, work).await?;
    report.interface_names = after.pinned;
    report.vmware_tools = match after.tools_present {
        Some(true) => "still installed",
        Some(false) => "not installed",
        None => "not checked",
    }
    .to_owned();
    report.seconds = started.elapsed().as_secs();
    report.log = log.display().to_string();
    Ok(ConvertedGuest { disks, report })
}

/// The libvirt domain virt-v2v reads: the guest as ESXi ran it.
fn libvirt_xml(input: &GuestInput<'_>) -> Result<String, GuestConversionError> {
    let inv = input.inventory;
    if input.disks.len() != inv.disks.len() {
        return Err(GuestConversionError::Undescribable(format!(
            "{} disk copies for {} disks in the inventory",
            input.disks.len(),
            inv.disks.len()
        )));
    }
    if input.name.is_empty()
        || !input.name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return Err(GuestConversionError::Undescribable(format!(
            "the name {:?} is not a DNS label",
            input.name
        )));
    }
    let mut x = String::new();
    x.push_str("<domain type='vmware'>\n");
    x.push_str(&format!("  <name>{}</name>\n", escape(input.name)));
    x.push_str(&format!("  <memory unit='MiB'>{}</memory>\n", inv.memory_mib.max(1)));
    x.push_str(&format!("  <vcpu>{}</vcpu>\n", (inv.cpu_sockets * inv.cores_per_socket).max(1)));
    let firmware = match inv.firmware {
        Firmware::Efi => "efi",
        Firmware::Bios => "bios",
    };
    x.push_str(&format!("  <os firmware='{firmware}'>\n    <type arch='x86_64'>hvm</type>\n  </os>\n"));
    x.push_str("  <devices>\n");
    let mut controllers = std::collections::BTreeSet::new();
    let (mut sd, mut hd, mut nvme) = (0, 0, 0);
    for (disk, path) in inv.disks.iter().zip(input.disks) {
        let path = path.to_str().filter(|p| p.starts_with('/')).ok_or_else(|| {
            GuestConversionError::Undescribable(format!(
                "the copy {} is not an absolute UTF-8 path",
                path.display()
            ))
        })?;
        let (bus, target) = match disk.bus.as_str() {
            "scsi" | "sata" => {
                sd += 1;
                (disk.bus.as_str(), disk_letter_name("sd", sd - 1))
            }
            "ide" => {
                hd += 1;
                ("ide", disk_letter_name("hd", hd - 1))
            }
            "nvme" => {
                nvme += 1;
                ("nvme", format!("nvme{}n1", nvme - 1))
            }
            other => {
                return Err(GuestConversionError::Undescribable(format!(
                    "disk {} is on an unknown bus {other:?}",
                    disk.device
                )));
            }
        };
        if bus == "scsi" {
            controllers.insert(scsi_model(&disk.controller_model));
        }
        x.push_str("    <disk type='file' device='disk'>\n");
        x.push_str("      <driver name='qemu' type='raw'/>\n");
        x.push_str(&format!("      <source file='{}'/>\n", escape(path)));
        x.push_str(&format!("      <target dev='{target}' bus='{bus}'/>\n"));
        x.push_str("    </disk>\n");
    }
    for (index, model) in controllers.iter().enumerate() {
        x.push_str(&format!("    <controller type='scsi' index='{index}' model='{model}'/>\n"));
    }
    for nic in &inv.nics {
        x.push_str("    <interface type='bridge'>\n");
        if is_mac(&nic.mac_address) {
            x.push_str(&format!("      <mac address='{}'/>\n", nic.mac_address));
        }
        x.push_str(&format!("      <source bridge='{}'/>\n", escape(&nic.network)));
        x.push_str(&format!("      <model type='{}'/>\n", escape(&nic.model)));
        x.push_str("    </interface>\n");
    }
    x.push_str("  </devices>\n</domain>\n");
    Ok(x)
}

/// libvirt's name for a VMware SCSI controller model.
fn scsi_model(vmx: &str) -> &'static str {
    match vmx.to_ascii_lowercase().as_str() {
        "pvscsi" => "vmpvscsi",
        "lsisas1068" => "lsisas1068",
        "buslogic" => "buslogic",
        _ => "lsilogic",
    }
}

/// `sda`, `sdb`, ..., `sdz`, `sdaa`, ... as Linux and virt-v2v name disks.
fn disk_letter_name(prefix: &str, index: usize) -> String {
    let mut letters = Vec::new();
    let mut n = index + 1;
    while n > 0 {
        n -= 1;
        letters.push(b'a' + (n % 26) as u8);
        n /= 26;
    }
    letters.reverse();
    format!("{prefix}{}", String::from_utf8(letters).expect("ASCII"))
}

fn is_mac(s: &str) -> bool {
    s.len() == 17
        && s.split(':').count() == 6
        && s.split(':').all(|p| p.len() == 2 && p.bytes().all(|b| b.is_ascii_hexdigit()))
}

fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '\'' => out.push_str("&apos;"),
            '"' => out.push_str("&quot;"),
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
    out
}

/// The interface name a guest with predictable names gives a NIC ESXi put
/// in `slot`.
fn esxi_interface_name(slot: u32) -> String {
    format!("ens{slot}")
}

struct Logged {
    success: bool,
    /// The log's head (what the report is read from).
    text: String,
    /// The log's end, what an error quotes: read only when it failed.
    end: String,
}

/// The last lines of `log` that say something, at most `max` bytes: what a
/// progress bar redrew (up to its last `\r`) and the bars themselves
/// (`▝   0% [-----]`) are left out, so they cannot push the error out.
fn last_words(log: &str, max: usize) -> String {
    let mut kept: Vec<&str> = Vec::new();
    let mut size = 0;
    for line in log.lines().rev() {
        let line = line.rsplit('\r').next().unwrap_or_default().trim();
        let bar = line.contains("% [") && line.ends_with(']');
        if line.is_empty() || bar {
            continue;
        }
        if size + line.len() + 1 > max {
            if kept.is_empty() {
                let mut start = line.len() - max;
                while !line.is_char_boundary(start) {
                    start += 1;
                }
                kept.push(&line[start..]);
            }
            break;
        }
        size += line.len() + 1;
        kept.push(line);
    }
    kept.reverse();
    kept.join("\n")
}

/// Runs `cmd` in a process group of its own (virt-v2v starts QEMU and
/// nbdkit; all of them go when the conversion is cancelled), its output
/// appended to `log`.
async fn run_logged(
    mut cmd: tokio::process::Command,
    force_tcg: bool,
    log: &Path,
) -> Result<Logged, GuestConversionError> {
    if std::env::var_os("LIBGUESTFS_BACKEND").is_none() {
        // In a container there is no libvirtd to start the appliance through.
        cmd.env("LIBGUESTFS_BACKEND", "direct");
    }
    if force_tcg {
        cmd.env("LIBGUESTFS_BACKEND_SETTINGS", "force_tcg");
    }
    if std::env::var_os("TAR_OPTIONS").is_none() {
        // supermin unpacks the appliance's base with tar, which as uid 0
        // restores owners: without CAP_CHOWN (a pod that drops every
        // capability yet runs as root) it fails, and the conversion with it.
        cmd.env("TAR_OPTIONS", "--no-same-owner");
    }
    let file = std::fs::OpenOptions::new().create(true).append(true).open(log)?;
    cmd.stdin(Stdio::null()).stdout(file.try_clone()?).stderr(file).process_group(0).kill_on_drop(true);
    let child = cmd.spawn().map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => GuestConversionError::NotInstalled,
        _ => GuestConversionError::Io(e),
    })?;
    let group = GroupGuard(child.id());
    if let Some(pid) = child.id() {
        std::fs::write(log.with_file_name(PGID_FILE), pid.to_string())?;
    }
    let status = child.wait_with_output().await?.status;
    std::mem::forget(group);
    // What ran in the guest's own tree may print without end: read a bounded head.
    let mut head = Vec::new();
    std::io::Read::read_to_end(
        &mut std::io::Read::take(std::fs::File::open(log)?, LOG_READ_LIMIT),
        &mut head,
    )?;
    let text = String::from_utf8_lossy(&head).into_owned();
    let end = match status.success() {
        true => String::new(),
        false => {
            let mut file = std::fs::File::open(log)?;
            let len = file.metadata()?.len();
            std::io::Seek::seek(&mut file, std::io::SeekFrom::Start(len.saturating_sub(ERROR_READ_LIMIT)))?;
            let mut last = Vec::new();
            std::io::Read::read_to_end(&mut std::io::Read::take(file, ERROR_READ_LIMIT), &mut last)?;
            String::from_utf8_lossy(&last).into_owned()
        }
    };
    Ok(Logged { success: status.success(), text, end })
}

/// The file beside virt-v2v's log that names its process group while it runs.
const PGID_FILE: &str = "virt-v2v.pgid";

/// Kills the process group `file` names when it is still a conversion of
/// ours: its leader is virt-v2v or guestfish, or it has died (a number
/// stays taken while its group has members, so a group without its leader
/// is the one we started; a recycled number with a live leader of another
/// name is left alone).
fn reap_orphans(file: &Path) {
    let Some(pgid) = std::fs::read_to_string(file).ok().and_then(|s| s.trim().parse::<u32>().ok()) else {
        return;
    };
    if pgid <= 1 {
        return;
    }
    let ours = match std::fs::read(format!("/proc/{pgid}/cmdline")) {
        Ok(cmdline) => {
            let program = cmdline.split(|b| *b == 0).next().unwrap_or_default();
            let name = Path::new(std::ffi::OsStr::from_bytes(program)).file_name().unwrap_or_default();
            name == "virt-v2v" || name == "guestfish"
        }
        Err(_) => true,
    };
    if ours {
        tracing::warn!(pgid, "killing the processes of an interrupted guest conversion");
        drop(GroupGuard(Some(pgid)));
    }
}

/// Kills a process group when dropped before it is forgotten: a cancelled
/// conversion leaves no appliance running.
struct GroupGuard(Option<u32>);

impl Drop for GroupGuard {
    fn drop(&mut self) {
        if let Some(pid) = self.0 {
            // `--`: procps's kill reads `-KILL -<pgid>` as two signals and
            // kills nothing.
            let _ = std::process::Command::new("kill")
                .args(["-s", "KILL", "--"])
                .arg(format!("-{pid}"))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

async fn tool_version(virt_v2v: &Path) -> String {
    match tokio::process::Command::new(virt_v2v).arg("--version").output().await {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout).trim().to_owned(),
        _ => "virt-v2v".to_owned(),
    }
}

/// virt-v2v's "Converting <guest> to run on KVM".
fn converted_os(log: &str) -> Option<String> {
    log.lines().find_map(|line| {
        let rest = line.split_once("Converting ")?.1;
        Some(rest.strip_suffix(" to run on KVM")?.trim().to_owned())
    })
}

/// The converted OS: libosinfo's id from the output domain (e.g.
/// `debian 12` from `http://debian.org/debian/12`) with virt-v2v's own name
/// for it (for Debian, its point release).
fn guest_name(domain: &str, log: &str) -> String {
    let osinfo = domain.lines().find_map(|line| {
        let id = line.trim().strip_prefix("<libosinfo:os id='")?.split('\'').next()?;
        let mut parts = id.trim_end_matches('/').rsplit('/');
        let version = parts.next()?;
        let family = parts.next()?;
        Some(format!("{family} {version}"))
    });
    match (osinfo, converted_os(log)) {
        (Some(os), Some(name)) if name != os => format!("{os} ({name})"),
        (Some(os), _) => os,
        (None, name) => name.unwrap_or_default(),
    }
}

/// The virtio devices virt-v2v's output domain gives the guest.
fn drivers(domain: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut add = |name: &str| {
        if !out.iter().any(|d| d == name) {
            out.push(name.to_owned());
        }
    };
    for line in domain.lines() {
        let line = line.trim();
        if line.starts_with("<target ") && line.contains("bus='virtio'") {
            add("virtio-blk");
        }
        if line.starts_with("<controller ") && line.contains("model='virtio-scsi'") {
            add("virtio-scsi");
        }
        if line.starts_with("<model ") && line.contains("type='virtio'") {
            add("virtio-net");
        }
        if line.starts_with("<rng ") {
            add("virtio-rng");
        }
        if line.starts_with("<memballoon ") && line.contains("model='virtio'") {
            add("virtio-balloon");
        }
    }
    out
}

/// Which accelerator libguestfs's appliance runs on.
fn accelerator(force_tcg: bool) -> &'static str {
    let forced =
        force_tcg || std::env::var("LIBGUESTFS_BACKEND_SETTINGS").is_ok_and(|s| s.contains("force_tcg"));
    let kvm = std::fs::OpenOptions::new().read(true).write(true).open("/dev/kvm").is_ok();
    if forced || !kvm { "tcg" } else { "kvm" }
}

struct AfterConversion {
    pinned: Vec<String>,
    tools_present: Option<bool>,
}

/// Writes a `.link` file per NIC with a known slot and MAC into the
/// converted guest, and reads back whether VMware Tools are still there.
async fn pin_interface_names(
    input: &GuestInput<'_>,
    disks: &[PathBuf],
    work: &Path,
) -> Result<AfterConversion, GuestConversionError> {
    if crate::machine::compatibility::is_windows(&input.inventory.guest_os) {
        return Ok(AfterConversion { pinned: Vec::new(), tools_present: None });
    }
    let script = pin_script(&input.inventory.nics);
    let script_path = work.join("pin-interface-names.sh");
    tokio::fs::write(&script_path, &script).await?;
    let commands = format!(
        "upload {} /tmp/vmmigrate-pin.sh\ncommand \"sh /tmp/vmmigrate-pin.sh\"\nrm /tmp/vmmigrate-pin.sh\n",
        script_path.display()
    );
    let mut cmd = tokio::process::Command::new("guestfish");
    cmd.args(["--rw", "-i"]);
    for disk in disks {
        cmd.arg("--format=raw").arg("-a").arg(disk);
    }
    let commands_path = work.join("pin-interface-names.guestfish");
    tokio::fs::write(&commands_path, commands).await?;
    cmd.arg("-f").arg(&commands_path);
    let log = work.join("guestfish.log");
    let out = run_logged(cmd, input.force_tcg, &log).await.map_err(|e| match e {
        GuestConversionError::NotInstalled => {
            GuestConversionError::Pinning("guestfish is not installed".into())
        }
        other => other,
    })?;
    if !out.success {
        return Err(GuestConversionError::Pinning(last_words(&out.end, ERROR_TAIL)));
    }
    let mut pinned = Vec::new();
    let mut tools_present = None;
    for line in out.text.lines() {
        if let Some(rest) = line.strip_prefix("vmmigrate-pinned ") {
            pinned.push(rest.trim().to_owned());
        }
        match line.trim() {
            "vmmigrate-tools present" => tools_present = Some(true),
            "vmmigrate-tools absent" => tools_present = Some(false),
            _ => {}
        }
    }
    Ok(AfterConversion { pinned, tools_present })
}

/// The shell script run inside the converted guest. Only MACs and names
/// this module made (hex, colons, `ens` and digits) reach it.
fn pin_script(nics: &[crate::api::SourceNic]) -> String {
    let mut s = String::from(
        "set -eu\n\
         if [ -e /usr/bin/vmtoolsd ] || [ -e /usr/sbin/vmtoolsd ]; then echo 'vmmigrate-tools present'; else echo 'vmmigrate-tools absent'; fi\n\
         if [ ! -d /etc/systemd ] && [ ! -d /lib/systemd ] && [ ! -d /usr/lib/systemd ]; then echo 'vmmigrate-skip no systemd'; exit 0; fi\n\
         if grep -qsw 'net.ifnames=0' /etc/default/grub /etc/kernel/cmdline; then echo 'vmmigrate-skip net.ifnames=0'; exit 0; fi\n\
         mkdir -p /etc/systemd/network\n",
    );
    for nic in nics {
        let (Some(slot), true) = (nic.pci_slot, is_mac(&nic.mac_address)) else { continue };
        let name = esxi_interface_name(slot);
        let mac = nic.mac_address.to_ascii_lowercase();
        s.push_str(&format!(
            "printf '# Written by vmmigrate: the name ESXi gave this NIC (PCI slot {slot}).\\n[Match]\\nMACAddress={mac}\\n\\n[Link]\\nName={name}\\n' > /etc/systemd/network/10-vmmigrate-{name}.link\n\
             echo 'vmmigrate-pinned {mac}={name}'\n"
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{SourceDisk, SourceNic};

    #[test]
    fn an_errors_last_words_leave_progress_bars_out_and_keep_the_line_that_failed() {
        let log = "[ 111.8] Copying disk 1/2\n\
                   \u{259d}   0% [--------------------------------]\r\u{259d}  12% [####----------------------------]\n\
                   nbdcopy: write at offset 0 failed: No space left on device\n\
                   virt-v2v: error: nbdcopy command failed\n\n";
        let said = last_words(log, 600);
        assert_eq!(
            said,
            "[ 111.8] Copying disk 1/2\nnbdcopy: write at offset 0 failed: No space left on device\nvirt-v2v: error: nbdcopy command failed"
        );
        // Bounded: the last lines that fit, the very last one cut from its start if it alone is too long.
        assert_eq!(last_words(log, 40), "virt-v2v: error: nbdcopy command failed");
        assert_eq!(last_words(&"x".repeat(5000), 10), "x".repeat(10));
        let many: String = (0..1000).map(|i| format!("line {i}\n")).collect();
        let said = last_words(&many, 600);
        assert!(said.len() <= 600 && said.ends_with("line 999"), "{said}");
    }

    fn inventory() -> SourceInventory {
        SourceInventory {
            name: "app".into(),
            guest_os: "debian12-64".into(),
            firmware: Firmware::Efi,
            cpu_sockets: 2,
            cores_per_socket: 1,
            memory_mib: 1024,
            disks: vec![
                SourceDisk {
                    device: "scsi0:0".into(),
                    bus: "scsi".into(),
                    controller_model: "pvscsi".into(),
                    ..Default::default()
                },
                SourceDisk { index: 1, device: "sata0:0".into(), bus: "sata".into(), ..Default::default() },
            ],
            nics: vec![SourceNic {
                device: "ethernet0".into(),
                model: "vmxnet3".into(),
                network: "VM Network <'&'>".into(),
                mac_address: "00:0c:29:aa:bb:01".into(),
                pci_slot: Some(192),
            }],
            ..Default::default()
        }
    }

    #[test]
    fn the_domain_puts_each_disk_on_its_bus_and_each_nic_with_its_mac_and_model() {
        let inv = inventory();
        let disks = [PathBuf::from("/w/disk-0.raw"), PathBuf::from("/w/disk 1.raw")];
        let xml = libvirt_xml(&GuestInput {
            name: "app",
            inventory: &inv,
            disks: &disks,
            format: OutputFormat::Raw,
            force_tcg: true,
        })
        .unwrap();
        assert!(xml.contains("<os firmware='efi'>"), "{xml}");
        assert!(
            xml.contains("<source file='/w/disk-0.raw'/>\n      <target dev='sda' bus='scsi'/>"),
            "{xml}"
        );
        assert!(
            xml.contains("<source file='/w/disk 1.raw'/>\n      <target dev='sdb' bus='sata'/>"),
            "{xml}"
        );
        assert!(xml.contains("<controller type='scsi' index='0' model='vmpvscsi'/>"), "{xml}");
        assert!(xml.contains("<mac address='00:0c:29:aa:bb:01'/>"), "{xml}");
        assert!(xml.contains("<source bridge='VM Network &lt;&apos;&amp;&apos;&gt;'/>"), "{xml}");
        assert!(xml.contains("<model type='vmxnet3'/>"), "{xml}");
        assert!(xml.contains("<vcpu>2</vcpu>") && xml.contains("<memory unit='MiB'>1024</memory>"), "{xml}");
    }

    #[test]
    fn a_guest_is_not_described_with_a_missing_copy_a_relative_path_or_a_name_that_is_not_a_label() {
        let inv = inventory();
        let one = [PathBuf::from("/w/disk-0.raw")];
        let relative = [PathBuf::from("/w/disk-0.raw"), PathBuf::from("disk-1.raw")];
        let two = [PathBuf::from("/w/a"), PathBuf::from("/w/b")];
        for (name, disks) in [("app", &one[..]), ("app", &relative[..]), ("App'; rm", &two[..])] {
            let err = libvirt_xml(&GuestInput {
                name,
                inventory: &inv,
                disks,
                format: OutputFormat::Raw,
                force_tcg: true,
            });
            assert!(matches!(err, Err(GuestConversionError::Undescribable(_))), "{name} {disks:?}: {err:?}");
        }
    }

    #[test]
    fn disks_are_lettered_as_linux_and_virt_v2v_letter_them() {
        let names: Vec<String> = [0, 1, 25, 26, 27].iter().map(|i| disk_letter_name("sd", *i)).collect();
        assert_eq!(names, ["sda", "sdb", "sdz", "sdaa", "sdab"]);
    }

    #[test]
    fn the_pin_script_names_each_nic_with_a_slot_by_its_mac_and_skips_the_others() {
        let mut nics = inventory().nics;
        nics.push(SourceNic {
            mac_address: "00:0c:29:aa:bb:02".into(),
            pci_slot: None,
            ..Default::default()
        });
        nics.push(SourceNic {
            mac_address: "00:0c:29:aa:bb:03'; reboot".into(),
            pci_slot: Some(224),
            ..Default::default()
        });
        let script = pin_script(&nics);
        assert!(script.contains("MACAddress=00:0c:29:aa:bb:01\\n\\n[Link]\\nName=ens192\\n' > /etc/systemd/network/10-vmmigrate-ens192.link"), "{script}");
        assert_eq!(script.matches("vmmigrate-pinned").count(), 1, "{script}");
        assert!(!script.contains("reboot"), "{script}");
    }

    #[test]
    fn what_virt_v2v_did_is_read_from_its_log_and_its_output_domain() {
        let log = "[  22.9] Checking for sufficient free disk space in the guest\n[  22.9] Converting Debian GNU/Linux 12 (bookworm) to run on KVM\nvirt-v2v: This guest has virtio drivers installed.\n";
        assert_eq!(converted_os(log).as_deref(), Some("Debian GNU/Linux 12 (bookworm)"));
        let domain = "  <metadata>\n    <libosinfo:libosinfo xmlns:libosinfo='http://libosinfo.org/xmlns/libvirt/domain/1.0'>\n      <libosinfo:os id='http://debian.org/debian/12'/>\n";
        assert_eq!(guest_name(domain, "[  99.0] Converting 12.15 to run on KVM\n"), "debian 12 (12.15)");
        assert_eq!(guest_name("", "[  99.0] Converting 12.15 to run on KVM\n"), "12.15");
        let domain = "<disk type='file' device='disk'>\n  <target dev='vda' bus='virtio'/>\n</disk>\n<interface type='bridge'>\n  <model type='virtio'/>\n</interface>\n<rng model='virtio'>\n";
        assert_eq!(drivers(domain), ["virtio-blk", "virtio-net", "virtio-rng"]);
    }

    /// Whether process `pid` runs (exists and is not a zombie).
    fn running(pid: u32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|stat| stat.rsplit(')').next().is_some_and(|rest| !rest.trim_start().starts_with('Z')))
    }

    fn wait_gone(pid: u32) -> bool {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while running(pid) {
            if std::time::Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        true
    }

    #[test]
    fn an_orphaned_conversions_processes_are_killed_and_a_recycled_number_is_left_alone() {
        use std::os::unix::process::CommandExt;
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join(PGID_FILE);
        // What a killed conversion leaves: its group's leader gone, a member
        // (QEMU, say) still running.
        let leader = std::process::Command::new("sh")
            .args(["-c", "sleep 600 </dev/null >/dev/null 2>&1 & echo $!"])
            .process_group(0)
            .output()
            .unwrap();
        let member: u32 = String::from_utf8_lossy(&leader.stdout).trim().parse().unwrap();
        assert!(running(member));
        let pgid = std::fs::read_to_string(format!("/proc/{member}/stat")).unwrap();
        let pgid = pgid.rsplit(')').next().unwrap().split_whitespace().nth(2).unwrap().to_owned();
        std::fs::write(&file, &pgid).unwrap();
        reap_orphans(&file);
        assert!(wait_gone(member), "the orphaned member of group {pgid} was killed");

        // A number recycled by a live process of another name: not ours.
        let mut other = std::process::Command::new("sleep").arg("600").process_group(0).spawn().unwrap();
        std::fs::write(&file, other.id().to_string()).unwrap();
        reap_orphans(&file);
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(other.try_wait().unwrap().is_none(), "a sleep that is no conversion of ours runs on");
        other.kill().unwrap();
        other.wait().unwrap();
    }
}
