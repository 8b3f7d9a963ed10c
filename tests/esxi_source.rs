//! The real ESXi adapter (russh client, parsers, power, disk copy) against the
//! ESXi emulator: a real OpenSSH sshd with ESXi's algorithms, BusyBox ash and
//! an emulated vim-cmd (tests/support/esxi_emulator.rs).

use crate::support::esxi_emulator::{EsxiEmulator, EsxiOptions};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;
use vmmigrate::api::{Firmware, SourcePowerState, VirtualMachineMigration};
use vmmigrate::ports::{EsxiHost, PowerObservation};
use vmmigrate::source::esxi::copy::{self, CopyPlan};
use vmmigrate::source::esxi::hosts::{CredentialSource, EsxiHosts};
use vmmigrate::source::esxi::ssh::{Credentials, RemoteCommand, Secret, Session, SshError, Target};
use vmmigrate::source::esxi::store::{EsxiDiskStore, StoreConfig};

fn migration(emu: &EsxiEmulator, vm_name: &str) -> VirtualMachineMigration {
    let mut vmm: VirtualMachineMigration = serde_json::from_value(serde_json::json!({
        "apiVersion": "migration.platform.example/v1alpha1",
        "kind": "VirtualMachineMigration",
        "metadata": {"name": "m", "namespace": "ns", "uid": "uid-1"},
        "spec": {
            "source": {
                "host": "127.0.0.1", "port": emu.port, "hostKey": emu.host_key_fingerprint(),
                "credentialsSecretRef": {"name": "unused"}, "vm": {"name": vm_name}
            },
            "destination": {"namespace": "apps", "storageClassName": "standard"}
        }
    }))
    .expect("migration");
    vmm.spec.strategy.timeouts.ssh_seconds = 20;
    vmm
}

fn password(emu: &EsxiEmulator) -> Credentials {
    Credentials { username: emu.username.clone(), secret: Secret::Password(emu.password.clone()) }
}

fn source(_emu: &EsxiEmulator, credentials: Credentials) -> (Arc<EsxiHosts>, tempfile::TempDir) {
    let store = tempfile::tempdir().expect("store");
    (Arc::new(EsxiHosts::new(CredentialSource::Fixed(credentials))), store)
}

/// The disk store over `hosts`, in `root`.
fn disk_store(hosts: &Arc<EsxiHosts>, root: &std::path::Path) -> EsxiDiskStore {
    let config = StoreConfig {
        root: root.to_path_buf(),
        streams: 4,
        chunk_size: 4 << 20,
        metrics: Default::default(),
    };
    EsxiDiskStore::new(hosts.clone(), config)
}

/// The migration of `vm_name` with its discovered inventory recorded, as the
/// controller has it once Discovering is done.
async fn discovered(esxi: &EsxiHosts, emu: &EsxiEmulator, vm_name: &str) -> VirtualMachineMigration {
    let mut vmm = migration(emu, vm_name);
    let inventory = esxi.discover(&vmm).await.expect("discovery");
    vmm.status = Some(vmmigrate::api::VirtualMachineMigrationStatus {
        source_inventory: Some(inventory),
        ..Default::default()
    });
    vmm
}

fn target(emu: &EsxiEmulator) -> Target {
    Target {
        host: "127.0.0.1".into(),
        port: emu.port,
        host_key: emu.host_key_fingerprint(),
        timeout: Duration::from_secs(20),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_reads_exact_inventories_of_the_emulator_vms() {
    let emu = EsxiEmulator::start(EsxiOptions::default()).expect("emulator");
    let (esxi, _store) = source(&emu, password(&emu));

    let web = esxi.discover(&migration(&emu, "web 01")).await.expect("web 01");
    assert_eq!(web.vmid, "1");
    assert_eq!(web.firmware, Firmware::Bios);
    assert_eq!(web.power_state, SourcePowerState::PoweredOn);
    assert_eq!(web.snapshots, 0);
    assert!(web.esxi_version.starts_with("VMware ESXi 8"), "{}", web.esxi_version);
    assert_eq!(web.disks.len(), 1);
    let disk = &web.disks[0];
    assert_eq!(
        (disk.device.as_str(), disk.bus.as_str(), disk.controller_model.as_str()),
        ("scsi0:0", "scsi", "pvscsi")
    );
    assert_eq!(disk.capacity_bytes, 64 << 20);
    assert_eq!(disk.create_type, "vmfs");
    let (path, _, _, size) = emu.disk_files("1").into_iter().next().expect("disk file");
    assert_eq!(disk.extent_path, path);
    assert_eq!(disk.capacity_bytes as u64, size);
    assert_eq!(web.nics.len(), 1);
    assert_eq!((web.nics[0].model.as_str(), web.nics[0].network.as_str()), ("vmxnet3", "VM Network"));
    assert!(!web.nics[0].mac_address.is_empty());
    assert_eq!(web.nics[0].pci_slot, Some(192), "the slot that names it ens192 in the guest");

    let db = esxi.discover(&migration(&emu, "db-02")).await.expect("db-02");
    assert_eq!(db.firmware, Firmware::Efi);
    assert_eq!(db.disks.len(), 2);
    assert_eq!(db.nics.len(), 2);
    assert!(db.nics.iter().any(|n| n.model == "e1000" && n.network == "DMZ"));

    let snap = esxi.discover(&migration(&emu, "snap-vm")).await.expect("snap-vm");
    assert!(snap.snapshots >= 1);
    assert!(snap.disks[0].create_type.contains("Sparse"), "{}", snap.disks[0].create_type);

    let question = esxi.discover(&migration(&emu, "question-vm")).await.expect("question-vm");
    assert!(question.pending_question.is_some());

    let hostile_name = "x'; rm -rf /; '";
    let hostile = esxi.discover(&migration(&emu, hostile_name)).await.expect("hostile");
    assert_eq!(hostile.name, hostile_name);
    assert_eq!(hostile.power_state, SourcePowerState::PoweredOff);
    // The datastore is intact: nothing was executed.
    assert!(emu.disk_files("1").iter().all(|(_, p, _, _)| p.exists()));

    let missing = esxi.discover(&migration(&emu, "no such vm")).await.expect_err("missing VM");
    assert_eq!(missing.reason, "SourceVMNotFound");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_vm_name_reaches_vim_cmd_as_one_literal_argument() {
    let emu = EsxiEmulator::start(EsxiOptions::default()).expect("emulator");
    let session = Session::connect(&target(&emu), &password(&emu)).await.expect("connect");
    let hostile = "x'; rm -rf /; '";
    let cmd = RemoteCommand::new("vim-cmd").unwrap().arg("vmsvc/get.summary").unwrap().arg(hostile).unwrap();
    session.run(&cmd).await.expect("run");
    let calls = emu.vimcmd_invocations();
    assert!(
        calls.iter().any(|argv| argv == &vec!["vmsvc/get.summary".to_owned(), hostile.to_owned()]),
        "{calls:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_host_key_is_refused_naming_both_fingerprints() {
    let emu = EsxiEmulator::start(EsxiOptions::default()).expect("emulator");
    let (esxi, _store) = source(&emu, password(&emu));
    let mut vmm = migration(&emu, "web 01");
    let pinned = "SHA256:AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA".to_owned();
    vmm.spec.source.host_key = pinned.clone();
    let failure = esxi.discover(&vmm).await.expect_err("refused");
    assert_eq!(failure.reason, "HostKeyMismatch");
    assert_eq!(failure.class, vmmigrate::machine::FailureClass::NeedsHuman);
    assert!(failure.message.contains(&pinned), "{}", failure.message);
    assert!(failure.message.contains(&emu.host_key_fingerprint()), "{}", failure.message);
    assert!(emu.vimcmd_invocations().is_empty(), "nothing ran on a host we do not trust");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changed_host_key_is_refused_after_a_reinstall() {
    let mut emu = EsxiEmulator::start(EsxiOptions::default()).expect("emulator");
    let vmm = migration(&emu, "web 01");
    emu.change_host_key().expect("new host key");
    let (esxi, _store) = source(&emu, password(&emu));
    let failure = esxi.discover(&vmm).await.expect_err("refused");
    assert_eq!(failure.reason, "HostKeyMismatch");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logins_by_password_and_rsa_key_work_and_bad_ones_are_clear_errors() {
    let emu = EsxiEmulator::start(EsxiOptions::default()).expect("emulator");
    let vmm = migration(&emu, "web 01");
    let (by_password, _s1) = source(&emu, password(&emu));
    by_password.discover(&vmm).await.expect("password (keyboard-interactive) login");
    let rsa = Credentials {
        username: emu.username.clone(),
        secret: Secret::PrivateKey(emu.rsa_key_openssh.clone()),
    };
    let (by_key, _s2) = source(&emu, rsa);
    by_key.discover(&vmm).await.expect("RSA key login");

    let wrong =
        Credentials { username: emu.username.clone(), secret: Secret::Password("not-the-password".into()) };
    let (bad, _s3) = source(&emu, wrong);
    let failure = bad.discover(&vmm).await.expect_err("wrong password");
    assert_eq!(failure.reason, "SSHAuthenticationFailed");
    assert!(!failure.message.contains("not-the-password"), "the secret never reaches messages");

    let ed25519 = Credentials {
        username: emu.username.clone(),
        secret: Secret::PrivateKey(emu.ed25519_key_openssh.clone()),
    };
    let (fips, _s4) = source(&emu, ed25519);
    assert_eq!(fips.discover(&vmm).await.expect_err("ed25519 refused").reason, "SSHAuthenticationFailed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn power_off_happens_once_even_when_repeated_after_a_crash() {
    let emu = EsxiEmulator::start(EsxiOptions::default()).expect("emulator");
    let vmm = {
        let (esxi, _store) = source(&emu, password(&emu));
        discovered(&esxi, &emu, "web 01").await
    };
    {
        // The first controller powers off, then dies before recording it.
        let (esxi, _store) = source(&emu, password(&emu));
        esxi.power_off(&vmm).await.expect("power off");
    }
    // The next one repeats the idempotent step: already off is success.
    let (esxi, _store) = source(&emu, password(&emu));
    esxi.power_off(&vmm).await.expect("repeat");
    esxi.request_shutdown(&vmm).await.expect("shutdown of an off VM is a no-op");
    assert_eq!(emu.power_off_transitions("1"), 1);
    assert_eq!(
        esxi.power(&vmm).await.unwrap(),
        PowerObservation { state: SourcePowerState::PoweredOff, tools_running: false }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_without_tools_is_a_clear_needs_human_error() {
    let emu = EsxiEmulator::start(EsxiOptions::default()).expect("emulator");
    let (esxi, _store) = source(&emu, password(&emu));
    let vmm = discovered(&esxi, &emu, "no-tools").await;
    assert!(!esxi.power(&vmm).await.unwrap().tools_running);
    let failure = esxi.request_shutdown(&vmm).await.expect_err("tools missing");
    assert_eq!(failure.reason, "ToolsNotRunning");
}

async fn copy_once(
    emu: &EsxiEmulator,
    path: &str,
    local: &std::path::Path,
    streams: usize,
) -> Result<copy::CopyResult, copy::CopyError> {
    let session = Arc::new(Session::connect(&target(emu), &password(emu)).await.expect("connect"));
    let plan = CopyPlan { streams, chunk_size: 16 << 20, ..CopyPlan::new(path, local) };
    copy::copy_disk(session, &plan, Arc::new(AtomicU64::new(0))).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_1_gib_disk_is_copied_with_the_sources_sha256_and_stays_sparse() {
    let emu = EsxiEmulator::start(EsxiOptions { big_disk_mib: Some(1024), ..Default::default() })
        .expect("emulator");
    let (path, real, sha, size) = emu.disk_files("7").into_iter().next().expect("big disk");
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("disk-0.raw");
    let result = copy_once(&emu, &path, &local, 4).await.expect("copy");
    assert_eq!(result.size, size);
    assert_eq!(result.sha256, sha);
    assert!(result.verified_remotely, "the host's sha256sum agreed");
    assert_eq!(copy::sha256_file(&local).unwrap(), sha);
    // The source was only read.
    assert_eq!(copy::sha256_file(&real).unwrap(), sha);
    use std::os::unix::fs::MetadataExt;
    let allocated = std::fs::metadata(&local).unwrap().blocks() * 512;
    assert!(allocated < size, "zero regions stay holes ({allocated} of {size} bytes allocated)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_connection_resumes_without_rereading_more_than_one_chunk() {
    let emu =
        EsxiEmulator::start(EsxiOptions { big_disk_mib: Some(256), ..Default::default() }).expect("emulator");
    let (path, _, sha, size) = emu.disk_files("7").into_iter().next().expect("big disk");
    let chunk = 16u64 << 20;
    for fraction in [0.3, 0.9] {
        let dir = tempfile::tempdir().unwrap();
        let local = dir.path().join("disk-0.raw");
        let served_before = emu.bytes_served();
        // One stream, so "the chunk in flight" is exactly one chunk.
        emu.set_cut_after_bytes(Some((size as f64 * fraction) as u64));
        let err = copy_once(&emu, &path, &local, 1).await.expect_err("cut");
        assert!(matches!(err, copy::CopyError::ShortRead { .. } | copy::CopyError::Ssh(_)), "{err:?}");
        let result = copy_once(&emu, &path, &local, 1).await.expect("resumed copy");
        assert_eq!(result.sha256, sha);
        let served = emu.bytes_served() - served_before;
        assert!(served <= size + chunk, "cut at {fraction}: read {served} bytes for a {size}-byte disk");
        assert!(result.bytes_read < size, "the resumed run read only what was missing");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_come_from_the_kubernetes_secret_and_a_missing_one_needs_a_human() {
    use k8s_openapi::api::core::v1::Secret as KubeSecret;
    use kube::api::{Api, PostParams};
    let emu = EsxiEmulator::start(EsxiOptions::default()).expect("emulator");
    let client = crate::support::KubeEnv::shared().client().await;
    let ns = crate::support::test_namespace(&client, "esxi-creds").await;
    let secret: KubeSecret = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "esxi01", "namespace": ns, "annotations": {
            vmmigrate::machine::tenancy::CREDENTIAL_HOSTS_ANNOTATION:
                format!("127.0.0.1:{}={}", emu.port, emu.host_key_fingerprint())}},
        "stringData": {"username": emu.username, "password": emu.password}
    }))
    .unwrap();
    Api::<KubeSecret>::namespaced(client.clone(), &ns).create(&PostParams::default(), &secret).await.unwrap();
    let esxi = EsxiHosts::new(CredentialSource::Kubernetes(client));
    let mut vmm = migration(&emu, "web 01");
    vmm.metadata.namespace = Some(ns.clone());
    vmm.spec.source.credentials_secret_ref.name = "esxi01".into();
    assert_eq!(esxi.discover(&vmm).await.expect("login with the Secret's password").vmid, "1");
    vmm.spec.source.credentials_secret_ref.name = "absent".into();
    let failure = esxi.discover(&vmm).await.expect_err("no Secret");
    assert_eq!(failure.reason, "CredentialsSecretMissing");
    assert!(!failure.message.contains(&emu.password));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_paths_out_of_the_vms_folder_and_descriptors_that_do_not_parse_are_for_a_person() {
    let emu = EsxiEmulator::start(EsxiOptions::default()).expect("emulator");
    let (esxi, _store) = source(&emu, password(&emu));
    let vmm = migration(&emu, "web 01");
    let inventory = esxi.discover(&vmm).await.expect("the VM as it is");
    let vmx = emu
        .host_path(&format!("/vmfs/volumes/datastore1/{}", inventory.vmx_path.split("] ").nth(1).unwrap()));
    let original = std::fs::read_to_string(&vmx).unwrap();
    let descriptor = emu.host_path(&inventory.disks[0].descriptor_path);
    let original_descriptor = std::fs::read_to_string(&descriptor).unwrap();
    let file_line = original.lines().find(|l| l.starts_with("scsi0:0.fileName")).expect("disk 0").to_owned();
    // A VM administrator points the disk at a host file, a device, another
    // VM's disk through `..`, or one by absolute path.
    for file in [
        "/etc/shadow",
        "/vmfs/devices/disks/naa.600508b1001c4d41",
        "../db 01/db 01.vmdk",
        "/vmfs/volumes/datastore1/db 01/db 01.vmdk",
    ] {
        std::fs::write(&vmx, original.replace(&file_line, &format!("scsi0:0.fileName = \"{file}\"")))
            .unwrap();
        let failure = esxi.discover(&vmm).await.expect_err(file);
        assert_eq!(failure.reason, "SourcePathRefused", "{file}: {failure}");
        assert!(failure.message.contains(file), "{failure}");
    }
    std::fs::write(&vmx, &original).unwrap();
    // A descriptor that does not parse is not copied as if it were the disk.
    std::fs::write(&descriptor, "root:$6$salt$hash:19000:0:99999:7:::\n").unwrap();
    assert_eq!(esxi.discover(&vmm).await.expect_err("no descriptor").reason, "DiskDescriptorInvalid");
    // An extent that leaves the descriptor's folder.
    let flat = inventory.disks[0].extent_path.rsplit('/').next().unwrap().to_owned();
    std::fs::write(
        &descriptor,
        original_descriptor.replace(&format!("\"{flat}\""), "\"../db 01/db 01-flat.vmdk\""),
    )
    .unwrap();
    assert_eq!(esxi.discover(&vmm).await.expect_err("extent out").reason, "SourcePathRefused");
    std::fs::write(&descriptor, &original_descriptor).unwrap();
    assert_eq!(esxi.discover(&vmm).await.expect("restored").disks, inventory.disks);
    assert!(emu.disk_reads().is_empty(), "nothing was read as a disk: {:?}", emu.disk_reads());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_pointing_a_teams_secret_at_another_host_never_connects_to_it() {
    use crate::support::fault_proxy::FaultProxy;
    use k8s_openapi::api::core::v1::Secret as KubeSecret;
    use kube::api::{Api, PostParams};
    use vmmigrate::machine::tenancy::CREDENTIAL_HOSTS_ANNOTATION;
    // finance's host, and an attacker's sshd behind a proxy that counts
    // every connection made to it.
    let finance = EsxiEmulator::start(EsxiOptions::default()).expect("finance's host");
    let attacker = EsxiEmulator::start(EsxiOptions::default()).expect("the attacker's sshd");
    let proxy = FaultProxy::start(([127, 0, 0, 1], attacker.port).into()).expect("proxy");
    let client = crate::support::KubeEnv::shared().client().await;
    let ns = crate::support::test_namespace(&client, "esxi-bound").await;
    let secrets = Api::<KubeSecret>::namespaced(client.clone(), &ns);
    for (name, hosts) in [
        ("finance", Some(format!("127.0.0.1:{}={}", finance.port, finance.host_key_fingerprint()))),
        ("unbound", None),
    ] {
        let mut metadata = serde_json::json!({"name": name, "namespace": ns});
        if let Some(hosts) = hosts {
            metadata["annotations"] = serde_json::json!({ CREDENTIAL_HOSTS_ANNOTATION: hosts });
        }
        let secret: KubeSecret = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Secret", "metadata": metadata,
            "stringData": {"username": finance.username, "password": finance.password}
        }))
        .unwrap();
        secrets.create(&PostParams::default(), &secret).await.unwrap();
    }
    let esxi = EsxiHosts::new(CredentialSource::Kubernetes(client));
    let mut vmm = migration(&finance, "web 01");
    vmm.metadata.namespace = Some(ns.clone());
    vmm.spec.source.credentials_secret_ref.name = "finance".into();
    assert_eq!(esxi.discover(&vmm).await.expect("finance's own host").vmid, "1");

    // The manifest names finance's Secret and the attacker's host and key.
    let mut stolen = vmm.clone();
    stolen.spec.source.port = i32::from(proxy.port);
    stolen.spec.source.host_key = attacker.host_key_fingerprint();
    for secret in ["finance", "unbound"] {
        stolen.spec.source.credentials_secret_ref.name = secret.into();
        let failure = esxi.discover(&stolen).await.expect_err("refused before connecting");
        assert_eq!(failure.reason, "CredentialsNotForHost", "{failure}");
        assert!(!failure.message.contains(&finance.password), "{failure}");
        assert_eq!(esxi.power(&stolen).await.expect_err("every call").reason, "CredentialsNotForHost");
    }
    assert_eq!(proxy.accepted(), 0, "the attacker's sshd saw a connection");
    // The proxy counts: a Secret that names the attacker's host reaches it.
    let bound_there = serde_json::json!({"metadata": {"annotations": {
        CREDENTIAL_HOSTS_ANNOTATION: format!("127.0.0.1:{}", proxy.port)}}});
    secrets
        .patch("unbound", &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&bound_there))
        .await
        .unwrap();
    stolen.spec.source.credentials_secret_ref.name = "unbound".into();
    let _ = esxi.discover(&stolen).await;
    assert!(proxy.accepted() >= 1, "the counter never saw the connection it was meant to");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_never_rides_a_session_opened_with_another_namespaces_credentials() {
    use k8s_openapi::api::core::v1::Secret as KubeSecret;
    use kube::api::{Api, PostParams};
    let emu = EsxiEmulator::start(EsxiOptions::default()).expect("emulator");
    let client = crate::support::KubeEnv::shared().client().await;
    let esxi = EsxiHosts::new(CredentialSource::Kubernetes(client.clone()));
    // Two teams, one host, one Secret name: only the first knows the password.
    let mut migrations = Vec::new();
    for (prefix, password) in [("esxi-team-a", emu.password.clone()), ("esxi-team-b", "guessed".to_owned())] {
        let ns = crate::support::test_namespace(&client, prefix).await;
        let secret: KubeSecret = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "esxi01", "namespace": ns, "annotations": {
                vmmigrate::machine::tenancy::CREDENTIAL_HOSTS_ANNOTATION: "127.0.0.1"}},
            "stringData": {"username": emu.username, "password": password}
        }))
        .unwrap();
        Api::<KubeSecret>::namespaced(client.clone(), &ns)
            .create(&PostParams::default(), &secret)
            .await
            .unwrap();
        let mut vmm = migration(&emu, "web 01");
        vmm.metadata.namespace = Some(ns);
        vmm.spec.source.credentials_secret_ref.name = "esxi01".into();
        migrations.push(vmm);
    }
    assert_eq!(esxi.discover(&migrations[0]).await.expect("team a logs in").vmid, "1");
    // Team a's session is open and cached; team b must log in with its own password.
    let failure = esxi.discover(&migrations[1]).await.expect_err("team b has the wrong password");
    assert_eq!(failure.reason, "SSHAuthenticationFailed", "{failure}");
    // Team a still rides its own session.
    assert_eq!(esxi.discover(&migrations[0]).await.expect("team a again").vmid, "1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_is_requested_once_and_observed_by_polling() {
    let emu = EsxiEmulator::start(EsxiOptions::default()).expect("emulator");
    let (esxi, _store) = source(&emu, password(&emu));
    let vmm = discovered(&esxi, &emu, "web 01").await;
    let before = esxi.power(&vmm).await.unwrap();
    assert_eq!(before, PowerObservation { state: SourcePowerState::PoweredOn, tools_running: true });
    esxi.request_shutdown(&vmm).await.expect("shutdown requested");
    // The guest takes a few polls to go down; the controller polls power.getstate.
    let mut polls = 0;
    while esxi.power(&vmm).await.unwrap().state != SourcePowerState::PoweredOff {
        polls += 1;
        assert!(polls < 20, "the guest never shut down");
    }
    assert_eq!(emu.power_off_transitions("1"), 1);
    let shutdowns = emu
        .vimcmd_invocations()
        .iter()
        .filter(|a| a.first().map(String::as_str) == Some("vmsvc/power.shutdown"))
        .count();
    assert_eq!(shutdowns, 1);
    let offs = emu
        .vimcmd_invocations()
        .iter()
        .filter(|a| a.first().map(String::as_str) == Some("vmsvc/power.off"))
        .count();
    assert_eq!(offs, 0, "a graceful shutdown never forces");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_that_prints_without_end_is_cut_off_at_the_output_limit_with_a_clear_error() {
    let emu = EsxiEmulator::start(EsxiOptions::default()).expect("emulator");
    let session = Session::connect(&target(&emu), &password(&emu)).await.expect("connect");
    // 64 MiB on stdout, where the longest an ESXi host prints is a few MiB.
    let flood =
        RemoteCommand::new("sh").unwrap().arg("-c").unwrap().arg("head -c 67108864 /dev/zero").unwrap();
    let error = session.run(&flood).await.expect_err("cut off");
    let message = error.to_string();
    assert!(message.contains("printed more than 8388608 bytes"), "{message}");
    assert!(matches!(error, SshError::OutputTooLarge { .. }), "{error:?}");
    // Within the limit is read whole, on a session that still works.
    let fine = RemoteCommand::new("sh").unwrap().arg("-c").unwrap().arg("head -c 1048576 /dev/zero").unwrap();
    let session = Session::connect(&target(&emu), &password(&emu)).await.expect("connect");
    assert_eq!(session.run(&fine).await.expect("1 MiB").stdout.len(), 1 << 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seven_mib_power_state_answer_reaches_status_as_at_most_one_kib() {
    let emu = EsxiEmulator::start(EsxiOptions::default()).expect("emulator");
    let (esxi, _store) = source(&emu, password(&emu));
    let vmm = discovered(&esxi, &emu, "web 01").await;
    emu.set_getstate_garbage(7 << 20);
    let failure = esxi.power(&vmm).await.expect_err("no state in the answer");
    assert_eq!(failure.reason, "UnparsableOutput", "{failure}");
    assert!(failure.message.len() <= 1024, "{} bytes of host text kept", failure.message.len());
    assert!(failure.message.contains("bytes cut"), "{}", &failure.message[..200]);
    emu.set_getstate_garbage(0);
    assert_eq!(esxi.power(&vmm).await.expect("the real answer").state, SourcePowerState::PoweredOn);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_disk_store_wakes_the_controller_when_a_copy_ends_and_then_reports_it_complete() {
    use vmmigrate::machine::CopyState;
    use vmmigrate::ports::DiskStore;
    let emu = EsxiEmulator::start(EsxiOptions::default()).expect("emulator");
    let (esxi, store) = source(&emu, password(&emu));
    let vmm = discovered(&esxi, &emu, "web 01").await;
    let disks = disk_store(&esxi, store.path());
    let (tx, mut woken) = tokio::sync::mpsc::unbounded_channel::<(String, String)>();
    disks.notify_on_finish(Arc::new(move |ns: &str, name: &str| {
        let _ = tx.send((ns.to_owned(), name.to_owned()));
    }));
    disks.start_copy(&vmm, 0).await.expect("start copy");
    let who =
        tokio::time::timeout(Duration::from_secs(60), woken.recv()).await.expect("woken").expect("wake");
    assert_eq!(who, ("ns".to_owned(), "m".to_owned()));
    // Looked at right after the wake, not a poll later: the copy is done.
    match disks.copy_state(&vmm, 0).await {
        CopyState::Complete { sha256, .. } => assert_eq!(sha256, emu.disk_files("1")[0].2),
        other => panic!("expected Complete right after the wake, got {other:?}"),
    }
}

fn sha256_of(path: &std::path::Path) -> String {
    copy::sha256_file(path).expect("sha256")
}

/// The disk `qemu-img` reads through a chain on the emulated host (the VM's disk as it is now), hashed.
fn chain_sha256(descriptor: &std::path::Path) -> String {
    let out = tempfile::NamedTempFile::new().unwrap();
    let status = std::process::Command::new("qemu-img")
        .args(["convert", "-f", "vmdk", "-O", "raw"])
        .arg(descriptor)
        .arg(out.path())
        .status()
        .expect("qemu-img");
    assert!(status.success());
    sha256_of(out.path())
}

/// The warm path's data plan, in both delta formats ESXi writes: a snapshot
/// taken (once, by name) while the guest writes, the frozen bases copied
/// while it runs, the VM powered off, only the deltas copied, and the disks
/// assembled locally: bit for bit the disks the VM has at power-off, which a
/// cold copy of the powered-off VM gives after the snapshot is removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_copy_of_a_changing_vm_assembles_exactly_the_disks_a_cold_copy_gives() {
    use crate::support::esxi_snapshots::GuestWrites;
    use crate::support::vmdk_delta::DeltaFormat;
    use vmmigrate::images::chain::{self, DeltaKind};
    use vmmigrate::source::esxi::snapshot::snapshot_name;
    for format in [DeltaFormat::SeSparse, DeltaFormat::VmfsSparse] {
        let emu = EsxiEmulator::start(EsxiOptions {
            pair_disk_mib: Some((24, 8)),
            snapshot_format: format,
            ..Default::default()
        })
        .expect("emulator");
        let writer = emu
            .start_guest_writes("12", GuestWrites { blocks_per_second: 200, seed: 11, ..Default::default() });
        let (esxi, store) = source(&emu, password(&emu));
        let vmm = discovered(&esxi, &emu, "pair").await;
        let inventory = vmm.status.as_ref().unwrap().source_inventory.clone().unwrap();
        let name = snapshot_name("m");

        let before_snapshot = emu.guest_blocks_written();
        let id = esxi.ensure_snapshot(&vmm, &name, true).await.expect("snapshot");
        assert_eq!(
            esxi.ensure_snapshot(&vmm, &name, true).await.expect("again"),
            id,
            "one snapshot, by name"
        );
        assert_eq!(esxi.snapshots(&vmm).await.unwrap().len(), 1);
        let chains = esxi.disk_chains(&vmm).await.expect("chains");
        assert_eq!(chains.len(), 2);
        for (chain, disk) in chains.iter().zip(&inventory.disks) {
            assert_eq!(chain.len(), 2, "{chain:?}");
            assert_eq!(chain[1].extent_path, disk.extent_path, "the base is the discovered extent");
            assert_eq!(chain[0].capacity_bytes, disk.capacity_bytes as u64);
        }

        // The bases, copied while the guest writes on into the deltas.
        let before = emu.guest_blocks_written();
        let mut bases = Vec::new();
        for (i, chain) in chains.iter().enumerate() {
            let local = store.path().join(format!("base-{i}.raw"));
            let done = copy_once(&emu, &chain[1].extent_path, &local, 2).await.expect("base copy");
            assert!(done.verified_remotely);
            bases.push(local);
        }
        vmmigrate_harness::process::wait_until(Duration::from_secs(30), "guest writes", || {
            Ok(emu.guest_blocks_written() > before + 100)
        })
        .unwrap();

        // The cutover: powered off, then only the deltas.
        esxi.power_off(&vmm).await.expect("power off");
        drop(writer);
        let mut assembled = Vec::new();
        for (i, chain) in chains.iter().enumerate() {
            let local = store.path().join(format!("delta-{i}.vmdk"));
            let done = copy_once(&emu, &chain[0].extent_path, &local, 2).await.expect("delta copy");
            assert!(done.verified_remotely);
            // Only the changes travel: no more than the 4 KiB blocks the guest
            // wrote since the snapshot (on any disk), plus the delta's grain
            // tables, and less than the disk (a slow run lets the guest dirty most of it).
            let written = (emu.guest_blocks_written() - before_snapshot) * 4096;
            assert!(
                done.size <= written + (1 << 20) && done.size < chain[0].capacity_bytes,
                "only the changes travel: {} bytes of delta for {written} bytes written",
                done.size
            );
            let kind = DeltaKind::from_create_type(&chain[0].create_type).expect("a delta");
            // The deltas applied onto a copy of the base, in place (twice: the same bytes).
            let in_place = store.path().join(format!("disk-{i}.raw"));
            std::fs::copy(&bases[i], &in_place).unwrap();
            let (capacity, deltas) = (chain[0].capacity_bytes, [(kind, local)]);
            let work = store.path().join(format!("apply-{i}"));
            chain::apply(&in_place, capacity, &deltas, &work).await.expect("apply");
            let once = sha256_of(&in_place);
            chain::apply(&in_place, capacity, &deltas, &work).await.expect("again");
            assert_eq!(sha256_of(&in_place), once, "{format:?}: applying again changes nothing");
            assembled.push(once);
        }
        let at_power_off: Vec<String> = emu.disk_tops("12").iter().map(|t| chain_sha256(t)).collect();
        assert_eq!(assembled, at_power_off, "{format:?}: the VM's disks at power-off");
        let base_shas: Vec<String> = bases.iter().map(|b| sha256_of(b)).collect();
        assert_ne!(assembled, base_shas, "{format:?}: the guest's writes are in the result");

        // Removing the snapshot consolidates on the host: a cold copy now reads the same bytes.
        assert!(esxi.remove_snapshot(&vmm, &name).await.expect("remove"));
        assert!(!esxi.remove_snapshot(&vmm, &name).await.expect("remove again"), "already gone");
        let cold: Vec<String> = emu.disk_files("12").iter().map(|d| sha256_of(&d.1)).collect();
        assert_eq!(assembled, cold, "{format:?}: warm and cold give the same bytes");
        assert_eq!(emu.power_off_transitions("12"), 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn someone_elses_snapshot_is_never_removed_and_a_chain_through_it_is_followed() {
    use vmmigrate::source::esxi::snapshot::snapshot_name;
    let emu = EsxiEmulator::start(EsxiOptions { pair_disk_mib: Some((1, 1)), ..Default::default() })
        .expect("emulator");
    let (esxi, _store) = source(&emu, password(&emu));
    let vmm = discovered(&esxi, &emu, "pair").await;
    let out =
        emu.ssh_command().arg("vim-cmd vmsvc/snapshot.create 12 before-upgrade '' 0 0").output().unwrap();
    assert!(out.status.success());
    let refused = esxi.remove_snapshot(&vmm, "before-upgrade").await.expect_err("not ours by name");
    assert!(refused.message.contains("removes only its own"), "{}", refused.message);
    assert!(
        esxi.ensure_snapshot(&vmm, "before-upgrade", false).await.is_err(),
        "only vmmigrate- names are made"
    );
    esxi.ensure_snapshot(&vmm, &snapshot_name("m"), false).await.expect("ours on top");
    let chains = esxi.disk_chains(&vmm).await.expect("chains");
    assert!(chains.iter().all(|c| c.len() == 3), "{chains:?}");
    assert!(esxi.remove_snapshot(&vmm, &snapshot_name("m")).await.unwrap());
    let left = esxi.snapshots(&vmm).await.unwrap();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].name, "before-upgrade", "the user's snapshot stays");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardware_a_kubevirt_vm_cannot_carry_is_read_from_the_vmx_and_named_in_the_inventory() {
    let emu = EsxiEmulator::start(EsxiOptions::default()).expect("emulator");
    let (esxi, _store) = source(&emu, password(&emu));
    let vmm = migration(&emu, "web 01");
    let plain = esxi.discover(&vmm).await.expect("the VM as it is");
    assert!(
        plain.hardware.is_empty(),
        "the emulator's VM has nothing beyond disks and NICs: {:?}",
        plain.hardware
    );
    let vmx =
        emu.host_path(&format!("/vmfs/volumes/datastore1/{}", plain.vmx_path.split("] ").nth(1).unwrap()));
    let original = std::fs::read_to_string(&vmx).unwrap();
    // What a VM administrator adds in the host client: a GPU, a TPM, an ISO.
    let added = "pciPassthru0.present = \"TRUE\"\npciPassthru0.vgpu = \"grid_t4-2q\"\nvtpm.present = \"TRUE\"\n\
                 ide1:0.present = \"TRUE\"\nide1:0.deviceType = \"cdrom-image\"\n\
                 ide1:0.fileName = \"/vmfs/volumes/datastore1/iso/tools.iso\"\n";
    std::fs::write(&vmx, format!("{original}{added}")).unwrap();
    let inventory = esxi.discover(&vmm).await.expect("discovered");
    assert_eq!(inventory.hardware.passthrough, ["pciPassthru0 (vGPU grid_t4-2q)"]);
    assert!(inventory.hardware.tpm);
    assert_eq!(inventory.hardware.cdrom_images, ["ide1:0: /vmfs/volumes/datastore1/iso/tools.iso"]);
    assert_eq!(inventory.disks, plain.disks, "an ISO is not a disk");
}
