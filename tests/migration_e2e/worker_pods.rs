//! The data plane in worker pods (`--data-plane pods`): db-02's copies,
//! conversions and staging run in a real pod of a real Job, placed by the
//! scheduler on the test cluster's node and run by its kubelet from the
//! release image, on a PersistentVolume of the node's provisioner; real CDI
//! imports from the worker's staging server through its Service.

use super::*;
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::DeleteParams;

/// The sidecar of a copy on the work claim: the chunks it recorded.
fn recorded_chunks(claim_dir: &Path) -> Vec<(PathBuf, usize)> {
    let mut found = Vec::new();
    walk(claim_dir, &mut |p| {
        if p.to_string_lossy().ends_with(".progress.json")
            && let Ok(text) = std::fs::read_to_string(p)
            && let Ok(sidecar) = serde_json::from_str::<Value>(&text)
        {
            found.push((p.to_path_buf(), sidecar["done"].as_array().map_or(0, Vec::len)));
        }
    });
    found
}

/// The directory of a bound claim's volume on the node (the provisioner's hostPath).
async fn claim_dir(client: &Client, ns: &str, claim: &str) -> PathBuf {
    let deadline = Instant::now() + WAIT;
    loop {
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
        if let Some(volume) = claims.get_opt(claim).await.unwrap().and_then(|c| c.spec?.volume_name) {
            let pv = Api::<PersistentVolume>::all(client.clone()).get(&volume).await.unwrap();
            let spec = pv.spec.unwrap_or_default();
            let dir = spec.host_path.map(|h| h.path).or(spec.local.map(|l| l.path));
            return PathBuf::from(dir.expect("a node-local volume"));
        }
        assert!(Instant::now() < deadline, "the work claim {claim} was never bound");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The worker's Job and pods as the API shows them, for a failure's message.
async fn report(client: &Client, ns: &str) -> String {
    let jobs = Api::<Job>::namespaced(client.clone(), ns).list(&ListParams::default()).await.unwrap();
    let pods = Api::<Pod>::namespaced(client.clone(), ns).list(&ListParams::default()).await.unwrap();
    let mut lines: Vec<String> =
        jobs.items.iter().map(|j| format!("Job {}: {:?}", j.name_any(), j.status)).collect();
    for pod in &pods.items {
        let status = pod.status.clone().unwrap_or_default();
        lines.push(format!(
            "Pod {} {:?} conditions {:?} containers {:?}",
            pod.name_any(),
            status.phase,
            status.conditions.unwrap_or_default().iter().map(|c| (&c.type_, &c.status)).collect::<Vec<_>>(),
            status
                .container_statuses
                .unwrap_or_default()
                .iter()
                .map(|c| (&c.state, c.restart_count))
                .collect::<Vec<_>>()
        ));
    }
    lines.join("\n")
}

fn ready(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none()
        && pod
            .status
            .as_ref()
            .is_some_and(|s| s.conditions.iter().flatten().any(|c| c.type_ == "Ready" && c.status == "True"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_pod_killed_mid_copy_resumes_in_a_new_pod_from_its_recorded_chunks_and_the_migration_completes()
 {
    let mut m = Migration::with_worker_pods("e2e-worker").await;
    // One stream per disk at 2 MiB/s: db-02's 32 MiB disk records its first
    // chunk (16 MiB) after about 8 s and is mid-way for 8 s more.
    m.opts.copy_streams = 1;
    m.kill_and_restart_controller().await;
    m.emu.set_read_rate(Some(2 << 20));
    m.create(|_| {}).await;

    let pods: Api<Pod> = Api::namespaced(m.client.clone(), &m.ns);
    let workers = ListParams::default().labels("migration.platform.example/role=worker");
    let vmm = m.wait_for("Preparing", |v| phase_of(v) == Phase::Preparing).await;
    let uid = vmm.uid().unwrap();
    let work = claim_dir(&m.client, &m.ns, &format!("{VM}-vmm-work")).await;

    // Mid-copy: a chunk of the big disk recorded on the claim, not all of it.
    let deadline = Instant::now() + WAIT;
    let (first_pod, sidecar) = loop {
        let chunks = recorded_chunks(&work);
        if let Some((sidecar, _)) =
            chunks.iter().find(|(p, done)| *done == 1 && p.to_string_lossy().contains("disk-0"))
        {
            let list = pods.list(&workers).await.unwrap().items;
            let running: Vec<&Pod> = list.iter().filter(|p| ready(p)).collect();
            assert_eq!(running.len(), 1, "one worker pod copies");
            break (running[0].clone(), sidecar.clone());
        }
        assert!(Instant::now() < deadline, "no chunk was recorded on the claim: {chunks:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(sidecar.starts_with(&work), "the copy lives on the claim, not in the pod");
    let reads_before = m.emu.disk_reads().len();

    // Killed: no grace, as a node would lose it. The Job starts another pod.
    let now = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    pods.delete(&first_pod.name_any(), &now).await.unwrap();
    m.emu.set_read_rate(None);
    let deadline = Instant::now() + WAIT;
    let second_pod = loop {
        let list = pods.list(&workers).await.unwrap().items;
        if let Some(pod) = list.into_iter().find(|p| ready(p) && p.uid() != first_pod.uid()) {
            break pod;
        }
        if Instant::now() > deadline {
            panic!("the Job never started a second worker pod:\n{}", report(&m.client, &m.ns).await);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_ne!(second_pod.name_any(), first_pod.name_any());

    let vmm = m.wait_completed().await;
    let status = vmm.status.clone().unwrap();

    // Resumed from the recorded chunk: the killed pod's read of disk 0 was
    // cut mid-way; the new pod's reads of it start after the recorded chunk
    // and read only what was not recorded.
    let disk0 = m.emu.disk_files(VMID)[0].clone();
    let reads = m.emu.disk_reads();
    let after: Vec<_> = reads[reads_before..].iter().filter(|r| r.path == disk0.0).collect();
    assert!(
        after.iter().any(|r| r.outcome == "error" && r.offset == 0 && r.delivered < disk0.3),
        "the killed pod was mid-way through disk 0: {after:?}"
    );
    let resumed: Vec<_> = after.iter().filter(|r| r.outcome == "ok").collect();
    assert_eq!(resumed.first().map(|r| r.offset), Some(16 << 20), "resumed at the recorded chunk: {after:?}");
    let read_again: u64 = resumed.iter().map(|r| r.delivered).sum();
    assert_eq!(read_again, disk0.3 - (16 << 20), "only what was not recorded was read again: {after:?}");

    // sha256 end to end: source = copy = artifact = imported bytes.
    let source = m.source_sha256_at_start();
    let recorded: Vec<String> = status.disks.iter().map(|d| d.source_sha256.clone().unwrap()).collect();
    assert_eq!(recorded, source, "sha256 of the copies");
    assert_eq!(m.imported_sha256(2).await, source, "the bytes in the PVCs are the source's");
    // CDI imported from the worker's staging server, through its Service.
    let dvs = m.list(&data_volume_resource()).await;
    for dv in &dvs {
        let url = dv.data["spec"]["source"]["http"]["url"].as_str().unwrap().to_owned();
        assert!(url.starts_with("https://") && url.contains(":8443/artifacts/"), "{url}");
    }
    // Nothing went through the controller's own staging server or work directory.
    assert_eq!(m.staging.stats().requests.load(Ordering::Relaxed), 0, "the controller served no artifact");
    assert_eq!(m.leftovers(&uid), Vec::<PathBuf>::new());

    // The worker's objects are gone with the migration's cleanup: Job, pods,
    // Service, Secret and the claim.
    let ours = ListParams::default().labels(&format!(
        "migration.platform.example/migration-uid={uid},migration.platform.example/role=worker"
    ));
    let deadline = Instant::now() + WAIT;
    loop {
        let jobs = Api::<Job>::namespaced(m.client.clone(), &m.ns).list(&ours).await.unwrap().items.len();
        let services =
            Api::<Service>::namespaced(m.client.clone(), &m.ns).list(&ours).await.unwrap().items.len();
        let secrets =
            Api::<Secret>::namespaced(m.client.clone(), &m.ns).list(&ours).await.unwrap().items.len();
        let claims = Api::<PersistentVolumeClaim>::namespaced(m.client.clone(), &m.ns)
            .list(&ours)
            .await
            .unwrap()
            .items
            .len();
        if (jobs, services, secrets, claims) == (0, 0, 0, 0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "left after Completed: {jobs} Jobs, {services} Services, {secrets} Secrets, {claims} claims"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    m.assert_source_off_and_untouched().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_of_the_workers_name_that_is_not_the_migrations_stops_it_at_validation_and_is_never_used_or_deleted()
 {
    let m = Migration::with_worker_pods("e2e-worker-foreign").await;
    // A user's own claim under the name the worker's would have.
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(m.client.clone(), &m.ns);
    let theirs: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": { "name": format!("{VM}-vmm-work") },
        "spec": { "accessModes": ["ReadWriteOnce"], "storageClassName": "local-path",
                  "resources": { "requests": { "storage": "1Mi" } } },
    }))
    .unwrap();
    let theirs = claims.create(&PostParams::default(), &theirs).await.unwrap();
    m.create(|_| {}).await;

    let vmm = m.wait_until_stopped(|v| phase_of(v) == Phase::ManualInterventionRequired).await;
    let status = vmm.status.clone().unwrap();
    // Found at validation: before anything irreversible.
    let blocker = status.blockers.iter().find(|b| b.reason == "WorkerCannotStart").expect("a blocker");
    assert!(blocker.message.contains("is not this migration's"), "{}", blocker.message);
    assert!(blocker.message.contains(&format!("{VM}-vmm-work")), "{}", blocker.message);
    assert_eq!(
        status.errors.last().map(|e| e.reason.as_str()),
        Some("ValidationBlocked"),
        "{:?}",
        status.errors
    );
    assert_eq!(m.emu.vm_power(m.vmid), "on", "the source was never powered off");
    assert_eq!(m.emu.power_off_transitions(m.vmid), 0);
    let jobs = Api::<Job>::namespaced(m.client.clone(), &m.ns).list(&ListParams::default()).await.unwrap();
    assert!(jobs.items.is_empty(), "no worker ran on someone else's claim");

    // Deleting the migration cleans up what is its own and leaves the claim.
    m.api.delete(VM, &Default::default()).await.unwrap();
    let deadline = Instant::now() + WAIT;
    while m.api.get_opt(VM).await.unwrap().is_some() {
        assert!(Instant::now() < deadline, "the migration's finalizer never finished");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let still = claims.get(&format!("{VM}-vmm-work")).await.unwrap();
    assert_eq!(still.uid(), theirs.uid(), "the user's claim is untouched");
    assert!(still.metadata.deletion_timestamp.is_none());
}
