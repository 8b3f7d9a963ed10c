//! Faults injected into the real parts while a migration runs, each in the
//! middle of the step it hurts: the emulated host's sshd restarted with its
//! sessions, refusing logins past `MaxStartups`, a connection blackholed by
//! a proxy; the work directory's file system full; the real kube-apiserver
//! stopped for a minute and for five; etcd compacted and restarted, so
//! watches get 410 Gone.
//!
//! Every case ends the same way, and checks it the same way
//! ([`Migration::assert_survived`]): Completed, the source powered off once
//! and every power call recorded, the imported bytes the source's at its
//! power-off, one conversion Job and one DataVolume per disk.
//!
//! The control-plane cases run on a cluster no other test uses
//! (`KubeEnv::shared_faults`), one at a time (`KubeEnv::fault_turn`).

use super::*;
use crate::support::fault_proxy::{FaultProxy, Mode};
use crate::support::full_fs::SmallFs;
use crate::support::kube_env::Component;

/// Slow enough that a fault lands mid-copy: db-02's 48 MiB take ~12 s.
const SLOW_READS: u64 = 4 << 20;

impl Migration {
    /// Waits until the host has served `bytes` of disk reads since the
    /// power-off (the copy is under way).
    async fn wait_copying(&self, bytes: u64) {
        let deadline = Instant::now() + WAIT;
        loop {
            let served: u64 =
                self.emu.disk_reads_after_power_off(self.vmid).iter().map(|r| r.delivered).sum();
            if served >= bytes {
                return;
            }
            assert!(Instant::now() < deadline, "the copy never started: {:#?}", self.get().await.status);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// What every fault case must end with.
    async fn assert_survived(&self) -> vmmigrate::api::VirtualMachineMigrationStatus {
        let done = self.wait_completed().await.status.unwrap();
        self.assert_source_off_and_untouched().await;
        let at_power_off = self.source_sha256_at_start();
        let recorded: Vec<String> = done.disks.iter().map(|d| d.source_sha256.clone().unwrap()).collect();
        assert_eq!(recorded, at_power_off, "recorded: the disks at the power-off");
        assert_eq!(self.imported_sha256(2).await, at_power_off, "imported: the disks at the power-off");
        assert_eq!(self.dvs_seen.lock().unwrap().len(), 2, "one DataVolume per disk, ever");
        eprintln!("{}: survived; errors on the way: {:#?}", self.ns, reasons(&done));
        done
    }
}

/// The reasons of `status.errors`, for messages.
fn reasons(status: &vmmigrate::api::VirtualMachineMigrationStatus) -> Vec<String> {
    status.errors.iter().map(|e| format!("{}: {}", e.reason, e.message)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sshd_restarted_mid_copy_with_its_sessions_ends_in_the_same_bytes_without_spending_the_budget() {
    let m = Migration::new("e2e-sshd-restart").await;
    m.emu.set_read_rate(Some(SLOW_READS));
    m.create(|body| body["spec"]["strategy"]["retryLimit"] = json!(1)).await;
    m.wait_copying(4 << 20).await;
    // Twice: once early, once with the first copy's resume under way.
    m.emu.restart_sshd_dropping_sessions().expect("restart sshd");
    m.wait_copying(12 << 20).await;
    m.emu.restart_sshd_dropping_sessions().expect("restart sshd");
    m.emu.set_read_rate(None);
    let done = m.assert_survived().await;
    assert!(!done.errors.is_empty(), "the restarts were felt");
    assert!(done.retry.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_host_refusing_logins_past_max_startups_mid_copy_is_waited_out() {
    let m = Migration::new("e2e-maxstartups").await;
    m.emu.set_read_rate(Some(SLOW_READS));
    m.create(|body| body["spec"]["strategy"]["retryLimit"] = json!(1)).await;
    m.wait_copying(4 << 20).await;
    // sshd restarts with MaxStartups 2 (the controller's sessions end), and
    // another tool takes both places with logins it never finishes: every
    // new login is dropped before the banner.
    m.emu.set_max_startups(Some(2)).expect("MaxStartups 2");
    let held: Vec<std::net::TcpStream> = (0..2)
        .map(|_| {
            let stream = std::net::TcpStream::connect(("127.0.0.1", m.emu.port)).expect("connect");
            let mut banner = [0u8; 8];
            std::io::Read::read_exact(&mut &stream, &mut banner).expect("the banner");
            stream
        })
        .collect();
    let deadline = Instant::now() + WAIT;
    while m.emu.dropped_for_max_startups() < 3 {
        assert!(Instant::now() < deadline, "sshd never dropped a login: {}", m.emu.sshd_log_tail());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let refused_phase = phase_of(&m.get().await);
    assert!(
        !matches!(refused_phase, Phase::Failed | Phase::ManualInterventionRequired),
        "refused logins stop nothing: {refused_phase}"
    );
    drop(held);
    m.emu.set_max_startups(None).expect("MaxStartups back");
    m.emu.set_read_rate(None);
    m.assert_survived().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_connection_blackholed_mid_copy_times_out_and_the_copy_resumes_once_the_path_is_back() {
    let m = Migration::new("e2e-blackhole").await;
    let proxy = FaultProxy::start(([127, 0, 0, 1], m.emu.port).into()).expect("proxy");
    m.emu.set_read_rate(Some(SLOW_READS));
    m.create(|body| {
        body["spec"]["source"]["port"] = json!(proxy.port);
        body["spec"]["strategy"]["retryLimit"] = json!(1);
        body["spec"]["strategy"]["timeouts"]["sshSeconds"] = json!(5);
    })
    .await;
    m.wait_copying(4 << 20).await;
    // Packets vanish both ways; connections stay open, new ones go nowhere.
    proxy.set_mode(Mode::Blackhole);
    let deadline = Instant::now() + WAIT;
    loop {
        let status = m.get().await.status.unwrap_or_default();
        if !status.errors.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "a blackholed copy was never noticed: {:#?}", reasons(&status));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The route comes back; the old connections are gone for good (reset).
    proxy.cut_all();
    proxy.set_mode(Mode::Pass);
    m.emu.set_read_rate(None);
    m.assert_survived().await;
    assert!(proxy.stalled_ms() > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_work_directory_that_fills_mid_copy_waits_for_room_and_resumes_the_partial_copy() {
    let fs = SmallFs::new(256).expect("a small file system");
    let env = tokio::task::block_in_place(KubeEnv::shared);
    fs.share_with(env.node.as_ref().expect("the shared cluster has a node")).expect("shared with the node");
    let m = Migration::start(
        "e2e-enospc",
        Setup { work_dir: Some(fs.path().to_path_buf()), ..Default::default() },
    )
    .await;
    // Room for 20 of the first disk's 32 MiB.
    fs.fill_leaving(20 << 20).expect("fill");
    m.create(|body| body["spec"]["strategy"]["retryLimit"] = json!(1)).await;
    let full = m
        .wait_for("WorkDirectoryFull", |v| {
            v.status.as_ref().is_some_and(|s| s.errors.iter().any(|e| e.reason == "WorkDirectoryFull"))
        })
        .await;
    let uid = full.uid().unwrap();
    let kept = m.leftovers(&uid);
    assert!(
        kept.iter().any(|p| p.to_string_lossy().ends_with(".progress.json")),
        "the partial copy and its progress are kept: {kept:?}"
    );
    let served_before = m.emu.bytes_served();
    // A person (or another migration's cleanup) makes room.
    fs.empty().expect("empty");
    let done = m.assert_survived().await;
    let error = done.errors.iter().find(|e| e.reason == "WorkDirectoryFull").unwrap();
    assert!(error.message.contains("No space left on device"), "{}", error.message);
    // Resumed, not started over: the whole 48 MiB are not read twice.
    let read_again = m.emu.bytes_served() - served_before;
    assert!(read_again < 48 << 20, "{read_again} bytes read after the room came back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_work_directory_that_fills_mid_conversion_waits_for_room_and_converts_again() {
    let fs = SmallFs::new(256).expect("a small file system");
    let env = tokio::task::block_in_place(KubeEnv::shared);
    fs.share_with(env.node.as_ref().expect("the shared cluster has a node")).expect("shared with the node");
    let m = Migration::start(
        "e2e-enospc-conv",
        Setup { work_dir: Some(fs.path().to_path_buf()), ..Default::default() },
    )
    .await;
    // The conversion Jobs wait for their work volume's claim (`work_volume`).
    m.create(|body| {
        body["spec"]["conversion"] = json!({"format": "qcow2", "runner": "job"});
        body["spec"]["strategy"]["retryLimit"] = json!(1);
    })
    .await;
    m.wait_for("Converting", |v| phase_of(v) == Phase::Converting).await;
    // The copies are done (48 MiB); the artifacts get 4 MiB of room.
    fs.fill_leaving(4 << 20).expect("fill");
    create_work_claim(&m.client, &m.ns).await;
    m.wait_for("WorkDirectoryFull", |v| {
        v.status.as_ref().is_some_and(|s| s.errors.iter().any(|e| e.reason == "WorkDirectoryFull"))
    })
    .await;
    fs.empty().expect("empty");
    let done = m.assert_survived().await;
    let full = done.errors.iter().find(|e| e.reason == "WorkDirectoryFull").unwrap();
    assert_eq!(full.phase, Phase::Converting, "{}", full.message);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_api_server_stopped_for_a_minute_mid_copy_leaves_the_copy_running_and_the_migration_completes() {
    let _turn = KubeEnv::fault_turn().await;
    let env = tokio::task::block_in_place(KubeEnv::shared_faults);
    let m = Migration::start("e2e-api-copy", Setup { fault_cluster: true, ..Default::default() }).await;
    // Slow: the copy outlasts the outage's start (each 16 MiB read ~30 s).
    m.emu.set_read_rate(Some(512 << 10));
    m.create(|_| {}).await;
    m.wait_copying(1).await;
    let served_at_stop = m.emu.bytes_served();
    tokio::task::block_in_place(|| env.kill(Component::ApiServer)).expect("stop the API server");
    let outage = Instant::now();
    while outage.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let served_in_outage = m.emu.bytes_served() - served_at_stop;
    m.emu.set_read_rate(None);
    tokio::task::block_in_place(|| env.start_again(Component::ApiServer)).expect("start the API server");
    m.assert_survived().await;
    assert!(served_in_outage > 0, "the copy stopped with the API server");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_api_server_stopped_for_five_minutes_mid_import_is_waited_out_and_imports_once() {
    let _turn = KubeEnv::fault_turn().await;
    let env = tokio::task::block_in_place(KubeEnv::shared_faults);
    let m =
        Migration::start("e2e-api-import", Setup { fault_cluster: true, front: true, ..Default::default() })
            .await;
    m.create(|_| {}).await;
    // Real importer pods run and fail against the closed front, again and again.
    m.importing_with_both_data_volumes().await;
    tokio::task::block_in_place(|| env.kill(Component::ApiServer)).expect("stop the API server");
    let outage = Instant::now();
    // The staging server opens while the API server is down: the kubelet
    // restarts the importers, which download without the API server.
    m.front.as_ref().unwrap().open();
    while outage.elapsed() < Duration::from_secs(300) {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    tokio::task::block_in_place(|| env.start_again(Component::ApiServer)).expect("start the API server");
    m.assert_survived().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_compacted_and_the_control_plane_restarted_mid_copy_answers_old_watches_410_and_the_migration_completes()
 {
    let _turn = KubeEnv::fault_turn().await;
    let env = tokio::task::block_in_place(KubeEnv::shared_faults);
    let m = Migration::start("e2e-etcd", Setup { fault_cluster: true, ..Default::default() }).await;
    m.emu.set_read_rate(Some(SLOW_READS));
    m.create(|_| {}).await;
    m.wait_copying(4 << 20).await;
    let old = m.get().await.metadata.resource_version.unwrap();
    // The controller's status writes move the history on before the compaction.
    m.wait_for("a newer status", |v| v.metadata.resource_version.as_deref() != Some(old.as_str())).await;
    // The control plane's machine restarts after a compaction: etcd comes
    // back with its history compacted, the API server with an empty watch
    // cache, and every watch resumed from before is answered 410 Gone.
    tokio::task::block_in_place(|| {
        env.compact_etcd()?;
        env.kill(Component::ApiServer)?;
        env.stop(Component::Etcd)?;
        env.start_again(Component::Etcd)?;
        env.start_again(Component::ApiServer)
    })
    .expect("compact etcd and restart the control plane");
    // A watch from before the compaction is answered 410 Gone (once the
    // API server reaches etcd again; until then it answers 5xx).
    let params = kube::api::WatchParams::default();
    let deadline = Instant::now() + WAIT;
    loop {
        use futures::StreamExt;
        let answer = match m.api.watch(&params, &old).await {
            Ok(stream) => stream.boxed().next().await,
            Err(e) => Some(Err(e)),
        };
        let code = match &answer {
            Some(Ok(kube::core::WatchEvent::Error(e))) => Some(e.code),
            Some(Err(kube::Error::Api(e))) => Some(e.code),
            _ => None,
        };
        if code == Some(410) {
            break;
        }
        assert!(Instant::now() < deadline, "no 410 Gone for a watch from before the compaction: {answer:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    m.emu.set_read_rate(None);
    m.assert_survived().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_kubelet_stopped_mid_import_and_started_again_leaves_one_import_per_disk() {
    let _turn = KubeEnv::fault_turn().await;
    let env = tokio::task::block_in_place(KubeEnv::shared_faults);
    let m = Migration::start("e2e-kubelet", Setup { fault_cluster: true, front: true, ..Default::default() })
        .await;
    m.create(|_| {}).await;
    m.importing_with_both_data_volumes().await;
    tokio::task::block_in_place(|| env.stop(Component::Kubelet)).expect("stop the kubelet");
    // The staging server opens while nobody on the node watches its pods.
    m.front.as_ref().unwrap().open();
    let outage = Instant::now();
    while outage.elapsed() < Duration::from_secs(20) {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    tokio::task::block_in_place(|| env.start_again(Component::Kubelet)).expect("start the kubelet");
    m.assert_survived().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_power_cycled_with_importer_pods_running_imports_once_per_disk() {
    let _turn = KubeEnv::fault_turn().await;
    let env = tokio::task::block_in_place(KubeEnv::shared_faults);
    let m = Migration::start(
        "e2e-reboot-import",
        Setup { fault_cluster: true, front: true, ..Default::default() },
    )
    .await;
    m.create(|_| {}).await;
    m.importing_with_both_data_volumes().await;
    tokio::task::block_in_place(|| env.power_cycle_node()).expect("power-cycle the node");
    m.front.as_ref().unwrap().open();
    m.assert_survived().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_power_cycled_mid_copy_by_worker_pods_ends_in_the_same_bytes() {
    let _turn = KubeEnv::fault_turn().await;
    let env = tokio::task::block_in_place(KubeEnv::shared_faults);
    let setup = Setup { fault_cluster: true, data_plane: DataPlane::Pods, ..Default::default() };
    let m = Migration::start("e2e-reboot-workers", setup).await;
    m.emu.set_read_rate(Some(SLOW_READS));
    m.create(|_| {}).await;
    m.wait_copying(4 << 20).await;
    tokio::task::block_in_place(|| env.power_cycle_node()).expect("power-cycle the node");
    m.emu.set_read_rate(None);
    m.assert_survived().await;
}
