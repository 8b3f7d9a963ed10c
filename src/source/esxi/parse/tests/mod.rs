//! Unit tests of the parsers: shared samples (from the ESXi facts notes and
//! assembled from their descriptions), one submodule per parser module, and
//! the panic-freedom checks over every parser.

use super::*;

mod descriptor;
mod version;
mod vim_cmd;
mod vmodl;
mod vmx;

// ----- samples copied from the ESXi facts notes -----

const GETALLVMS: &str = "\
Vmid          Name                               File                             Guest OS       Version   Annotation
1      ubuntu-desktop       [HDD] ubuntu-desktop/ubuntu-desktop.vmx           ubuntu64Guest      vmx-13
3      windows-7            [HDD] windows-7/windows-7.vmx                     windows7_64Guest   vmx-13
";

const POWER_ON: &str = "Retrieved runtime info\nPowered on\n";

/// As it appears in the notes, indented by the markdown list.
const RESET_FAULT_INDENTED: &str = r#"  Reset VM:
  Reset failed: (vim.fault.InvalidPowerState) {
     faultCause = (vmodl.MethodFault) null, 
     faultMessage = <unset>, 
     requestedState = "poweredOn", 
     existingState = "poweredOff"
     msg = "The attempted operation cannot be performed in the current state (Powered off)."
  }
"#;

/// The same output as the host prints it (list indentation removed).
const RESET_FAULT: &str = r#"Reset VM:
Reset failed: (vim.fault.InvalidPowerState) {
   faultCause = (vmodl.MethodFault) null, 
   faultMessage = <unset>, 
   requestedState = "poweredOn", 
   existingState = "poweredOff"
   msg = "The attempted operation cannot be performed in the current state (Powered off)."
}
"#;

const NOT_FOUND: &str = r#"(vim.fault.NotFound) {
   faultCause = (vmodl.MethodFault) null,
   faultMessage = <unset>
   msg = "Unable to find a VM corresponding to "2""
}
"#;

const GUEST: &str = r#"Guest information:

(vim.vm.GuestInfo) {
   toolsStatus = "toolsOk", 
   toolsRunningStatus = "guestToolsRunning", 
   guestId = "debian10_64Guest", 
   ipAddress = "192.168.200.9", 
   net = (vim.vm.GuestInfo.NicInfo) [
      (vim.vm.GuestInfo.NicInfo) {
         network = "Kubernetes Network", 
         ipAddress = (string) [
            "192.168.200.9", 
            "fe80::20c:29ff:fe62:e86d"
         ], 
         macAddress = "00:0c:29:62:e8:6d"
      }
   ], 
   guestState = "running"
}
"#;

const SNAPSHOTS: &str = "\
Get Snapshot:
|-ROOT
--Snapshot Name        : snap0
--Snapshot Id        : 5
--Snapshot Desciption  : clush configured
tmp and all traces of mapr removed
--Snapshot Created On  : 11/29/2017 23:59:6
--Snapshot State       : powered on
--|-CHILD
----Snapshot Name        : finish_naigos_install
----Snapshot Id        : 6
";

const MESSAGE: &str = "\
Virtual machine message 12: msg.uuid.altered:This virtual machine may have been moved or copied.
0. Cancel (Cancel) 1. I _moved it (I _moved it) 2. I _copied it (I _copied it) [default]
";

const VMX: &str = r#"displayName = "esx6.7-rhel8.6-nvme-disk"
guestOS = "rhel8-64"
memSize = "2048"
numvcpus = "2"
firmware = "efi"
scsi0.virtualDev = "pvscsi"
scsi0:0.deviceType = "scsi-hardDisk"
scsi0:0.fileName = "Fedora-20.vmdk"
nvme0:0.fileName = "nvme-disk.vmdk"
sata0:0.deviceType = "cdrom-image"
sata0:0.fileName = "/vmfs/volumes/5458b680-…/ISOs/Fedora-20-x86_64-netinst.iso"
ethernet0.virtualDev = "vmxnet3"
ethernet0.networkName = "VM Network"
ethernet0.addressType = "vpx"
ethernet0.generatedAddress = "00:50:56:9b:5f:0d"
ethernet0.pciSlotNumber = "192"
uuid.bios = "42 1b 4b 87 e6 b7 d8 81-07 a0 c9 d2 21 cd 3c 6b"
"#;

const DESCRIPTOR: &str = r#"# Disk DescriptorFile
version=1
encoding="UTF-8"
CID=fffffffe
parentCID=ffffffff
createType="vmfs"

# Extent description
RW 4194304 VMFS "vm-flat.vmdk"

# The Disk Data Base
#DDB
ddb.adapterType = "lsilogic"
ddb.thinProvisioned = "1"
ddb.virtualHWVersion = "13"
"#;

// ----- realistic outputs assembled from the notes' descriptions -----

const SUMMARY: &str = r#"Listsummary:

(vim.vm.Summary) {
   vm = 'vim.VirtualMachine:4', 
   runtime = (vim.vm.RuntimeInfo) {
      device = (vim.vm.DeviceRuntimeInfo) [
         (vim.vm.DeviceRuntimeInfo) {
            runtimeState = (vim.vm.DeviceRuntimeInfo.VirtualEthernetCardRuntimeState) {
               vmDirectPathGen2Active = false, 
               vmDirectPathGen2InactiveReasonVm = (string) [
                  "vmNptIncompatibleAdapterType"
               ], 
               reservationStatus = <unset>, 
            }, 
            key = 4000
         }
      ], 
      host = 'vim.HostSystem:ha-host', 
      connectionState = "connected", 
      powerState = "poweredOn", 
      faultToleranceState = "notConfigured", 
      dasVmProtection = (vim.vm.RuntimeInfo.DasProtectionState) null, 
      bootTime = "2023-05-02T10:11:12.123456Z", 
      question = (vim.vm.QuestionInfo) null, 
      maxMemoryUsage = 2048, 
      consolidationNeeded = false, 
      featureMask = (vim.host.FeatureMask) [], 
   }, 
   guest = (vim.vm.Summary.GuestSummary) {
      guestId = "debian10_64Guest", 
      toolsStatus = "toolsOk", 
      hostName = "web01", 
      ipAddress = "192.168.200.9", 
   }, 
   config = (vim.vm.Summary.ConfigSummary) {
      name = "web 01", 
      template = false, 
      vmPathName = "[datastore1] web 01/web 01.vmx", 
      memorySizeMB = 4096, 
      numCpu = 2, 
      numEthernetCards = 1, 
      numVirtualDisks = 1, 
      uuid = "564d8a6e-2c3b-1f5e-8f0a-9a3c2b1d0e4f", 
      instanceUuid = "52b1c4aa-6a2e-3b8f-1c2d-3e4f5a6b7c8d", 
      guestId = "debian10_64Guest", 
      annotation = "Owner: web team
says "hi", with a comma", 
      product = (vim.vApp.ProductInfo) null, 
      ftInfo = (vim.vm.FaultToleranceConfigInfo) null, 
      hwVersion = "vmx-13"
   }, 
   storage = (vim.vm.Summary.StorageSummary) {
      committed = 4563746816, 
      uncommitted = 17179869184, 
      unshared = 4563746816, 
   }, 
   overallStatus = "green", 
   customValue = (vim.CustomFieldsManager.Value) []
}
"#;

const GUEST_NO_TOOLS: &str = r#"Guest information:

(vim.vm.GuestInfo) {
   dynamicType = <unset>,
   toolsStatus = "toolsNotInstalled",
   toolsRunningStatus = "guestToolsNotRunning",
   guestId = <unset>,
   ipAddress = <unset>,
   net = (vim.vm.GuestInfo.NicInfo) [],
   guestState = "notRunning",
}
"#;

const ESXCLI_VERSION: &str = "   Product: VMware ESXi
   Version: 8.0.2
   Build: Releasebuild-22380479
   Update: 2
   Patch: 0
";

// ----- panic freedom -----

/// SplitMix64: a tiny deterministic PRNG.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        if n == 0 { 0 } else { (self.next() % n as u64) as usize }
    }
}

const INTERESTING: &[u8] = b"(){}[]\"'-=,:|.<> \n\n\t\r#_0123456789abcXYZvmx[]|-ROOT";

fn random_byte(rng: &mut SplitMix64) -> u8 {
    match rng.below(4) {
        0 => rng.next() as u8,
        1 => b' ' + rng.below(95) as u8,
        _ => INTERESTING[rng.below(INTERESTING.len())],
    }
}

fn mutate(rng: &mut SplitMix64, samples: &[&str]) -> Vec<u8> {
    let mut v = samples[rng.below(samples.len())].as_bytes().to_vec();
    for _ in 0..1 + rng.below(6) {
        match rng.below(9) {
            0 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] ^= 1 << rng.below(8);
            }
            1 => {
                let i = rng.below(v.len() + 1);
                for _ in 0..1 + rng.below(8) {
                    v.insert(i, random_byte(rng));
                }
            }
            2 if !v.is_empty() => {
                let i = rng.below(v.len());
                let n = (1 + rng.below(16)).min(v.len() - i);
                v.drain(i..i + n);
            }
            3 => v.truncate(rng.below(v.len() + 1)),
            4 => {
                // Duplicate a line (possibly many times).
                let lines: Vec<&[u8]> = v.split_inclusive(|&b| b == b'\n').collect();
                if !lines.is_empty() {
                    let line = lines[rng.below(lines.len())].to_vec();
                    let at = rng.below(v.len() + 1);
                    for _ in 0..1 + rng.below(4) {
                        v.splice(at..at, line.iter().copied());
                    }
                }
            }
            5 => {
                // A run of one structural character.
                let c = INTERESTING[rng.below(12)];
                let at = rng.below(v.len() + 1);
                let n = 1 + rng.below(200);
                v.splice(at..at, std::iter::repeat_n(c, n));
            }
            6 => {
                // Splice in a chunk of another sample.
                let other = samples[rng.below(samples.len())].as_bytes();
                let a = rng.below(other.len() + 1);
                let b = a + rng.below(other.len() - a + 1);
                let at = rng.below(v.len() + 1);
                v.splice(at..at, other[a..b].iter().copied());
            }
            7 => {
                // Pure random ASCII.
                v = (0..rng.below(300)).map(|_| random_byte(rng)).collect();
            }
            _ => {}
        }
    }
    v
}

fn feed_all(bytes: &[u8]) {
    let s = String::from_utf8_lossy(bytes);
    let _ = parse_getallvms(&s);
    let _ = parse_power_state(&s);
    let _ = parse_fault(&s);
    let _ = parse_snapshots(&s);
    let _ = parse_message(&s);
    let _ = parse_vmodl(&s);
    let _ = parse_guest_info(&s).map(|g| g.tools_running());
    let _ = parse_summary(&s);
    let _ = vmx_facts(&parse_vmx(&s));
    let _ = parse_descriptor(&s).map(|d| d.capacity_bytes());
    let _ = parse_version(&s);
}

/// Inputs built to trigger quadratic scans; each must finish quickly even in
/// debug builds (a quadratic parser would take minutes here).
#[test]
fn parsers_finish_on_large_adversarial_inputs() {
    let inputs = [
        format!("{})", "(".repeat(50_000)),
        format!("{}) {{", "(".repeat(50_000)),
        "(a) x, ".repeat(10_000),
        format!("(t) {{\n{}", "x = \"unterminated\n".repeat(10_000)),
        format!("(t) [\n{}", "'r, ".repeat(15_000)),
        format!("1   n   {}", "[a]   ".repeat(10_000)),
        format!("(vim.fault.X) {{\n{}", "a = (t) {\n}\n".repeat(10_000)),
        "--Snapshot Desciption : x\n\n".repeat(10_000),
        "scsi0:0.fileName = \"|2|2|2\"\n".repeat(10_000),
        "\"".repeat(50_000),
    ];
    // How fast is for `benches/`; here: every parser finishes on them.
    for input in &inputs {
        feed_all(input.as_bytes());
    }
}

#[test]
fn parsers_never_panic_on_mutated_samples() {
    let samples = [
        GETALLVMS,
        POWER_ON,
        RESET_FAULT,
        RESET_FAULT_INDENTED,
        NOT_FOUND,
        GUEST,
        GUEST_NO_TOOLS,
        SNAPSHOTS,
        MESSAGE,
        VMX,
        DESCRIPTOR,
        SUMMARY,
        ESXCLI_VERSION,
    ];
    for sample in samples {
        feed_all(sample.as_bytes());
    }
    // 20,000 inputs over two threads (one per seed) to stay fast in debug builds.
    std::thread::scope(|scope| {
        for seed in [0x5EED_E5C1_u64, 0xC0FF_EE00_D15C_0001] {
            scope.spawn(move || {
                let mut rng = SplitMix64(seed);
                for _ in 0..10_000 {
                    let input = mutate(&mut rng, &samples);
                    feed_all(&input);
                }
            });
        }
    });
}
