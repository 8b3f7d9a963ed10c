//! Leader election on a `coordination.k8s.io/v1` Lease, the way client-go's
//! `leaderelection` does it, so that of several controller replicas exactly
//! one reconciles at a time.
//!
//! - A candidate reads the Lease and `decide`s (pure, time is an input):
//!   create it, renew it, take it over once it has expired (or its holder
//!   released it), or wait.
//! - Expiry is measured on the candidate's own monotonic clock, never by
//!   comparing another node's `renewTime` with the local wall clock (client-go's
//!   rule): the candidate remembers the record it last read (holder, times,
//!   duration, transitions: an `Observation`) and when it first read it, and the
//!   Lease is expired only once `leaseDurationSeconds` has passed locally
//!   without the record changing. Any change (a renewal, a new holder) starts
//!   the wait again. A replica whose clock runs ahead therefore cannot take a
//!   live Lease early, and one whose clock runs behind does not wait for ever.
//!   Only clock rates matter, not offsets. A released Lease (no holder) is
//!   taken at once. Wall-clock times are still written into
//!   `renewTime`/`acquireTime`, for people and for other tools.
//! - Every write is a `replace` carrying the resourceVersion that was read, so
//!   of two candidates acting on the same read only one write succeeds (409 for
//!   the other): two candidates cannot both win. It also means a takeover only
//!   succeeds on the record as it stands, so the observer has seen the holder's
//!   latest renewal before the wait that lets it take over began.
//! - The leader renews every `retry_period`. If no renewal succeeds within
//!   `renew_deadline` (another holder, API unreachable), the work is cancelled
//!   and `run` returns `LostLease`. `renew_deadline < lease_duration` is what
//!   makes that safe: the work stops before anybody else may take the Lease,
//!   as long as the nodes' clocks run at about the same rate.
//! - The fence (`LeaderElector::holds_lease_now`, `LeaderElector::fence`) is
//!   open only while this process leads and its last successful renewal
//!   started less than `renew_deadline` ago on its monotonic clock. Noticing a
//!   lost Lease and cancelling the work takes a moment; the fence closes at the
//!   deadline itself. The reconciler asks it right before an irreversible
//!   action (a power-off, a delete) and skips the action when it is closed. A
//!   successor's wait starts no earlier than that renewal did and lasts
//!   `lease_duration`, so the gap `lease_duration - renew_deadline` absorbs
//!   clock-rate drift and the time between the check and the action.
//! - On shutdown the work is cancelled first, then the Lease is released
//!   (holder cleared), so a successor takes over at its next retry instead of
//!   waiting for the Lease to expire.

use crate::metrics::Metrics;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, PostParams};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::time::Instant;

/// Which Lease, who we are, and the timing (client-go's names and defaults).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    /// Unique per process (see `unique_identity`): two processes with one
    /// identity would both believe they lead.
    pub identity: String,
    /// How long others wait after the last renewal before taking over.
    pub lease_duration: Duration,
    /// How long the leader keeps trying to renew before it gives up and stops working.
    pub renew_deadline: Duration,
    /// Interval between renewals, and between attempts to acquire.
    pub retry_period: Duration,
}

impl LeaseConfig {
    /// client-go's defaults: a 15 s lease, a 10 s renew deadline, a 2 s retry period.
    pub fn new(namespace: impl Into<String>, name: impl Into<String>, identity: impl Into<String>) -> Self {
        LeaseConfig {
            namespace: namespace.into(),
            name: name.into(),
            identity: identity.into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }

    /// A lease of `seconds`, with the renew deadline and retry period in
    /// client-go's default proportions (15 : 10 : 2).
    pub(crate) fn with_lease_seconds(mut self, seconds: u64) -> Self {
        self.lease_duration = Duration::from_secs(seconds.max(1));
        self.renew_deadline = self.lease_duration * 2 / 3;
        self.retry_period = self.lease_duration * 2 / 15;
        self
    }

    fn validate(&self) -> Result<(), LeaderError> {
        let invalid = |why: &str| Err(LeaderError::InvalidConfig(why.to_owned()));
        if self.identity.is_empty() {
            return invalid("the identity is empty");
        }
        if self.lease_duration.as_secs() < 1 || self.lease_duration.subsec_nanos() != 0 {
            // leaseDurationSeconds is whole seconds; anything else would be rounded on the wire.
            return invalid("the lease duration must be a whole number of seconds, at least 1");
        }
        if self.renew_deadline >= self.lease_duration {
            return invalid("the renew deadline must be shorter than the lease duration");
        }
        if self.retry_period.is_zero() || self.retry_period >= self.renew_deadline {
            return invalid("the retry period must be positive and shorter than the renew deadline");
        }
        Ok(())
    }

    fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    fn lease_seconds(&self) -> i32 {
        i32::try_from(self.lease_duration.as_secs()).unwrap_or(i32::MAX)
    }
}

/// `<instance>_<random>`: the pod name for people, a suffix so a restarted
/// process never mistakes its predecessor's lease for its own.
pub(crate) fn unique_identity(instance: &str) -> String {
    use std::hash::{BuildHasher, RandomState};
    let salt = RandomState::new().hash_one((std::process::id(), Timestamp::now().as_nanosecond()));
    format!("{instance}_{:08x}", salt as u32)
}

/// Why leadership ended other than by shutdown.
#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    /// Terminal for this process: exit and let the Deployment restart it.
    #[error("lost the lease {lease}: {detail}")]
    LostLease { lease: String, detail: String },
    /// Needs a human: the settings cannot give a safe election.
    #[error("invalid leader election settings: {0}")]
    InvalidConfig(String),
}

impl LeaderError {
    /// Stable reason for logs and metrics.
    pub fn reason(&self) -> crate::api::Reason {
        match self {
            LeaderError::LostLease { .. } => crate::api::Reason::LostLease,
            LeaderError::InvalidConfig(_) => crate::api::Reason::InvalidLeaderElectionConfig,
        }
    }
}

/// What a candidate does with the Lease it read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// There is no Lease: create it, holding it.
    Create,
    /// We hold it: write a new renewTime.
    Renew,
    /// Released or expired: take it, one more transition.
    TakeOver,
    /// Someone else holds it: expired after this much more of the local
    /// clock, unless its record changes first.
    Wait(Duration),
}

/// The Lease record a candidate last read and the local instant it first read
/// it (client-go's observedRecord and observedTime). A record is the whole
/// spec, as client-go compares the whole raw record: metadata-only writes
/// (labels, resourceVersion) are no renewal.
#[derive(Clone, Debug, Default)]
pub(crate) struct Observation {
    last: Option<(Option<LeaseSpec>, Instant)>,
}

impl Observation {
    /// Notes the Lease as read at `now` (local monotonic clock) and returns
    /// since when this same record has been seen unchanged.
    pub(crate) fn see(&mut self, lease: Option<&Lease>, now: Instant) -> Instant {
        let record = lease.and_then(|l| l.spec.as_ref());
        match &self.last {
            Some((seen, since)) if seen.as_ref() == record => *since,
            _ => {
                self.last = Some((record.cloned(), now));
                now
            }
        }
    }
}

/// The next step for candidate `me` given the Lease as read at `now`, a record
/// this candidate has seen unchanged `since` (both on its monotonic clock; see
/// `Observation`). The times written in the Lease decide nothing: they come
/// from another node's wall clock.
pub(crate) fn decide(lease: Option<&Lease>, me: &str, since: Instant, now: Instant) -> Action {
    let Some(lease) = lease else { return Action::Create };
    let spec = lease.spec.as_ref();
    match spec.and_then(|s| s.holder_identity.as_deref()).filter(|h| !h.is_empty()) {
        None => Action::TakeOver,
        Some(holder) if holder == me => Action::Renew,
        Some(_) => {
            // A holder that never recorded a renewal or a duration promised nothing.
            let Some(promised) = spec.and_then(promised) else { return Action::TakeOver };
            match promised.saturating_sub(now.saturating_duration_since(since)) {
                left if left.is_zero() => Action::TakeOver,
                left => Action::Wait(left),
            }
        }
    }
}

/// How long the holder promised to keep renewing: `leaseDurationSeconds`,
/// provided it recorded a renewal (`renewTime`, else `acquireTime`) at all.
fn promised(spec: &LeaseSpec) -> Option<Duration> {
    spec.renew_time.as_ref().or(spec.acquire_time.as_ref())?;
    // A negative duration promised nothing, like a zero one.
    Some(Duration::from_secs(u64::try_from(spec.lease_duration_seconds?).unwrap_or(0)))
}

/// When this process last renewed the Lease, on its monotonic clock: the state
/// behind the fence (`LeaderElector::holds_lease_now`).
#[derive(Debug)]
struct LeaseHold {
    renew_deadline: Duration,
    /// When the last successful renewal (or the acquisition) started; `None`
    /// while not leading.
    renewed: Mutex<Option<Instant>>,
}

impl LeaseHold {
    fn new(renew_deadline: Duration) -> Self {
        LeaseHold { renew_deadline, renewed: Mutex::new(None) }
    }

    /// A renewal (or the acquisition) that started `at` succeeded.
    fn renewed(&self, at: Instant) {
        *self.slot() = Some(at);
    }

    /// Leadership ended.
    fn lost(&self) {
        *self.slot() = None;
    }

    /// Whether the last renewal started less than `renew_deadline` before `now`.
    fn holds(&self, now: Instant) -> bool {
        self.slot().is_some_and(|at| now.saturating_duration_since(at) < self.renew_deadline)
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        // The value is a plain Instant: a panic elsewhere cannot leave it half-written.
        self.renewed.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The spec to write for `action` (`None` for `Wait`).
fn claimed(
    old: Option<&LeaseSpec>,
    action: &Action,
    me: &str,
    seconds: i32,
    now: Timestamp,
) -> Option<LeaseSpec> {
    let mut spec = old.cloned().unwrap_or_default();
    let now = Some(MicroTime(now));
    match action {
        Action::Wait(_) => return None,
        Action::Create => {
            spec.acquire_time = now.clone();
            spec.lease_transitions = Some(0);
        }
        Action::TakeOver => {
            spec.acquire_time = now.clone();
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0).saturating_add(1));
        }
        Action::Renew => {
            if spec.acquire_time.is_none() {
                spec.acquire_time = now.clone();
            }
        }
    }
    spec.holder_identity = Some(me.to_owned());
    spec.lease_duration_seconds = Some(seconds);
    spec.renew_time = now;
    Some(spec)
}

/// The Lease given up: no holder, and a one-second duration for candidates
/// that only look at expiry (what client-go writes on release).
fn released(old: &LeaseSpec, now: Timestamp) -> LeaseSpec {
    LeaseSpec {
        holder_identity: None,
        lease_duration_seconds: Some(1),
        acquire_time: Some(MicroTime(now)),
        renew_time: Some(MicroTime(now)),
        ..old.clone()
    }
}

fn holder(lease: Option<&Lease>) -> Option<String> {
    lease?.spec.as_ref()?.holder_identity.clone().filter(|h| !h.is_empty())
}

/// One renewal attempt's outcome.
enum Renewal {
    Renewed,
    /// Someone else holds the Lease (or it is gone): leadership is over.
    Lost(Option<String>),
    /// The write did not happen (conflict, API error, timeout); try again.
    Failed(String),
}

/// Runs work only while this process holds the Lease. Cheap to clone; clones
/// share the leadership flag and the fence.
#[derive(Clone)]
pub struct LeaderElector {
    api: Api<Lease>,
    config: Arc<LeaseConfig>,
    leader: Arc<AtomicBool>,
    hold: Arc<LeaseHold>,
    metrics: Arc<Metrics>,
}

impl LeaderElector {
    pub fn new(client: Client, config: LeaseConfig) -> Self {
        LeaderElector {
            api: Api::namespaced(client, &config.namespace),
            hold: Arc::new(LeaseHold::new(config.renew_deadline)),
            config: Arc::new(config),
            leader: Arc::new(AtomicBool::new(false)),
            metrics: Arc::default(),
        }
    }

    /// Reports leadership as `vmmigrate_leader` in `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// Whether this process holds the Lease now (for /readyz and metrics).
    pub fn is_leader(&self) -> bool {
        self.leader.load(Ordering::SeqCst)
    }

    /// The fence for irreversible actions: true only while this process leads
    /// and its last successful renewal started less than `renew_deadline` ago
    /// on the local monotonic clock. It closes at the deadline itself, before
    /// `run` has noticed the loss and cancelled the work, and well before a
    /// successor may take over (`lease_duration` after that renewal at the
    /// earliest). The reconciler asks it right before a power-off or a
    /// destructive action, and leaves the action for the next reconcile (of
    /// this leader or its successor) when it is closed.
    pub(crate) fn holds_lease_now(&self) -> bool {
        self.is_leader() && self.hold.holds(Instant::now())
    }

    /// `holds_lease_now` as a closure, for code that must not depend on the
    /// elector (the reconciler asks it right before a power-off or a
    /// destructive action).
    pub fn fence(&self) -> Arc<dyn Fn() -> bool + Send + Sync> {
        let elector = self.clone();
        Arc::new(move || elector.holds_lease_now())
    }

    /// Leading, with the Lease acquired by an attempt that started `at`.
    fn lead(&self, at: Instant) {
        self.hold.renewed(at);
        self.leader.store(true, Ordering::SeqCst);
        self.metrics.set_leader(true);
    }

    /// Leading no more; the fence closes first.
    fn step_down(&self) {
        self.hold.lost();
        self.leader.store(false, Ordering::SeqCst);
        self.metrics.set_leader(false);
    }

    pub fn config(&self) -> &LeaseConfig {
        &self.config
    }

    /// Waits until this process holds the Lease, then runs `work` while
    /// renewing every `retry_period`.
    ///
    /// - `shutdown` resolves: `work` is dropped (cancelled), the Lease is
    ///   released so a successor takes over at once, and `Ok` is returned
    ///   (also when `shutdown` comes before leadership did).
    /// - `work` ends on its own: the Lease is released, `Ok`.
    /// - No renewal succeeds within `renew_deadline`, or another holder shows
    ///   up: `work` is dropped and `Err(LostLease)` is returned. The caller
    ///   must then exit and let the Deployment restart it: dropping the future
    ///   does not stop what it spawned (disk copies, conversions, child
    ///   processes; kube-runtime's reconcile tasks stop only at their next
    ///   await), and none of that in-process state may outlive leadership.
    ///   A fresh process starts from what the API server recorded.
    ///
    /// Cancelling `work` at any await is what a crash does to the reconciler,
    /// which records before it advances and survives exactly that.
    pub async fn run<F: Future<Output = ()>>(
        &self,
        work: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), LeaderError> {
        self.config.validate()?;
        let mut shutdown = std::pin::pin!(shutdown);
        let mut renewed_at = tokio::select! {
            biased;
            () = &mut shutdown => {
                tracing::info!(lease = %self.config.key(), identity = %self.config.identity, "shutdown before acquiring the lease");
                return Ok(());
            }
            at = self.acquire() => at,
        };
        self.lead(renewed_at);
        // Boxed so it can be dropped, and its work cancelled, before the release.
        let mut work = Box::pin(work);
        loop {
            tokio::select! {
                biased;
                () = &mut shutdown => {
                    self.step_down();
                    drop(work);
                    self.release().await;
                    return Ok(());
                }
                () = &mut work => {
                    tracing::info!(lease = %self.config.key(), identity = %self.config.identity, "work finished; releasing the lease");
                    self.step_down();
                    self.release().await;
                    return Ok(());
                }
                renewal = self.keep(renewed_at) => match renewal {
                    Ok(at) => {
                        renewed_at = at;
                        self.hold.renewed(at);
                    }
                    Err(err) => {
                        self.step_down();
                        drop(work);
                        tracing::error!(lease = %self.config.key(), identity = %self.config.identity, reason = err.reason().as_str(), "{err}; work stopped");
                        return Err(err);
                    }
                },
            }
        }
    }

    /// Tries until the Lease is ours; returns when the successful attempt started.
    async fn acquire(&self) -> Instant {
        let cfg = &*self.config;
        let mut last_holder: Option<String> = None;
        let mut observation = Observation::default();
        loop {
            let started = Instant::now();
            let mut pause = cfg.retry_period;
            match self.bounded(self.api.get_opt(&cfg.name)).await {
                Err(err) => {
                    tracing::warn!(lease = %cfg.key(), identity = %cfg.identity, "cannot read the lease: {}", describe(err))
                }
                Ok(lease) => match self.judge(&mut observation, lease.as_ref()) {
                    Action::Wait(left) => {
                        let holder = holder(lease.as_ref());
                        if holder != last_holder {
                            tracing::info!(lease = %cfg.key(), identity = %cfg.identity, holder = ?holder, ?left, "lease held by another instance; waiting");
                            last_holder = holder;
                        }
                        // Wake at expiry if that comes before the next retry.
                        pause = pause.min(left.max(Duration::from_millis(10)));
                    }
                    action => {
                        let previous = holder(lease.as_ref());
                        match self.write(lease, &action, Timestamp::now(), true).await {
                            Ok(lease) => {
                                let transitions = lease.spec.and_then(|s| s.lease_transitions);
                                tracing::info!(lease = %cfg.key(), identity = %cfg.identity, previous = ?previous, ?action, ?transitions, "acquired the lease; now leading");
                                return started;
                            }
                            // Another candidate wrote first: read again at once.
                            Err(Some(err)) if is_conflict(&err) => {
                                tracing::debug!(lease = %cfg.key(), identity = %cfg.identity, "lost the race for the lease: {err}");
                                continue;
                            }
                            Err(err) => {
                                tracing::warn!(lease = %cfg.key(), identity = %cfg.identity, ?action, "cannot claim the lease: {}", describe(err))
                            }
                        }
                    }
                },
            }
            tokio::time::sleep(pause).await;
        }
    }

    /// `decide` on a Lease just read. The record counts as seen when the read
    /// returned, not when it was sent: a renewal written while the request was
    /// in flight must not have its wait start before it was written.
    fn judge(&self, observation: &mut Observation, lease: Option<&Lease>) -> Action {
        let read = Instant::now();
        decide(lease, &self.config.identity, observation.see(lease, read), read)
    }

    /// Renews every retry period until a renewal succeeds (returns when it
    /// started) or `renew_deadline` after `renewed_at` passes.
    async fn keep(&self, renewed_at: Instant) -> Result<Instant, LeaderError> {
        let cfg = &*self.config;
        let deadline = renewed_at + cfg.renew_deadline;
        let mut last_failure = String::from("no attempt finished");
        loop {
            tokio::time::sleep_until((Instant::now() + cfg.retry_period).min(deadline)).await;
            let started = Instant::now();
            if started >= deadline {
                return Err(self.lost(format!("not renewed within {:?}: {last_failure}", cfg.renew_deadline)));
            }
            let attempt = tokio::time::timeout(deadline - started, self.renew_once());
            match attempt.await {
                Ok(Renewal::Renewed) => {
                    tracing::debug!(lease = %cfg.key(), identity = %cfg.identity, "renewed the lease");
                    return Ok(started);
                }
                Ok(Renewal::Lost(holder)) => {
                    let who = holder.unwrap_or_else(|| "nobody (deleted or released)".into());
                    return Err(self.lost(format!("now held by {who}")));
                }
                Ok(Renewal::Failed(why)) => {
                    tracing::warn!(lease = %cfg.key(), identity = %cfg.identity, "cannot renew the lease: {why}");
                    last_failure = why;
                }
                Err(_) => last_failure = "the API server did not answer".into(),
            }
        }
    }

    async fn renew_once(&self) -> Renewal {
        let cfg = &*self.config;
        let now = Timestamp::now();
        let lease = match self.api.get_opt(&cfg.name).await {
            Ok(lease) => lease,
            Err(err) => return Renewal::Failed(format!("reading: {err}")),
        };
        let holder = holder(lease.as_ref());
        if holder.as_deref() != Some(cfg.identity.as_str()) {
            return Renewal::Lost(holder);
        }
        match self.write(lease, &Action::Renew, now, false).await {
            Ok(_) => Renewal::Renewed,
            Err(err) => Renewal::Failed(describe(err)),
        }
    }

    /// Creates or replaces the Lease for `action`. Replacing sends the
    /// resourceVersion that was read: a concurrent writer makes this fail with
    /// 409 instead of both succeeding. `Err(None)`: the call timed out.
    async fn write(
        &self,
        lease: Option<Lease>,
        action: &Action,
        now: Timestamp,
        acquiring: bool,
    ) -> Result<Lease, Option<kube::Error>> {
        let cfg = &*self.config;
        let Some(mut spec) = claimed(
            lease.as_ref().and_then(|l| l.spec.as_ref()),
            action,
            &cfg.identity,
            cfg.lease_seconds(),
            now,
        ) else {
            return Err(None);
        };
        if acquiring && *action == Action::Renew {
            // Our identity, but not this process's leadership: it starts now.
            spec.acquire_time = Some(MicroTime(now));
        }
        let pp = PostParams::default();
        match lease {
            None => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(cfg.name.clone()),
                        namespace: Some(cfg.namespace.clone()),
                        ..ObjectMeta::default()
                    },
                    spec: Some(spec),
                };
                self.bounded(self.api.create(&pp, &lease)).await
            }
            Some(mut lease) => {
                lease.spec = Some(spec);
                self.bounded(self.api.replace(&cfg.name, &pp, &lease)).await
            }
        }
    }

    /// Clears the holder if it is still us; failures only mean a successor
    /// waits for expiry.
    async fn release(&self) {
        let cfg = &*self.config;
        let result = async {
            let Some(mut lease) = self.bounded(self.api.get_opt(&cfg.name)).await? else {
                return Ok(false);
            };
            if holder(Some(&lease)).as_deref() != Some(cfg.identity.as_str()) {
                return Ok(false);
            }
            lease.spec = Some(released(&lease.spec.clone().unwrap_or_default(), Timestamp::now()));
            self.bounded(self.api.replace(&cfg.name, &PostParams::default(), &lease)).await.map(|_| true)
        }
        .await;
        match result {
            Ok(true) => tracing::info!(lease = %cfg.key(), identity = %cfg.identity, "released the lease"),
            Ok(false) => {
                tracing::info!(lease = %cfg.key(), identity = %cfg.identity, "lease no longer ours; nothing to release")
            }
            Err(err) => {
                tracing::warn!(lease = %cfg.key(), identity = %cfg.identity, "cannot release the lease; it expires on its own: {}", describe(err))
            }
        }
    }

    /// Any single API call, bounded by the renew deadline.
    async fn bounded<T>(
        &self,
        call: impl Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, Option<kube::Error>> {
        match tokio::time::timeout(self.config.renew_deadline, call).await {
            Ok(result) => result.map_err(Some),
            Err(_) => Err(None),
        }
    }

    fn lost(&self, detail: String) -> LeaderError {
        LeaderError::LostLease { lease: self.config.key(), detail }
    }
}

fn is_conflict(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(s) if s.code == 409)
}

fn describe(err: Option<kube::Error>) -> String {
    match err {
        Some(err) => err.to_string(),
        None => "the API server did not answer in time".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + seconds).unwrap()
    }

    fn lease(holder: Option<&str>, renewed: Option<i64>, seconds: Option<i32>) -> Lease {
        Lease {
            metadata: ObjectMeta { name: Some("l".into()), ..ObjectMeta::default() },
            spec: Some(LeaseSpec {
                holder_identity: holder.map(str::to_owned),
                renew_time: renewed.map(|s| MicroTime(at(s))),
                acquire_time: renewed.map(|s| MicroTime(at(s))),
                lease_duration_seconds: seconds,
                lease_transitions: Some(3),
                ..LeaseSpec::default()
            }),
        }
    }

    const SECOND: Duration = Duration::from_secs(1);

    /// `decide` for candidate "a" on `lease` read at `now`, after `seen` has
    /// noted it, as `LeaderElector::judge` does.
    fn judge(seen: &mut Observation, lease: Option<&Lease>, now: Instant) -> Action {
        decide(lease, "a", seen.see(lease, now), now)
    }

    #[test]
    fn no_lease_is_created() {
        let now = Instant::now();
        assert_eq!(decide(None, "a", now, now), Action::Create);
    }

    #[test]
    fn our_own_lease_is_renewed_even_when_expired() {
        let t0 = Instant::now();
        let mine = lease(Some("a"), Some(0), Some(15));
        assert_eq!(decide(Some(&mine), "a", t0, t0 + 5 * SECOND), Action::Renew);
        assert_eq!(decide(Some(&mine), "a", t0, t0 + 500 * SECOND), Action::Renew);
    }

    #[test]
    fn a_live_lease_of_another_holder_is_waited_for_until_it_expires() {
        let (l, t0) = (lease(Some("b"), Some(0), Some(15)), Instant::now());
        assert_eq!(decide(Some(&l), "a", t0, t0), Action::Wait(15 * SECOND));
        assert_eq!(decide(Some(&l), "a", t0, t0 + 14 * SECOND), Action::Wait(SECOND));
    }

    #[test]
    fn an_expired_lease_is_taken_over_at_its_expiry_and_after() {
        let (l, t0) = (lease(Some("b"), Some(0), Some(15)), Instant::now());
        assert_eq!(decide(Some(&l), "a", t0, t0 + 15 * SECOND), Action::TakeOver);
        assert_eq!(decide(Some(&l), "a", t0, t0 + 3600 * SECOND), Action::TakeOver);
    }

    #[test]
    fn a_candidate_whose_clock_runs_ahead_does_not_take_over_a_live_lease() {
        // b renewed at its own wall-clock time at(0), 2023: by this
        // candidate's wall clock its lease ran out long ago. The record was
        // only just read, though, so the candidate waits the full duration.
        let l = lease(Some("b"), Some(0), Some(15));
        assert!(at(15) < Timestamp::now(), "the written expiry lies in the candidate's past");
        let (mut seen, t0) = (Observation::default(), Instant::now());
        assert_eq!(judge(&mut seen, Some(&l), t0), Action::Wait(15 * SECOND));
        assert_eq!(judge(&mut seen, Some(&l), t0 + 2 * SECOND), Action::Wait(13 * SECOND));
    }

    #[test]
    fn a_candidate_whose_clock_runs_behind_takes_over_a_dead_lease_after_the_duration() {
        // b's renewTime lies an hour in this candidate's future by wall clock;
        // b is dead, so the record never changes and 15 s of local time decide.
        let mut l = lease(Some("b"), Some(0), Some(15));
        let ahead = Timestamp::now().checked_add(k8s_openapi::jiff::SignedDuration::from_hours(1)).unwrap();
        l.spec.as_mut().unwrap().renew_time = Some(MicroTime(ahead));
        let (mut seen, t0) = (Observation::default(), Instant::now());
        assert_eq!(judge(&mut seen, Some(&l), t0), Action::Wait(15 * SECOND));
        assert_eq!(judge(&mut seen, Some(&l), t0 + 15 * SECOND), Action::TakeOver);
    }

    #[test]
    fn a_lease_whose_record_stops_changing_expires_after_the_duration_on_the_local_clock() {
        let l = lease(Some("b"), Some(0), Some(15));
        let (mut seen, t0) = (Observation::default(), Instant::now());
        assert_eq!(judge(&mut seen, Some(&l), t0), Action::Wait(15 * SECOND));
        // Read again and again (a fresh copy each time, as from the API): the
        // wait still counts from the first read of this record.
        for elapsed in [2, 4, 10, 14] {
            let again = lease(Some("b"), Some(0), Some(15));
            let left = (15 - elapsed) * SECOND;
            assert_eq!(judge(&mut seen, Some(&again), t0 + elapsed * SECOND), Action::Wait(left));
        }
        let just_before = t0 + 15 * SECOND - Duration::from_millis(1);
        assert_eq!(judge(&mut seen, Some(&l), just_before), Action::Wait(Duration::from_millis(1)));
        assert_eq!(judge(&mut seen, Some(&l), t0 + 15 * SECOND), Action::TakeOver);
    }

    #[test]
    fn the_observed_duration_is_the_holders_not_ours() {
        let l = lease(Some("b"), Some(0), Some(40));
        let (mut seen, t0) = (Observation::default(), Instant::now());
        assert_eq!(judge(&mut seen, Some(&l), t0), Action::Wait(40 * SECOND));
        assert_eq!(judge(&mut seen, Some(&l), t0 + 39 * SECOND), Action::Wait(SECOND));
        assert_eq!(judge(&mut seen, Some(&l), t0 + 40 * SECOND), Action::TakeOver);
    }

    #[test]
    fn a_changed_record_restarts_the_local_expiry() {
        let l = lease(Some("b"), Some(0), Some(15));
        let (mut seen, t0) = (Observation::default(), Instant::now());
        assert_eq!(judge(&mut seen, Some(&l), t0), Action::Wait(15 * SECOND));

        // b renews at t0 + 10: a new renewTime, read at once.
        let mut renewed = lease(Some("b"), Some(0), Some(15));
        renewed.spec.as_mut().unwrap().renew_time = Some(MicroTime(at(10)));
        let t1 = t0 + 10 * SECOND;
        assert_eq!(judge(&mut seen, Some(&renewed), t1), Action::Wait(15 * SECOND));
        assert_eq!(judge(&mut seen, Some(&renewed), t0 + 15 * SECOND), Action::Wait(10 * SECOND));
        assert_eq!(judge(&mut seen, Some(&renewed), t1 + 15 * SECOND), Action::TakeOver);

        // Another candidate took it over (new holder, one more transition),
        // its renewTime even older by wall clock: the wait starts again.
        let mut taken = lease(Some("c"), Some(-100), Some(15));
        taken.spec.as_mut().unwrap().lease_transitions = Some(4);
        let t2 = t1 + 20 * SECOND;
        assert_eq!(judge(&mut seen, Some(&taken), t2), Action::Wait(15 * SECOND));
        assert_eq!(judge(&mut seen, Some(&taken), t2 + 14 * SECOND), Action::Wait(SECOND));
    }

    #[test]
    fn a_write_that_changes_only_metadata_is_no_renewal() {
        let l = lease(Some("b"), Some(0), Some(15));
        let (mut seen, t0) = (Observation::default(), Instant::now());
        assert_eq!(judge(&mut seen, Some(&l), t0), Action::Wait(15 * SECOND));
        let mut relabelled = l.clone();
        relabelled.metadata.resource_version = Some("42".into());
        relabelled.metadata.labels = Some([("team".to_owned(), "x".to_owned())].into());
        assert_eq!(judge(&mut seen, Some(&relabelled), t0 + 15 * SECOND), Action::TakeOver);
    }

    #[test]
    fn a_released_lease_is_taken_at_once() {
        // Just read for the first time (no local time has passed), even right
        // after it changed from a live record.
        let t0 = Instant::now();
        for holder in [None, Some("")] {
            let mut seen = Observation::default();
            assert_eq!(
                judge(&mut seen, Some(&lease(Some("b"), Some(0), Some(15))), t0),
                Action::Wait(15 * SECOND)
            );
            let l = lease(holder, Some(0), Some(15));
            assert_eq!(judge(&mut seen, Some(&l), t0 + SECOND), Action::TakeOver, "{holder:?}");
        }
        let empty = Lease { metadata: ObjectMeta::default(), spec: None };
        assert_eq!(judge(&mut Observation::default(), Some(&empty), t0), Action::TakeOver);
    }

    #[test]
    fn a_holder_without_renewal_or_duration_promised_nothing() {
        let t0 = Instant::now();
        assert_eq!(decide(Some(&lease(Some("b"), None, Some(15))), "a", t0, t0), Action::TakeOver);
        assert_eq!(decide(Some(&lease(Some("b"), Some(0), None)), "a", t0, t0), Action::TakeOver);
    }

    #[test]
    fn an_acquire_time_stands_in_for_a_missing_renew_time() {
        let mut l = lease(Some("b"), Some(0), Some(15));
        l.spec.as_mut().unwrap().renew_time = None;
        let t0 = Instant::now();
        assert_eq!(decide(Some(&l), "a", t0, t0), Action::Wait(15 * SECOND));
    }

    #[test]
    fn claims_record_times_duration_and_transitions() {
        let old = lease(Some("b"), Some(0), Some(15)).spec.unwrap();
        let created = claimed(None, &Action::Create, "a", 3, at(20)).unwrap();
        assert_eq!(created.holder_identity.as_deref(), Some("a"));
        assert_eq!((created.lease_transitions, created.lease_duration_seconds), (Some(0), Some(3)));
        assert_eq!(created.acquire_time, Some(MicroTime(at(20))));

        let taken = claimed(Some(&old), &Action::TakeOver, "a", 3, at(20)).unwrap();
        assert_eq!(taken.lease_transitions, Some(4), "one more transition");
        assert_eq!(taken.acquire_time, Some(MicroTime(at(20))));
        assert_eq!(taken.renew_time, Some(MicroTime(at(20))));

        let mine = lease(Some("a"), Some(0), Some(15)).spec.unwrap();
        let renewed = claimed(Some(&mine), &Action::Renew, "a", 3, at(20)).unwrap();
        assert_eq!(renewed.lease_transitions, Some(3), "a renewal is no transition");
        assert_eq!(renewed.acquire_time, Some(MicroTime(at(0))), "acquired when it was");
        assert_eq!(renewed.renew_time, Some(MicroTime(at(20))));

        assert_eq!(claimed(Some(&old), &Action::Wait(15 * SECOND), "a", 3, at(1)), None);
    }

    #[test]
    fn a_released_lease_has_no_holder_and_keeps_its_transitions() {
        let mine = lease(Some("a"), Some(0), Some(15)).spec.unwrap();
        let free = released(&mine, at(7));
        assert_eq!(free.holder_identity, None);
        assert_eq!(free.lease_transitions, Some(3));
        let as_read = Lease { metadata: ObjectMeta::default(), spec: Some(free) };
        let now = Instant::now();
        assert_eq!(decide(Some(&as_read), "b", now, now), Action::TakeOver);
    }

    /// An elector whose API server is never contacted: the fence is local state.
    fn elector() -> LeaderElector {
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        LeaderElector::new(Client::try_from(config).unwrap(), LeaseConfig::new("ns", "l", "a"))
    }

    #[tokio::test(start_paused = true)]
    async fn the_fence_closes_once_the_renew_deadline_passes_without_a_renewal() {
        let elector = elector();
        let fence = elector.fence();
        assert!(!fence(), "closed before leading");
        elector.lead(Instant::now());
        assert!(fence() && elector.holds_lease_now());
        tokio::time::advance(Duration::from_millis(9_999)).await;
        assert!(fence(), "open until the 10 s renew deadline");
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(elector.is_leader(), "run has not noticed the loss yet");
        assert!(!fence() && !elector.holds_lease_now(), "closed at the renew deadline");
    }

    #[tokio::test(start_paused = true)]
    async fn a_renewal_keeps_the_fence_open_for_a_renew_deadline_from_when_it_started() {
        let elector = elector();
        let fence = elector.fence();
        let t0 = Instant::now();
        elector.lead(t0);
        tokio::time::advance(8 * SECOND).await;
        // A renewal that started at t0 + 6 s and succeeded now.
        elector.hold.renewed(t0 + 6 * SECOND);
        tokio::time::advance(7 * SECOND).await;
        assert!(fence(), "15 s after acquiring, 9 s after the renewal started");
        tokio::time::advance(SECOND).await;
        assert!(!fence(), "10 s after the renewal started, not after it succeeded");
    }

    #[tokio::test(start_paused = true)]
    async fn the_fence_closes_at_once_when_leadership_ends() {
        let elector = elector();
        let fence = elector.fence();
        elector.lead(Instant::now());
        assert!(fence());
        elector.step_down();
        assert!(!fence() && !elector.is_leader());
    }

    #[test]
    fn settings_that_allow_two_leaders_are_refused() {
        let ok = LeaseConfig::new("ns", "l", "a");
        assert!(ok.validate().is_ok());
        assert_eq!(ok.clone().with_lease_seconds(15), ok, "the defaults are the 15 s proportions");
        let bad = LeaseConfig { renew_deadline: Duration::from_secs(15), ..ok.clone() };
        assert!(matches!(bad.validate(), Err(LeaderError::InvalidConfig(_))));
        let bad = LeaseConfig { retry_period: Duration::from_secs(10), ..ok.clone() };
        assert!(bad.validate().is_err());
        let bad = LeaseConfig { lease_duration: Duration::from_millis(2500), ..ok.clone() };
        assert!(bad.validate().is_err());
        let bad = LeaseConfig { identity: String::new(), ..ok };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn identities_are_unique_per_process_start() {
        let (a, b) = (unique_identity("pod-0"), unique_identity("pod-0"));
        assert!(a.starts_with("pod-0_"), "{a}");
        assert_ne!(a, b);
    }
}
