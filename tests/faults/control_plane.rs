//! Faults injected into the real control plane and node while a migration
//! runs, each in the middle of the step it hurts: kube-apiserver stopped for
//! a minute mid-copy and for five mid-import; etcd compacted and the control
//! plane restarted, so every watch resumed from before gets 410 Gone; the
//! kubelet stopped mid-import; the node power-cycled with importer pods and
//! with worker pods running; CDI redeployed mid-import.
//!
//! Each fault breaks the whole cluster, so these tests take turns
//! (`KubeEnv::fault_turn`) on this binary's own cluster, and every case ends
//! the way [`Migration::assert_survived`] checks.

use crate::support::KubeEnv;
use crate::support::migration::*;
use std::time::{Duration, Instant};
use vmmigrate::controller::service::DataPlane;
use vmmigrate_harness::kube_env::Component;

impl Migration {
    /// Waits until real CDI's importer pods are running and have asked the
    /// closed staging front for the disks `times` times (mid-import).
    pub(crate) async fn wait_importers_refused(&self, times: usize) {
        self.importing_with_both_data_volumes().await;
        let front = self.front.as_ref().expect("a test with a front");
        let deadline = Instant::now() + WAIT;
        while front.refused() < times {
            assert!(Instant::now() < deadline, "the importers never asked: {:#?}", self.get().await.status);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// This test's turn, the cluster, and db-02's migration caught mid-import:
/// real importer pods running and failing against the closed staging front
/// (`Migration::front`), which the test opens when it wants the imports to
/// go through.
async fn mid_import(prefix: &str) -> (tokio::sync::MutexGuard<'static, ()>, &'static KubeEnv, Migration) {
    let turn = KubeEnv::fault_turn().await;
    let env = tokio::task::block_in_place(KubeEnv::shared);
    let m = Migration::start(prefix, Setup { front: true, ..Default::default() }).await;
    m.create(|_| {}).await;
    m.wait_importers_refused(2).await;
    (turn, env, m)
}

/// The kubelet's longest wait before it restarts a container that keeps
/// exiting (CrashLoopBackOff's cap).
const KUBELET_BACKOFF_CAP: Duration = Duration::from_secs(300);

/// The fault lasts `length`, counted from now.
async fn outage(length: Duration) {
    let started = Instant::now();
    while started.elapsed() < length {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_api_server_stopped_for_a_minute_mid_copy_leaves_the_copy_running_and_the_migration_completes() {
    let _turn = KubeEnv::fault_turn().await;
    let env = tokio::task::block_in_place(KubeEnv::shared);
    let m = Migration::start("e2e-api-copy", Setup::default()).await;
    // Slow: the copy (three 16 MiB reads at once, 32 s) outlasts the
    // outage's start and ends inside it.
    m.emu.set_read_rate(Some(512 << 10));
    m.create(|_| {}).await;
    m.wait_copying(2 << 20).await;
    let served_at_stop = m.emu.bytes_served();
    tokio::task::block_in_place(|| env.kill(Component::ApiServer)).expect("stop the API server");
    outage(Duration::from_secs(60)).await;
    let served_in_outage = m.emu.bytes_served() - served_at_stop;
    m.emu.set_read_rate(None);
    tokio::task::block_in_place(|| env.start_again(Component::ApiServer)).expect("start the API server");
    m.assert_survived().await;
    assert!(served_in_outage > 0, "the copy stopped with the API server");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_api_server_stopped_for_five_minutes_mid_import_is_waited_out_and_imports_once_or_again_after_a_stall()
 {
    let (_turn, env, m) = mid_import("e2e-api-import").await;
    tokio::task::block_in_place(|| env.kill(Component::ApiServer)).expect("stop the API server");
    // The staging server opens while the API server is down: the kubelet
    // restarts the importers, which download without the API server.
    m.front.as_ref().unwrap().open();
    outage(Duration::from_secs(300)).await;
    tokio::task::block_in_place(|| env.start_again(Component::ApiServer)).expect("start the API server");
    // An outage this long takes the kubelet's crash back-off of the pods
    // that exit without the API server (CDI's controllers among them, once
    // they lose their leader lease) to its 5-minute cap: they may take that
    // long to run again after it returns. The outage and that back-off can
    // outlast `importStallSeconds` (600 s) of unchanged progress: then the
    // imports are given up on once (`ImportStalled`) and made again.
    m.assert_survived_with(WAIT + KUBELET_BACKOFF_CAP, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_compacted_and_the_control_plane_restarted_mid_copy_answers_old_watches_410_and_the_migration_completes()
 {
    let _turn = KubeEnv::fault_turn().await;
    let env = tokio::task::block_in_place(KubeEnv::shared);
    let m = Migration::start("e2e-etcd", Setup::default()).await;
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
async fn the_kubelet_stopped_and_containerd_crashed_mid_import_then_started_again_leave_one_import_per_disk()
{
    let (_turn, env, m) = mid_import("e2e-kubelet").await;
    tokio::task::block_in_place(|| {
        env.stop(Component::Kubelet)?;
        // containerd dies under it; the containers' shims live on.
        env.kill(Component::Containerd)
    })
    .expect("stop the kubelet and kill containerd");
    // The staging server opens while nobody on the node watches its pods.
    m.front.as_ref().unwrap().open();
    outage(Duration::from_secs(20)).await;
    tokio::task::block_in_place(|| {
        env.start_again(Component::Containerd)?;
        env.start_again(Component::Kubelet)
    })
    .expect("start containerd and the kubelet");
    m.assert_survived().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_power_cycled_with_importer_pods_running_imports_once_per_disk() {
    let (_turn, env, m) = mid_import("e2e-reboot-import").await;
    tokio::task::block_in_place(|| env.power_cycle_node()).expect("power-cycle the node");
    m.front.as_ref().unwrap().open();
    m.assert_survived().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_power_cycled_mid_copy_by_worker_pods_ends_in_the_same_bytes() {
    let _turn = KubeEnv::fault_turn().await;
    let env = tokio::task::block_in_place(KubeEnv::shared);
    let setup = Setup { data_plane: DataPlane::Pods, ..Default::default() };
    let m = Migration::start("e2e-reboot-workers", setup).await;
    m.emu.set_read_rate(Some(SLOW_READS));
    m.create(|_| {}).await;
    m.wait_copying(4 << 20).await;
    tokio::task::block_in_place(|| env.power_cycle_node()).expect("power-cycle the node");
    m.emu.set_read_rate(None);
    m.assert_survived().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cdi_redeployed_mid_import_imports_once_per_disk() {
    let (_turn, env, m) = mid_import("e2e-cdi-redeploy").await;
    // A new rollout of CDI's operator, and every pod of CDI replaced (its
    // controller, API server and upload proxy elect and start anew).
    tokio::task::block_in_place(|| {
        env.kubectl(&["rollout", "restart", "deployment", "cdi-operator", "-n", "cdi"])?;
        env.kubectl(&["delete", "pod", "--all", "-n", "cdi", "--wait=false"])?;
        anyhow::Ok(())
    })
    .expect("redeploy CDI");
    m.front.as_ref().unwrap().open();
    tokio::task::block_in_place(|| env.wait_settled()).expect("CDI settles");
    m.assert_survived().await;
}
