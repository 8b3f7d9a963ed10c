//! Deterministic simulation of the controller: the real `engine::step` (the
//! code the kube-runtime controller runs) against the in-memory world of
//! `support::sim`, through thousands of seeded schedules of faults and
//! crashes. A crash drops everything a controller process holds in memory,
//! at any crash point: after observing, or after any single action and before
//! the status write.
//!
//! A fifth of the schedules migrate warm and a fifth rehearse, with a guest
//! writing to its disks while the VM is on: the crashes then also land
//! between each new step (snapshot taken, bases copied, deltas applied,
//! snapshot removed) and the status write that records it.
//!
//! Every schedule asserts the invariants of DESIGN §8. A failure prints its
//! seed; replay it with
//!   VMMIGRATE_SIM_SEED=<seed> cargo test --test integration machine_simulation
//! Run more schedules with VMMIGRATE_SIM_SCHEDULES=<n> (default 2000).

use crate::support::sim::{self, FaultPlan, SimWorld, SplitMix};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;
use std::collections::BTreeMap;
use std::io::Write;
use std::time::Duration;
use vmmigrate::api::{
    CleanupAction, MigrationMode, Phase, PowerOffPolicy, RETRY_ANNOTATION, VirtualMachineMigration,
    VirtualMachineMigrationSpec, condition,
};
use vmmigrate::controller::engine::{self, CrashPoint, StepInput};
use vmmigrate::machine::tenancy::DestinationRules;
use vmmigrate::machine::{Action, Reason, conditions};

const MAX_STEPS: usize = 6000;

#[derive(Debug, Clone, PartialEq)]
enum Expect {
    Completed,
    /// Passes through ManualInterventionRequired with this reason; a human fixes and retries.
    HumanThenCompleted(Reason),
    Failed(Reason),
}

struct Scenario {
    mode: MigrationMode,
    /// Someone edits `spec.mode` of the running migration (kubectl) to this.
    mode_edited_to: Option<MigrationMode>,
    faults: FaultPlan,
    policy: PowerOffPolicy,
    retry_limit: i32,
    on_failure: CleanupAction,
    crash_rate: f64,
    expect: Expect,
    /// Each reconcile runs on a replica whose clock runs up to 15 minutes ahead.
    clock_ahead: bool,
    /// A person may delete the migration at any crash point.
    deleted_at_random: bool,
    /// Now and then a second replica steps too, on a read of several steps
    /// ago: its lease lapsed while it looked (a hung call outlasted it).
    stale_replica: bool,
}

fn scenario(seed: u64) -> Scenario {
    let mut rng = SplitMix(seed);
    let mut faults = FaultPlan {
        transient: rng.unit() * 0.08,
        hang: rng.unit() * 0.02,
        cut_copy: rng.unit() * 0.15,
        corrupt_copy: rng.unit() * 0.1,
        kill_conversion: rng.unit() * 0.1,
        evict_importer: rng.unit() * 0.1,
        no_capacity: rng.unit() * 0.1,
        lost_response: rng.unit() * 0.2,
        fail_nth_call: Some(1 + rng.below(60)),
        ..FaultPlan::default()
    };
    let policies = [
        PowerOffPolicy::GracefulOnly,
        PowerOffPolicy::GracefulThenForce,
        PowerOffPolicy::Force,
        PowerOffPolicy::RequireAlreadyOff,
    ];
    let mut policy = policies[rng.below(3) as usize];
    let mut retry_limit = 60;
    let mut clock_ahead = rng.chance(0.2);
    let mut expect = Expect::Completed;
    match rng.below(10) {
        0 if rng.chance(0.5) => {
            faults.guest_ignores_shutdown = true;
            policy = PowerOffPolicy::GracefulOnly;
            expect = Expect::HumanThenCompleted(Reason::GuestShutdownTimeout);
        }
        0 => {
            // The guest ignores the shutdown and the policy forces after the
            // timeout, while replicas whose clocks run ahead take turns.
            faults.guest_ignores_shutdown = true;
            policy = PowerOffPolicy::GracefulThenForce;
            clock_ahead = true;
        }
        1 => {
            faults.tools_not_running = true;
            policy = PowerOffPolicy::GracefulOnly;
            expect = Expect::HumanThenCompleted(Reason::ToolsNotRunning);
        }
        2 => {
            faults.snapshot = rng.chance(0.5);
            faults.foreign_vm = !faults.snapshot;
            expect = Expect::HumanThenCompleted(Reason::ValidationBlocked);
        }
        3 => {
            faults.wrong_content = true;
            expect = Expect::HumanThenCompleted(Reason::ApplicationCheckFailed);
        }
        4 => {
            faults.discovery_always_fails = true;
            retry_limit = rng.below(4) as i32;
            expect = Expect::Failed(Reason::RetryBudgetExhausted);
        }
        5 => {
            // The VM is already off; nothing may touch its power.
            policy = policies[3];
            faults.tools_not_running = true;
        }
        6 => {
            // Tools missing but force allowed: hard power-off after no request.
            faults.tools_not_running = true;
            policy = PowerOffPolicy::GracefulThenForce;
        }
        _ => {}
    }
    let on_failure = if rng.chance(0.5) { CleanupAction::Retain } else { CleanupAction::Delete };
    let crash_rate = rng.unit() * 0.3;
    let mode = match rng.below(5) {
        0 => MigrationMode::Warm,
        1 => MigrationMode::Rehearsal,
        _ => MigrationMode::Cold,
    };
    // A person powers the source on again after vmmigrate powered it off:
    // mid-copy, or after the copies completed, before the destination starts.
    if mode != MigrationMode::Rehearsal
        && expect == Expect::Completed
        && policy != PowerOffPolicy::RequireAlreadyOff
        && rng.chance(0.3)
    {
        let phases = [Phase::Preparing, Phase::Converting, Phase::Importing, Phase::CreatingVm];
        faults.person_powers_on_in = Some(phases[rng.below(4) as usize]);
        faults.zombie_copy = 0.5;
        expect = Expect::HumanThenCompleted(Reason::SourcePoweredOnAgain);
    } else if mode == MigrationMode::Cold
        && expect == Expect::Completed
        && policy != PowerOffPolicy::RequireAlreadyOff
        && rng.chance(0.15)
    {
        // A person powers it on, the guest writes and the person powers it
        // off again between two looks, after its copies completed: only the
        // extents' stat tells.
        let phases = [Phase::Converting, Phase::Importing, Phase::CreatingVm];
        faults.person_cycles_unseen_in = Some(phases[rng.below(3) as usize]);
        expect = Expect::HumanThenCompleted(Reason::SourceDisksChanged);
    } else if mode != MigrationMode::Rehearsal
        && expect == Expect::Completed
        && policy != PowerOffPolicy::RequireAlreadyOff
        && rng.chance(0.15)
    {
        // A backup tool snapshots the source while the cutover is prepared,
        // or a person adds a disk to it.
        if rng.chance(0.5) {
            faults.backup_snapshot_before_cutover = true;
        } else {
            faults.disk_added_before_cutover = true;
        }
        expect = Expect::HumanThenCompleted(Reason::SourceChangedSinceDiscovery);
    }
    faults.guest_writes = mode != MigrationMode::Cold;
    faults.cdi_without_checksum = rng.chance(0.3);
    // A rehearsal never asks the guest to shut down: nobody is asked about it.
    if mode == MigrationMode::Rehearsal
        && matches!(
            expect,
            Expect::HumanThenCompleted(Reason::GuestShutdownTimeout | Reason::ToolsNotRunning)
        )
    {
        expect = Expect::Completed;
    }
    // Half the rehearsals are edited into a migration that would power off,
    // once they left Validated: the recorded mode must win.
    let mode_edited_to = (mode == MigrationMode::Rehearsal && rng.chance(0.5))
        .then(|| if rng.chance(0.5) { MigrationMode::Cold } else { MigrationMode::Warm });
    Scenario {
        mode,
        mode_edited_to,
        faults,
        policy,
        retry_limit,
        on_failure,
        crash_rate,
        expect,
        clock_ahead,
        deleted_at_random: rng.chance(0.25),
        stale_replica: rng.chance(0.3),
    }
}

fn migration(s: &Scenario) -> VirtualMachineMigration {
    let spec: VirtualMachineMigrationSpec = serde_json::from_value(serde_json::json!({
        "source": {
            "host": "esxi01", "hostKey": "SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s",
            "credentialsSecretRef": {"name": "creds"}, "vm": {"name": "web 01"}
        },
        "destination": {"namespace": "migrations", "storageClassName": "standard"},
        "networkMap": [{"source": "VM Network", "type": "Pod"}],
        "validation": {"checks": [
            {"name": "home", "http": {"service": "web", "port": 80}},
            {"name": "agent", "guestAgent": {}}
        ]}
    }))
    .expect("spec");
    let mut vmm = VirtualMachineMigration::new("web-01", spec);
    vmm.metadata.namespace = Some("migrations".into());
    vmm.metadata.uid = Some("3f0c1d2e-uid".into());
    vmm.metadata.generation = Some(1);
    vmm.spec.power_off_policy = s.policy;
    vmm.spec.mode = s.mode;
    vmm.spec.strategy.retry_limit = s.retry_limit;
    vmm.spec.cleanup.on_failure = s.on_failure;
    vmm
}

#[derive(Default)]
struct Totals {
    schedules: usize,
    steps: usize,
    crashes: usize,
    action_failures: usize,
    human_retries: usize,
    outcomes: BTreeMap<String, usize>,
    /// Crashes right after an action of this kind, before its status write.
    crashes_after: BTreeMap<String, usize>,
    /// Rehearsals whose spec.mode was edited mid-run.
    mode_edits: usize,
    /// Steps the fence refused.
    refusals: usize,
    /// Schedules ended by a deletion at a random crash point.
    deletions: usize,
    /// Steps of a stale replica, on an old read and without the lease.
    stale_steps: usize,
}

fn run_schedule(seed: u64, rt: &tokio::runtime::Runtime, totals: &mut Totals) -> Result<(), String> {
    let sc = scenario(seed);
    let world = SimWorld::new(seed, sc.faults.clone());
    world.track_write_ahead();
    if sc.policy == PowerOffPolicy::RequireAlreadyOff {
        // RequireAlreadyOff is only chosen for a VM a human already shut down.
        world.human_shuts_down();
    }
    let initial_off_transitions = world.ledger().power_off_transitions;
    let initial_power = world.source_power();
    let adapters = sim::adapters(&world);
    let mut rng = SplitMix(seed.wrapping_mul(0x2545_F491_4F6C_DD1D));
    let mut vmm = migration(&sc);
    let mut now = Timestamp::from_second(1_800_000_000).expect("time");
    let mut powered_off_at = None;
    let mut left_pending = false;
    let mut seen_human = Vec::new();
    // When the last guest shutdown was asked, and when each recorded
    // request was first seen, on the true clock.
    let mut shutdown_asked_at: Option<Timestamp> = None;
    let mut shutdown_seen: BTreeMap<String, Timestamp> = BTreeMap::new();
    // The migration as the last reconciles read it, oldest first.
    let mut reads: std::collections::VecDeque<VirtualMachineMigration> = Default::default();

    for _ in 0..MAX_STEPS {
        let status = vmm.status.clone().unwrap_or_default();
        if sc.stale_replica && reads.len() > 1 && rng.chance(0.15) {
            let old = reads[rng.below(reads.len() as u64 - 1) as usize].clone();
            stale_replica_steps(&world, &adapters, rt, &old, now)?;
            totals.stale_steps += 1;
        }
        reads.push_back(vmm.clone());
        if reads.len() > 8 {
            reads.pop_front();
        }
        if status.phase.is_terminal() && status.timestamps.cleaned_up.is_some() {
            break;
        }
        if status.phase == Phase::ManualInterventionRequired
            && !vmm.annotations().contains_key(RETRY_ANNOTATION)
        {
            let why = status.errors.last().map(|e| e.reason.clone()).unwrap_or_default();
            // A snapshot taken before the cutover stops it at the comparison
            // before the power-off, or at validation when a retry came first.
            let backup = sc.faults.backup_snapshot_before_cutover && why == Reason::ValidationBlocked;
            match &sc.expect {
                Expect::HumanThenCompleted(expected) if why == *expected || backup => {}
                _ => {
                    return Err(format!(
                        "unexpected ManualInterventionRequired ({why}); expected {:?}",
                        sc.expect
                    ));
                }
            }
            seen_human.push(why);
            world.human_fixes();
            world.person_powers_off(rng.chance(0.5));
            vmm.metadata
                .annotations
                .get_or_insert_with(Default::default)
                .insert(RETRY_ANNOTATION.into(), "true".into());
            totals.human_retries += 1;
        }
        if let Some(edited) = sc.mode_edited_to
            && status.mode.is_some()
            && vmm.spec.mode != edited
        {
            vmm.spec.mode = edited;
            vmm.metadata.generation = Some(vmm.metadata.generation.unwrap_or(1) + 1);
            totals.mode_edits += 1;
        }
        world.person_acts(&status);
        totals.steps += 1;
        let crash_rate = sc.crash_rate;
        // Now and then the fence refuses (a stale read, a deletion, a lost
        // lease): the step must then do nothing irreversible or destructive.
        let refuse = rng.chance(0.03);
        world.set_fence_closed(false);
        let fence = SimFence {
            world: world.clone(),
            written: Default::default(),
            refuse,
            refused: Default::default(),
        };
        let mut crash_rng = SplitMix(rng.next_u64());
        // A replica whose clock runs ahead stamps and judges by its clock,
        // but measures how long it has seen a shutdown request on its own.
        let skew = if sc.clock_ahead { rng.below(900) as i64 } else { 0 };
        let seen_for = status.timestamps.shutdown_requested.as_ref().map(|t| {
            let first = *shutdown_seen.entry(t.0.to_string()).or_insert(now);
            Duration::from_secs(now.duration_since(first).as_secs().max(0) as u64)
        });
        let input = StepInput {
            now: now + SignedDuration::from_secs(skew),
            jitter: rng.unit(),
            retry_requested: vmm.annotations().get(RETRY_ANNOTATION).is_some_and(|v| v == "true"),
            destinations: &DestinationRules::default(),
            cutover_approved: false,
            fleet: Default::default(),
            shutdown_seen_for: seen_for,
            watched_for: None,
            orphan_hold: false,
            fence: &fence,
        };
        let mut crashed_after = None;
        let step = rt.block_on(engine::step(&adapters, &vmm, input, |cp: &CrashPoint| {
            let crash = crash_rng.chance(crash_rate);
            if crash && let CrashPoint::Performed(action) = cp {
                crashed_after = Some(action.clone());
            }
            crash
        }));
        if let Some(action) = crashed_after {
            let name = format!("{action:?}");
            let kind = name.split([' ', '{']).next().unwrap_or_default().to_owned();
            *totals.crashes_after.entry(kind).or_default() += 1;
        }
        let ahead = fence.written.lock().expect("fence").take();
        if step.is_none() && fence.refused.load(std::sync::atomic::Ordering::SeqCst) {
            // Refused, not crashed: nothing was recorded; look again.
            totals.refusals += 1;
            world.set_fence_closed(false);
            now += SignedDuration::from_secs(1);
            world.advance(1);
            continue;
        }
        let Some(step) = step else {
            // The controller died: in-memory work is lost, and only what it
            // wrote ahead was recorded.
            if let Some(ahead) = ahead {
                vmm.status = Some(ahead);
            }
            world.crash();
            totals.crashes += 1;
            let restart = 1 + rng.below(5);
            now += SignedDuration::from_secs(restart as i64);
            world.advance(restart);
            continue;
        };
        if let Some((action, failure)) = &step.failed {
            totals.action_failures += 1;
            // The engine's last line of defence must never be needed.
            if failure.reason == Reason::PowerActionRefused {
                return Err(format!("{action:?} was asked for in a rehearsal and refused"));
            }
        }
        let next = step.decision.status.clone();

        // Power is touched only after validation, and never again once recorded off.
        let power_acts = step
            .performed
            .iter()
            .filter(|a| matches!(a, Action::RequestGuestShutdown | Action::PowerOffHard));
        for action in power_acts {
            if !conditions::is_true(&status, condition::VALIDATED) {
                return Err(format!("{action:?} performed before Validated=True (phase {})", status.phase));
            }
            if status.timestamps.source_powered_off.is_some() {
                return Err(format!("{action:?} performed after the power-off was recorded"));
            }
            if sc.policy == PowerOffPolicy::RequireAlreadyOff {
                return Err(format!("{action:?} performed under RequireAlreadyOff"));
            }
            if sc.mode == MigrationMode::Rehearsal {
                return Err(format!("{action:?} performed in a rehearsal"));
            }
            if *action == Action::PowerOffHard && sc.policy == PowerOffPolicy::GracefulOnly {
                return Err("hard power-off under GracefulOnly".into());
            }
            // The guest keeps its whole shutdown window, whatever the clocks say.
            if *action == Action::PowerOffHard
                && let Some(asked) = shutdown_asked_at
                && status.timestamps.shutdown_requested.is_some()
            {
                let waited = now.duration_since(asked).as_secs();
                let timeout = i64::from(vmm.spec.strategy.timeouts.shutdown_seconds);
                if waited < timeout {
                    return Err(format!(
                        "forced {waited} s after the shutdown request, before the {timeout} s timeout"
                    ));
                }
            }
            if *action == Action::RequestGuestShutdown {
                shutdown_asked_at = Some(now);
            }
        }
        if step.performed.contains(&Action::RemoveRetryAnnotation) {
            vmm.metadata.annotations.get_or_insert_with(Default::default).remove(RETRY_ANNOTATION);
        }
        // Terminal phases are never left; Pending is never re-entered.
        if status.phase.is_terminal() && next.phase != status.phase {
            return Err(format!("left terminal phase {} for {}", status.phase, next.phase));
        }
        if status.phase != Phase::Pending {
            left_pending = true;
        }
        if left_pending && next.phase == Phase::Pending {
            return Err("went back to Pending".into());
        }
        // Retryable resumes the failed phase, or the earlier phase its cause
        // lies in (`retry.resume`), never anything else.
        if status.phase == Phase::Retryable
            && next.phase != Phase::Retryable
            && Some(next.phase) != status.retry.as_ref().map(|r| r.resume.unwrap_or(r.phase))
        {
            return Err(format!("Retryable resumed {} instead of the failed phase", next.phase));
        }
        if let Some(r) = &next.retry
            && let Some(resume) = r.resume
            && resume >= r.phase
        {
            return Err(format!("retry of {} resumes {resume}, which is not earlier", r.phase));
        }
        // The power-off timestamp is written once per epoch, and removed
        // only when the epoch ends because the source was seen on again, or
        // its extents changed because a person ran it unseen.
        if next.epoch < status.epoch {
            return Err(format!("epoch went back from {} to {}", status.epoch, next.epoch));
        }
        match (&powered_off_at, &next.timestamps.source_powered_off) {
            (Some((e, a)), Some(b)) if *e == next.epoch && a != b => {
                return Err("timestamps.sourcePoweredOff rewritten in one epoch".into());
            }
            (Some(_), None) => match next.errors.last().map(|e| e.reason.as_str()) {
                Some("SourcePoweredOnAgain") => powered_off_at = None,
                Some("SourceDisksChanged") if world.ledger().person_power_ons > 0 => powered_off_at = None,
                _ => {
                    return Err(
                        "timestamps.sourcePoweredOff removed without the source seen on again or run".into(),
                    );
                }
            },
            (_, Some(b)) => powered_off_at = Some((next.epoch, b.clone())),
            _ => {}
        }
        // A snapshot is removed as soon as its disks are copied: none is
        // left once the migration recorded a phase past Preparing.
        if next.phase > Phase::Preparing
            && next.phase.is_active()
            && let Some(name) = world.snapshot_left()
        {
            return Err(format!("snapshot {name} still on the source in {}", next.phase));
        }
        let ledger = world.ledger();
        // Once per epoch: a power-off again only after a person powered it on.
        if ledger.power_off_transitions - initial_off_transitions > 1 + ledger.person_power_ons {
            return Err(format!("source powered off {} times", ledger.power_off_transitions));
        }
        if let Some(v) = ledger.violations.first() {
            return Err(format!("world saw a violation: {v}"));
        }
        for (disk, creates) in &ledger.dv_creates {
            let deletes = ledger.dv_deletes.get(disk).copied().unwrap_or(0);
            if *creates > deletes + 1 {
                return Err(format!(
                    "DataVolume of disk {disk} created {creates} times with {deletes} deletions"
                ));
            }
        }
        if ledger.vm_creates > 1 {
            return Err(format!("VirtualMachine created {} times", ledger.vm_creates));
        }

        // Record (one status write), then let time pass as the requeue asks.
        vmm.status = Some(next);
        // Now and then a person deletes the migration at this crash point:
        // the finalizer's work, and the schedule ends.
        if sc.deleted_at_random && rng.chance(0.02) {
            totals.deletions += 1;
            return deleted(&vmm, &adapters, &world, rt, &sc);
        }
        let wait = step.decision.requeue.unwrap_or(Duration::from_secs(60)).max(Duration::from_secs(1));
        now += SignedDuration::from_millis(wait.as_millis() as i64);
        world.advance(wait.as_secs());
    }

    let status = vmm.status.clone().unwrap_or_default();
    let outcome = format!("{:?} {}", sc.mode, status.phase);
    *totals.outcomes.entry(outcome).or_default() += 1;
    if !(status.phase.is_terminal() && status.timestamps.cleaned_up.is_some()) {
        let last: Vec<String> = status
            .errors
            .iter()
            .rev()
            .take(3)
            .map(|e| format!("{} {}: {}", e.phase, e.reason, e.message))
            .collect();
        return Err(format!(
            "did not finish in {MAX_STEPS} steps; stuck in {} (last errors: {last:?})",
            status.phase
        ));
    }
    if world.source_sha() != world.recorded_source_sha() {
        return Err("a source disk was written".into());
    }
    let (dvs, vm_present, still_owned, leftovers) = world.destination_summary();
    if leftovers {
        return Err("copied or staged data left behind".into());
    }
    if let Some(name) = world.snapshot_left() {
        return Err(format!("snapshot {name} left on the source after the migration ended"));
    }
    let ledger = world.ledger();
    if sc.mode == MigrationMode::Cold && ledger.snapshots_created > 0 {
        return Err("a cold migration took a snapshot".into());
    }
    let rehearsal = sc.mode == MigrationMode::Rehearsal;
    if rehearsal && ledger.shutdown_requests + ledger.hard_power_offs > 0 {
        return Err("a rehearsal asked for a power action".into());
    }
    match &sc.expect {
        Expect::Completed | Expect::HumanThenCompleted(_) => {
            if status.phase != Phase::Completed {
                let last = status.errors.last().map(|e| format!("{}: {}", e.reason, e.message));
                return Err(format!("ended {} ({last:?}), expected Completed", status.phase));
            }
            let backup_seen = sc.faults.backup_snapshot_before_cutover
                && seen_human.iter().any(|r| *r == Reason::ValidationBlocked);
            if let Expect::HumanThenCompleted(reason) = &sc.expect
                && !seen_human.iter().any(|r| r == reason)
                && !backup_seen
            {
                return Err(format!("never asked a human about {reason}"));
            }
            // A rehearsal copies the moment of its snapshot; a migration the
            // disks at their last power-off.
            let source = if rehearsal { world.frozen_sha() } else { world.at_power_off() };
            let destination = if rehearsal { "web-01-rehearsal" } else { "web-01" };
            // Every disk the source has is migrated (one added before the
            // cutover too), none left behind.
            if status.disks.len() != source.len() {
                return Err(format!(
                    "{} disk(s) migrated of the source's {}",
                    status.disks.len(),
                    source.len()
                ));
            }
            for (i, disk) in status.disks.iter().enumerate() {
                if disk.source_sha256.as_deref() != Some(source[i].as_str()) {
                    return Err(format!(
                        "disk {i}: recorded sha256 {:?} != source {}",
                        disk.source_sha256, source[i]
                    ));
                }
                if disk.artifact_sha256 != disk.source_sha256 {
                    return Err(format!("disk {i}: raw artifact checksum differs from the source's"));
                }
                // The bytes the volume holds, as the world imported them.
                if world.imported_sha().get(i).cloned().flatten().as_deref() != Some(source[i].as_str()) {
                    return Err(format!(
                        "disk {i}: imported {:?}, the source {}",
                        world.imported_sha().get(i),
                        source[i]
                    ));
                }
                if disk.data_volume_name.as_deref() != Some(format!("{destination}-disk-{i}").as_str()) {
                    return Err(format!("disk {i}: DataVolume name {:?}", disk.data_volume_name));
                }
            }
            if dvs != source.len() || !vm_present {
                return Err(format!(
                    "destination incomplete: {} disks, {dvs} DataVolumes, VM {vm_present}",
                    status.disks.len()
                ));
            }
            if still_owned != rehearsal {
                return Err(format!(
                    "owned by the migration: {still_owned}; a completed VM is released, a rehearsal's goes with it"
                ));
            }
            if rehearsal {
                let transitions = world.ledger().power_off_transitions - initial_off_transitions;
                if transitions != 0 || world.source_power() != initial_power {
                    return Err(format!("a rehearsal changed the source's power ({transitions} power-offs)"));
                }
                return Ok(());
            }
            let by_us = if sc.policy == PowerOffPolicy::RequireAlreadyOff { 0 } else { 1 };
            let ledger = world.ledger();
            // Once, and once more for each time a person powered it on and left it on.
            let expected_off = by_us + ledger.person_power_ons - ledger.person_power_offs;
            let transitions = world.ledger().power_off_transitions - initial_off_transitions;
            if transitions != expected_off {
                return Err(format!(
                    "source powered off {transitions} times by the migration, expected {expected_off}"
                ));
            }
            if world.source_power() != vmmigrate::api::SourcePowerState::PoweredOff {
                return Err("source is not off after the migration".into());
            }
        }
        Expect::Failed(reason) => {
            if status.phase != Phase::Failed {
                return Err(format!("ended {}, expected Failed", status.phase));
            }
            let cause = status.errors.iter().rev().find(|e| e.phase.is_active());
            let last = cause.map(|e| e.reason.as_str()).unwrap_or_default();
            let stalled = status.conditions.iter().find(|c| c.type_ == condition::STALLED);
            if stalled.map(|c| c.reason.as_str()) != Some(reason.as_str()) {
                return Err(format!("Stalled condition {stalled:?} does not name {reason}"));
            }
            if last != *reason {
                return Err(format!("failed with {last}, expected {reason}"));
            }
            if world.ledger().power_off_transitions != initial_off_transitions {
                return Err("the source was powered off although validation never passed".into());
            }
        }
    }
    Ok(())
}

/// A deletion at the crash point the migration is at: the finalizer's actions
/// run (retried as the controller's backoff would), and then nothing of the
/// migration is left that should go, nothing that is not its own is gone,
/// and the source's power was not touched.
fn deleted(
    vmm: &VirtualMachineMigration,
    adapters: &vmmigrate::ports::Adapters,
    world: &std::sync::Arc<SimWorld>,
    rt: &tokio::runtime::Runtime,
    sc: &Scenario,
) -> Result<(), String> {
    let before = world.ledger();
    let foreign = world.foreign_vm_present();
    let actions = engine::cleanup_actions(vmm);
    for action in &actions {
        let mut tries = 0;
        while let Err(failure) = rt.block_on(engine::perform_cleanup(adapters, vmm, action)) {
            tries += 1;
            if tries > 50 {
                return Err(format!("the finalizer's {action:?} never succeeded: {failure}"));
            }
        }
    }
    let after = world.ledger();
    if after.shutdown_requests + after.hard_power_offs != before.shutdown_requests + before.hard_power_offs {
        return Err("the finalizer asked something of the source's power".into());
    }
    if foreign && !world.foreign_vm_present() {
        return Err("the finalizer deleted a VM that was not the migration's".into());
    }
    if let Some(name) = world.snapshot_left() {
        return Err(format!("snapshot {name} left on the source by a deleted migration"));
    }
    let (dvs, vm, _, leftovers) = world.destination_summary();
    // (A copy task of another process may still write: not this world's to judge.)
    if actions.contains(&Action::CleanupStaging) && leftovers && sc.faults.zombie_copy == 0.0 {
        return Err("copied or staged data left by a deleted migration".into());
    }
    if actions.contains(&Action::DeleteDestination) && (dvs > 0 || vm) {
        return Err(format!("a deleted migration left {dvs} DataVolume(s), VM {vm}"));
    }
    Ok(())
}

/// A replica that read the migration `old` (the migration has moved on
/// since) and lost its lease while it looked steps once on that read, in
/// its own process: it sees the shared world (host, work directory,
/// cluster) but none of the other process's running tasks. Its fence
/// refuses (the write carries a stale resourceVersion, the lease lapsed),
/// and its decision is never recorded (its status write fails the same
/// way). It must act on nothing: the world's invariants judge what it did.
fn stale_replica_steps(
    world: &std::sync::Arc<SimWorld>,
    adapters: &vmmigrate::ports::Adapters,
    rt: &tokio::runtime::Runtime,
    old: &VirtualMachineMigration,
    now: Timestamp,
) -> Result<(), String> {
    world.set_other_process(true);
    world.set_fence_closed(true);
    let input = StepInput {
        now,
        jitter: 0.5,
        retry_requested: old.annotations().get(RETRY_ANNOTATION).is_some_and(|v| v == "true"),
        destinations: &DestinationRules::default(),
        cutover_approved: false,
        fleet: Default::default(),
        shutdown_seen_for: None,
        watched_for: None,
        orphan_hold: false,
        fence: &LapsedLease,
    };
    let step = rt.block_on(engine::step(adapters, old, input, |_| false));
    world.set_other_process(false);
    world.set_fence_closed(false);
    match step {
        Some(step) if !step.performed.is_empty() => {
            Err(format!("a replica without the lease performed {:?}", step.performed))
        }
        _ => Ok(()),
    }
}

/// The fence of a replica whose lease lapsed: the API server refuses its
/// write (409, the migration moved on), and it no longer leads.
struct LapsedLease;

#[async_trait::async_trait]
impl engine::Fence for LapsedLease {
    async fn write_ahead(
        &self,
        _status: &vmmigrate::api::VirtualMachineMigrationStatus,
    ) -> Result<(), vmmigrate::machine::Failure> {
        Err(vmmigrate::machine::Failure::retryable(Reason::KubeAPIError, "409 Conflict: a stale read"))
    }

    fn leading(&self) -> Result<(), vmmigrate::machine::Failure> {
        Err(vmmigrate::machine::Failure::retryable(Reason::LostLease, "the lease lapsed"))
    }
}

/// The simulation's fence: the status a step writes ahead is recorded (a
/// crash after it keeps it), and the world learns which power actions it holds.
struct SimFence {
    world: std::sync::Arc<SimWorld>,
    written: std::sync::Mutex<Option<vmmigrate::api::VirtualMachineMigrationStatus>>,
    refuse: bool,
    refused: std::sync::atomic::AtomicBool,
}

#[async_trait::async_trait]
impl engine::Fence for SimFence {
    async fn write_ahead(
        &self,
        status: &vmmigrate::api::VirtualMachineMigrationStatus,
    ) -> Result<(), vmmigrate::machine::Failure> {
        if self.refuse {
            self.refused.store(true, std::sync::atomic::Ordering::SeqCst);
            self.world.set_fence_closed(true);
            return Err(vmmigrate::machine::Failure::retryable(Reason::LostLease, "the fence refused"));
        }
        self.world.written_ahead(&status.power_actions);
        *self.written.lock().expect("fence") = Some(status.clone());
        Ok(())
    }

    fn leading(&self) -> Result<(), vmmigrate::machine::Failure> {
        Ok(())
    }
}

#[test]
fn thousands_of_fault_and_crash_schedules_keep_every_invariant() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("runtime");
    let seeds: Vec<u64> = match std::env::var("VMMIGRATE_SIM_SEED") {
        Ok(seed) => vec![seed.parse().expect("VMMIGRATE_SIM_SEED must be a number")],
        Err(_) => {
            let n: u64 =
                std::env::var("VMMIGRATE_SIM_SCHEDULES").ok().and_then(|v| v.parse().ok()).unwrap_or(2000);
            (0..n).map(|i| 0xC0FFEE_u64.wrapping_add(i.wrapping_mul(0x9E37_79B9))).collect()
        }
    };
    let mut totals = Totals::default();
    let mut failures = Vec::new();
    for seed in &seeds {
        totals.schedules += 1;
        if let Err(why) = run_schedule(*seed, &rt, &mut totals) {
            failures.push(format!("seed {seed}: {why}"));
        }
    }
    // Written straight to stderr so the summary shows in CI logs (libtest captures println!).
    let _ = writeln!(
        std::io::stderr(),
        "machine simulation: {} schedules, {} reconciles, {} crashes ({:?} right after an action), {} refused by the fence, {} deleted midway, {} steps of a stale replica, {} failed actions, {} human retries; outcomes {:?}; {} failing",
        totals.schedules,
        totals.steps,
        totals.crashes,
        totals.crashes_after,
        totals.refusals,
        totals.deletions,
        totals.stale_steps,
        totals.action_failures,
        totals.human_retries,
        totals.outcomes,
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {} schedules broke an invariant (replay: VMMIGRATE_SIM_SEED=<seed> cargo test --test integration machine_simulation):\n{}",
        failures.len(),
        seeds.len(),
        failures.iter().take(20).cloned().collect::<Vec<_>>().join("\n")
    );
    assert!(
        totals.crashes > 0 && totals.human_retries > 0,
        "the schedules must exercise crashes and human retries"
    );
    if seeds.len() >= 100 {
        for mode in ["Cold", "Warm", "Rehearsal"] {
            let completed = totals.outcomes.get(&format!("{mode} Completed")).copied().unwrap_or(0);
            assert!(completed > 0, "no {mode} schedule completed: {:?}", totals.outcomes);
        }
        assert!(totals.mode_edits > 0, "no rehearsal was edited mid-run");
        assert!(totals.stale_steps > 0, "no stale replica stepped");
        // The controller died right after each step of warm and rehearsal
        // runs, before recording it, and the run still ended well.
        for step in
            ["CreateSnapshot", "StartDiskCopy", "RemoveSnapshot", "StartDeltaCopy", "ReleaseSourceClaim"]
        {
            let crashes = totals.crashes_after.get(step).copied().unwrap_or(0);
            assert!(crashes > 0, "no crash right after {step}: {:?}", totals.crashes_after);
        }
    }
}
