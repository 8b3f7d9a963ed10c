//! The real `DiskStore`: disks copied from ESXi hosts into a local store,
//! one background task per disk (and per warm delta copy), at most one task
//! per key, each woken migration told when its copy ends.

use super::copy::{self, CopyError, CopyPlan, CopyResult};
use super::hosts::EsxiHosts;
use crate::api::Reason;
use crate::api::{SourceDisk, VirtualMachineMigration};
use crate::machine::{CopyState, Failure};
use crate::metrics::Metrics;
use crate::ports::DiskStore;
use crate::ports::workdir::{copy_path, migration_copies_dir};
use async_trait::async_trait;
use kube::ResourceExt;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

pub(super) struct CopyTask {
    pub(super) progress: Arc<AtomicU64>,
    pub(super) total: u64,
    /// Set when the copy has its result, just before the controller is
    /// woken: the task may not have returned yet when it looks.
    pub(super) ended: Arc<std::sync::atomic::AtomicBool>,
    pub(super) handle: tokio::task::JoinHandle<Result<CopyResult, CopyError>>,
}

/// What the copy table holds under a key: a start under way, or its task.
pub(super) enum CopyEntry {
    /// Reserved by a start before its first `.await` (the session, the
    /// disk chains) and until it spawns: another start of the key is a
    /// no-op, and the start spawns only if its `token` is still here (a
    /// discard in between wins).
    Starting {
        token: u64,
    },
    Running(CopyTask),
}

/// A key of the copy table held by one start until it spawns its task.
/// Dropped without spawning (a failure, a call cancelled by its timeout),
/// it frees the key.
pub(super) struct Reservation<'a> {
    source: &'a EsxiDiskStore,
    key: (String, usize),
    token: u64,
}

impl Reservation<'_> {
    fn holds(&self, copies: &HashMap<(String, usize), CopyEntry>) -> bool {
        matches!(copies.get(&self.key), Some(CopyEntry::Starting { token }) if *token == self.token)
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let mut copies = self.source.copies();
        if self.holds(&copies) {
            copies.remove(&self.key);
        }
    }
}

/// Settings of the disk store.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    pub root: PathBuf,
    pub streams: usize,
    pub chunk_size: u64,
    /// Where finished copy runs count their bytes.
    pub metrics: Arc<Metrics>,
}

/// The local store of disks copied from ESXi hosts.
pub struct EsxiDiskStore {
    /// The hosts the copies read from.
    pub(super) hosts: Arc<EsxiHosts>,
    pub(super) config: StoreConfig,
    /// One entry per disk copy (and per delta copy) started or being started:
    /// at most one task per key.
    pub(super) copies: Mutex<HashMap<(String, usize), CopyEntry>>,
    /// Tokens of [`Reservation`]s.
    next_token: AtomicU64,
    /// Told when a copy ends.
    pub(super) wake: std::sync::OnceLock<crate::ports::Wake>,
}

impl Drop for EsxiDiskStore {
    /// Copies belong to the controller process: they stop with it (and resume
    /// from their sidecar in the next one).
    fn drop(&mut self) {
        for entry in self.copies().values() {
            if let CopyEntry::Running(task) = entry {
                task.handle.abort();
            }
        }
    }
}

impl EsxiDiskStore {
    pub fn new(hosts: Arc<EsxiHosts>, config: StoreConfig) -> EsxiDiskStore {
        EsxiDiskStore {
            hosts,
            config,
            copies: Mutex::new(HashMap::new()),
            next_token: AtomicU64::new(0),
            wake: std::sync::OnceLock::new(),
        }
    }

    /// The copy table, also after a panic elsewhere held it: a poisoned
    /// table read as empty would let every start spawn another task.
    pub(super) fn copies(&self) -> MutexGuard<'_, HashMap<(String, usize), CopyEntry>> {
        self.copies.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Reserves `key` for a start, before anything is awaited; `None` when
    /// a start or a task holds it already (the caller then does nothing).
    /// Checked and reserved under one lock: two starts of one key cannot
    /// both pass, however long the first waits for its session.
    pub(super) fn reserve(&self, key: (String, usize)) -> Option<Reservation<'_>> {
        let mut copies = self.copies();
        if copies.contains_key(&key) {
            return None;
        }
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        copies.insert(key.clone(), CopyEntry::Starting { token });
        Some(Reservation { source: self, key, token })
    }

    pub(super) fn local_path(&self, vmm: &VirtualMachineMigration, disk: usize) -> PathBuf {
        copy_path(&self.config.root, vmm, disk)
    }

    fn migration_dir(&self, vmm: &VirtualMachineMigration) -> PathBuf {
        migration_copies_dir(&self.config.root, vmm)
    }

    /// The state of the task under `key` while it runs, and once it ended
    /// its failure (reported once: the entry goes; what it left is discarded
    /// only when `may_discard`); `None` when the files must speak.
    pub(super) async fn task_state(
        &self,
        key: &(String, usize),
        what: &str,
        may_discard: bool,
    ) -> Option<CopyState> {
        let finished = {
            let mut copies = self.copies();
            match copies.get(key) {
                // Being started (another call waits for its session): no other start.
                Some(CopyEntry::Starting { .. }) => {
                    return Some(CopyState::InProgress { bytes_done: 0, bytes_total: 0 });
                }
                Some(CopyEntry::Running(task))
                    if !task.handle.is_finished() && !task.ended.load(Ordering::Acquire) =>
                {
                    return Some(CopyState::InProgress {
                        bytes_done: task.progress.load(Ordering::Relaxed) as i64,
                        bytes_total: task.total as i64,
                    });
                }
                Some(CopyEntry::Running(_)) => match copies.remove(key) {
                    Some(CopyEntry::Running(task)) => Some(task),
                    _ => None,
                },
                None => None,
            }
        }?;
        match finished.handle.await {
            Ok(Err(err)) => {
                let (failure, discard) = err.failure();
                Some(CopyState::Failed { failure, discard: discard && may_discard })
            }
            Err(join) if join.is_panic() => Some(CopyState::Failed {
                failure: Failure::retryable(Reason::CopyTaskPanicked, format!("{what} panicked")),
                discard: may_discard,
            }),
            _ => None,
        }
    }

    pub(super) fn disk_of(vmm: &VirtualMachineMigration, disk: usize) -> Option<SourceDisk> {
        vmm.status.as_ref()?.source_inventory.as_ref()?.disks.get(disk).cloned()
    }

    pub(super) fn task_key(vmm: &VirtualMachineMigration, disk: usize) -> (String, usize) {
        (vmm.metadata.uid.clone().unwrap_or_default(), disk)
    }

    /// Runs a copy (`run`, given its progress counter) in the background
    /// under the key `reservation` holds: its bytes are counted when it ends
    /// (`bytes_read` excludes what a resume skipped), then it is marked ended
    /// and its migration woken. Nothing runs if the reservation was taken
    /// away meanwhile (the copy was discarded or its migration removed).
    pub(super) fn spawn_copy<F>(
        &self,
        vmm: &VirtualMachineMigration,
        reservation: Reservation<'_>,
        total: u64,
        run: impl FnOnce(Arc<AtomicU64>) -> F,
    ) where
        F: std::future::Future<Output = Result<CopyResult, CopyError>> + Send + 'static,
    {
        let mut copies = self.copies();
        if !reservation.holds(&copies) {
            tracing::info!(key = ?reservation.key, "the copy was discarded while it started; not started");
            return;
        }
        let progress = Arc::new(AtomicU64::new(0));
        let copying = run(progress.clone());
        let metrics = self.config.metrics.clone();
        let wake = self.wake.get().cloned();
        let (namespace, name) = (vmm.metadata.namespace.clone().unwrap_or_default(), vmm.name_any());
        let ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let task_ended = ended.clone();
        let handle = tokio::spawn(async move {
            let result = copying.await;
            if let Ok(done) = &result {
                metrics.copied_bytes(done.bytes_read);
            }
            task_ended.store(true, Ordering::Release);
            if let Some(wake) = wake {
                wake(&namespace, &name);
            }
            result
        });
        // In place of the reservation, under the same lock: nobody sees the key free.
        copies
            .insert(reservation.key.clone(), CopyEntry::Running(CopyTask { progress, total, ended, handle }));
        // The table's lock goes before the reservation (whose drop takes it; it keeps the task).
        drop(copies);
        drop(reservation);
    }
}

/// The key of a disk's warm delta task in the copy table: apart from its base copy.
pub(super) fn delta_key_uid(uid: &str) -> String {
    format!("{uid}/delta")
}

#[async_trait]
impl DiskStore for EsxiDiskStore {
    fn notify_on_finish(&self, wake: crate::ports::Wake) {
        let _ = self.wake.set(wake);
    }

    async fn copy_state(&self, vmm: &VirtualMachineMigration, disk: usize) -> CopyState {
        if let Some(state) = self.task_state(&Self::task_key(vmm, disk), "the copy task", true).await {
            return state;
        }
        let local = self.local_path(vmm, disk);
        if let Some(m) = copy::is_complete(&local) {
            return CopyState::Complete {
                size: m.size as i64,
                sha256: m.sha256,
                verified_remotely: m.verified,
                epoch: m.epoch,
                source: m.source,
            };
        }
        let present = copy::bytes_present(&local);
        let total = Self::disk_of(vmm, disk).map(|d| d.capacity_bytes).unwrap_or(0);
        if present > 0 {
            CopyState::Partial { bytes_done: present as i64, bytes_total: total }
        } else {
            CopyState::Absent
        }
    }

    async fn start_copy(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        // Reserved before the first `.await` (the session): a second start
        // while this one connects finds the key taken and does nothing,
        // instead of passing the same check and spawning a second copy.
        let Some(reservation) = self.reserve(Self::task_key(vmm, disk)) else {
            return Ok(());
        };
        let local = self.local_path(vmm, disk);
        if copy::is_complete(&local).is_some() {
            return Ok(());
        }
        let source = Self::disk_of(vmm, disk).ok_or_else(|| {
            Failure::retryable(Reason::InventoryMissing, format!("no disk {disk} in the inventory"))
        })?;
        let session = self.hosts.session(vmm).await?;
        let plan = CopyPlan {
            chunk_size: self.config.chunk_size,
            streams: self.config.streams,
            epoch: vmm.status.as_ref().map_or(0, |s| s.epoch),
            ..CopyPlan::new(source.extent_path.clone(), local)
        };
        let total = source.capacity_bytes.max(0) as u64;
        self.spawn_copy(vmm, reservation, total, move |progress| async move {
            copy::copy_disk(session, &plan, progress).await
        });
        Ok(())
    }

    async fn delta_state(&self, vmm: &VirtualMachineMigration, disk: usize) -> CopyState {
        self.warm_delta_state(vmm, disk).await
    }

    async fn start_delta_copy(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        self.warm_start_delta_copy(vmm, disk).await
    }

    async fn patch(&self, vmm: &VirtualMachineMigration, disk: usize) -> Option<crate::api::DiskPatch> {
        super::snapshot::read_patch(&self.local_path(vmm, disk))
    }

    async fn discard_copy(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        // A start under way loses its reservation and does not spawn.
        if let Some(CopyEntry::Running(task)) = self.copies().remove(&Self::task_key(vmm, disk)) {
            task.handle.abort();
        }
        copy::discard(&self.local_path(vmm, disk)).map_err(|e| {
            Failure::retryable(Reason::LocalDiskError, format!("removing the copy of disk {disk}: {e}"))
        })
    }

    async fn remove_all(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        let uid = vmm.metadata.uid.clone().unwrap_or_default();
        let delta_uid = delta_key_uid(&uid);
        self.copies().retain(|(u, _), entry| {
            let ours = *u == uid || *u == delta_uid;
            if ours && let CopyEntry::Running(task) = entry {
                task.handle.abort();
            }
            !ours
        });
        remove_dir(&self.migration_dir(vmm))
    }
}

fn remove_dir(dir: &Path) -> Result<(), Failure> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Failure::retryable(Reason::LocalDiskError, format!("removing {}: {e}", dir.display()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::SourceInventory;
    use crate::api::VirtualMachineMigrationStatus;
    use crate::source::esxi::hosts::CredentialSource;
    use crate::source::esxi::ssh::{Credentials, Secret};
    use std::time::Duration;

    /// A migration of one 2 GiB disk on a "host" at `port`.
    fn vmm(port: u16) -> VirtualMachineMigration {
        let mut vmm: VirtualMachineMigration = serde_json::from_value(serde_json::json!({
            "apiVersion": "migration.platform.example/v1alpha1",
            "kind": "VirtualMachineMigration",
            "metadata": { "name": "web", "namespace": "apps", "uid": "u-1" },
            "spec": {
                "source": { "host": "127.0.0.1", "port": port, "hostKey": format!("SHA256:{}", "A".repeat(43)),
                            "credentialsSecretRef": { "name": "esxi-cred" }, "vm": { "name": "web" } },
                "destination": { "namespace": "apps", "storageClassName": "fast" },
            },
        }))
        .unwrap();
        vmm.status = Some(VirtualMachineMigrationStatus {
            source_inventory: Some(SourceInventory {
                disks: vec![SourceDisk {
                    index: 0,
                    extent_path: "/vmfs/volumes/ds1/web/web-flat.vmdk".into(),
                    capacity_bytes: 2 << 30,
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        });
        vmm
    }

    /// The report: two `dd skip=0` of one extent in the same second. Two
    /// calls to start one disk's copy (a worker pod answers calls at once;
    /// two controller replicas during a handover) both passed the check
    /// while the first waited for its SSH session, and both spawned a copy
    /// the moment it was there. The second must find the key taken.
    #[tokio::test]
    async fn a_second_start_while_the_first_connects_starts_nothing() {
        // A "host" that accepts and never says a word: the first start waits in its session.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (accepted_tx, mut accepted) = tokio::sync::mpsc::unbounded_channel();
        let host = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                held.push(socket);
                let _ = accepted_tx.send(());
            }
        });
        let work = tempfile::tempdir().unwrap();
        let source = Arc::new(source_in(work.path()));
        let vmm = vmm(port);
        let first = tokio::spawn({
            let (source, vmm) = (source.clone(), vmm.clone());
            async move { source.start_copy(&vmm, 0).await }
        });
        tokio::time::timeout(Duration::from_secs(10), accepted.recv())
            .await
            .expect("the first start connects");

        let second = tokio::time::timeout(Duration::from_secs(3), source.start_copy(&vmm, 0)).await;
        assert!(
            matches!(second, Ok(Ok(()))),
            "a second start of a disk being started returns at once, starting nothing: {second:?}"
        );
        assert!(
            matches!(source.copy_state(&vmm, 0).await, CopyState::InProgress { .. }),
            "a copy being started is in progress: nobody asks for it again"
        );
        assert_eq!(source.copies().len(), 1);
        assert!(accepted.try_recv().is_err(), "one connection: the second start did not go to the host");

        // A start that never got its session (cancelled here, as by its call's
        // timeout) frees the key: the next start may go.
        first.abort();
        let _ = first.await;
        assert!(source.copies().is_empty(), "the reservation goes with its start");
        assert_eq!(source.copy_state(&vmm, 0).await, CopyState::Absent);
        host.abort();
    }

    /// A store in `root` with a password that no host checks.
    fn source_in(root: &std::path::Path) -> EsxiDiskStore {
        let credentials = Credentials { username: "root".into(), secret: Secret::Password("pw".into()) };
        let store = StoreConfig {
            root: root.to_path_buf(),
            streams: 1,
            chunk_size: copy::DEFAULT_CHUNK_SIZE,
            metrics: Arc::new(Metrics::new()),
        };
        EsxiDiskStore::new(Arc::new(EsxiHosts::new(CredentialSource::Fixed(credentials))), store)
    }

    /// A discard while a start waits for its session wins: the start spawns nothing.
    #[tokio::test]
    async fn a_start_whose_reservation_was_discarded_spawns_nothing() {
        let work = tempfile::tempdir().unwrap();
        let source = source_in(work.path());
        let vmm = vmm(22);
        let key = EsxiDiskStore::task_key(&vmm, 0);
        let reservation = source.reserve(key.clone()).expect("a free key");
        assert!(source.reserve(key.clone()).is_none(), "one start at a time");
        source.discard_copy(&vmm, 0).await.unwrap();
        let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = ran.clone();
        source.spawn_copy(&vmm, reservation, 0, move |_| async move {
            flag.store(true, Ordering::SeqCst);
            Err(CopyError::Stat("never".into()))
        });
        tokio::task::yield_now().await;
        assert!(!ran.load(Ordering::SeqCst), "a discarded start spawns nothing");
        assert!(source.copies().is_empty());
    }
}
