//! Faults injected into the real parts around the source and the work
//! directory while a migration runs, each in the middle of the step it
//! hurts: the emulated host's sshd restarted with its sessions, refusing
//! logins past `MaxStartups`, a connection blackholed by a proxy; the work
//! directory's file system full mid-copy and mid-conversion; real KubeVirt's
//! virt-api gone while the VM is created. (The control plane's and the
//! node's faults break a whole cluster: they are the `faults` binary's.)
//!
//! Every case ends the same way, and checks it the same way
//! ([`Migration::assert_survived`]): Completed, the source powered off once
//! and every power call recorded, the imported bytes the source's at its
//! power-off, one conversion Job and one DataVolume per disk.

use super::*;
use crate::support::fault_proxy::{FaultProxy, Mode};
use crate::support::full_fs::SmallFs;
use std::sync::Arc;

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
    // The controller reaches the host through a proxy, so that its
    // connections, and only its, can be ended; another tool comes straight.
    let proxy = FaultProxy::start(([127, 0, 0, 1], m.emu.port).into()).expect("proxy");
    m.emu.set_read_rate(Some(SLOW_READS));
    m.create(|body| {
        body["spec"]["source"]["port"] = json!(proxy.port);
        body["spec"]["strategy"]["retryLimit"] = json!(1);
    })
    .await;
    m.wait_copying(4 << 20).await;
    // sshd restarts with MaxStartups 2, and another tool takes both places
    // with logins it never finishes, and takes them again when sshd ends
    // one after its LoginGraceTime (30 s: on a busy machine the
    // controller's next login can come later than that). A login of the
    // controller's may hold a place for a moment: the tool tries until it
    // holds two.
    m.emu.set_max_startups(Some(2)).expect("MaxStartups 2");
    let hog = PlaceHog::start(m.emu.port, 2);
    let deadline = Instant::now() + WAIT;
    while hog.held() < 2 {
        assert!(Instant::now() < deadline, "the other tool never held two places: {}", m.emu.sshd_log_tail());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The controller's connections end; every login it tries now is
    // dropped before the banner.
    let dropped_before = m.emu.dropped_for_max_startups();
    proxy.cut_all();
    let deadline = Instant::now() + WAIT;
    while m.emu.dropped_for_max_startups() < dropped_before + 3 {
        let phase = phase_of(&m.get().await);
        assert!(
            !matches!(phase, Phase::Failed | Phase::ManualInterventionRequired),
            "refused logins stop nothing: {phase}"
        );
        assert!(Instant::now() < deadline, "sshd never dropped a login: {}", m.emu.sshd_log_tail());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(hog);
    m.emu.set_max_startups(None).expect("MaxStartups back");
    m.emu.set_read_rate(None);
    m.assert_survived().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_connection_blackholed_then_refused_mid_copy_times_out_is_waited_out_and_the_copy_resumes_once_the_path_is_back()
 {
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
    // A firewall then rejects the path: the old connections are reset and
    // every new one is refused, and the migration keeps trying.
    proxy.cut_all();
    proxy.set_mode(Mode::Refuse);
    let deadline = Instant::now() + WAIT;
    while proxy.refused() < 2 {
        let phase = phase_of(&m.get().await);
        assert!(
            !matches!(phase, Phase::Failed | Phase::ManualInterventionRequired),
            "a refused path stops nothing: {phase}"
        );
        assert!(Instant::now() < deadline, "no new connection was tried while refused");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The route comes back.
    let accepted_before = proxy.accepted();
    proxy.set_mode(Mode::Pass);
    m.emu.set_read_rate(None);
    m.assert_survived().await;
    assert!(proxy.stalled_ms() > 0);
    assert!(proxy.accepted() > accepted_before, "the copy resumed through the path");
}

/// db-02's migration whose work directory is a 256 MiB file system of its
/// own, on the host and in the node (for the conversion Jobs).
async fn on_a_small_file_system(prefix: &str) -> (SmallFs, Migration) {
    let fs = SmallFs::new(256).expect("a small file system");
    let env = tokio::task::block_in_place(KubeEnv::shared);
    fs.share_with(env.node.as_ref().expect("the shared cluster has a node")).expect("shared with the node");
    let setup = Setup { work_dir: Some(fs.path().to_path_buf()), ..Default::default() };
    let m = Migration::start(prefix, setup).await;
    (fs, m)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_work_directory_that_fills_mid_copy_keeps_what_it_copied_waits_for_room_and_reads_nothing_twice() {
    let (fs, m) = on_a_small_file_system("e2e-enospc").await;
    // Room for 20 of the disks' 48 MiB.
    fs.fill_leaving(20 << 20).expect("fill");
    m.create(|body| body["spec"]["strategy"]["retryLimit"] = json!(1)).await;
    let full = m
        .wait_for("WorkDirectoryFull", |v| {
            v.status.as_ref().is_some_and(|s| s.errors.iter().any(|e| e.reason == "WorkDirectoryFull"))
        })
        .await;
    let uid = full.uid().unwrap();
    let kept = m.leftovers(&uid);
    let sidecars: Vec<&PathBuf> =
        kept.iter().filter(|p| p.to_string_lossy().ends_with(".progress.json")).collect();
    assert!(!sidecars.is_empty(), "the partial copies and their progress are kept: {kept:?}");
    // What the kept progress says is done (whole chunks) is never read again.
    let done_bytes: u64 = sidecars
        .iter()
        .map(|p| {
            let sidecar: Value = serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap();
            sidecar["done"].as_array().map_or(0, |d| d.len() as u64) * sidecar["chunk_size"].as_u64().unwrap()
        })
        .sum();
    let served_before = m.emu.bytes_served();
    // A person (or another migration's cleanup) makes room.
    fs.empty().expect("empty");
    let done = m.assert_survived().await;
    let error = done.errors.iter().find(|e| e.reason == "WorkDirectoryFull").unwrap();
    assert!(error.message.contains("No space left on device"), "{}", error.message);
    let read_again = m.emu.bytes_served() - served_before;
    assert!(
        read_again <= (48 << 20) - done_bytes,
        "{read_again} bytes read after the room came back; {done_bytes} were done before"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_work_directory_that_fills_mid_conversion_waits_for_room_and_converts_again() {
    let (fs, m) = on_a_small_file_system("e2e-enospc-conv").await;
    // The conversion Jobs wait for their work volume's claim (`work_volume`).
    m.create(|body| {
        body["spec"]["conversion"] = json!({"format": "qcow2", "runner": "job", "guest": "none"});
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
async fn virt_api_down_while_the_vm_is_created_is_waited_out_and_the_guest_boots_from_one_vm() {
    let _virt_api = crate::support::VIRT_API.write().await;
    let setup = Setup { holds_virt_api: true, ..Default::default() };
    let m = Migration::guest_with("e2e-virt-api", "app-bios", setup).await;
    let env = tokio::task::block_in_place(KubeEnv::shared_kubevirt);
    let vms: Api<DynamicObject> = Api::namespaced_with(m.client.clone(), &m.ns, &virtual_machine_resource());
    let (vms_seen, vm_watch) = watch_uids(vms);
    m.hold_importer_pods().await;
    m.create(|_| {}).await;
    m.wait_for("Importing", |v| phase_of(v) == Phase::Importing).await;
    // virt-api goes, and cannot come back until the test lets it: its
    // namespace takes no new pod.
    let quota = r#"{"apiVersion":"v1","kind":"ResourceQuota","metadata":{"name":"virt-api-down","namespace":"kubevirt"},"spec":{"hard":{"pods":"0"}}}"#;
    let quota_file = m.work.path().join("virt-api-down.json");
    std::fs::write(&quota_file, quota).unwrap();
    tokio::task::block_in_place(|| {
        env.kubectl(&["apply", "-f", &quota_file.to_string_lossy()])?;
        env.kubectl(&["delete", "pod", "-n", "kubevirt", "-l", "kubevirt.io=virt-api", "--wait=true"])
    })
    .expect("take virt-api down");
    m.release_importer_pods().await;
    // The VM's create is refused while its webhooks cannot be called.
    let refused = m
        .wait_for("a refused VM create", |v| {
            v.status.as_ref().is_some_and(|s| {
                s.errors.iter().any(|e| e.phase == Phase::CreatingVm && e.message.contains("webhook"))
            })
        })
        .await;
    let error = refused.status.unwrap().errors.into_iter().find(|e| e.phase == Phase::CreatingVm).unwrap();
    assert_eq!(error.reason, "APIError", "{}", error.message);
    tokio::task::block_in_place(|| {
        env.kubectl(&["delete", "resourcequota", "virt-api-down", "-n", "kubevirt"])?;
        env.wait_settled()
    })
    .expect("virt-api back");
    let done = m.wait_completed().await.status.unwrap();
    assert_the_three_checks_passed(&done);
    assert_eq!(vms_seen.lock().unwrap().len(), 1, "one VirtualMachine, ever");
    vm_watch.abort();
    assert_eq!(m.imported_sha256(1).await, m.source_sha256_at_start());
    m.assert_source_off_and_untouched().await;
}

/// Another tool on the host: it keeps `places` connections that got sshd's
/// banner and never log in, opening a new one whenever sshd ends one
/// (`LoginGraceTime`), until dropped.
struct PlaceHog {
    held: Arc<std::sync::atomic::AtomicUsize>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PlaceHog {
    fn start(port: u16, places: usize) -> PlaceHog {
        use std::sync::atomic::Ordering::SeqCst;
        let held = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (count, stopping) = (held.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut streams: Vec<std::net::TcpStream> = Vec::new();
            while !stopping.load(SeqCst) {
                // sshd closed the ones whose grace ran out.
                streams.retain(|s| {
                    // Whatever sshd sent is read and dropped; the end of the
                    // stream (or a reset) means the place is gone.
                    let _ = s.set_nonblocking(true);
                    let mut buf = [0u8; 4096];
                    let open = loop {
                        match std::io::Read::read(&mut &*s, &mut buf) {
                            Ok(0) => break false,
                            Ok(_) => continue,
                            Err(e) => break e.kind() == std::io::ErrorKind::WouldBlock,
                        }
                    };
                    let _ = s.set_nonblocking(false);
                    open
                });
                if streams.len() < places
                    && let Ok(stream) = std::net::TcpStream::connect(("127.0.0.1", port))
                {
                    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
                    let mut banner = [0u8; 8];
                    // Dropped past MaxStartups: no banner, tried again below.
                    if std::io::Read::read_exact(&mut &stream, &mut banner).is_ok() {
                        streams.push(stream);
                    }
                }
                count.store(streams.len(), SeqCst);
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        PlaceHog { held, stop, thread: Some(thread) }
    }

    fn held(&self) -> usize {
        self.held.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for PlaceHog {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
