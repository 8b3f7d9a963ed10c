//! The kube-runtime glue: watch VirtualMachineMigrations (and the
//! DataVolumes, VirtualMachines and VMIs they created), run one
//! `engine::step` per reconcile, record what changed of the status as a merge
//! patch on `/status`, publish Events, back off per object.
//!
//! Migrations are watched untyped and converted per reconcile, so one object
//! that does not deserialize is reported on itself and skipped instead of
//! breaking the watch for every other migration.

use super::engine::{self, StepInput};
use super::fleet_view::Fleet;
use crate::api::Reason;
use crate::api::labels::{MIGRATION as LABEL_MIGRATION, MIGRATION_NAMESPACE as LABEL_MIGRATION_NAMESPACE};
use crate::api::{
    APPROVE_CUTOVER_ANNOTATION, CONFIRM_ORPHAN_ANNOTATION, ORPHANED_ANNOTATION, Phase, RETRY_ANNOTATION,
    VirtualMachineMigration, VirtualMachineMigrationStatus,
};
use crate::destination::cluster::{
    FIELD_MANAGER, data_volume_resource, virtual_machine_instance_resource, virtual_machine_resource,
};
use crate::machine::tenancy::DestinationRules;
use crate::machine::{self, Action as MachineAction, EventType, Failure};
use crate::ports::Adapters;
use futures::StreamExt;
use futures::channel::mpsc::UnboundedReceiver;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams};
use kube::core::ApiResource;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType as KubeEventType, Recorder, Reporter};
use kube::runtime::finalizer::{Error as FinalizerError, Event as FinalizerEvent, finalizer};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::Instrument;

/// Finalizer that runs cleanup before a migration disappears.
pub const FINALIZER: &str = "migration.platform.example/cleanup";
/// Longest per-object backoff after reconcile errors.
pub(crate) const MAX_ERROR_BACKOFF: Duration = Duration::from_secs(300);
/// Longest backoff while the API server (or the path to it) fails: the
/// migration resumes within this of its return, whatever the outage lasted.
pub(crate) const MAX_TRANSPORT_BACKOFF: Duration = Duration::from_secs(30);

/// Asked at every checkpoint of a reconcile with the phase it started in;
/// returning true abandons the reconcile there, as if the process died.
pub type Interrupt = Arc<dyn Fn(Phase, &engine::CrashPoint) -> bool + Send + Sync>;

/// Controller settings.
#[derive(Clone, Default)]
pub struct ControllerConfig {
    /// Watch only this namespace's migrations (all when `None`).
    pub namespace: Option<String>,
    /// Upper bound on every requeue and backoff (tests shorten the machine's polls).
    pub max_requeue: Option<Duration>,
    /// Reporting instance name for Events (the pod name).
    pub instance: String,
    /// Which destination namespaces migrations of each namespace may write
    /// into (by default: only their own).
    pub destinations: DestinationRules,
    /// Crash injection for tests; `None` in production.
    pub interrupt: Option<Interrupt>,
    /// Where reconciles, migrations and readiness are recorded (the
    /// default: a registry of its own, which nobody serves).
    pub metrics: Arc<crate::metrics::Metrics>,
    /// Concurrent disk reads per ESXi host and in the cluster.
    pub limits: crate::machine::fleet::ReadCaps,
    /// Whether this process still holds the leader Lease (on its own clock),
    /// asked right before an irreversible or destructive action; `None`
    /// when it runs without leader election.
    pub lease_fence: Option<LeaseFence>,
}

/// Answers whether this process may still act as the leader.
pub(crate) type LeaseFence = Arc<dyn Fn() -> bool + Send + Sync>;

impl std::fmt::Debug for ControllerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControllerConfig")
            .field("namespace", &self.namespace)
            .field("max_requeue", &self.max_requeue)
            .field("instance", &self.instance)
            .field("destinations", &self.destinations)
            .field("limits", &self.limits)
            .field("interrupt", &self.interrupt.is_some())
            .field("lease_fence", &self.lease_fence.is_some())
            .finish()
    }
}

/// Errors of one reconcile; each has a stable reason for Events and metrics.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    #[error("Kubernetes API error while {0}: {1}")]
    Kube(&'static str, #[source] kube::Error),
    #[error("{0}")]
    Step(Failure),
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<Error>>),
}

impl Error {
    pub(crate) fn reason(&self) -> Reason {
        match self {
            Error::Kube(..) => Reason::KubeAPIError,
            Error::Step(f) => f.reason,
            // The reason of the step that failed inside the finalizer wrapper.
            Error::Finalizer(e) => match e.as_ref() {
                FinalizerError::ApplyFailed(inner) | FinalizerError::CleanupFailed(inner) => inner.reason(),
                _ => Reason::FinalizerError,
            },
        }
    }
}

/// Shared state of the controller.
pub(crate) struct Context {
    client: Client,
    adapters: Adapters,
    recorder: Recorder,
    config: ControllerConfig,
    failures: Mutex<HashMap<String, u32>>,
    /// Seeds the requeue jitter: the standard library's per-process random
    /// hasher keys, hashed with a counter (no PRNG crate needed for a spread).
    jitter_keys: std::hash::RandomState,
    jitter_draws: std::sync::atomic::AtomicU64,
    /// Waves and read slots across every migration this controller sees.
    fleet: Fleet,
    /// When this process first saw each migration's recorded
    /// `shutdownRequested` (uid, the recorded time), on its own clock.
    shutdown_seen: Mutex<HashMap<(String, String), std::time::Instant>>,
    /// Per migration (uid): since when this process has looked at it
    /// without a gap longer than [`LOOK_GAP`], and when it last looked.
    looks: Mutex<HashMap<String, (std::time::Instant, std::time::Instant)>>,
}

/// Two looks at a migration further apart than this are not one watch: the
/// time between them (an API outage, a restart, a lost lease) was not
/// watched. Longer than any requeue of a migration at work
/// (`POLL_WAITING` plus its jitter, the 30 s transport backoff).
pub(crate) const LOOK_GAP: Duration = Duration::from_secs(90);

impl Context {
    /// The context and the stream of migrations the fleet wakes.
    pub(crate) fn new(
        client: Client,
        adapters: Adapters,
        config: ControllerConfig,
    ) -> (Context, UnboundedReceiver<ObjectRef<DynamicObject>>) {
        let reporter = Reporter { controller: FIELD_MANAGER.into(), instance: Some(config.instance.clone()) };
        let (fleet, woken) = Fleet::new(config.limits.clone(), migration_resource());
        adapters.disks.notify_on_finish(fleet.waker());
        adapters.converter.notify_on_finish(fleet.waker());
        let ctx = Context {
            fleet,
            recorder: Recorder::new(client.clone(), reporter),
            client,
            adapters,
            config,
            failures: Mutex::new(HashMap::new()),
            jitter_keys: std::hash::RandomState::new(),
            jitter_draws: std::sync::atomic::AtomicU64::new(0),
            shutdown_seen: Mutex::new(HashMap::new()),
            looks: Mutex::new(HashMap::new()),
        };
        (ctx, woken)
    }

    /// Uniform in [0, 1).
    fn jitter(&self) -> f64 {
        use std::hash::BuildHasher;
        let draw = self.jitter_draws.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        (self.jitter_keys.hash_one(draw) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// How long this process has seen the shutdown request recorded in
    /// `status`, on its own clock (client-go's rule for durations that span
    /// replicas: another replica's timestamp is not compared with our clock).
    fn shutdown_seen_for(&self, vmm: &VirtualMachineMigration) -> Option<Duration> {
        let requested = vmm.status.as_ref()?.timestamps.shutdown_requested.as_ref()?;
        let key = (vmm.metadata.uid.clone().unwrap_or_default(), requested.0.to_string());
        let mut seen = self.shutdown_seen.lock().ok()?;
        // Forget requests of migrations that moved on (bounded by the fleet).
        if seen.len() > 4096 {
            seen.clear();
        }
        Some(seen.entry(key).or_insert_with(std::time::Instant::now).elapsed())
    }

    /// This look at `vmm` (read fresh): how long this process has looked at
    /// it without a gap longer than [`LOOK_GAP`], on its own clock.
    fn watched_for(&self, vmm: &VirtualMachineMigration) -> Option<Duration> {
        let uid = vmm.metadata.uid.clone()?;
        let mut looks = self.looks.lock().ok()?;
        if looks.len() > 4096 {
            looks.clear();
        }
        let now = std::time::Instant::now();
        let (since, last) = looks.entry(uid).or_insert((now, now));
        if now.duration_since(*last) > LOOK_GAP {
            *since = now;
        }
        *last = now;
        Some(now.duration_since(*since))
    }

    fn cap(&self, d: Duration) -> Duration {
        match self.config.max_requeue {
            Some(max) => d.min(max),
            None => d,
        }
    }
}

fn migration_resource() -> ApiResource {
    ApiResource::erase::<VirtualMachineMigration>(&())
}

/// Maps a DataVolume, VirtualMachine or VMI back to the migration named in its labels.
fn owner_of(obj: DynamicObject) -> Option<ObjectRef<DynamicObject>> {
    let labels = obj.labels();
    let name = labels.get(LABEL_MIGRATION)?;
    let namespace = labels.get(LABEL_MIGRATION_NAMESPACE)?;
    Some(ObjectRef::new_with(name, migration_resource()).within(namespace))
}

/// Runs the controller until `shutdown` resolves.
pub async fn run(
    client: Client,
    adapters: Adapters,
    config: ControllerConfig,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let ar = migration_resource();
    let migrations: Api<DynamicObject> = match &config.namespace {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    };
    let managed = watcher::Config::default().labels("app.kubernetes.io/managed-by=vmmigrate");
    let (ctx, woken) = Context::new(client.clone(), adapters, config);
    let ctx = Arc::new(ctx);
    // Ready once the migrations can be listed (API server reachable, CRD
    // installed, RBAC granted); not ready once this returns or is dropped.
    // Not `Store::wait_until_ready`: the store wakes only its latest waiter,
    // and the controller's own runner waits on it.
    let _ready = crate::metrics::ReadinessGuard::new(&ctx.config.metrics, "controller");
    let probe = migrations.clone();
    let metrics = ctx.config.metrics.clone();
    let ready = async move {
        let mut delay = Duration::from_millis(500);
        while let Err(err) = probe.list_metadata(&ListParams::default().limit(1)).await {
            tracing::warn!(error = %err, "cannot list migrations; not ready");
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(30));
        }
        metrics.set_ready("controller", true);
        std::future::pending::<()>().await
    };
    // The cache the controller and the fleet read: without managedFields,
    // which grow with every status write and are never read here (a
    // reconcile decides on a fresh read).
    let writer = kube::runtime::reflector::store::Writer::new(ar.clone());
    let reader = writer.as_reader();
    let watch = watcher::watcher(migrations, watcher::Config::default()).default_backoff().modify(|obj| {
        obj.managed_fields_mut().clear();
    });
    // The controller's own status writes do not trigger it again (each
    // would, and a copy's progress would loop as fast as writes go): what a
    // reconcile asks for comes from its requeue, the fleet's wakes and the
    // watched DataVolumes, VMs and VMIs. Spec, annotations (retry,
    // approval), labels, finalizers and deletion still trigger.
    let stream = kube::runtime::reflector::reflector(writer, watch)
        .applied_objects()
        .predicate_filter(trigger_fingerprint, Default::default());
    let mut controller = Controller::for_stream_with(stream, reader, ar).reconcile_on(woken);
    ctx.fleet.attach(controller.store());
    for child in [data_volume_resource(), virtual_machine_resource(), virtual_machine_instance_resource()] {
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &child);
        // A kind the cluster does not serve (CDI or KubeVirt not installed)
        // is not watched: its watch would fail forever, and kube-runtime
        // backs off every trigger of the controller with it. The migrations
        // that need it say so themselves (CDIMissing, preflight).
        if let Err(kube::Error::Api(status)) = api.list_metadata(&ListParams::default().limit(1)).await
            && status.code == 404
        {
            tracing::warn!(kind = %child.kind, group = %child.group, "not served by this cluster; not watched");
            continue;
        }
        controller = controller.watches_with(api, child, managed.clone(), owner_of);
    }
    let run = controller.graceful_shutdown_on(shutdown).run(reconcile, error_policy, ctx).for_each(
        |result| async move {
            match result {
                Ok((obj, action)) => tracing::debug!(migration = %obj, ?action, "reconciled"),
                Err(err) => tracing::warn!(error = %err, "reconcile failed"),
            }
        },
    );
    tokio::select! {
        () = run => {}
        () = ready => {}
    }
}

/// What of a migration, when it changes, asks for a reconcile: everything but
/// its status (which only the controller writes).
fn trigger_fingerprint(obj: &DynamicObject) -> Option<u64> {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    let meta = &obj.metadata;
    (meta.generation, meta.deletion_timestamp.is_some(), &meta.finalizers, &meta.annotations, &meta.labels)
        .hash(&mut hasher);
    obj.data.get("spec").map(|spec| spec.to_string()).hash(&mut hasher);
    Some(hasher.finish())
}

/// The typed migration, or why this object cannot be read.
pub(crate) fn parse(obj: &DynamicObject) -> Result<VirtualMachineMigration, serde_json::Error> {
    serde_json::to_value(obj).and_then(serde_json::from_value)
}

fn key(obj: &DynamicObject) -> String {
    format!("{}/{}", obj.namespace().unwrap_or_default(), obj.name_any())
}

async fn reconcile(obj: Arc<DynamicObject>, ctx: Arc<Context>) -> Result<Action, Error> {
    // Every log line of a reconcile carries the migration key.
    let span = tracing::info_span!("reconcile", migration = %key(&obj));
    let started = std::time::Instant::now();
    let result = reconcile_one(obj, ctx.clone()).instrument(span).await;
    let reason = result.as_ref().err().map(Error::reason);
    ctx.config.metrics.reconciled(started.elapsed(), reason.map(Reason::as_str));
    result
}

async fn reconcile_one(obj: Arc<DynamicObject>, ctx: Arc<Context>) -> Result<Action, Error> {
    let key = key(&obj);
    let vmm = match parse(&obj) {
        Ok(vmm) => vmm,
        Err(err) => {
            // Report on the object itself and wait for it to change.
            tracing::warn!(error = %err, "migration does not deserialize; skipped");
            let reference = obj.object_ref(&migration_resource());
            let event = Event {
                type_: KubeEventType::Warning,
                reason: "InvalidObject".into(),
                note: Some(format!("vmmigrate cannot read this object: {err}")),
                action: "Reconcile".into(),
                secondary: None,
            };
            let _ = ctx.recorder.publish(&event, &reference).await;
            return Ok(Action::await_change());
        }
    };
    let ns = vmm.namespace().unwrap_or_default();
    let api: Api<VirtualMachineMigration> = Api::namespaced(ctx.client.clone(), &ns);
    // Decide on a fresh read, not the watch cache: a stale status could repeat
    // a decision that was already recorded.
    let Some(fresh) =
        api.get_opt(&vmm.name_any()).await.map_err(|e| Error::Kube("reading the migration", e))?
    else {
        ctx.config.metrics.forget_migration(&ns, &vmm.name_any());
        return Ok(Action::await_change());
    };
    let result = finalizer(&api, FINALIZER, Arc::new(fresh), |event| async {
        match event {
            FinalizerEvent::Apply(vmm) => reconcile_steps(&vmm, &api, &ctx).await,
            FinalizerEvent::Cleanup(vmm) => cleanup(&vmm, &ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)));
    if result.is_ok()
        && let Ok(mut failures) = ctx.failures.lock()
    {
        failures.remove(&key);
    }
    result
}

async fn publish(ctx: &Context, vmm: &VirtualMachineMigration, events: &[machine::Event]) {
    let reference = vmm.object_ref(&());
    for ev in events {
        let event = Event {
            type_: match ev.type_ {
                EventType::Normal => KubeEventType::Normal,
                EventType::Warning => KubeEventType::Warning,
            },
            reason: ev.reason.clone(),
            note: Some(machine::capped(ev.message.clone())),
            action: "Reconcile".into(),
            secondary: None,
        };
        if let Err(err) = ctx.recorder.publish(&event, &reference).await {
            tracing::warn!(error = %err, reason = %ev.reason, "cannot publish event");
        }
    }
}

/// Most steps one reconcile takes in a row (see [`reconcile_steps`]).
const CHAINED_STEPS: usize = 8;

/// Reconciles one migration. A step that asks to look again at once (it
/// entered a phase) is followed in the same reconcile by the next, decided
/// on the object its status write returned: the API server's answer is as
/// fresh as a new read, and the migration does not wait for the queue.
async fn reconcile_steps(
    vmm: &VirtualMachineMigration,
    api: &Api<VirtualMachineMigration>,
    ctx: &Context,
) -> Result<Action, Error> {
    let mut current = std::borrow::Cow::Borrowed(vmm);
    for _ in 0..CHAINED_STEPS {
        match apply_step(&current, api, ctx).await? {
            (_, Some(written)) if written.metadata.deletion_timestamp.is_none() => {
                current = std::borrow::Cow::Owned(written);
            }
            (action, _) => return Ok(action),
        }
    }
    Ok(Action::requeue(Duration::from_millis(100)))
}

/// One step; with the written object when the next step should follow at once.
async fn apply_step(
    vmm: &VirtualMachineMigration,
    api: &Api<VirtualMachineMigration>,
    ctx: &Context,
) -> Result<(Action, Option<VirtualMachineMigration>), Error> {
    let phase = vmm.status.as_ref().map(|s| s.phase).unwrap_or_default();
    tracing::info!(phase = %phase, "reconciling");
    let retry_requested = vmm.annotations().get(RETRY_ANNOTATION).is_some_and(|v| v == "true");
    let cutover_approved = vmm.annotations().get(APPROVE_CUTOVER_ANNOTATION).is_some_and(|v| v == "true");
    let now = Timestamp::now();
    let status = vmm.status.clone().unwrap_or_default();
    // Warm and Rehearsal copy from a snapshot before any cutover: they ask
    // for a read slot at once (by the mode recorded, once there is one).
    let cutover_open = status.mode.unwrap_or(vmm.spec.mode).takes_snapshot()
        || matches!(machine::fleet::cutover_gate(&vmm.spec, &status, now, cutover_approved), Ok(None));
    let annotated = |key: &str| vmm.annotations().get(key).is_some_and(|v| v == "true");
    let fence = WriteAhead { api, vmm, lease: ctx.config.lease_fence.clone(), written: Mutex::new(None) };
    let input = StepInput {
        now,
        jitter: ctx.jitter(),
        retry_requested,
        destinations: &ctx.config.destinations,
        cutover_approved,
        fleet: ctx.fleet.gates(vmm, cutover_open).await,
        shutdown_seen_for: ctx.shutdown_seen_for(vmm),
        watched_for: ctx.watched_for(vmm),
        orphan_hold: annotated(ORPHANED_ANNOTATION) && !annotated(CONFIRM_ORPHAN_ANNOTATION),
        fence: &fence,
    };
    let interrupt = ctx.config.interrupt.clone();
    let stop = |cp: &engine::CrashPoint| interrupt.as_ref().is_some_and(|f| f(phase, cp));
    let Some(step) = engine::step(&ctx.adapters, vmm, input, stop).await else {
        // Interrupted (tests), or the fence refused: nothing was recorded.
        tracing::warn!(phase = %phase, "reconcile ended before recording");
        return Ok((Action::requeue(ctx.cap(Duration::from_secs(1))), None));
    };
    // Written ahead: the record continues from that write.
    let ahead = fence.written.lock().ok().and_then(|mut w| w.take());
    let vmm = ahead.as_ref().unwrap_or(vmm);
    let mut resource_version = vmm.resource_version();
    if step.performed.contains(&MachineAction::RemoveRetryAnnotation) {
        let patch = json!({ "metadata": { "annotations": { RETRY_ANNOTATION: null } } });
        let patched = api
            .patch(&vmm.name_any(), &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(|e| Error::Kube("removing the retry annotation", e))?;
        resource_version = patched.resource_version();
    }
    publish(ctx, vmm, &step.decision.events).await;
    let written = record(api, vmm, &step.decision.status, resource_version).await?;
    if let Some(written) = &written {
        ctx.fleet.recorded(vmm, &step.decision.status, written.resource_version().unwrap_or_default());
    }
    // Only a freed read slot or a wave that may have opened wakes anyone.
    let new = &step.decision.status;
    let freed = machine::fleet::holds_slot_in(&status) && !machine::fleet::holds_slot_in(new);
    let ended = new.phase != phase
        && matches!(new.phase, Phase::Completed | Phase::Failed | Phase::ManualInterventionRequired);
    if freed || ended {
        ctx.fleet.changed(vmm, new);
    }
    let ns = vmm.namespace().unwrap_or_default();
    ctx.config.metrics.observe_migration(&ns, &vmm.name_any(), &step.decision.status);
    if let Some((action, failure)) = &step.failed {
        tracing::warn!(?action, reason = %failure.reason, "action failed: {}", failure.message);
        if step.decision.requeue.is_none() {
            // Finishing work of a waiting or terminal phase: retry with backoff.
            return Err(Error::Step(failure.clone()));
        }
    }
    let next = written.filter(|_| step.failed.is_none() && step.decision.requeue == Some(Duration::ZERO));
    let action = match step.decision.requeue {
        Some(d) => Action::requeue(ctx.cap(d.max(Duration::from_millis(100)))),
        None => Action::await_change(),
    };
    Ok((action, next))
}

/// The controller's fence: the status a step will record, written ahead
/// with the resourceVersion the step read (a stale read fails with 409); the
/// step acts only if that write succeeded, the written object is not being
/// deleted, and the lease is still held (asked before and after the write).
struct WriteAhead<'a> {
    api: &'a Api<VirtualMachineMigration>,
    vmm: &'a VirtualMachineMigration,
    lease: Option<LeaseFence>,
    /// The object as written ahead.
    written: Mutex<Option<VirtualMachineMigration>>,
}

#[async_trait::async_trait]
impl engine::Fence for WriteAhead<'_> {
    fn leading(&self) -> Result<(), Failure> {
        match &self.lease {
            Some(holds) if !holds() => Err(Failure::retryable(
                Reason::LostLease,
                "this replica no longer holds the leader Lease: it does nothing more",
            )),
            _ => Ok(()),
        }
    }

    async fn write_ahead(&self, status: &VirtualMachineMigrationStatus) -> Result<(), Failure> {
        self.leading()?;
        let written = write_status(self.api, self.vmm, status, self.vmm.resource_version())
            .await
            .map_err(|e| Failure::retryable(Reason::KubeAPIError, format!("writing ahead: {e}")))?;
        if written.metadata.deletion_timestamp.is_some() {
            return Err(Failure::needs_human(
                Reason::PowerActionRefused,
                "the migration is being deleted: nothing irreversible is done",
            ));
        }
        self.leading()?;
        if let Ok(mut slot) = self.written.lock() {
            *slot = Some(written);
        }
        Ok(())
    }
}

/// One status write per reconcile, skipped when nothing changed: a JSON merge
/// patch of what changed since the status that was read (a removed field is
/// `null`), so the API server decodes and merges the changes, not the whole
/// status again. The resourceVersion makes a write based on a stale read
/// fail with 409, so the patch always applies to the status it was computed from.
/// Returns the object as written, `None` when nothing was.
async fn record(
    api: &Api<VirtualMachineMigration>,
    vmm: &VirtualMachineMigration,
    status: &VirtualMachineMigrationStatus,
    resource_version: Option<String>,
) -> Result<Option<VirtualMachineMigration>, Error> {
    if vmm.status.as_ref() == Some(status) {
        return Ok(None);
    }
    write_status(api, vmm, status, resource_version).await.map(Some)
}

/// The merge patch of `status` over the one `vmm` holds, guarded by
/// `resource_version`; always sent (an unchanged status still checks it).
async fn write_status(
    api: &Api<VirtualMachineMigration>,
    vmm: &VirtualMachineMigration,
    status: &VirtualMachineMigrationStatus,
    resource_version: Option<String>,
) -> Result<VirtualMachineMigration, Error> {
    let to_json =
        |s: &VirtualMachineMigrationStatus| serde_json::to_value(s).unwrap_or(serde_json::Value::Null);
    let before = vmm.status.as_ref().map(to_json).unwrap_or(serde_json::Value::Null);
    let patch = json!({
        "metadata": { "resourceVersion": resource_version },
        "status": merge_patch(&before, &to_json(status)),
    });
    let params = PatchParams { field_manager: Some(FIELD_MANAGER.into()), ..PatchParams::default() };
    api.patch_status(&vmm.name_any(), &params, &Patch::Merge(&patch))
        .await
        .map_err(|e| Error::Kube("writing status", e))
}

/// The RFC 7386 merge patch that turns `before` into `after`: changed members
/// of objects recursively, `null` for a removed member, anything else whole.
fn merge_patch(before: &serde_json::Value, after: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match (before, after) {
        (Value::Object(old), Value::Object(new)) => {
            let mut patch = serde_json::Map::new();
            for (key, value) in new {
                match old.get(key) {
                    Some(previous) if previous == value => {}
                    Some(previous) if !value.is_null() => {
                        patch.insert(key.clone(), merge_patch(previous, value));
                    }
                    // A null in `after` is an absent member; absent already needs nothing.
                    None if value.is_null() => {}
                    _ => {
                        patch.insert(key.clone(), strip_nulls(value));
                    }
                }
            }
            for key in old.keys().filter(|k| !new.contains_key(*k)) {
                patch.insert(key.clone(), Value::Null);
            }
            Value::Object(patch)
        }
        _ => strip_nulls(after),
    }
}

/// A value set whole by a merge patch: its nulls would delete, not set, so
/// members that are null are left out (an absent member reads the same).
fn strip_nulls(value: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match value {
        Value::Object(map) => Value::Object(
            map.iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.clone(), strip_nulls(v))).collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(strip_nulls).collect()),
        other => other.clone(),
    }
}

async fn cleanup(vmm: &VirtualMachineMigration, ctx: &Context) -> Result<Action, Error> {
    let pinned = vmm.pinned();
    let vmm = pinned.as_ref().unwrap_or(vmm);
    let status = vmm.status.clone().unwrap_or_default();
    let actions = engine::cleanup_actions(vmm);
    tracing::info!(phase = %status.phase, ?actions, "migration deleted; cleaning up");
    let mut left = Vec::new();
    for action in &actions {
        // As in a step: a replica that lost the lease deletes nothing (the
        // next leader cleans up).
        if let Some(holds) = &ctx.config.lease_fence
            && !holds()
        {
            return Err(Error::Step(Failure::retryable(
                Reason::LostLease,
                "this replica no longer holds the leader Lease: the next leader cleans up",
            )));
        }
        match engine::perform(&ctx.adapters, vmm, action).await {
            Ok(()) => {}
            // The source cannot be reached for good (its Secret went with the
            // namespace, the host refuses): what stays there is recorded, and
            // the migration goes; a passing failure is retried.
            Err(failure)
                if *action == MachineAction::RemoveSnapshot
                    && failure.class != machine::FailureClass::Retryable =>
            {
                left.push(snapshot_left(vmm, &failure));
                // Kept where neither the migration's deletion nor its
                // namespace's reaches, before letting go (a failure here is
                // retried): the gitops side writes it to Git.
                ctx.adapters
                    .cluster
                    .record_left_on_source(&left_record(vmm, &failure))
                    .await
                    .map_err(Error::Step)?;
            }
            Err(failure) => return Err(Error::Step(failure)),
        }
    }
    if !left.is_empty() {
        let mut status = status.clone();
        if let Some(snapshot) = status.snapshot.as_mut() {
            snapshot.left_on_source = Some(left.join("; "));
        }
        // Best effort: the status (and so Git) says what stayed, if it still can.
        let _ = record(
            &Api::namespaced(ctx.client.clone(), &vmm.namespace().unwrap_or_default()),
            vmm,
            &status,
            vmm.resource_version(),
        )
        .await;
        publish(
            ctx,
            vmm,
            &[machine::Event {
                type_: EventType::Warning,
                reason: "SnapshotLeftOnSource".into(),
                message: left.join("; "),
            }],
        )
        .await;
    }
    // The source VM is free for another migration once this one is gone.
    ctx.adapters.cluster.release_source(vmm).await.map_err(Error::Step)?;
    ctx.fleet.removed(vmm);
    let kept = if actions.contains(&MachineAction::DeleteDestination) {
        "deleted the destination objects"
    } else {
        "kept the destination objects"
    };
    let note = if status.phase == Phase::Completed { "the migrated VM stays" } else { kept };
    let source = match status.power_actions.len() {
        0 => "the source VM's power was never touched".to_owned(),
        n => format!(
            "{n} power action(s) on the source were recorded (status.powerActions); its power is left as it is"
        ),
    };
    ctx.config.metrics.forget_migration(&vmm.namespace().unwrap_or_default(), &vmm.name_any());
    publish(
        ctx,
        vmm,
        &[machine::Event {
            type_: EventType::Normal,
            reason: "CleanedUp".into(),
            message: format!("migration deleted in phase {}: {note}; {source}", status.phase),
        }],
    )
    .await;
    Ok(Action::await_change())
}

/// What a deleted migration leaves on its source: host, VM and snapshot.
fn snapshot_left(vmm: &VirtualMachineMigration, failure: &Failure) -> String {
    let vm = vmm.status.as_ref().and_then(|s| s.source_inventory.as_ref());
    format!(
        "snapshot {} of VM {} (vmid {}) on host {} is left on the source: {}",
        crate::api::snapshot_name(&vmm.name_any()),
        vm.map_or("?", |i| i.name.as_str()),
        vm.map_or("?", |i| i.vmid.as_str()),
        vmm.spec.source.host,
        failure
    )
}

/// The record of a snapshot left on the source, for the controller's namespace and Git.
fn left_record(vmm: &VirtualMachineMigration, failure: &Failure) -> crate::api::LeftOnSource {
    let vm = vmm.status.as_ref().and_then(|s| s.source_inventory.as_ref());
    crate::api::LeftOnSource {
        namespace: vmm.namespace().unwrap_or_default(),
        migration: vmm.name_any(),
        uid: vmm.uid().unwrap_or_default(),
        host: vmm.spec.source.host.clone(),
        vm: vm.map(|i| i.name.clone()).unwrap_or_default(),
        vmid: vm.map(|i| i.vmid.clone()).unwrap_or_default(),
        snapshot: crate::api::snapshot_name(&vmm.name_any()),
        reason: failure.reason.as_str().to_owned(),
        recorded: machine::api_time(Timestamp::now()).0.to_string(),
    }
}

fn error_policy(obj: Arc<DynamicObject>, err: &Error, ctx: Arc<Context>) -> Action {
    let attempts = ctx
        .failures
        .lock()
        .map(|mut f| {
            let n = f.entry(key(&obj)).or_insert(0);
            *n += 1;
            *n
        })
        .unwrap_or(1);
    let delay = error_backoff(attempts, ctx.jitter(), err.reason());
    tracing::warn!(migration = %key(&obj), reason = %err.reason(), attempts, ?delay, "reconcile error: {err}");
    Action::requeue(ctx.cap(delay))
}

/// Per-object backoff after reconcile errors: 2^attempts seconds with equal
/// jitter, capped at `MAX_ERROR_BACKOFF`, or at `MAX_TRANSPORT_BACKOFF` when
/// the API server could not be reached or answered an error.
pub(crate) fn error_backoff(attempts: u32, jitter: f64, reason: Reason) -> Duration {
    let cap = if reason.is_transport() { MAX_TRANSPORT_BACKOFF } else { MAX_ERROR_BACKOFF };
    let base = Duration::from_secs(1u64 << attempts.min(9)).min(cap);
    base.mul_f64(0.5 + jitter.clamp(0.0, 1.0) / 2.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_backoff_grows_exponentially_and_is_capped() {
        let step = Reason::SSHAuthenticationFailed;
        assert_eq!(error_backoff(1, 1.0, step), Duration::from_secs(2));
        assert_eq!(error_backoff(3, 1.0, step), Duration::from_secs(8));
        assert_eq!(error_backoff(3, 0.0, step), Duration::from_secs(4));
        assert_eq!(error_backoff(30, 1.0, step), MAX_ERROR_BACKOFF);
    }

    #[test]
    fn after_an_api_outage_of_any_length_a_migration_is_tried_again_within_thirty_seconds() {
        for reason in [Reason::APIUnavailable, Reason::KubeAPIError, Reason::Timeout, Reason::ConnectionLost]
        {
            assert_eq!(error_backoff(3, 1.0, reason), Duration::from_secs(8), "{reason}: grows as any error");
            assert_eq!(error_backoff(30, 1.0, reason), MAX_TRANSPORT_BACKOFF, "{reason}");
        }
        assert_eq!(MAX_TRANSPORT_BACKOFF, Duration::from_secs(30));
    }

    /// RFC 7386's apply, as the API server does it.
    fn apply_merge_patch(target: &mut serde_json::Value, patch: &serde_json::Value) {
        match patch {
            serde_json::Value::Object(members) => {
                if !target.is_object() {
                    *target = json!({});
                }
                let map = target.as_object_mut().unwrap();
                for (k, v) in members {
                    if v.is_null() {
                        map.remove(k);
                    } else {
                        apply_merge_patch(map.entry(k.clone()).or_insert(serde_json::Value::Null), v);
                    }
                }
            }
            other => *target = other.clone(),
        }
    }

    #[test]
    fn a_status_merge_patch_carries_only_changes_and_turns_the_old_status_into_the_new() {
        let before = json!({
            "phase": "Importing",
            "waiting": {"reason": "WaitingForHostSlot", "message": "2nd for esx-01"},
            "history": [{"phase": "Pending"}, {"phase": "Importing"}],
            "copy": {"disks": [{"bytes": 1, "sha256": null}], "total": 10},
            "same": {"deep": {"x": 1}},
        });
        let after = json!({
            "phase": "CreatingVM",
            "waiting": null,
            "history": [{"phase": "Pending"}, {"phase": "Importing"}, {"phase": "CreatingVM", "note": null}],
            "copy": {"disks": [{"bytes": 10, "sha256": "ab"}], "total": 10},
            "same": {"deep": {"x": 1}},
            "new": {"a": null, "b": 2},
        });
        let patch = merge_patch(&before, &after);
        assert_eq!(patch["waiting"], serde_json::Value::Null, "a removed member is deleted");
        assert!(patch.get("same").is_none(), "an unchanged member is not sent: {patch}");
        assert!(patch["copy"].get("total").is_none(), "only what changed inside an object: {patch}");
        assert_eq!(patch["new"], json!({"b": 2}), "a null inside a new member is left out");
        let mut applied = before.clone();
        apply_merge_patch(&mut applied, &patch);
        assert_eq!(applied, strip_nulls(&after));
        // From no status at all: the whole status without its nulls.
        let mut from_nothing = serde_json::Value::Null;
        apply_merge_patch(&mut from_nothing, &merge_patch(&serde_json::Value::Null, &after));
        assert_eq!(from_nothing, strip_nulls(&after));
    }

    #[test]
    fn an_object_that_does_not_deserialize_is_reported_not_fatal() {
        let bad: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "migration.platform.example/v1alpha1",
            "kind": "VirtualMachineMigration",
            "metadata": {"name": "broken", "namespace": "x"},
            "spec": {"source": 5}
        }))
        .unwrap();
        let err = parse(&bad).unwrap_err();
        assert!(err.to_string().contains("invalid type"), "{err}");
    }
}
