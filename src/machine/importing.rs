//! Importing: one DataVolume per disk, imported by CDI from the staging
//! server and proven to hold the copy's bytes (CDI's own checksum check, or
//! the verify Job where CDI has none), with CDI's failure model turned into
//! the machine's: importer restarts and imports that stop moving are given
//! up on and made again after Converting re-checks the artifact.

use super::*;

pub(super) fn importing(ctx: &mut Ctx<'_>, observed: Observed) {
    let facts = match observed {
        Observed::Importing(Ok(facts)) => facts,
        Observed::Importing(Err(failure)) => return ctx.fail(Phase::Importing, failure),
        _ => return mismatch(ctx, Phase::Importing, "importing"),
    };
    let volumes = facts.volumes;
    let mut succeeded = 0;
    let mut verifying = 0;
    let mut progress = Progress::default();
    let mut importer_trouble = Vec::new();
    for (disk, dv) in volumes.iter().enumerate() {
        let name = data_volume_name(&ctx.destination, disk);
        if let Some(d) = ctx.status.disks.get_mut(disk) {
            d.data_volume_name = Some(name.clone());
        }
        let size = ctx.status.disks.get(disk).map(|d| d.size_bytes).unwrap_or(0);
        let raw = ctx.status.disks.get(disk).and_then(|d| d.artifact_format.as_deref()) == Some("raw");
        // A volume asked for blank as Preparing began is filled by vmmigrate.
        let early = ctx.status.timestamps.volumes_requested.is_some();
        if early
            && raw
            && *dv != DataVolumeState::Absent
            && ctx.status.disks.get(disk).is_some_and(|d| d.import_verification.is_none())
        {
            let how = match patchable(&ctx.status, disk) {
                true => ImportVerification::Patched,
                false => ImportVerification::Filled,
            };
            // Written from now on: what it held before no longer stands.
            ctx.status.forget_volume_base(disk);
            if let Some(d) = ctx.status.disks.get_mut(disk) {
                d.import_verification = Some(how);
            }
        }
        let percent = match dv {
            DataVolumeState::Absent => {
                // The checksum goes into the DataVolume only where CDI
                // knows the field; otherwise the volume is read afterwards.
                // A raw artifact goes into a blank volume that vmmigrate
                // fills where this cluster does; CDI's importer converts
                // anything else.
                let planned = match (facts.fills_volumes, facts.cdi_verifies_checksum) {
                    (Some(true), Some(_)) if raw => ImportVerification::Filled,
                    (_, Some(true)) => ImportVerification::CdiChecksum,
                    (_, Some(false)) => ImportVerification::VolumeSha256,
                    (_, None) => return mismatch(ctx, Phase::Importing, "CDI's checksum support"),
                };
                let now = ctx.now.clone();
                // A volume made again is blank.
                ctx.status.forget_volume_base(disk);
                if let Some(d) = ctx.status.disks.get_mut(disk) {
                    d.import_verification = Some(planned);
                    d.imported_sha256 = None;
                    d.import_progress = None;
                    d.import_progress_at = Some(now);
                }
                ctx.actions.push(Action::CreateDataVolume { disk });
                0
            }
            DataVolumeState::InProgress { phase, percent, restarts, importer_error } => {
                if let Some(stalled) = import_stalled(ctx, disk, &name, phase, *percent, importer_error) {
                    return redo_import(ctx, disk, stalled);
                }
                if *restarts >= IMPORTER_RESTART_LIMIT {
                    // An import that fails the same way again and again (a
                    // refused credential, a wrong URL) never ends in CDI.
                    let last = importer_error.as_deref().unwrap_or("no message");
                    let failure = Failure::retryable(
                        Reason::ImportFailed,
                        format!("DataVolume {name}: the importer failed {restarts} times; last: {last}"),
                    );
                    return redo_import(ctx, disk, failure);
                }
                if let Some(error) = importer_error {
                    importer_trouble.push(format!("{name}: importer restarted {restarts} time(s): {error}"));
                }
                *percent
            }
            DataVolumeState::Succeeded => {
                match verify_import(ctx, disk, &name, facts.checks.get(disk).cloned().flatten()) {
                    Verified::Yes => succeeded += 1,
                    Verified::NotYet => verifying += 1,
                    Verified::Stop => return,
                }
                100
            }
            DataVolumeState::Failed(failure) if failure.class == FailureClass::Terminal => {
                ctx.condition(
                    condition::DISK_IMPORTED,
                    false,
                    failure.reason.as_str(),
                    failure.message.clone(),
                );
                return ctx.fail(Phase::Importing, failure.clone());
            }
            DataVolumeState::Failed(failure) => return redo_import(ctx, disk, failure.clone()),
        };
        progress.disks.push(DiskProgress {
            index: disk as i32,
            bytes_done: size * i64::from(percent.clamp(0, 100)) / 100,
            bytes_total: size,
            ..Default::default()
        });
    }
    if succeeded == volumes.len() && !volumes.is_empty() {
        let count = |how: ImportVerification| {
            ctx.status.disks.iter().filter(|d| d.import_verification == Some(how)).count()
        };
        let (read_back, patched) =
            (count(ImportVerification::VolumeSha256), count(ImportVerification::Patched));
        let filled = count(ImportVerification::Filled) + patched;
        let how = match (read_back, filled) {
            (0, n) if n == succeeded && patched > 0 => format!(
                "{patched} holding its base before the cutover and written only the ranges changed since, {} filled whole, each hashed to the copy's",
                filled - patched
            ),
            (0, 0) => "each checked by CDI against the copy's sha256".to_owned(),
            (n, 0) if n == succeeded => "each read back and hashed to the copy's sha256".to_owned(),
            (0, n) if n == succeeded => {
                "each filled by vmmigrate, the bytes written hashed to the copy's sha256".to_owned()
            }
            (r, f) => format!(
                "{f} filled by vmmigrate, {r} read back and hashed, the others checked by CDI, against the copy's sha256"
            ),
        };
        ctx.condition(
            condition::DISK_IMPORTED,
            true,
            "Imported",
            format!("{succeeded} DataVolume(s) succeeded, {how}"),
        );
        ctx.advance(Phase::CreatingVm);
    } else {
        set_progress(ctx, progress);
        let mut message = format!("{succeeded} of {} DataVolume(s) succeeded and verified", volumes.len());
        if verifying > 0 {
            message.push_str(&format!(
                "; {verifying} being filled or read back to compare its sha256 with the copy's"
            ));
        }
        let reason = if importer_trouble.is_empty() { "Importing" } else { "ImporterRestarting" };
        for trouble in &importer_trouble {
            message.push_str("; ");
            message.push_str(trouble);
        }
        ctx.condition(condition::DISK_IMPORTED, false, reason, message);
        // DataVolumes are watched, Jobs are not (that would take reading
        // every Job in the cluster): while a fill or verify Job runs, look
        // again as the checks do, from every second (a patch written after
        // a warm cutover takes seconds, each of them downtime) to every 5 s.
        let poll = match verifying {
            0 => POLL_IN_PROGRESS,
            _ => checks_poll(elapsed_since(&phase_entered(&ctx.status), ctx.now_ts).unwrap_or_default())
                .min(POLL_IN_PROGRESS),
        };
        ctx.wait(poll);
    }
}

/// When the current phase was entered, as the history records it.
fn phase_entered(status: &VirtualMachineMigrationStatus) -> Option<Time> {
    status.history.iter().rev().find(|t| t.phase == status.phase).map(|t| t.time.clone())
}

/// Whether disk `disk`'s volume can take its patch alone: it holds the
/// base the patch applies on (filled and hashed before the cutover), and
/// the artifact is the assembled copy itself (a converted guest's disk is
/// not, and is filled whole).
fn patchable(status: &VirtualMachineMigrationStatus, disk: usize) -> bool {
    let Some(d) = status.disks.get(disk) else { return false };
    let Some(patch) = &d.patch else { return false };
    d.artifact_sha256.is_some()
        && d.artifact_sha256 == d.source_sha256
        && status.expected_volume_sha256(disk) == d.source_sha256
        && status.volume_holds_base(disk, &patch.base_sha256)
}

enum Verified {
    Yes,
    NotYet,
    /// The phase failed (recorded).
    Stop,
}

/// A succeeded DataVolume is done only once its bytes are proven the copy's:
/// by CDI's own checksum check (`check` is `None`: the stored DataVolume
/// kept `checksum`), or by the verify Job reading the volume.
fn verify_import(ctx: &mut Ctx<'_>, disk: usize, name: &str, check: Option<VolumeCheck>) -> Verified {
    let planned = ctx.status.disks.get(disk).and_then(|d| d.import_verification);
    let whole = ctx.status.expected_volume_sha256(disk).unwrap_or_default();
    // Patched: the fill Job hashed the patch it wrote, not the disk.
    let patch = ctx.status.disks.get(disk).and_then(|d| d.patch.as_ref()).map(|p| p.sha256.clone());
    let expected = match (planned, patch) {
        (Some(ImportVerification::Patched), Some(patch)) => patch,
        _ => whole.clone(),
    };
    let record = |ctx: &mut Ctx<'_>, how: ImportVerification, sha: Option<String>| {
        if let Some(d) = ctx.status.disks.get_mut(disk) {
            d.import_verification = Some(how);
            d.imported_sha256 = sha;
        }
    };
    match check {
        None => {
            record(ctx, ImportVerification::CdiChecksum, None);
            Verified::Yes
        }
        Some(VolumeCheck::Absent) => {
            ctx.actions.push(Action::StartVolumeCheck { disk });
            Verified::NotYet
        }
        Some(VolumeCheck::Running) => Verified::NotYet,
        Some(VolumeCheck::Matches { sha256 }) if sha256 == expected => {
            // Filled (or patched) where it was planned so, else read back.
            // A patched volume is its base (hashed when it was filled) with
            // the patch (hashed now) written: the disk's bytes.
            let how = match planned {
                Some(how @ (ImportVerification::Filled | ImportVerification::Patched)) => how,
                _ => ImportVerification::VolumeSha256,
            };
            record(ctx, how, Some(whole));
            Verified::Yes
        }
        Some(VolumeCheck::Matches { sha256 } | VolumeCheck::Differs { sha256, .. }) => {
            let failure = Failure::retryable(
                Reason::ImportChecksumMismatch,
                format!(
                    "DataVolume {name}: the imported volume's sha256 is {sha256}, the copy's {expected} (or bytes after the disk are not zero)"
                ),
            );
            ctx.condition(condition::DISK_IMPORTED, false, failure.reason.as_str(), failure.message.clone());
            ctx.actions.push(Action::DeleteVolumeCheck { disk });
            ctx.actions.push(Action::DeleteDataVolume { disk });
            ctx.fail_resuming(Phase::Importing, Some(Phase::Converting), failure);
            Verified::Stop
        }
        Some(VolumeCheck::Failed(failure)) => {
            ctx.actions.push(Action::DeleteVolumeCheck { disk });
            ctx.fail(Phase::Importing, failure);
            Verified::Stop
        }
        Some(VolumeCheck::Unavailable(why)) => {
            ctx.fail(
                Phase::Importing,
                Failure::needs_human(
                    Reason::ImportUnverifiable,
                    format!("DataVolume {name} was imported by a CDI that does not check checksums, and it cannot be read back: {why}"),
                ),
            );
            Verified::Stop
        }
    }
}

/// Gives an import up: its DataVolume goes, and it is made again when the
/// phase is retried (by backoff or by a human) after Converting has checked
/// the artifact again: a failed import may mean the staged bytes are bad, and
/// a DataVolume must never be recreated on an artifact known to be corrupt.
fn redo_import(ctx: &mut Ctx<'_>, disk: usize, failure: Failure) {
    ctx.condition(condition::DISK_IMPORTED, false, failure.reason.as_str(), failure.message.clone());
    ctx.actions.push(Action::DeleteDataVolume { disk });
    ctx.fail_resuming(Phase::Importing, Some(Phase::Converting), failure);
}

/// Importer pod restarts (CDI's `restartCount`) after which an import is
/// given up on and retried from Converting.
pub const IMPORTER_RESTART_LIMIT: i32 = 3;

/// Records the import's progress when it moved and returns the failure of an
/// import that has not moved for `timeouts.importStallSeconds`: an importer
/// pod that never starts (no room, a quota, a missing image) or a download
/// that hangs without failing leaves CDI waiting for ever, with no restart
/// to count.
fn import_stalled(
    ctx: &mut Ctx<'_>,
    disk: usize,
    name: &str,
    phase: &str,
    percent: i32,
    importer_error: &Option<String>,
) -> Option<Failure> {
    let seen = format!("{} {percent}%", if phase.is_empty() { "Pending" } else { phase });
    let now = ctx.now.clone();
    let now_ts = ctx.now_ts;
    let limit = Duration::from_secs(ctx.spec.strategy.timeouts.import_stall_seconds.max(1) as u64);
    // Time nobody could look (the API server down, the controller
    // restarting) is not time the import was seen stalled.
    let watched_long_enough = ctx.watched_for.is_none_or(|watched| watched >= limit);
    let d = ctx.status.disks.get_mut(disk)?;
    if d.import_progress.as_deref() != Some(seen.as_str()) || d.import_progress_at.is_none() {
        d.import_progress = Some(seen);
        d.import_progress_at = Some(now);
        return None;
    }
    let still = elapsed_since(&d.import_progress_at, now_ts).unwrap_or_default();
    if still < limit || !watched_long_enough {
        return None;
    }
    d.import_progress = None;
    d.import_progress_at = None;
    let last =
        importer_error.as_deref().map(|e| format!("; the importer's last error: {e}")).unwrap_or_default();
    Some(Failure::retryable(
        Reason::ImportStalled,
        format!("DataVolume {name} made no progress for {}s (still {seen}){last}", still.as_secs()),
    ))
}
