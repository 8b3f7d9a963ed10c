//! What a validated migration waits for before its cutover, in the order it is
//! asked: its wave (every earlier wave of its plan Completed), its cutover
//! (`Now`, a window, an approval), then a read slot on its ESXi host (and the
//! cluster-wide cap) in a fair queue.
//!
//! Pure functions of the spec, the time and a snapshot of the fleet: the
//! controller builds the snapshot from its watch cache (`controller::fleet_view`),
//! `decide` only reads the answer. A slot is counted in disks, because every
//! disk of a migration is read at once.

use super::Failure;
use crate::api::{
    CutoverMode, CutoverWindow, Phase, Reason, VirtualMachineMigrationSpec, VirtualMachineMigrationStatus,
};
use jiff::Timestamp;
use std::collections::{BTreeMap, HashMap};

/// One reason to wait, for `status.waiting`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Wait {
    pub reason: Reason,
    pub message: String,
    /// The time it waits for (a window's start).
    pub until: Option<Timestamp>,
    /// 1-based place in its queue.
    pub position: Option<u32>,
}

impl Wait {
    fn new(reason: Reason, message: String) -> Wait {
        Wait { reason, message, until: None, position: None }
    }
}

/// The controller's answer for one migration: what the rest of the fleet says.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FleetGates {
    /// An earlier wave of its plan is not Completed yet.
    pub wave: Option<Wait>,
    /// No read slot is free for it (only asked once wave and cutover are open).
    pub slot: Option<Wait>,
}

/// Concurrent disk reads allowed per ESXi host and in the whole cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadCaps {
    /// Reads per host unless `hosts` names the host.
    pub per_host: u32,
    /// Per-host overrides, by `spec.source.host`.
    pub hosts: BTreeMap<String, u32>,
    /// Reads in the whole cluster; `None`: only the per-host caps.
    pub cluster: Option<u32>,
}

impl Default for ReadCaps {
    fn default() -> Self {
        ReadCaps { per_host: DEFAULT_READS_PER_HOST, hosts: BTreeMap::new(), cluster: None }
    }
}

/// Two streams keep one ESXi host's SSH busy without stretching every downtime.
pub(crate) const DEFAULT_READS_PER_HOST: u32 = 2;

impl ReadCaps {
    pub fn host(&self, host: &str) -> u32 {
        self.hosts.get(host).copied().unwrap_or(self.per_host).max(1)
    }
}

/// What the queue needs to know about one migration.
#[derive(Clone, Debug, PartialEq)]
pub struct Member {
    pub namespace: String,
    pub name: String,
    /// `spec.source.host`.
    pub host: String,
    /// `(plan, number)` of `spec.wave`.
    pub wave: Option<(String, i32)>,
    pub phase: Phase,
    /// Disks it reads at once (at least 1).
    pub disks: u32,
    /// Reading, or admitted to read: counts against the caps.
    pub holds_slot: bool,
    /// Validated and waiting for nothing but a slot: in the queue.
    pub queued: bool,
    /// Since when it is in line (when it was validated).
    pub queued_since: Timestamp,
    /// Recorded as waiting for its wave (to be woken when the wave opens).
    pub waits_for_wave: bool,
    /// `spec.source.maxConcurrentReads` (its provider's): it is admitted
    /// only while its host has room under this cap too.
    pub own_cap: Option<u32>,
}

impl Member {
    pub fn key(&self) -> (&str, &str) {
        (&self.namespace, &self.name)
    }

    /// The reads this migration may see on its host: the host's cap, lowered
    /// by its own `maxConcurrentReads`.
    fn cap(&self, limits: &ReadCaps) -> u32 {
        let host = limits.host(&self.host);
        self.own_cap.map_or(host, |own| own.clamp(1, host))
    }
}

/// Whether a migration in `phase` (with this retry bookkeeping) is reading its
/// disks or will be again without passing the queue.
pub(crate) fn holds_slot_in(status: &VirtualMachineMigrationStatus) -> bool {
    match status.phase {
        Phase::Preparing => true,
        Phase::Retryable => {
            status.retry.as_ref().is_some_and(|r| r.resume.unwrap_or(r.phase) == Phase::Preparing)
        }
        _ => false,
    }
}

/// A wave with migrations that are not Completed: those of them that need a person.
#[derive(Clone, Debug, Default)]
struct WaveState {
    held: Vec<String>,
}

/// `(namespace, plan)` → wave number → its state.
type Plans = HashMap<(String, String), BTreeMap<i32, WaveState>>;

/// The waves of every plan, indexed once per look at the fleet.
#[derive(Clone, Debug, Default)]
pub(crate) struct WaveIndex {
    plans: Plans,
}

impl WaveIndex {
    pub fn new(members: &[Member]) -> WaveIndex {
        let mut plans = Plans::new();
        for m in members.iter().filter(|m| m.phase != Phase::Completed) {
            let Some((plan, number)) = &m.wave else { continue };
            let wave =
                plans.entry((m.namespace.clone(), plan.clone())).or_default().entry(*number).or_default();
            if matches!(m.phase, Phase::Failed | Phase::ManualInterventionRequired) {
                wave.held.push(format!("{} ({})", m.name, m.phase));
            }
        }
        WaveIndex { plans }
    }

    /// The wave gate: every migration of an earlier wave of the same plan, in
    /// the same namespace, must have Completed.
    pub(crate) fn gate(&self, me: &Member) -> Option<Wait> {
        let (plan, number) = me.wave.as_ref()?;
        let waves = self.plans.get(&(me.namespace.clone(), plan.clone()))?;
        let earlier: Vec<(&i32, &WaveState)> = waves.range(..*number).collect();
        let (first, _) = earlier.first()?;
        let mut held: Vec<String> = earlier.iter().flat_map(|(_, w)| w.held.iter().cloned()).collect();
        if !held.is_empty() {
            held.sort();
            return Some(Wait::new(
                Reason::WaveHeld,
                format!(
                    "plan {plan:?} wave {number} is held: an earlier wave needs a person: {}; retry or fix it, or remove its manifest",
                    list(&held)
                ),
            ));
        }
        // Names the earliest open wave only: the message stays the same while
        // that wave drains, so a waiting migration's status is not rewritten
        // at every completion in it (STATUS.md shows each one's phase).
        Some(Wait::new(
            Reason::WaitingForWave,
            format!("plan {plan:?} wave {number} waits for every migration of wave {first} to complete"),
        ))
    }
}

fn list(names: &[String]) -> String {
    const SHOWN: usize = 5;
    let mut text = names.iter().take(SHOWN).cloned().collect::<Vec<_>>().join(", ");
    if names.len() > SHOWN {
        text.push_str(&format!(" and {} more", names.len() - SHOWN));
    }
    text
}

/// The cutover gate. Open once the source's power-off was asked for or seen
/// (the irreversible step happened), else as `spec.cutover` says.
pub(crate) fn cutover_gate(
    spec: &VirtualMachineMigrationSpec,
    status: &VirtualMachineMigrationStatus,
    now: Timestamp,
    approved_by_annotation: bool,
) -> Result<Option<Wait>, Failure> {
    if status.timestamps.shutdown_requested.is_some() || status.timestamps.source_powered_off.is_some() {
        return Ok(None);
    }
    match spec.cutover.mode {
        CutoverMode::Now => Ok(None),
        CutoverMode::Approval if spec.cutover.approved || approved_by_annotation => Ok(None),
        CutoverMode::Approval => Ok(Some(Wait::new(
            Reason::WaitingForApproval,
            format!(
                "the cutover waits for approval: merge `spec.cutover.approved: true`, or annotate the migration with {}=\"true\"",
                crate::api::APPROVE_CUTOVER_ANNOTATION
            ),
        ))),
        CutoverMode::Window => {
            let Some(window) = &spec.cutover.window else {
                return Err(invalid_window("mode Window needs cutover.window"));
            };
            let (start, end) = window_bounds(window).map_err(|e| invalid_window(&e))?;
            let shown = format!("{} to {} {}", window.start, window.end, window.time_zone);
            if now < start {
                let mut wait = Wait::new(
                    Reason::WaitingForWindow,
                    format!("the cutover waits for its window {shown} (opens in {})", span(now, start)),
                );
                wait.until = Some(start);
                Ok(Some(wait))
            } else if now >= end {
                Ok(Some(Wait::new(
                    Reason::CutoverWindowClosed,
                    format!(
                        "the cutover window {shown} closed before the cutover could start; set a new window (nothing irreversible happened)"
                    ),
                )))
            } else {
                Ok(None)
            }
        }
    }
}

fn invalid_window(message: &str) -> Failure {
    Failure::needs_human(Reason::InvalidCutoverWindow, format!("spec.cutover.window: {message}"))
}

/// The window's start and end as instants. Errors name the field.
pub(crate) fn window_bounds(window: &CutoverWindow) -> Result<(Timestamp, Timestamp), String> {
    let zone = jiff::tz::TimeZone::get(&window.time_zone)
        .map_err(|_| format!("timeZone {:?} is not a known IANA time zone", window.time_zone))?;
    let at = |field: &str, value: &str| -> Result<Timestamp, String> {
        let local: jiff::civil::DateTime = value
            .parse()
            .map_err(|e| format!("{field} {value:?} is not a local date and time (YYYY-MM-DDTHH:MM): {e}"))?;
        zone.to_ambiguous_zoned(local)
            .compatible()
            .map(|z| z.timestamp())
            .map_err(|e| format!("{field} {value:?} does not exist in {}: {e}", window.time_zone))
    };
    let start = at("start", &window.start)?;
    let end = at("end", &window.end)?;
    if end <= start {
        return Err(format!("end {:?} is not after start {:?}", window.end, window.start));
    }
    Ok((start, end))
}

fn span(from: Timestamp, to: Timestamp) -> String {
    let secs = to.as_second().saturating_sub(from.as_second()).max(0);
    match secs {
        s if s >= 86_400 => format!("{}d{}h", s / 86_400, s % 86_400 / 3600),
        s if s >= 3600 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        s if s >= 60 => format!("{}m{:02}s", s / 60, s % 60),
        s => format!("{s}s"),
    }
}

/// The queue at one moment: who may read now and where everyone else stands.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Queue {
    /// Indexes into the members of the queued members admitted now, in order.
    pub admitted: Vec<usize>,
    /// Queued members that wait, with their wait.
    pub waiting: HashMap<usize, Wait>,
}

/// Orders the queued members fairly and admits as many as the caps allow.
///
/// Fair: a namespace with fewer reads running goes first (so one tenant's
/// thousand migrations do not starve another's ten), then the earliest
/// validated, then the name. Nobody is passed over by someone later in the
/// same order on the same host, so no migration starves: the head of a host's
/// line goes as soon as that host has room.
pub fn queue(members: &[Member], limits: &ReadCaps) -> Queue {
    let mut host_used: HashMap<&str, u32> = HashMap::new();
    let mut ns_used: HashMap<&str, u32> = HashMap::new();
    let mut cluster_used = 0u32;
    for m in members.iter().filter(|m| m.holds_slot) {
        let weight = m.disks.max(1).min(m.cap(limits));
        *host_used.entry(&m.host).or_default() += weight;
        *ns_used.entry(&m.namespace).or_default() += 1;
        cluster_used += weight;
    }
    let mut line: Vec<usize> =
        (0..members.len()).filter(|&i| members[i].queued && !members[i].holds_slot).collect();
    line.sort_by(|&a, &b| {
        let (ma, mb) = (&members[a], &members[b]);
        let ua = ns_used.get(ma.namespace.as_str()).copied().unwrap_or(0);
        let ub = ns_used.get(mb.namespace.as_str()).copied().unwrap_or(0);
        (ua, ma.queued_since, &ma.namespace, &ma.name).cmp(&(ub, mb.queued_since, &mb.namespace, &mb.name))
    });
    let mut out = Queue::default();
    let mut host_line: HashMap<&str, u32> = HashMap::new();
    let mut cluster_line = 0u32;
    for i in line {
        let m = &members[i];
        let cap = m.cap(limits);
        let weight = m.disks.max(1).min(cap);
        let used = host_used.get(m.host.as_str()).copied().unwrap_or(0);
        let host_room = used + weight <= cap;
        let cluster_room = limits.cluster.is_none_or(|c| cluster_used + weight <= c.max(weight));
        // Someone earlier on this host still waits: nobody overtakes them there.
        let host_free = host_line.get(m.host.as_str()).copied().unwrap_or(0) == 0;
        if host_room && cluster_room && host_free {
            *host_used.entry(&m.host).or_default() += weight;
            cluster_used += weight;
            out.admitted.push(i);
            continue;
        }
        let ahead = host_line.entry(&m.host).or_default();
        *ahead += 1;
        let wait = if !host_room || !host_free {
            Wait {
                reason: Reason::WaitingForHostSlot,
                message: format!(
                    "{} in line for {} ({} of {} reads in use)",
                    ordinal(*ahead),
                    m.host,
                    used,
                    cap
                ),
                until: None,
                position: Some(*ahead),
            }
        } else {
            cluster_line += 1;
            Wait {
                reason: Reason::WaitingForClusterSlot,
                message: format!(
                    "{} in line for the cluster-wide cap ({} of {} reads in use)",
                    ordinal(cluster_line),
                    cluster_used,
                    limits.cluster.unwrap_or_default()
                ),
                until: None,
                position: Some(cluster_line),
            }
        };
        out.waiting.insert(i, wait);
    }
    out
}

/// `1st`, `2nd`, `3rd`, `4th`, `11th`, `21st`.
pub(crate) fn ordinal(n: u32) -> String {
    let suffix = match (n % 10, n % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

#[cfg(test)]
mod tests;
