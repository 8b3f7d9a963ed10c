//! An in-memory fleet: many ESXi hosts, one VM per migration, and a
//! destination that imports and boots at once. Stands in for every port
//! (`ports::*`) so that tests of the fleet rules (caps, queue, waves,
//! cutover) run the real controller against the real API server with many
//! migrations and nothing else in the way. Each disk copy takes a set time;
//! every copy's interval is recorded, so a test proves the caps from what
//! actually overlapped rather than from what the controller believed. Where
//! the real controller would hear from its watches (a DataVolume, VM or VMI
//! it created changed) or from the disk store (a copy ended), the fleet
//! wakes the migration the same way.

use async_trait::async_trait;
use kube::ResourceExt;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use vmmigrate::api::{
    Firmware, Reason, SourceDisk, SourceInventory, SourceNic, SourcePowerState, ValidationCheck,
    VirtualMachineMigration,
};
use vmmigrate::machine::{
    ArtifactState, CheckResult, CopyState, DataVolumeState, DestinationOccupancy, Failure, PreflightFacts,
    StartingFacts, VmState, VmiState,
};
use vmmigrate::ports::{
    Cluster, Converter, DiskStore, EsxiHost, ImportAccess, PowerObservation, Prober, Staging,
};

/// One disk read: which host, when it began and ended.
#[derive(Clone, Debug)]
pub struct Read {
    pub migration: String,
    pub host: String,
    pub start: Instant,
    pub end: Instant,
}

#[derive(Default)]
struct Vm {
    powered_off: bool,
    power_offs: u32,
    copies: HashMap<usize, Instant>,
    vm_created: bool,
}

#[derive(Default)]
struct State {
    vms: HashMap<String, Vm>,
    reads: Vec<Read>,
    /// Migrations (by name) whose discovery a person must fix.
    broken: Vec<String>,
    /// Power actions of approval-mode migrations asked without the approval.
    unapproved_power_actions: u32,
}

/// The fleet. Cloned `Arc`s fill every adapter slot.
pub struct FleetSim {
    copy_time: Duration,
    disks: usize,
    state: Mutex<State>,
    wake: std::sync::OnceLock<vmmigrate::ports::Wake>,
}

fn key(vmm: &VirtualMachineMigration) -> String {
    format!("{}/{}", vmm.namespace().unwrap_or_default(), vmm.name_any())
}

impl FleetSim {
    pub fn new(copy_time: Duration, disks: usize) -> Arc<FleetSim> {
        Arc::new(FleetSim {
            copy_time,
            disks,
            state: Mutex::new(State::default()),
            wake: std::sync::OnceLock::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Discovery of this migration's VM fails until `heal`: a person must look.
    pub fn break_discovery(&self, name: &str) {
        self.lock().broken.push(name.to_owned());
    }

    /// Every disk read so far (finished or not).
    pub fn reads(&self) -> Vec<Read> {
        self.lock().reads.clone()
    }

    /// How often each VM was powered off.
    /// Power actions asked for a migration in approval mode without its approval.
    pub fn unapproved_power_actions(&self) -> u32 {
        self.lock().unapproved_power_actions
    }

    pub fn power_offs(&self) -> HashMap<String, u32> {
        self.lock().vms.iter().map(|(k, v)| (k.clone(), v.power_offs)).collect()
    }

    /// The most reads that overlapped at any instant, per host and in total.
    pub fn peak_reads(&self) -> (HashMap<String, usize>, usize) {
        let reads = self.reads();
        let mut per_host: HashMap<String, usize> = HashMap::new();
        let mut total = 0;
        for r in &reads {
            // Reads are intervals; the peak is reached at some read's start.
            let live: Vec<&Read> = reads.iter().filter(|o| o.start <= r.start && r.start < o.end).collect();
            total = total.max(live.len());
            let on_host = live.iter().filter(|o| o.host == r.host).count();
            let peak = per_host.entry(r.host.clone()).or_default();
            *peak = (*peak).max(on_host);
        }
        (per_host, total)
    }

    pub fn adapters(self: &Arc<Self>) -> vmmigrate::ports::Adapters {
        vmmigrate::ports::Adapters {
            esxi: self.clone(),
            disks: self.clone(),
            converter: self.clone(),
            staging: self.clone(),
            cluster: self.clone(),
            prober: self.clone(),
        }
    }

    /// What the controller's watch on DataVolumes, VirtualMachines and VMIs
    /// does when the real objects change: the migration is looked at again.
    fn changed(&self, vmm: &VirtualMachineMigration) {
        if let Some(wake) = self.wake.get() {
            wake(&vmm.namespace().unwrap_or_default(), &vmm.name_any());
        }
    }

    fn sha(vmm: &VirtualMachineMigration, disk: usize) -> String {
        use sha2::Digest;
        hex(&sha2::Sha256::digest(format!("{}/{disk}", key(vmm)).as_bytes()))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[async_trait]
impl EsxiHost for FleetSim {
    async fn discover(&self, vmm: &VirtualMachineMigration) -> Result<SourceInventory, Failure> {
        let mut state = self.lock();
        if state.broken.contains(&vmm.name_any()) {
            return Err(Failure::needs_human(Reason::VmxUnreadable, "the .vmx cannot be read (simulated)"));
        }
        let vm = state.vms.entry(key(vmm)).or_default();
        let name = vmm.spec.source.vm.name.clone().unwrap_or_default();
        Ok(SourceInventory {
            vmid: "1".into(),
            name: name.clone(),
            vmx_path: format!("[ds1] {name}/{name}.vmx"),
            guest_os: "debian12_64Guest".into(),
            esxi_version: "VMware ESXi 8.0.3 build-24022510".into(),
            firmware: Firmware::Bios,
            cpu_sockets: 1,
            cores_per_socket: 1,
            memory_mib: 256,
            power_state: if vm.powered_off {
                SourcePowerState::PoweredOff
            } else {
                SourcePowerState::PoweredOn
            },
            disks: (0..self.disks)
                .map(|i| SourceDisk {
                    index: i as i32,
                    device: format!("scsi0:{i}"),
                    bus: "scsi".into(),
                    controller_model: "pvscsi".into(),
                    descriptor_path: format!("/vmfs/volumes/ds1/{name}/{name}_{i}.vmdk"),
                    extent_path: format!("/vmfs/volumes/ds1/{name}/{name}_{i}-flat.vmdk"),
                    capacity_bytes: 1 << 20,
                    create_type: "vmfs".into(),
                    mode: "persistent".into(),
                })
                .collect(),
            nics: vec![SourceNic {
                device: "ethernet0".into(),
                model: "vmxnet3".into(),
                network: "VM Network".into(),
                mac_address: "00:50:56:01:02:03".into(),
                pci_slot: Some(192),
            }],
            ..Default::default()
        })
    }

    async fn power(&self, vmm: &VirtualMachineMigration) -> Result<PowerObservation, Failure> {
        let mut state = self.lock();
        let vm = state.vms.entry(key(vmm)).or_default();
        let power = if vm.powered_off { SourcePowerState::PoweredOff } else { SourcePowerState::PoweredOn };
        Ok(PowerObservation { state: power, tools_running: true })
    }

    /// Fleet copies record no extent stat (`source: None`): never asked.
    async fn extent_stats(
        &self,
        _vmm: &VirtualMachineMigration,
        paths: &[String],
    ) -> Result<Vec<String>, Failure> {
        Ok(vec![vmmigrate::ports::UNREADABLE_EXTENT.to_owned(); paths.len()])
    }

    async fn request_shutdown(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        let mut state = self.lock();
        // A power action of an approval migration carries its approval (the
        // annotation or spec.cutover.approved) in the object it is asked for.
        let approval = vmm.spec.cutover.mode == vmmigrate::api::CutoverMode::Approval;
        let approved = vmm.spec.cutover.approved
            || vmm.metadata.annotations.as_ref().is_some_and(|a| {
                a.get(vmmigrate::api::APPROVE_CUTOVER_ANNOTATION).is_some_and(|v| v == "true")
            });
        if approval && !approved {
            state.unapproved_power_actions += 1;
        }
        let vm = state.vms.entry(key(vmm)).or_default();
        if !vm.powered_off {
            vm.powered_off = true;
            vm.power_offs += 1;
        }
        Ok(())
    }

    async fn power_off(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        self.request_shutdown(vmm).await
    }
}

#[async_trait]
impl DiskStore for FleetSim {
    fn notify_on_finish(&self, wake: vmmigrate::ports::Wake) {
        let _ = self.wake.set(wake);
    }

    async fn copy_state(&self, vmm: &VirtualMachineMigration, disk: usize) -> CopyState {
        let state = self.lock();
        match state.vms.get(&key(vmm)).and_then(|vm| vm.copies.get(&disk)) {
            None => CopyState::Absent,
            Some(started) if started.elapsed() >= self.copy_time => CopyState::Complete {
                size: 1 << 20,
                sha256: Self::sha(vmm, disk),
                verified_remotely: true,
                // Nothing powers a fleet VM on again: every copy is of the current epoch.
                epoch: vmm.status.as_ref().map_or(0, |s| s.epoch),
                source: None,
            },
            Some(started) => {
                let done = (started.elapsed().as_secs_f64() / self.copy_time.as_secs_f64() * (1 << 20) as f64)
                    as i64;
                CopyState::InProgress { bytes_done: done, bytes_total: 1 << 20 }
            }
        }
    }

    async fn start_copy(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        let mut state = self.lock();
        let vm = state.vms.entry(key(vmm)).or_default();
        if vm.copies.contains_key(&disk) {
            return Ok(());
        }
        let now = Instant::now();
        vm.copies.insert(disk, now);
        let read = Read {
            migration: key(vmm),
            host: vmm.spec.source.host.clone(),
            start: now,
            end: now + self.copy_time,
        };
        state.reads.push(read);
        // The disk store wakes the migration when a copy ends; so does the fleet.
        if let Some(wake) = self.wake.get().cloned() {
            let (namespace, name, copy_time) =
                (vmm.namespace().unwrap_or_default(), vmm.name_any(), self.copy_time);
            tokio::spawn(async move {
                tokio::time::sleep(copy_time).await;
                wake(&namespace, &name);
            });
        }
        Ok(())
    }

    async fn discard_copy(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        if let Some(vm) = self.lock().vms.get_mut(&key(vmm)) {
            vm.copies.remove(&disk);
        }
        Ok(())
    }

    async fn remove_all(&self, _vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        Ok(())
    }
}

#[async_trait]
impl Converter for FleetSim {
    /// The simulated conversion converts Linux guests (it has no virtio-win).
    fn guest_converter(&self) -> vmmigrate::machine::GuestConverterFacts {
        vmmigrate::machine::GuestConverterFacts { virt_v2v: true, virtio_win: false, uefi_firmware: true }
    }
    async fn artifact_state(&self, vmm: &VirtualMachineMigration, disk: usize) -> ArtifactState {
        ArtifactState::Complete { sha256: Self::sha(vmm, disk), staged_url: None }
    }
    async fn start_conversion(&self, _vmm: &VirtualMachineMigration, _disk: usize) -> Result<(), Failure> {
        Ok(())
    }
    async fn discard_artifact(&self, _vmm: &VirtualMachineMigration, _disk: usize) -> Result<(), Failure> {
        Ok(())
    }
}

#[async_trait]
impl Staging for FleetSim {
    async fn staged_url(
        &self,
        vmm: &VirtualMachineMigration,
        disk: usize,
        _sha256: &str,
    ) -> Result<Option<String>, Failure> {
        Ok(Some(format!("https://staging.invalid/{}/disk-{disk}.raw", vmm.uid().unwrap_or_default())))
    }
    async fn stage(&self, _vmm: &VirtualMachineMigration, _disk: usize) -> Result<(), Failure> {
        Ok(())
    }
    async fn import_access(
        &self,
        _vmm: &VirtualMachineMigration,
        _disk: usize,
    ) -> Result<ImportAccess, Failure> {
        Ok(ImportAccess { access_key_id: "k".into(), secret_key: "s".into(), ca_pem: String::new() })
    }
    async fn remove_all(&self, _vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        Ok(())
    }
}

#[async_trait]
impl Cluster for FleetSim {
    /// Fleets here delete no migration whose host is gone: nothing to keep.
    async fn record_left_on_source(&self, _left: &vmmigrate::api::LeftOnSource) -> Result<(), Failure> {
        Ok(())
    }
    /// The fleet's CDI checks checksums itself (the read-back path is the
    /// machine simulation's); imports are instant and hold the copies' bytes.
    async fn cdi_verifies_checksum(&self) -> Result<bool, Failure> {
        Ok(true)
    }
    async fn import_check(
        &self,
        _vmm: &VirtualMachineMigration,
        _disk: usize,
    ) -> Result<Option<vmmigrate::machine::VolumeCheck>, Failure> {
        Ok(None)
    }
    async fn preflight(&self, _vmm: &VirtualMachineMigration) -> Result<PreflightFacts, Failure> {
        Ok(PreflightFacts {
            storage_class_exists: true,
            destination_namespace_exists: true,
            destination_vm: DestinationOccupancy::Free,
            destination_refused: None,
            data_plane_blocked: None,
            source_claimed_by: None,
            guest_converter: Default::default(),
        })
    }
    async fn data_volume(
        &self,
        _vmm: &VirtualMachineMigration,
        _disk: usize,
    ) -> Result<DataVolumeState, Failure> {
        Ok(DataVolumeState::Succeeded)
    }
    async fn create_data_volume(
        &self,
        vmm: &VirtualMachineMigration,
        _disk: usize,
        _access: &ImportAccess,
    ) -> Result<(), Failure> {
        self.changed(vmm);
        Ok(())
    }
    async fn delete_data_volume(&self, _vmm: &VirtualMachineMigration, _disk: usize) -> Result<(), Failure> {
        Ok(())
    }
    async fn vm(&self, vmm: &VirtualMachineMigration) -> Result<VmState, Failure> {
        let state = self.lock();
        Ok(match state.vms.get(&key(vmm)) {
            Some(vm) if vm.vm_created => VmState::Matching { uid: format!("vm-{}", key(vmm)) },
            _ => VmState::Absent,
        })
    }
    async fn create_vm(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        self.lock().vms.entry(key(vmm)).or_default().vm_created = true;
        self.changed(vmm);
        Ok(())
    }
    async fn update_vm(&self, _vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        Ok(())
    }
    async fn starting(&self, _vmm: &VirtualMachineMigration) -> Result<StartingFacts, Failure> {
        Ok(StartingFacts { run_strategy_set: true, vmi: VmiState::Running })
    }
    async fn set_run_strategy(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        self.changed(vmm);
        Ok(())
    }
    async fn delete_destination(&self, _vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        Ok(())
    }
    async fn release_destination(&self, _vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        Ok(())
    }
}

#[async_trait]
impl Prober for FleetSim {
    async fn check(&self, _vmm: &VirtualMachineMigration, check: &ValidationCheck) -> CheckResult {
        CheckResult::Pass { message: format!("{}: passed (simulated)", check.name) }
    }
}
