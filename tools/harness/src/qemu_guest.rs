//! Boots a guest's disks under plain QEMU (software emulation) on the
//! hardware ESXi gives a VM or on what KubeVirt gives it, and reads what the
//! guest says on its serial console and serves on port 80.
//!
//! VMware's hardware: a q35 machine, the disks on a PVSCSI controller (or
//! NVMe: Debian's OVMF cannot boot from PVSCSI, and ESXi gives recent UEFI
//! guests NVMe), the NIC a vmxnet3 in a PCIe root port in slot 192 with ACPI
//! hot-plug of bridges off, which is what makes a Linux guest name it
//! `ens192` as ESXi does. KubeVirt's: q35, virtio-blk disks and a virtio-net NIC, as the
//! virt-launcher domain has them. Either way the NIC is on QEMU's user
//! network laid out like KubeVirt's masquerade binding (the guest at
//! 10.0.2.2/24, the gateway at 10.0.2.1), restricted so the guest reaches
//! nothing, with the guest's port 80 forwarded to a loopback port.
//!
//! The disks are opened with `-snapshot`: nothing the guest writes reaches
//! them.

use crate::process::{Janitor, free_port, http_get_plain, wait_until};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// What the guest's devices look like.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hardware {
    /// PVSCSI disks and a vmxnet3 NIC in slot 192, as on ESXi.
    VmwarePvscsi,
    /// NVMe disks and a vmxnet3 NIC in slot 192, as on ESXi.
    VmwareNvme,
    /// virtio-blk disks and a virtio-net NIC, as on KubeVirt.
    Virtio,
}

/// A guest to boot.
pub struct Boot<'a> {
    pub name: &'a str,
    pub disks: &'a [PathBuf],
    pub efi: bool,
    pub hardware: Hardware,
    pub mac: &'a str,
    pub memory_mib: u32,
}

/// A running guest; stopped (with its directory) when dropped.
pub struct QemuGuest {
    janitor: Janitor,
    name: String,
    serial: PathBuf,
    http_port: u16,
}

const OVMF_CODE: &str = "/usr/share/OVMF/OVMF_CODE.fd";
const OVMF_VARS: &str = "/usr/share/OVMF/OVMF_VARS.fd";

impl QemuGuest {
    /// Starts QEMU; returns at once, the guest booting.
    pub fn boot(boot: &Boot<'_>) -> anyhow::Result<QemuGuest> {
        let janitor = Janitor::new(&format!("qemu-{}", boot.name))?;
        let serial = janitor.dir().join("serial.log");
        let http_port = free_port()?;
        let mut cmd = Command::new("qemu-system-x86_64");
        cmd.args([
            "-accel",
            "tcg",
            "-machine",
            "q35",
            "-cpu",
            "max",
            "-smp",
            "1",
            "-nodefaults",
            "-no-user-config",
        ])
        .args(["-display", "none", "-snapshot", "-no-reboot"])
        .arg("-m")
        .arg(boot.memory_mib.to_string())
        .arg("-serial")
        .arg(format!("file:{}", serial.display()));
        if boot.efi {
            let vars = janitor.dir().join("OVMF_VARS.fd");
            std::fs::copy(OVMF_VARS, &vars)?;
            cmd.arg("-drive")
                .arg(format!("if=pflash,format=raw,unit=0,readonly=on,file={OVMF_CODE}"))
                .arg("-drive")
                .arg(format!("if=pflash,format=raw,unit=1,file={}", vars.display()));
        }
        let netdev = format!(
            "user,id=net0,net=10.0.2.0/24,host=10.0.2.1,dns=10.0.2.3,dhcpstart=10.0.2.100,restrict=on,hostfwd=tcp:127.0.0.1:{http_port}-10.0.2.2:80"
        );
        cmd.arg("-netdev").arg(netdev);
        match boot.hardware {
            Hardware::VmwarePvscsi | Hardware::VmwareNvme => {
                cmd.args(["-global", "ICH9-LPC.acpi-pci-hotplug-with-bridge-support=off"])
                    .args(["-device", "pcie-root-port,id=slot192,chassis=1,slot=192"])
                    .arg("-device")
                    .arg(format!("vmxnet3,netdev=net0,mac={},bus=slot192", boot.mac));
            }
            Hardware::Virtio => {
                cmd.arg("-device").arg(format!("virtio-net-pci,netdev=net0,mac={}", boot.mac));
            }
        }
        if boot.hardware == Hardware::VmwarePvscsi {
            cmd.args(["-device", "pvscsi,id=scsi0"]);
        }
        for (i, disk) in boot.disks.iter().enumerate() {
            cmd.arg("-drive").arg(format!("if=none,id=disk{i},format=raw,file={}", disk.display()));
            let device = match boot.hardware {
                Hardware::VmwarePvscsi => {
                    format!("scsi-hd,drive=disk{i},bus=scsi0.0,scsi-id={i},bootindex={i}")
                }
                Hardware::VmwareNvme => format!("nvme,drive=disk{i},serial=vmmigrate{i},bootindex={i}"),
                Hardware::Virtio => format!("virtio-blk-pci,drive=disk{i},bootindex={i}"),
            };
            cmd.arg("-device").arg(device);
        }
        janitor.spawn("qemu", &mut cmd)?;
        Ok(QemuGuest { janitor, name: boot.name.to_owned(), serial, http_port })
    }

    /// Everything the guest has written to its serial console so far.
    pub fn console(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(&self.serial).unwrap_or_default()).into_owned()
    }

    /// Waits until the console holds one of `lines` and returns it; fails
    /// with the console's end when QEMU exits or `timeout` passes first.
    pub fn wait_for_console(&self, lines: &[&str], timeout: Duration) -> anyhow::Result<String> {
        let mut found = None;
        let waited = wait_until(timeout, &format!("{} to print one of {lines:?}", self.name), || {
            let console = self.console();
            found = lines.iter().find(|l| console.contains(**l)).map(|l| (*l).to_owned());
            if found.is_none() {
                self.janitor.check_alive()?;
            }
            Ok(found.is_some())
        });
        match (waited, found) {
            (Ok(()), Some(line)) => Ok(line),
            (result, _) => Err(anyhow::anyhow!(
                "{}: {:#}\n--- console (end) ---\n{}",
                self.name,
                result.err().unwrap_or_else(|| anyhow::anyhow!("no line")),
                tail(&self.console(), 3000)
            )),
        }
    }

    /// The guest's page on port 80, through the forwarded loopback port.
    pub fn http_get(&self, path: &str) -> std::io::Result<String> {
        http_get_plain(self.http_port, path)
    }

    /// The directory the guest's files live in.
    pub fn dir(&self) -> &Path {
        self.janitor.dir()
    }
}

/// The end of `s`, at most `max` bytes.
fn tail(s: &str, max: usize) -> &str {
    let mut start = s.len().saturating_sub(max);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}
