//! Simulation: an in-memory world that stands in for the ESXi host, the local
//! disk store, the converter, the staging server, the destination cluster
//! (CDI DataVolumes, KubeVirt VirtualMachine/VMI) and the application prober.
//!
//! It exists so that tests can drive the real controller code (`engine::step`)
//! through thousands of seeded schedules of faults and crashes in seconds. The
//! real adapters are proven against real parts elsewhere (sshd, qemu-img, the
//! API server). Background work (a copy, a conversion, an import, a boot)
//! advances one tick each time it is observed. Faults: fail the Nth call,
//! transient failures, a cut connection mid-copy, a corrupted copy, a killed
//! conversion, an evicted importer, a VMI without capacity, a call that hangs
//! until the engine's timeout, a create whose response is lost, and the
//! needs-a-human cases (guest ignores shutdown, snapshots, wrong app content).
//! Warm and rehearsal runs get the host's snapshots (a snapshot freezes the
//! base the copies read; removing it keeps what the guest wrote since), a
//! guest that writes while the VM is on, and the delta copy that assembles a
//! disk as it is at power-off.
//! `crash()` drops what a controller process would lose when it dies.

use async_trait::async_trait;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use vmmigrate::api::Reason;
use vmmigrate::api::{
    Firmware, SourceDisk, SourceInventory, SourceNic, SourcePowerState, ValidationCheck,
    VirtualMachineMigration,
};
use vmmigrate::machine::{
    ArtifactState, CheckResult, CopyState, DataVolumeState, DestinationOccupancy, Failure, PreflightFacts,
    StartingFacts, VmState, VmiState,
};
use vmmigrate::ports::{Cluster, Converter, DiskStore, EsxiHost, PowerObservation, Prober, Staging};

/// Bytes a running copy advances per tick.
const COPY_CHUNK: usize = 4096;

/// A small deterministic PRNG (SplitMix64).
#[derive(Clone, Debug)]
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.unit() < p
    }
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }
}

/// Which faults to inject, and how often.
#[derive(Clone, Debug, Default)]
pub struct FaultPlan {
    /// Probability that any adapter call fails with a retryable error.
    pub transient: f64,
    /// Probability that a call hangs until the engine's timeout.
    pub hang: f64,
    /// Probability per copy tick that the SSH connection is cut.
    pub cut_copy: f64,
    /// Probability that a finished copy's checksum does not match.
    pub corrupt_copy: f64,
    /// Probability per conversion tick that qemu-img is killed.
    pub kill_conversion: f64,
    /// Probability per import tick that the importer pod is evicted.
    pub evict_importer: f64,
    /// Probability per boot tick that the VMI fails to schedule (capacity).
    pub no_capacity: f64,
    /// Probability that a create succeeds but its response is lost.
    pub lost_response: f64,
    /// Fail exactly the Nth adapter call (1-based) with a retryable error.
    pub fail_nth_call: Option<u64>,
    /// Discovery fails every time (the budget runs out).
    pub discovery_always_fails: bool,
    /// The guest ignores graceful shutdown requests.
    pub guest_ignores_shutdown: bool,
    /// VMware Tools is not running in the guest.
    pub tools_not_running: bool,
    /// The VM has a snapshot (validation blocks).
    pub snapshot: bool,
    /// The application answers with the wrong content.
    pub wrong_content: bool,
    /// A foreign VM already has the destination name.
    pub foreign_vm: bool,
    /// Copies make no progress while set (tests use it to catch a migration mid-copy).
    pub hold_copies: bool,
    /// The guest writes to its disks while the VM is on (one write per power observation).
    pub guest_writes: bool,
    /// A person powers the source on again after vmmigrate powered it off,
    /// once it reaches this phase (`Preparing`: mid-copy; later: after the
    /// copies completed); the guest writes while it runs, and the person
    /// powers it off again once vmmigrate saw it on and stopped.
    pub person_powers_on_in: Option<vmmigrate::api::Phase>,
    /// Once the migration reaches this phase, a person powers the source
    /// on, its guest writes, and the person powers it off again, all
    /// between two of vmmigrate's looks: its power is never seen on, only
    /// its extents' stat changes.
    pub person_cycles_unseen_in: Option<vmmigrate::api::Phase>,
    /// A backup tool takes a snapshot of the source between its discovery
    /// and the cutover (while the migration prepares, before any power-off).
    pub backup_snapshot_before_cutover: bool,
    /// A person adds a disk to the source between its discovery and the
    /// cutover (while the migration prepares, before any power-off).
    pub disk_added_before_cutover: bool,
    /// Probability that removing every copy leaves a copy task of another
    /// process running (a stale replica's, a worker pod's): it finishes
    /// later, in the epoch it was started in.
    pub zombie_copy: f64,
    /// The installed CDI has no `spec.source.http.checksum`: each import is
    /// read back by a verify Job and compared.
    pub cdi_without_checksum: bool,
}

impl SimWorld {
    /// Power calls must find their record written ahead through
    /// [`SimWorld::written_ahead`] (the simulation's own fence).
    pub fn track_write_ahead(&self) {
        self.lock().tracks_write_ahead = true;
    }

    /// The ESXi credentials are gone for good (the namespace's deletion
    /// took the Secret): every call to the host fails and needs a person.
    pub fn lose_credentials(&self) {
        self.lock().credentials_gone = true;
    }
}

#[derive(Debug, Default)]
struct LocalCopy {
    data: Vec<u8>,
    running: bool,
    pending_failure: Option<(Failure, bool)>,
    /// Warm: the deltas are being copied onto this base copy.
    delta_running: bool,
    /// Warm: the deltas were applied; the copy is the disk at power-off.
    assembled: bool,
    /// The host's sha256 of what the copy read, taken as it read it (a
    /// later change of the disk does not make a finished copy wrong).
    host_sha: Option<String>,
    /// The power-off epoch the copy was started in (the migration's, as
    /// the controller passed it).
    epoch: i32,
    /// The extent's stat when the copy began (the real copy stats it
    /// before its first read and after its last).
    stat_at_start: Option<String>,
}

/// A snapshot of the source: the base it froze, which copies read.
#[derive(Debug)]
struct SimSnapshot {
    name: String,
    id: String,
    base: Vec<Vec<u8>>,
    /// Per disk, the bytes the guest wrote since: the snapshot's delta.
    dirty: Vec<std::collections::BTreeSet<usize>>,
}

#[derive(Debug, Default)]
struct Artifact {
    /// Ticks left while running.
    running: Option<u32>,
    partial: bool,
    done: Option<String>,
    pending_failure: Option<Failure>,
}

#[derive(Debug)]
struct SimDv {
    ticks: u32,
    failed: Option<Failure>,
    owned: bool,
    /// sha256 of the bytes it imported: the artifact staged when it was made.
    bytes: String,
    /// `spec.source.http.checksum`, which a CDI that knows the field checks.
    checksum: Option<String>,
    /// The verify Job reading the volume back: ticks left, when started.
    verify: Option<u32>,
}

#[derive(Debug)]
struct SimVm {
    ours: bool,
    owned: bool,
    drifted: bool,
    run_strategy: String,
    uid: String,
}

/// Counters and the invariant violations the world saw itself.
#[derive(Clone, Debug, Default)]
pub struct Ledger {
    pub calls: u64,
    pub power_off_transitions: u32,
    pub shutdown_requests: u32,
    pub hard_power_offs: u32,
    pub dv_creates: BTreeMap<usize, u32>,
    pub dv_deletes: BTreeMap<usize, u32>,
    pub vm_creates: u32,
    pub vm_updates: u32,
    pub snapshots_created: u32,
    pub snapshots_removed: u32,
    /// Times a person powered the source on (outside vmmigrate).
    pub person_power_ons: u32,
    /// Times a person powered the source off (outside vmmigrate).
    pub person_power_offs: u32,
    /// Power actions recorded in a status written ahead, not yet asked.
    pub written_ahead: Vec<(vmmigrate::api::PowerActionKind, String)>,
    pub violations: Vec<String>,
}

struct World {
    rng: SplitMix,
    faults: FaultPlan,
    ledger: Ledger,
    power: SourcePowerState,
    shutdown_ticks: Option<u32>,
    source_disks: Vec<Vec<u8>>,
    source_sha: Vec<String>,
    /// Writes that landed on each disk's extent itself (not a snapshot's
    /// delta): with the size, what the host's `stat` shows (its mtime).
    extent_writes: Vec<u64>,
    copies: Vec<LocalCopy>,
    artifacts: Vec<Artifact>,
    staged: BTreeMap<usize, String>,
    dvs: BTreeMap<usize, SimDv>,
    vm: Option<SimVm>,
    vmi_ticks: Option<u32>,
    app_ticks: u32,
    staging_base: String,
    published: Option<Published>,
    snapshot: Option<SimSnapshot>,
    /// sha256 of each disk of the base the last snapshot froze.
    frozen_sha: Vec<String>,
    /// The person's power-on is done (it happens once).
    person_done: bool,
    /// Written-ahead power actions already asked of the host.
    asked: Vec<(vmmigrate::api::PowerActionKind, String)>,
    /// The source runs by the person's hand, not yet seen by vmmigrate.
    person_running: bool,
    /// sha256 of each disk when the source last went off.
    at_power_off: Vec<String>,
    /// The controller's fence refused this step (a stale read, a deleted
    /// migration, a lost lease): nothing irreversible or destructive may follow.
    fence_closed: bool,
    /// The host cannot be reached for good (see `lose_credentials`).
    credentials_gone: bool,
    /// What deleted migrations recorded as left on the source.
    left_on_source: Vec<vmmigrate::api::LeftOnSource>,
    /// Whether the driver writes ahead through `written_ahead` (the
    /// simulation's fence); the real controller's fence writes to the API server.
    tracks_write_ahead: bool,
    /// The calls come from another controller process (a stale replica):
    /// it sees files and objects, never this process's running tasks or
    /// their unreported results.
    other_process: bool,
}

/// Where staged artifacts are written for the real staging server to serve
/// to real CDI (set by `support::publish_sim_staging`).
struct Published {
    root: std::path::PathBuf,
    access: Arc<vmmigrate::convert::access::StagingAccess>,
}

impl Published {
    fn file(&self, uid: &str, disk: usize) -> std::path::PathBuf {
        self.root.join(vmmigrate::machine::artifact_key(uid, disk, "raw"))
    }

    /// The artifact as the converter leaves it: data, then its marker.
    fn write(&self, uid: &str, disk: usize, data: &[u8]) -> std::io::Result<()> {
        use vmmigrate::convert::artifact::{Marker, write_marker};
        let file = self.file(uid, disk);
        std::fs::create_dir_all(file.parent().expect("a parent"))?;
        std::fs::write(&file, data)?;
        write_marker(&file, &Marker { size: data.len() as u64, sha256: sha_hex(data) })
    }
}

/// The simulated world; clone the `Arc` into every adapter slot.
pub struct SimWorld {
    world: Mutex<World>,
}

fn sha_hex(data: &[u8]) -> String {
    Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect()
}

impl SimWorld {
    /// A powered-on VM with two disks (24 KiB and 8 KiB of patterned data).
    pub fn new(seed: u64, faults: FaultPlan) -> Arc<SimWorld> {
        let disks: Vec<Vec<u8>> = [24 * 1024, 8 * 1024]
            .iter()
            .enumerate()
            .map(|(d, len)| (0..*len).map(|i| ((i * 31 + d * 7 + 1) % 251) as u8).collect())
            .collect();
        let source_sha = disks.iter().map(|d| sha_hex(d)).collect();
        let n = disks.len();
        let vm = faults.foreign_vm.then(|| SimVm {
            ours: false,
            owned: false,
            drifted: false,
            run_strategy: "Always".into(),
            uid: "foreign".into(),
        });
        Arc::new(SimWorld {
            world: Mutex::new(World {
                rng: SplitMix(seed ^ 0x5EED),
                faults,
                ledger: Ledger::default(),
                power: SourcePowerState::PoweredOn,
                shutdown_ticks: None,
                source_disks: disks,
                source_sha,
                extent_writes: vec![0; n],
                copies: (0..n).map(|_| LocalCopy::default()).collect(),
                artifacts: (0..n).map(|_| Artifact::default()).collect(),
                staged: BTreeMap::new(),
                dvs: BTreeMap::new(),
                vm,
                vmi_ticks: None,
                app_ticks: 3,
                staging_base: "http://staging.sim".into(),
                published: None,
                snapshot: None,
                frozen_sha: Vec::new(),
                person_done: false,
                asked: Vec::new(),
                person_running: false,
                at_power_off: Vec::new(),
                fence_closed: false,
                credentials_gone: false,
                left_on_source: Vec::new(),
                tracks_write_ahead: false,
                other_process: false,
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, World> {
        // A poisoned lock only means another test thread panicked; the data is still usable.
        self.world.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What a controller process loses when it dies: running background work
    /// stops (partial data stays), and unreported task results are gone.
    pub fn crash(&self) {
        let mut w = self.lock();
        for copy in &mut w.copies {
            copy.running = false;
            copy.delta_running = false;
            copy.pending_failure = None;
        }
        for artifact in &mut w.artifacts {
            if artifact.running.take().is_some() {
                artifact.partial = true;
            }
            artifact.pending_failure = None;
        }
    }

    /// A human fixes what the needs-a-human faults broke.
    pub fn human_fixes(&self) {
        let mut w = self.lock();
        w.faults.guest_ignores_shutdown = false;
        w.faults.tools_not_running = false;
        w.faults.snapshot = false;
        w.faults.wrong_content = false;
        if w.vm.as_ref().is_some_and(|vm| !vm.ours) {
            w.vm = None;
        }
    }

    /// Stage artifacts as files under `root` (the layout of the real staging
    /// server, which serves them at `url`) with the credentials of `access`.
    pub fn publish(
        &self,
        root: &std::path::Path,
        url: &str,
        access: Arc<vmmigrate::convert::access::StagingAccess>,
    ) {
        let mut w = self.lock();
        w.staging_base = url.trim_end_matches('/').to_owned();
        w.published = Some(Published { root: root.to_path_buf(), access });
    }

    /// Lets held copies progress again.
    pub fn release_copies(&self) {
        self.lock().faults.hold_copies = false;
    }

    /// Time passes on the host: a guest shutting down gets that much nearer
    /// to off (one tick a second, besides one per look at the power).
    pub fn advance(&self, seconds: u64) {
        let mut w = self.lock();
        if let Some(ticks) = w.shutdown_ticks {
            w.shutdown_ticks = Some(ticks.saturating_sub(seconds.min(u64::from(u32::MAX)) as u32));
        }
    }

    /// A human shuts the guest down on the host (outside vmmigrate).
    pub fn human_shuts_down(&self) {
        let mut w = self.lock();
        w.power = SourcePowerState::PoweredOff;
        w.went_off();
    }

    /// The migration reached `phase` (as recorded): a person who powers the
    /// source on in that phase does so now, once, after vmmigrate powered
    /// it off; the guest writes at the start of every disk while it runs.
    pub fn person_acts(&self, status: &vmmigrate::api::VirtualMachineMigrationStatus) {
        let mut w = self.lock();
        if (w.faults.backup_snapshot_before_cutover || w.faults.disk_added_before_cutover)
            && status.phase == vmmigrate::api::Phase::Preparing
            && status.timestamps.source_powered_off.is_none()
            && !w.person_done
        {
            w.person_done = true;
            if w.faults.backup_snapshot_before_cutover {
                w.faults.snapshot = true;
            } else {
                w.add_disk();
            }
            return;
        }
        if !w.person_done
            && w.faults.person_cycles_unseen_in == Some(status.phase)
            && w.power == SourcePowerState::PoweredOff
            && status.timestamps.source_powered_off.is_some()
        {
            w.person_done = true;
            w.ledger.person_power_ons += 1;
            for disk in 0..w.source_disks.len() {
                w.write_at(disk, 0);
            }
            w.ledger.person_power_offs += 1;
            w.went_off();
            return;
        }
        if w.person_done
            || w.faults.person_powers_on_in != Some(status.phase)
            || w.power != SourcePowerState::PoweredOff
            || status.timestamps.source_powered_off.is_none()
        {
            return;
        }
        w.person_done = true;
        w.person_running = true;
        w.power = SourcePowerState::PoweredOn;
        w.ledger.person_power_ons += 1;
        for disk in 0..w.source_disks.len() {
            w.write_at(disk, 0);
        }
    }

    /// After vmmigrate stopped for the source running again, the person
    /// powers it off themselves, or leaves it on for vmmigrate to power off
    /// again (`by_hand`).
    pub fn person_powers_off(&self, by_hand: bool) {
        let mut w = self.lock();
        if w.person_running {
            w.person_running = false;
            if by_hand {
                w.power = SourcePowerState::PoweredOff;
                w.ledger.person_power_offs += 1;
                w.went_off();
            }
        }
    }

    /// A power action was recorded in a status written ahead of its call.
    pub fn written_ahead(&self, records: &[vmmigrate::api::PowerActionRecord]) {
        let mut w = self.lock();
        for r in records {
            let key = (r.action, format!("#{}", r.seq));
            if !w.ledger.written_ahead.contains(&key) && !w.asked.contains(&key) {
                w.ledger.written_ahead.push(key);
            }
        }
    }

    /// Whether the controller's fence refused the current step.
    pub fn set_fence_closed(&self, closed: bool) {
        self.lock().fence_closed = closed;
    }

    /// The calls that follow come from another controller process (see
    /// `World::other_process`), until called again with `false`.
    pub fn set_other_process(&self, other: bool) {
        self.lock().other_process = other;
    }

    /// sha256 of each disk when the source last went off.
    pub fn at_power_off(&self) -> Vec<String> {
        self.lock().at_power_off.clone()
    }

    pub fn ledger(&self) -> Ledger {
        self.lock().ledger.clone()
    }

    pub fn source_sha(&self) -> Vec<String> {
        let w = self.lock();
        w.source_disks.iter().map(|d| sha_hex(d)).collect()
    }

    pub fn recorded_source_sha(&self) -> Vec<String> {
        self.lock().source_sha.clone()
    }

    pub fn source_power(&self) -> SourcePowerState {
        self.lock().power
    }

    /// The sha256 of the disks the last snapshot froze.
    pub fn frozen_sha(&self) -> Vec<String> {
        self.lock().frozen_sha.clone()
    }

    /// The name of a snapshot the source still has.
    pub fn snapshot_left(&self) -> Option<String> {
        self.lock().snapshot.as_ref().map(|s| s.name.clone())
    }

    /// Whether a VM of the destination's name that is not the migration's
    /// is still there.
    pub fn foreign_vm_present(&self) -> bool {
        self.lock().vm.as_ref().is_some_and(|vm| !vm.ours)
    }

    /// sha256 of the bytes each disk's DataVolume imported (`None`: no DataVolume).
    pub fn imported_sha(&self) -> Vec<Option<String>> {
        let w = self.lock();
        (0..w.source_disks.len()).map(|d| w.dvs.get(&d).map(|dv| dv.bytes.clone())).collect()
    }

    /// (DataVolumes present, VM present, VM still owned, anything staged or copied).
    pub fn destination_summary(&self) -> (usize, bool, bool, bool) {
        let w = self.lock();
        let leftovers = !w.staged.is_empty() || w.copies.iter().any(|c| !c.data.is_empty());
        let owned = w.vm.as_ref().is_some_and(|vm| vm.owned) || w.dvs.values().any(|dv| dv.owned);
        (w.dvs.len(), w.vm.as_ref().is_some_and(|vm| vm.ours), owned, leftovers)
    }
}

impl World {
    /// Common entry of every call: counts it and rolls the generic faults.
    /// Returns `Err` for an injected failure, `Ok(true)` when the call must hang.
    fn enter(&mut self, what: &str) -> Result<bool, Failure> {
        self.ledger.calls += 1;
        if self.faults.fail_nth_call == Some(self.ledger.calls) {
            return Err(Failure::retryable(
                Reason::APIUnavailable,
                format!("{what}: injected failure of call {}", self.ledger.calls),
            ));
        }
        if self.rng.chance(self.faults.transient) {
            return Err(Failure::retryable(Reason::APIUnavailable, format!("{what}: transient failure")));
        }
        Ok(self.rng.chance(self.faults.hang))
    }

    /// What a copy reads of disk `disk`: the base a snapshot froze, else the disk.
    fn readable(&self, disk: usize) -> &[u8] {
        match &self.snapshot {
            Some(s) => &s.base[disk],
            None => &self.source_disks[disk],
        }
    }

    /// The running guest writes one byte to one of its disks (the expected
    /// contents follow: only vmmigrate must never write).
    fn guest_write(&mut self) {
        if !(self.faults.guest_writes || self.person_running) || self.power != SourcePowerState::PoweredOn {
            return;
        }
        let disk = self.rng.below(self.source_disks.len() as u64) as usize;
        let at = self.rng.below(self.source_disks[disk].len() as u64) as usize;
        self.write_at(disk, at);
    }

    /// A person adds a 4 KiB disk to the source (a snapshot it has keeps
    /// the new disk as it is: the migration drops that snapshot anyway).
    fn add_disk(&mut self) {
        let d = self.source_disks.len();
        let data: Vec<u8> = (0..4096).map(|i| ((i * 13 + d * 5 + 3) % 251) as u8).collect();
        self.source_sha.push(sha_hex(&data));
        if let Some(snapshot) = self.snapshot.as_mut() {
            snapshot.base.push(data.clone());
            snapshot.dirty.push(Default::default());
        }
        self.source_disks.push(data);
        self.extent_writes.push(0);
        self.copies.push(LocalCopy::default());
        self.artifacts.push(Artifact::default());
    }

    /// The guest changes byte `at` of disk `disk` (a snapshot's delta keeps it).
    fn write_at(&mut self, disk: usize, at: usize) {
        self.source_disks[disk][at] = self.source_disks[disk][at].wrapping_add(1);
        self.source_sha[disk] = sha_hex(&self.source_disks[disk]);
        match self.snapshot.as_mut() {
            Some(snapshot) => {
                snapshot.dirty[disk].insert(at);
            }
            None => self.extent_writes[disk] += 1,
        }
    }

    /// What the host's `stat` shows of disk `disk`'s extent: size and mtime.
    fn extent_stat(&self, disk: usize) -> String {
        format!("{}:{}", self.source_disks[disk].len(), self.extent_writes[disk])
    }

    /// An irreversible or destructive call: never after the fence refused.
    fn behind_fence(&mut self, what: &str) {
        if self.fence_closed {
            self.ledger.violations.push(format!("{what} performed after the fence refused the step"));
        }
    }

    /// The source went off: what its disks hold now is what a migration must import.
    fn went_off(&mut self) {
        self.at_power_off = self.source_disks.iter().map(|d| sha_hex(d)).collect();
    }

    /// A power call: it must have been written ahead (a record in a status
    /// the controller wrote before it asked, not used by an earlier call).
    fn asked_for(&mut self, kind: vmmigrate::api::PowerActionKind, vmm: &VirtualMachineMigration) {
        if self.faults.snapshot {
            // Discovery saw none (validation refuses them): it came since.
            self.ledger
                .violations
                .push(format!("{kind:?} asked while a snapshot not seen at discovery is on the source"));
        }
        let recorded =
            vmm.status.as_ref().and_then(|s| s.power_actions.iter().rev().find(|r| r.action == kind));
        let key = recorded.map(|r| (r.action, format!("#{}", r.seq)));
        if !self.tracks_write_ahead {
            return;
        }
        match key {
            Some(key) if self.ledger.written_ahead.contains(&key) => {
                self.ledger.written_ahead.retain(|k| *k != key);
                self.asked.push(key);
            }
            _ => self
                .ledger
                .violations
                .push(format!(
                    "{kind:?} asked of the host without a record written ahead (records {:?}, written ahead {:?}, asked {:?})",
                    vmm.status.as_ref().map(|s| s.power_actions.iter().map(|r| format!("{:?}@{}@{}", r.action, r.epoch, r.recorded.0)).collect::<Vec<_>>()),
                    self.ledger.written_ahead,
                    self.asked
                )),
        }
    }
}

macro_rules! call {
    ($self:ident, $what:expr) => {{
        let hang = {
            let mut w = $self.lock();
            w.enter($what)?
        };
        if hang {
            std::future::pending::<()>().await;
        }
    }};
}

#[async_trait]
impl EsxiHost for SimWorld {
    async fn discover(&self, _vmm: &VirtualMachineMigration) -> Result<SourceInventory, Failure> {
        call!(self, "discover");
        let w = self.lock();
        if w.faults.discovery_always_fails {
            return Err(Failure::retryable(Reason::SSHConnectFailed, "connection refused by the ESXi host"));
        }
        let disks = w
            .source_disks
            .iter()
            .enumerate()
            .map(|(i, d)| SourceDisk {
                index: i as i32,
                device: format!("scsi0:{i}"),
                bus: "scsi".into(),
                controller_model: "pvscsi".into(),
                descriptor_path: format!("/vmfs/volumes/ds1/web/web_{i}.vmdk"),
                extent_path: format!("/vmfs/volumes/ds1/web/web_{i}-flat.vmdk"),
                capacity_bytes: d.len() as i64,
                create_type: "vmfs".into(),
                mode: "persistent".into(),
            })
            .collect();
        Ok(SourceInventory {
            vmid: "7".into(),
            name: "web 01".into(),
            vmx_path: "[ds1] web/web.vmx".into(),
            guest_os: "debian12_64Guest".into(),
            esxi_version: "VMware ESXi 8.0.3 build-24022510".into(),
            firmware: Firmware::Efi,
            secure_boot: false,
            bios_uuid: "421b4b87-e6b7-d881-07a0-c9d221cd3c6b".into(),
            cpu_sockets: 1,
            cores_per_socket: 2,
            memory_mib: 2048,
            power_state: w.power,
            // As the real adapter counts them: not the migration's own.
            snapshots: i32::from(w.faults.snapshot),
            pending_question: None,
            disks,
            nics: vec![SourceNic {
                device: "ethernet0".into(),
                model: "vmxnet3".into(),
                network: "VM Network".into(),
                mac_address: "00:50:56:01:02:03".into(),
                pci_slot: Some(192),
            }],
            ip_addresses: vec![],
            hardware: Default::default(),
        })
    }

    async fn power(&self, _vmm: &VirtualMachineMigration) -> Result<PowerObservation, Failure> {
        call!(self, "power.getstate");
        let mut w = self.lock();
        w.guest_write();
        if let Some(ticks) = w.shutdown_ticks {
            if ticks == 0 {
                w.shutdown_ticks = None;
                if w.power == SourcePowerState::PoweredOn {
                    w.power = SourcePowerState::PoweredOff;
                    w.ledger.power_off_transitions += 1;
                    w.went_off();
                }
            } else {
                w.shutdown_ticks = Some(ticks - 1);
            }
        }
        Ok(PowerObservation { state: w.power, tools_running: !w.faults.tools_not_running })
    }

    async fn extent_stats(
        &self,
        _vmm: &VirtualMachineMigration,
        paths: &[String],
    ) -> Result<Vec<String>, Failure> {
        call!(self, "stat extents");
        let w = self.lock();
        Ok(paths
            .iter()
            .map(|path| {
                (0..w.source_disks.len())
                    .find(|i| *path == format!("/vmfs/volumes/ds1/web/web_{i}-flat.vmdk"))
                    .map_or_else(|| vmmigrate::ports::UNREADABLE_EXTENT.to_owned(), |i| w.extent_stat(i))
            })
            .collect())
    }

    async fn request_shutdown(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        call!(self, "power.shutdown");
        let mut w = self.lock();
        w.ledger.shutdown_requests += 1;
        w.behind_fence("power.shutdown");
        w.asked_for(vmmigrate::api::PowerActionKind::Shutdown, vmm);
        if w.faults.tools_not_running {
            return Err(Failure::needs_human(
                Reason::ToolsNotRunning,
                "Cannot complete operation because VMware Tools is not running in this virtual machine.",
            ));
        }
        if w.power == SourcePowerState::PoweredOn
            && !w.faults.guest_ignores_shutdown
            && w.shutdown_ticks.is_none()
        {
            w.shutdown_ticks = Some(2);
        }
        Ok(())
    }

    async fn power_off(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        call!(self, "power.off");
        let mut w = self.lock();
        w.ledger.hard_power_offs += 1;
        w.behind_fence("power.off");
        w.asked_for(vmmigrate::api::PowerActionKind::PowerOff, vmm);
        if w.power == SourcePowerState::PoweredOn {
            w.power = SourcePowerState::PoweredOff;
            w.ledger.power_off_transitions += 1;
            w.went_off();
        }
        Ok(())
    }

    async fn snapshot_id(
        &self,
        _vmm: &VirtualMachineMigration,
        name: &str,
    ) -> Result<Option<String>, Failure> {
        call!(self, "snapshot.get");
        Ok(self.lock().snapshot.as_ref().filter(|s| s.name == name).map(|s| s.id.clone()))
    }

    async fn create_snapshot(
        &self,
        _vmm: &VirtualMachineMigration,
        name: &str,
        _quiesce: bool,
    ) -> Result<(), Failure> {
        call!(self, "snapshot.create");
        let mut w = self.lock();
        if w.snapshot.is_none() {
            w.ledger.snapshots_created += 1;
            let base = w.source_disks.clone();
            w.frozen_sha = base.iter().map(|d| sha_hex(d)).collect();
            let id = w.ledger.snapshots_created.to_string();
            let dirty = vec![Default::default(); base.len()];
            w.snapshot = Some(SimSnapshot { name: name.to_owned(), id, base, dirty });
        }
        let lost = w.faults.lost_response;
        if w.rng.chance(lost) {
            return Err(Failure::retryable(Reason::SSHConnectFailed, "snapshot.create: the answer was lost"));
        }
        Ok(())
    }

    async fn remove_snapshot(&self, _vmm: &VirtualMachineMigration, name: &str) -> Result<(), Failure> {
        call!(self, "snapshot.remove");
        let mut w = self.lock();
        if w.credentials_gone {
            return Err(Failure::needs_human(
                Reason::CredentialsSecretMissing,
                "secret \"esxi-credentials\" not found",
            ));
        }
        if w.snapshot.as_ref().is_some_and(|s| s.name == name) {
            // Consolidated: the disks keep what the guest wrote since.
            w.snapshot = None;
            w.ledger.snapshots_removed += 1;
        }
        Ok(())
    }
}

#[async_trait]
impl DiskStore for SimWorld {
    async fn copy_state(&self, _vmm: &VirtualMachineMigration, disk: usize) -> CopyState {
        let mut w = self.lock();
        w.ledger.calls += 1;
        let total = w.source_disks.get(disk).map(|d| d.len()).unwrap_or(0);
        let cut = w.faults.cut_copy;
        let corrupt = w.faults.corrupt_copy;
        let roll_cut = w.rng.chance(cut);
        let roll_corrupt = w.rng.chance(corrupt);
        // Another process sees the file a running copy writes, no more.
        let hold = w.faults.hold_copies || w.other_process;
        let other_process = w.other_process;
        if disk >= w.source_disks.len() {
            return CopyState::Failed {
                failure: Failure::terminal(Reason::LocalDiskError, format!("disk {disk}")),
                discard: false,
            };
        }
        let source = w.readable(disk).to_vec();
        let stat_now = w.extent_stat(disk);
        let World { copies, .. } = &mut *w;
        let Some(copy) = copies.get_mut(disk) else {
            return CopyState::Failed {
                failure: Failure::terminal(Reason::LocalDiskError, format!("disk {disk}")),
                discard: false,
            };
        };
        if !other_process && let Some((failure, discard)) = copy.pending_failure.take() {
            return CopyState::Failed { failure, discard };
        }
        if copy.running && !hold {
            if roll_cut {
                copy.running = false;
                return CopyState::Failed {
                    failure: Failure::retryable(
                        Reason::ConnectionLost,
                        "the SSH connection was lost mid-copy",
                    ),
                    discard: false,
                };
            }
            // Only reads from the source, never writes.
            let start = copy.data.len();
            let end = (start + COPY_CHUNK).min(total);
            copy.data.extend_from_slice(&source[start..end]);
            if copy.data.len() == total && copy.stat_at_start.as_ref().is_some_and(|s| *s != stat_now) {
                // The extent was written while it was read (the real copy
                // stats it again after its last read); what it read goes.
                *copy = LocalCopy::default();
                return CopyState::Failed {
                    failure: Failure::retryable(Reason::SourceChanged, "the source changed during the copy"),
                    discard: true,
                };
            }
            if copy.data.len() == total {
                copy.running = false;
                copy.host_sha = Some(sha_hex(&source));
                if roll_corrupt && !copy.data.is_empty() {
                    copy.data[0] ^= 0xff;
                }
            } else {
                return CopyState::InProgress {
                    bytes_done: copy.data.len() as i64,
                    bytes_total: total as i64,
                };
            }
        }
        if copy.running && !other_process {
            return CopyState::InProgress { bytes_done: copy.data.len() as i64, bytes_total: total as i64 };
        }
        if copy.data.is_empty() {
            return CopyState::Absent;
        }
        if copy.data.len() < total {
            return CopyState::Partial { bytes_done: copy.data.len() as i64, bytes_total: total as i64 };
        }
        let sha = sha_hex(&copy.data);
        let host_sha = copy.host_sha.clone().unwrap_or_else(|| sha_hex(&source));
        if !copy.assembled && sha != host_sha {
            return CopyState::Failed {
                failure: Failure::retryable(
                    Reason::ChecksumMismatch,
                    "the copy's sha256 differs from the source's",
                ),
                discard: true,
            };
        }
        let source = if copy.assembled { None } else { copy.stat_at_start.clone() };
        CopyState::Complete {
            size: total as i64,
            sha256: sha,
            verified_remotely: true,
            epoch: copy.epoch,
            source,
        }
    }

    async fn start_copy(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        call!(self, "start copy");
        let mut w = self.lock();
        let power = w.power;
        if power != SourcePowerState::PoweredOff && w.snapshot.is_none() {
            w.ledger.violations.push(format!("disk {disk} copy started while the source was {power:?}"));
        }
        let epoch = vmm.status.as_ref().map_or(0, |s| s.epoch);
        let stat = (disk < w.source_disks.len()).then(|| w.extent_stat(disk));
        // A second process's copy beside a running one: two tasks write one file.
        if w.other_process && w.copies.get(disk).is_some_and(|c| c.running) {
            w.ledger.violations.push(format!("disk {disk}: two copy tasks write one file"));
        }
        if let Some(copy) = w.copies.get_mut(disk) {
            if !copy.running && copy.data.is_empty() {
                copy.epoch = epoch;
                copy.stat_at_start = stat;
            }
            copy.running = true;
        }
        Ok(())
    }

    async fn delta_state(&self, _vmm: &VirtualMachineMigration, disk: usize) -> CopyState {
        let mut w = self.lock();
        w.ledger.calls += 1;
        let World { copies, source_disks, snapshot, other_process, .. } = &mut *w;
        let Some(copy) = copies.get_mut(disk) else { return CopyState::Absent };
        if copy.delta_running && !*other_process {
            // One tick: the snapshot's delta (the bytes written since it was
            // taken, as the disk holds them now) applied onto the base copy.
            copy.delta_running = false;
            if let Some(snapshot) = snapshot.as_ref() {
                for &at in &snapshot.dirty[disk] {
                    copy.data[at] = source_disks[disk][at];
                }
            }
            copy.assembled = true;
        }
        if !copy.assembled {
            return CopyState::Absent;
        }
        let size = copy.data.len() as i64;
        CopyState::Complete {
            size,
            sha256: sha_hex(&copy.data),
            verified_remotely: true,
            epoch: copy.epoch,
            source: None,
        }
    }

    async fn start_delta_copy(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        call!(self, "start delta copy");
        let mut w = self.lock();
        let power = w.power;
        let total = w.source_disks.get(disk).map_or(0, Vec::len);
        if power != SourcePowerState::PoweredOff {
            w.ledger
                .violations
                .push(format!("disk {disk} delta copy started while the source was {power:?}"));
        }
        if w.snapshot.is_none() {
            w.ledger.violations.push(format!("disk {disk} delta copy started without a snapshot"));
        }
        let Some(copy) = w.copies.get_mut(disk) else { return Ok(()) };
        if copy.data.len() != total || copy.running {
            let violation = format!("disk {disk} delta copy started before its base was copied");
            w.ledger.violations.push(violation);
            return Ok(());
        }
        if !copy.assembled {
            copy.delta_running = true;
            copy.epoch = vmm.status.as_ref().map_or(0, |s| s.epoch);
        }
        Ok(())
    }

    async fn discard_copy(&self, _vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        call!(self, "discard copy");
        let mut w = self.lock();
        w.behind_fence("discarding a copy");
        if let Some(copy) = w.copies.get_mut(disk) {
            *copy = LocalCopy::default();
        }
        if let Some(a) = w.artifacts.get_mut(disk) {
            *a = Artifact::default();
        }
        Ok(())
    }

    async fn remove_all(&self, _vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        call!(self, "remove copies");
        let mut w = self.lock();
        w.behind_fence("removing the copies");
        let zombie = w.faults.zombie_copy;
        // (While the source runs again: the epoch ending under those tasks.)
        let zombies = w.rng.chance(zombie) && w.power == SourcePowerState::PoweredOn;
        for copy in &mut w.copies {
            if zombies && !copy.data.is_empty() {
                // Another process's task goes on writing this copy.
                copy.running = true;
                continue;
            }
            *copy = LocalCopy::default();
        }
        for artifact in &mut w.artifacts {
            *artifact = Artifact::default();
        }
        Ok(())
    }
}

#[async_trait]
impl Converter for SimWorld {
    /// The simulated conversion converts Linux guests (it has no virtio-win).
    fn guest_converter(&self) -> vmmigrate::machine::GuestConverterFacts {
        vmmigrate::machine::GuestConverterFacts { virt_v2v: true, virtio_win: false, uefi_firmware: true }
    }
    async fn artifact_state(&self, _vmm: &VirtualMachineMigration, disk: usize) -> ArtifactState {
        let mut w = self.lock();
        w.ledger.calls += 1;
        let kill = w.faults.kill_conversion;
        let killed = w.rng.chance(kill);
        let World { artifacts, copies, other_process, .. } = &mut *w;
        let Some(artifact) = artifacts.get_mut(disk) else {
            return ArtifactState::Failed(Failure::terminal(Reason::LocalDiskError, format!("disk {disk}")));
        };
        if *other_process {
            // Another process sees an output being written as incomplete.
            if artifact.running.is_some() {
                return ArtifactState::Invalid { reason: "output is incomplete".into() };
            }
        } else if let Some(failure) = artifact.pending_failure.take() {
            return ArtifactState::Failed(failure);
        }
        if let Some(ticks) = artifact.running {
            if killed {
                artifact.running = None;
                artifact.partial = true;
                return ArtifactState::Failed(Failure::retryable(
                    Reason::ConversionKilled,
                    "qemu-img was killed",
                ));
            }
            if ticks == 0 {
                artifact.running = None;
                artifact.done = Some(sha_hex(&copies[disk].data));
            } else {
                artifact.running = Some(ticks - 1);
                return ArtifactState::InProgress { bytes_done: 1, bytes_total: 2 };
            }
        }
        if artifact.partial {
            return ArtifactState::Invalid { reason: "output is incomplete".into() };
        }
        match &artifact.done {
            Some(sha) => ArtifactState::Complete { sha256: sha.clone(), staged_url: None },
            None => ArtifactState::Absent,
        }
    }

    async fn start_conversion(&self, _vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        call!(self, "start conversion");
        let mut w = self.lock();
        // A second process's conversion beside a running one: two writers of one output.
        if w.other_process && w.artifacts.get(disk).is_some_and(|a| a.running.is_some()) {
            w.ledger.violations.push(format!("disk {disk}: two conversions write one output"));
        }
        if let Some(a) = w.artifacts.get_mut(disk)
            && a.running.is_none()
            && a.done.is_none()
        {
            a.running = Some(1);
            a.partial = false;
        }
        Ok(())
    }

    async fn discard_artifact(&self, _vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        call!(self, "discard artifact");
        let mut w = self.lock();
        if let Some(a) = w.artifacts.get_mut(disk) {
            *a = Artifact::default();
        }
        w.staged.remove(&disk);
        Ok(())
    }
}

#[async_trait]
impl Staging for SimWorld {
    async fn staged_url(
        &self,
        vmm: &VirtualMachineMigration,
        disk: usize,
        sha256: &str,
    ) -> Result<Option<String>, Failure> {
        call!(self, "staging lookup");
        let w = self.lock();
        let key = vmmigrate::machine::artifact_key(vmm.metadata.uid.as_deref().unwrap_or("uid"), disk, "raw");
        Ok(w.staged
            .get(&disk)
            .filter(|s| *s == sha256)
            .map(|_| format!("{}/artifacts/{key}", w.staging_base)))
    }

    async fn stage(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        call!(self, "stage");
        let mut w = self.lock();
        match w.artifacts.get(disk).and_then(|a| a.done.clone()) {
            Some(sha) => {
                if let Some(published) = &w.published {
                    let data = w.copies.get(disk).map(|c| c.data.clone()).unwrap_or_default();
                    let uid = vmm.metadata.uid.as_deref().unwrap_or("uid");
                    published.write(uid, disk, &data).map_err(|e| {
                        Failure::retryable(Reason::WorkDirError, format!("staging disk {disk}: {e}"))
                    })?;
                }
                w.staged.insert(disk, sha);
                Ok(())
            }
            None => Err(Failure::retryable(
                Reason::ArtifactMissing,
                format!("no artifact for disk {disk} to stage"),
            )),
        }
    }

    async fn import_access(
        &self,
        vmm: &VirtualMachineMigration,
        disk: usize,
    ) -> Result<vmmigrate::ports::ImportAccess, Failure> {
        call!(self, "import access");
        let uid = vmm.metadata.uid.as_deref().unwrap_or("uid");
        let w = self.lock();
        Ok(match &w.published {
            Some(published) => published.access.credential(uid, &format!("disk-{disk}.raw")),
            None => vmmigrate::ports::ImportAccess {
                access_key_id: vmmigrate::machine::artifact_key(uid, disk, "raw"),
                secret_key: format!("sim-secret-{disk}"),
                ca_pem: String::new(),
            },
        })
    }

    async fn remove_all(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        call!(self, "unstage");
        let mut w = self.lock();
        if let Some(published) = &w.published {
            let dir = published.root.join(vmm.metadata.uid.as_deref().unwrap_or("uid"));
            match std::fs::remove_dir_all(&dir) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(Failure::retryable(Reason::WorkDirError, format!("{}: {e}", dir.display())));
                }
                _ => {}
            }
        }
        w.staged.clear();
        Ok(())
    }
}

#[async_trait]
impl Cluster for SimWorld {
    async fn preflight(&self, _vmm: &VirtualMachineMigration) -> Result<PreflightFacts, Failure> {
        call!(self, "preflight");
        let w = self.lock();
        let destination_vm = match &w.vm {
            None => DestinationOccupancy::Free,
            Some(vm) if vm.ours => DestinationOccupancy::Ours,
            Some(_) => DestinationOccupancy::Taken,
        };
        Ok(PreflightFacts {
            storage_class_exists: true,
            destination_namespace_exists: true,
            destination_vm,
            destination_refused: None,
            data_plane_blocked: None,
            source_claimed_by: None,
            guest_converter: Default::default(),
        })
    }

    async fn data_volume(
        &self,
        _vmm: &VirtualMachineMigration,
        disk: usize,
    ) -> Result<DataVolumeState, Failure> {
        call!(self, "get DataVolume");
        let mut w = self.lock();
        let evict = w.faults.evict_importer;
        let evicted = w.rng.chance(evict);
        let cdi_without_checksum = w.faults.cdi_without_checksum;
        let Some(dv) = w.dvs.get_mut(&disk) else { return Ok(DataVolumeState::Absent) };
        if let Some(failure) = &dv.failed {
            return Ok(DataVolumeState::Failed(failure.clone()));
        }
        if dv.ticks == 0 {
            // A CDI that knows `checksum` fails a download that does not match it.
            if !cdi_without_checksum && dv.checksum.as_ref().is_some_and(|c| *c != dv.bytes) {
                let failure = Failure::retryable(Reason::ImportChecksumMismatch, "checksum mismatch");
                dv.failed = Some(failure.clone());
                return Ok(DataVolumeState::Failed(failure));
            }
            return Ok(DataVolumeState::Succeeded);
        }
        if evicted {
            dv.failed = Some(Failure::retryable(Reason::ImportFailed, "the importer pod was evicted"));
            return Ok(DataVolumeState::Failed(Failure::retryable(
                Reason::ImportFailed,
                "the importer pod was evicted",
            )));
        }
        dv.ticks -= 1;
        Ok(DataVolumeState::InProgress {
            phase: "ImportInProgress".into(),
            percent: 50,
            restarts: 0,
            importer_error: None,
        })
    }

    async fn create_data_volume(
        &self,
        vmm: &VirtualMachineMigration,
        disk: usize,
        access: &vmmigrate::ports::ImportAccess,
    ) -> Result<(), Failure> {
        call!(self, "create DataVolume");
        let mut w = self.lock();
        if w.dvs.contains_key(&disk) {
            return Ok(());
        }
        let key = vmmigrate::machine::artifact_key(vmm.metadata.uid.as_deref().unwrap_or("uid"), disk, "raw");
        if access.access_key_id != key {
            w.ledger.violations.push(format!(
                "DataVolume for disk {disk} given the credentials of {}",
                access.access_key_id
            ));
        }
        if !w.staged.contains_key(&disk) {
            w.ledger
                .violations
                .push(format!("DataVolume for disk {disk} created before its artifact was staged"));
        }
        let bytes = w.staged.get(&disk).cloned().unwrap_or_default();
        let checksum =
            vmm.status.as_ref().and_then(|s| s.disks.get(disk)).and_then(|d| d.artifact_sha256.clone());
        w.dvs.insert(disk, SimDv { ticks: 2, failed: None, owned: true, bytes, checksum, verify: None });
        *w.ledger.dv_creates.entry(disk).or_default() += 1;
        let lost = w.faults.lost_response;
        if w.rng.chance(lost) {
            return Err(Failure::retryable(Reason::Timeout, "the create's response was lost"));
        }
        Ok(())
    }

    async fn delete_data_volume(&self, _vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        call!(self, "delete DataVolume");
        let mut w = self.lock();
        if w.dvs.remove(&disk).is_some() {
            *w.ledger.dv_deletes.entry(disk).or_default() += 1;
        }
        Ok(())
    }

    async fn vm(&self, _vmm: &VirtualMachineMigration) -> Result<VmState, Failure> {
        call!(self, "get VM");
        let w = self.lock();
        Ok(match &w.vm {
            None => VmState::Absent,
            Some(vm) if !vm.ours => VmState::NotOurs,
            Some(vm) if vm.drifted => VmState::Drifted {
                uid: vm.uid.clone(),
                differences: vec!["spec.template: changed in the simulated world".into()],
            },
            Some(vm) => VmState::Matching { uid: vm.uid.clone() },
        })
    }

    async fn create_vm(&self, _vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        call!(self, "create VM");
        let mut w = self.lock();
        if w.vm.is_some() {
            return Ok(());
        }
        if w.dvs.len() != w.source_disks.len() {
            w.ledger.violations.push("VM created before every DataVolume existed".into());
        }
        // Sometimes someone edits the VM right after we create it.
        let drifted = w.rng.chance(0.2);
        w.vm = Some(SimVm {
            ours: true,
            owned: true,
            drifted,
            run_strategy: "Halted".into(),
            uid: "vm-uid-1".into(),
        });
        w.ledger.vm_creates += 1;
        let lost = w.faults.lost_response;
        if w.rng.chance(lost) {
            return Err(Failure::retryable(Reason::Timeout, "the create's response was lost"));
        }
        Ok(())
    }

    async fn update_vm(&self, _vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        call!(self, "update VM");
        let mut w = self.lock();
        w.ledger.vm_updates += 1;
        match w.vm.as_mut() {
            Some(vm) if vm.ours => {
                vm.drifted = false;
                Ok(())
            }
            _ => Err(Failure::retryable(Reason::NotFound, "the VM is gone")),
        }
    }

    async fn starting(&self, vmm: &VirtualMachineMigration) -> Result<StartingFacts, Failure> {
        call!(self, "get VMI");
        let mut w = self.lock();
        let wanted = format!("{:?}", vmm.spec.run_strategy());
        let set = w.vm.as_ref().is_some_and(|vm| vm.run_strategy == wanted);
        let no_capacity = w.faults.no_capacity;
        let unschedulable = w.rng.chance(no_capacity);
        // The VMI's progress and failures follow the looks of the process
        // that runs the migration; another process only reads it.
        if w.other_process {
            let vmi = match w.vmi_ticks {
                None => VmiState::Absent,
                Some(0) => VmiState::Running,
                Some(_) => VmiState::Waiting { phase: "Scheduling".into() },
            };
            return Ok(StartingFacts { run_strategy_set: set, vmi });
        }
        let vmi = match w.vmi_ticks {
            None => VmiState::Absent,
            Some(_) if unschedulable => {
                w.vmi_ticks = Some(2);
                VmiState::Failed(Failure::retryable(
                    Reason::Unschedulable,
                    "0/3 nodes are available: insufficient memory",
                ))
            }
            Some(0) => VmiState::Running,
            Some(t) => {
                w.vmi_ticks = Some(t - 1);
                VmiState::Waiting { phase: "Scheduling".into() }
            }
        };
        Ok(StartingFacts { run_strategy_set: set, vmi })
    }

    async fn set_run_strategy(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        call!(self, "set runStrategy");
        let mut w = self.lock();
        let rehearsal = vmm.status.as_ref().and_then(|s| s.mode).unwrap_or(vmm.spec.mode)
            == vmmigrate::api::MigrationMode::Rehearsal;
        if !rehearsal && w.power != SourcePowerState::PoweredOff {
            let power = w.power;
            w.ledger.violations.push(format!("the destination was started while the source was {power:?}"));
        }
        let wanted = format!("{:?}", vmm.spec.run_strategy());
        match w.vm.as_mut() {
            Some(vm) if vm.ours => {
                vm.run_strategy = wanted;
                if w.vmi_ticks.is_none() {
                    w.vmi_ticks = Some(2);
                }
                Ok(())
            }
            _ => Err(Failure::retryable(Reason::NotFound, "the VM is gone")),
        }
    }

    async fn cdi_verifies_checksum(&self) -> Result<bool, Failure> {
        call!(self, "read the DataVolume definition");
        Ok(!self.lock().faults.cdi_without_checksum)
    }

    async fn import_check(
        &self,
        _vmm: &VirtualMachineMigration,
        disk: usize,
    ) -> Result<Option<vmmigrate::machine::VolumeCheck>, Failure> {
        use vmmigrate::machine::VolumeCheck;
        call!(self, "read the verify Job");
        let mut w = self.lock();
        let without = w.faults.cdi_without_checksum;
        let Some(dv) = w.dvs.get_mut(&disk) else { return Ok(Some(VolumeCheck::Absent)) };
        if !without && dv.checksum.is_some() {
            return Ok(None);
        }
        Ok(Some(match dv.verify {
            None => VolumeCheck::Absent,
            Some(0) => VolumeCheck::Matches { sha256: dv.bytes.clone() },
            Some(left) => {
                dv.verify = Some(left - 1);
                VolumeCheck::Running
            }
        }))
    }

    async fn start_volume_check(&self, _vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        call!(self, "create the verify Job");
        if let Some(dv) = self.lock().dvs.get_mut(&disk) {
            dv.verify.get_or_insert(2);
        }
        Ok(())
    }

    async fn delete_volume_check(&self, _vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        call!(self, "delete the verify Job");
        if let Some(dv) = self.lock().dvs.get_mut(&disk) {
            dv.verify = None;
        }
        Ok(())
    }

    async fn delete_destination(&self, _vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        call!(self, "delete destination");
        let mut w = self.lock();
        w.behind_fence("deleting the destination");
        let disks: Vec<usize> = w.dvs.keys().copied().collect();
        for disk in disks {
            w.dvs.remove(&disk);
            *w.ledger.dv_deletes.entry(disk).or_default() += 1;
        }
        if w.vm.as_ref().is_some_and(|vm| vm.ours) {
            w.vm = None;
            w.vmi_ticks = None;
        }
        Ok(())
    }

    async fn record_left_on_source(&self, left: &vmmigrate::api::LeftOnSource) -> Result<(), Failure> {
        call!(self, "record left on source");
        let mut w = self.lock();
        if !w.left_on_source.iter().any(|l| l.uid == left.uid) {
            w.left_on_source.push(left.clone());
        }
        Ok(())
    }

    async fn release_destination(&self, _vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        call!(self, "release destination");
        let mut w = self.lock();
        for dv in w.dvs.values_mut() {
            dv.owned = false;
        }
        if let Some(vm) = w.vm.as_mut().filter(|vm| vm.ours) {
            vm.owned = false;
        }
        Ok(())
    }
}

#[async_trait]
impl Prober for SimWorld {
    async fn check(&self, _vmm: &VirtualMachineMigration, check: &ValidationCheck) -> CheckResult {
        let mut w = self.lock();
        w.ledger.calls += 1;
        if w.vmi_ticks != Some(0) {
            return CheckResult::NotYet { message: format!("{}: the VM is not running", check.name) };
        }
        if w.app_ticks > 0 {
            w.app_ticks -= 1;
            return CheckResult::NotYet { message: format!("{}: connection refused", check.name) };
        }
        if w.faults.wrong_content {
            return CheckResult::Wrong {
                message: format!("{}: body does not contain the expected text", check.name),
            };
        }
        CheckResult::Pass { message: format!("{}: 200 OK", check.name) }
    }
}

/// All adapter slots filled with the same simulated world.
pub fn adapters(world: &Arc<SimWorld>) -> vmmigrate::ports::Adapters {
    vmmigrate::ports::Adapters {
        esxi: world.clone(),
        disks: world.clone(),
        converter: world.clone(),
        staging: world.clone(),
        cluster: world.clone(),
        prober: world.clone(),
    }
}
