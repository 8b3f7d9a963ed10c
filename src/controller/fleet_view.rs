//! The fleet as the controller sees it: every migration in its watch cache,
//! plus the read slots this process has just granted and not yet seen
//! recorded. Answers `machine::fleet`'s questions for one migration (its wave,
//! its read slot) and says whom to wake when a slot or a wave opens.
//!
//! Only the leader reconciles, so the grants live in memory: after a restart
//! the holders are read back from the phases (Preparing, or Retryable on its
//! way back to Preparing), and a grant not yet recorded is simply asked again.

use crate::api::{Phase, Reason, VirtualMachineMigration, VirtualMachineMigrationStatus, condition};
use crate::machine::fleet::{self, FleetGates, Member, ReadCaps};
use futures::channel::mpsc::{UnboundedReceiver, UnboundedSender, unbounded};
use jiff::Timestamp;
use kube::ResourceExt;
use kube::api::DynamicObject;
use kube::core::ApiResource;
use kube::runtime::reflector::{ObjectRef, Store};
use serde_json::Value;
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a granted slot counts before the grant shows in the status.
const GRANT_TTL: Duration = Duration::from_secs(120);

/// `(namespace, name)`.
type Key = (String, String);

/// A status this process wrote: its resourceVersion and how the queue reads it.
type Recorded = (String, Member);

/// The fleet view of one controller process.
pub(crate) struct Fleet {
    limits: ReadCaps,
    resource: ApiResource,
    store: OnceLock<Store<DynamicObject>>,
    grants: Mutex<HashMap<(String, String), Instant>>,
    /// What this process last recorded for each migration, with the
    /// resourceVersion the write produced, until the cache shows that
    /// version: a waiter woken by a write must not be judged on the state
    /// before it (the watch delivers a moment later).
    recent: Mutex<HashMap<Key, Recorded>>,
    /// The queue's view of each cached object, by uid and resourceVersion:
    /// the fleet is looked at on every phase change, objects change less.
    parsed: Mutex<HashMap<String, (String, Option<Member>)>>,
    /// Held from reading the fleet to recording a grant: reconciles of
    /// different migrations run at once, and two must not take one slot.
    admitting: tokio::sync::Mutex<()>,
    wake: UnboundedSender<ObjectRef<DynamicObject>>,
}

impl Fleet {
    /// The view and the stream of migrations to reconcile because a gate opened.
    pub(crate) fn new(
        limits: ReadCaps,
        resource: ApiResource,
    ) -> (Fleet, UnboundedReceiver<ObjectRef<DynamicObject>>) {
        let (wake, woken) = unbounded();
        let fleet = Fleet {
            limits,
            resource,
            store: OnceLock::new(),
            grants: Mutex::new(HashMap::new()),
            parsed: Mutex::new(HashMap::new()),
            recent: Mutex::new(HashMap::new()),
            admitting: tokio::sync::Mutex::new(()),
            wake,
        };
        (fleet, woken)
    }

    /// Wakes a migration by `(namespace, name)`: for adapters whose background work ended.
    pub(crate) fn waker(&self) -> crate::ports::Wake {
        let wake = self.wake.clone();
        let resource = self.resource.clone();
        std::sync::Arc::new(move |namespace: &str, name: &str| {
            let _ = wake.unbounded_send(ObjectRef::new_with(name, resource.clone()).within(namespace));
        })
    }

    /// The controller's watch cache, once the controller exists.
    pub(crate) fn attach(&self, store: Store<DynamicObject>) {
        let _ = self.store.set(store);
    }

    /// Every migration, with `fresh` (just read or just recorded) in place of its cached copy.
    fn members(
        &self,
        fresh: Option<(&VirtualMachineMigration, &VirtualMachineMigrationStatus)>,
    ) -> Vec<Member> {
        let fresh_key = fresh.map(|(vmm, _)| (vmm.namespace().unwrap_or_default(), vmm.name_any()));
        let objects = self.store.get().map(|store| store.state()).unwrap_or_default();
        let mut members: Vec<Member> = {
            let mut parsed = self.parsed.lock().unwrap_or_else(|e| e.into_inner());
            let mut seen = std::collections::HashSet::with_capacity(objects.len());
            let members = objects
                .iter()
                .filter_map(|obj| {
                    let uid = obj.metadata.uid.clone().unwrap_or_default();
                    let version = obj.metadata.resource_version.clone().unwrap_or_default();
                    seen.insert(uid.clone());
                    match parsed.get(&uid) {
                        Some((v, member)) if *v == version => member.clone(),
                        _ => {
                            let member = member_of(obj);
                            parsed.insert(uid, (version, member.clone()));
                            member
                        }
                    }
                })
                .filter(|m| fresh_key.as_ref().is_none_or(|(ns, name)| (&m.namespace, &m.name) != (ns, name)))
                .collect();
            parsed.retain(|uid, _| seen.contains(uid));
            members
        };
        {
            let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
            let versions: HashMap<(&str, &str), &str> = objects
                .iter()
                .map(|o| {
                    let key = (
                        o.metadata.namespace.as_deref().unwrap_or_default(),
                        o.metadata.name.as_deref().unwrap_or_default(),
                    );
                    (key, o.metadata.resource_version.as_deref().unwrap_or_default())
                })
                .collect();
            // Kept until the cache shows that very version (or the object is
            // gone): only this process writes status, so what it wrote last is
            // the newest status even when the cache falls behind for long (a
            // watch re-established late must not make a long copy's slot look
            // free).
            recent.retain(|(ns, name), (version, _)| {
                versions.get(&(ns.as_str(), name.as_str())).is_some_and(|v| v != version)
            });
            for m in &mut members {
                if let Some((_, written)) = recent.get(&(m.namespace.clone(), m.name.clone())) {
                    // The status as written; the spec (host, wave) as cached.
                    *m = Member { host: m.host.clone(), wave: m.wave.clone(), ..written.clone() };
                }
            }
        }
        if let Some((vmm, status)) = fresh
            && vmm.metadata.deletion_timestamp.is_none()
        {
            members.push(typed_member(vmm, status));
        }
        let mut grants = self.grants.lock().unwrap_or_else(|e| e.into_inner());
        grants.retain(|key, at| {
            at.elapsed() < GRANT_TTL
                && members
                    .iter()
                    .any(|m| (&m.namespace, &m.name) == (&key.0, &key.1) && m.phase == Phase::Validated)
        });
        for m in &mut members {
            if grants.contains_key(&(m.namespace.clone(), m.name.clone())) {
                m.holds_slot = true;
            }
        }
        members
    }

    /// The fleet's gates for a migration at Validated. The read slot is asked
    /// (and granted) only when nothing before it holds the cutover.
    pub(crate) async fn gates(&self, vmm: &VirtualMachineMigration, cutover_open: bool) -> FleetGates {
        let status = vmm.status.clone().unwrap_or_default();
        if status.phase != Phase::Validated {
            return FleetGates::default();
        }
        let _admitting = self.admitting.lock().await;
        let mut members = self.members(Some((vmm, &status)));
        let me = members.len() - 1;
        let wave = fleet::WaveIndex::new(&members).gate(&members[me]);
        if wave.is_some() || !cutover_open {
            return FleetGates { wave, slot: None };
        }
        if members[me].holds_slot {
            return FleetGates::default();
        }
        members[me].queued = true;
        let queue = fleet::queue(&members, &self.limits);
        tracing::debug!(
            admitted = queue.admitted.contains(&me),
            waiting = ?queue.waiting.get(&me).map(|w| &w.message),
            "asked for a read slot"
        );
        if queue.admitted.contains(&me) {
            let key = (members[me].namespace.clone(), members[me].name.clone());
            self.grants.lock().unwrap_or_else(|e| e.into_inner()).insert(key, Instant::now());
            return FleetGates::default();
        }
        FleetGates { wave: None, slot: queue.waiting.get(&me).cloned() }
    }

    /// `vmm` recorded `status` as `version`: judged so until the cache shows it.
    pub(crate) fn recorded(
        &self,
        vmm: &VirtualMachineMigration,
        status: &VirtualMachineMigrationStatus,
        version: String,
    ) {
        let member = typed_member(vmm, status);
        let key = (member.namespace.clone(), member.name.clone());
        self.recent.lock().unwrap_or_else(|e| e.into_inner()).insert(key, (version, member));
    }

    /// After `vmm` recorded `status` in another phase: wakes the waiters a
    /// freed slot or an opened wave lets go on.
    pub(crate) fn changed(&self, vmm: &VirtualMachineMigration, status: &VirtualMachineMigrationStatus) {
        let members = self.members(Some((vmm, status)));
        self.wake_waiters(&members);
    }

    /// After `vmm` was deleted.
    pub(crate) fn removed(&self, vmm: &VirtualMachineMigration) {
        let (ns, name) = (vmm.namespace().unwrap_or_default(), vmm.name_any());
        let members: Vec<Member> =
            self.members(None).into_iter().filter(|m| (&m.namespace, &m.name) != (&ns, &name)).collect();
        self.wake_waiters(&members);
    }

    fn wake_waiters(&self, members: &[Member]) {
        let queue = fleet::queue(members, &self.limits);
        let mut woken: Vec<&Member> = queue.admitted.iter().map(|&i| &members[i]).collect();
        // Waiting for a wave that is open now.
        let waves = fleet::WaveIndex::new(members);
        for m in members.iter().filter(|m| m.phase == Phase::Validated && m.waits_for_wave) {
            if waves.gate(m).is_none() {
                woken.push(m);
            }
        }
        for m in woken {
            tracing::debug!(migration = %format!("{}/{}", m.namespace, m.name), "woken: a read slot or its wave opened");
            let reference = ObjectRef::new_with(&m.name, self.resource.clone()).within(&m.namespace);
            let _ = self.wake.unbounded_send(reference);
        }
    }
}

/// The queue's view of a cached migration, read straight from its JSON.
fn member_of(obj: &DynamicObject) -> Option<Member> {
    if obj.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let spec = obj.data.get("spec")?;
    let host = spec.pointer("/source/host")?.as_str()?.to_owned();
    let wave = spec.get("wave").and_then(|w| {
        let plan = w.get("plan").and_then(Value::as_str).unwrap_or("default").to_owned();
        Some((plan, w.get("number")?.as_i64()? as i32))
    });
    let (status, disks) = match obj.data.get("status") {
        Some(s) => (
            serde_json::from_value(slim(s)).ok()?,
            s.pointer("/sourceInventory/disks").and_then(Value::as_array).map_or(0, Vec::len),
        ),
        None => (VirtualMachineMigrationStatus::default(), 0),
    };
    let own_cap = spec.pointer("/source/maxConcurrentReads").and_then(Value::as_u64).map(|n| n as u32);
    let mut member =
        member_from(obj.namespace().unwrap_or_default(), obj.name_any(), host, wave, &status, disks);
    member.own_cap = own_cap;
    Some(member)
}

/// The parts of a status the queue reads (the inventory can be large).
fn slim(status: &Value) -> Value {
    let mut out = serde_json::Map::new();
    for key in ["phase", "retry", "conditions", "waiting"] {
        if let Some(v) = status.get(key) {
            out.insert(key.to_owned(), v.clone());
        }
    }
    Value::Object(out)
}

/// The queue's view of a migration read or written by this process, with `status`.
fn typed_member(vmm: &VirtualMachineMigration, status: &VirtualMachineMigrationStatus) -> Member {
    let mut member = member_from(
        vmm.namespace().unwrap_or_default(),
        vmm.name_any(),
        vmm.spec.source.host.clone(),
        vmm.spec.wave.as_ref().map(|w| (w.plan.clone(), w.number)),
        status,
        status.source_inventory.as_ref().map_or(0, |i| i.disks.len()),
    );
    member.own_cap = vmm.spec.source.max_concurrent_reads.map(|n| n.max(1) as u32);
    member
}

fn member_from(
    namespace: String,
    name: String,
    host: String,
    wave: Option<(String, i32)>,
    status: &VirtualMachineMigrationStatus,
    disks: usize,
) -> Member {
    let validated = status.conditions.iter().find(|c| c.type_ == condition::VALIDATED);
    let queued_since = validated.map(|c| c.last_transition_time.0).unwrap_or(Timestamp::MAX);
    let slot_wait = status.waiting.as_ref().is_none_or(|w| {
        w.reason == Reason::WaitingForHostSlot.as_str() || w.reason == Reason::WaitingForClusterSlot.as_str()
    });
    Member {
        namespace,
        name,
        host,
        wave,
        phase: status.phase,
        disks: (disks as u32).max(1),
        holds_slot: fleet::holds_slot_in(status),
        queued: status.phase == Phase::Validated
            && crate::machine::conditions::is_true(status, condition::VALIDATED)
            && slot_wait,
        queued_since,
        waits_for_wave: status.waiting.as_ref().is_some_and(|w| {
            w.reason == Reason::WaitingForWave.as_str() || w.reason == Reason::WaveHeld.as_str()
        }),
        own_cap: None,
    }
}
