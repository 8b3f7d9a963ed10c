//! Filling a destination volume from the staging server without CDI's
//! importer: `vmmigrate fill-volume`, run in a pod that mounts the volume
//! (a blank DataVolume's `disk.img`, or its block device), reads one staged
//! artifact over HTTPS (the staging CA pinned, the artifact's own basic-auth
//! credentials), writes it in place and hashes what it wrote on the way.
//! Nothing after the disk's bytes is touched, and a block of zeros is
//! written only where the volume does not already read as zeros, so a blank
//! volume stays sparse where the disk is.
//!
//! The network read, the hash and the writes run on three threads joined by
//! bounded queues of reused buffers, so none waits for the others while the
//! queues have room.

use crate::api::VirtualMachineMigration;
use crate::destination::verify::VerifySettings;
use crate::machine::{data_volume_name, destination_name};
use crate::objects::pods::{container_security_context, pod_security_context};
use crate::objects::{LABEL_ROLE, bounded_name, labels, owner_references};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};

/// One read from the network, handed to the hasher and the writer.
const BUFFER: usize = 4 << 20;
/// Buffers in flight between the reader and the writer.
const IN_FLIGHT: usize = 6;
/// The unit in which zeros are skipped.
const ZERO_BLOCK: usize = 64 << 10;

/// What to fill, from where.
pub(crate) struct FillRequest<'a> {
    /// The artifact's staging URL (`https://…/artifacts/<uid>/disk-<n>.<fmt>`).
    pub url: &'a str,
    /// The staging server's CA, PEM: the only certificate authority trusted.
    pub ca_pem: &'a [u8],
    pub username: &'a str,
    pub password: &'a str,
    /// The volume's image file or block device.
    pub path: &'a Path,
    /// The artifact's size in bytes; the served length must be this. With
    /// `patch`, the disk's: no range may end past it.
    pub size: u64,
    /// The URL serves a patch (`images::patch`) to write onto the base the
    /// volume holds, not the disk.
    pub patch: bool,
}

/// What `fill-volume` wrote.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct FillReport {
    /// sha256 of the bytes written (the disk), hex.
    pub sha256: String,
    pub size: u64,
    /// Bytes written; the rest were zeros the volume already held.
    pub written: u64,
}

/// The uid and gid the fill Job writes as: the `qemu` user, which CDI's
/// importer writes a volume's `disk.img` as and KubeVirt's launcher opens it
/// as.
pub(crate) const VOLUME_OWNER: u32 = 107;

/// The fill Job's name: `<dv>-fill`, at most 63 characters.
pub(crate) fn job_name(vmm: &VirtualMachineMigration, disk: usize) -> String {
    bounded_name(&dv_name(vmm, disk), "-fill")
}

/// The base fill Job's name: `<dv>-fill-base`.
pub(crate) fn base_job_name(vmm: &VirtualMachineMigration, disk: usize) -> String {
    bounded_name(&dv_name(vmm, disk), "-fill-base")
}

/// What a fill Job writes into the volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fill<'a> {
    /// The staged artifact, whole (`disks[].artifactUrl`); or, where the
    /// disk's import is `Patched`, only its patch (`<artifact>.patch`) onto
    /// the base the volume holds.
    Import,
    /// Warm, before the cutover: the disk's base, staged at `url`.
    Base { url: &'a str, sha256: &'a str },
}

/// The staged patch's URL: beside the artifact.
pub(crate) fn patch_url(artifact_url: &str) -> String {
    format!("{artifact_url}.patch")
}

fn dv_name(vmm: &VirtualMachineMigration, disk: usize) -> String {
    data_volume_name(&destination_name(&vmm.spec, vmm.metadata.name.as_deref().unwrap_or_default()), disk)
}

/// The Job filling disk `disk`'s blank DataVolume from its staged artifact:
/// the volume mounted read-write, the artifact's import Secret (its
/// credentials and the staging CA) read-only; nothing else, as `deploy/`'s
/// admission policy demands. It runs as [`VOLUME_OWNER`], every capability
/// dropped.
pub(crate) fn fill_job(
    settings: &VerifySettings,
    vmm: &VirtualMachineMigration,
    disk: usize,
    fill: Fill<'_>,
) -> Value {
    let status = vmm.status.clone().unwrap_or_default();
    let evidence = status.disks.get(disk).cloned().unwrap_or_default();
    let dv = dv_name(vmm, disk);
    let size = match fill {
        Fill::Import => evidence.size_bytes.max(0) as u64,
        Fill::Base { .. } => disk_size(vmm, disk),
    };
    let artifact_url = evidence.artifact_url.clone().unwrap_or_default();
    let patch = evidence
        .patch
        .as_ref()
        .filter(|_| evidence.import_verification == Some(crate::api::ImportVerification::Patched));
    let (name, url, sha256) = match (fill, patch) {
        (Fill::Base { url, sha256 }, _) => (base_job_name(vmm, disk), url.to_owned(), sha256.to_owned()),
        (Fill::Import, Some(patch)) => (job_name(vmm, disk), patch_url(&artifact_url), patch.sha256.clone()),
        (Fill::Import, None) => {
            (job_name(vmm, disk), artifact_url, status.expected_volume_sha256(disk).unwrap_or_default())
        }
    };
    let mut args = vec![
        "fill-volume".to_owned(),
        "--url".into(),
        url,
        "--ca".into(),
        "/credentials/ca.pem".into(),
        "--credentials".into(),
        "/credentials".into(),
        "--path".into(),
        "/volume/disk.img".into(),
        "--size".into(),
        size.to_string(),
        "--sha256".into(),
        sha256,
    ];
    if patch.is_some() && fill == Fill::Import {
        args.push("--patch".into());
    }
    let mut labels = labels(vmm);
    labels.insert(LABEL_ROLE.into(), json!("fill"));
    labels.insert(crate::api::labels::DISK.into(), json!(disk.to_string()));
    let pod_spec = json!({
        "restartPolicy": "Never",
        "securityContext": pod_security_context(Some((VOLUME_OWNER, VOLUME_OWNER))),
        "containers": [{
            "name": "fill",
            "image": settings.image,
            "command": ["vmmigrate"],
            "args": args,
            "terminationMessagePolicy": "FallbackToLogsOnError",
            "resources": { "requests": { "cpu": "100m", "memory": "64Mi" }, "limits": { "memory": "256Mi" } },
            "securityContext": container_security_context(true),
            "volumeMounts": [
                { "name": "volume", "mountPath": "/volume" },
                { "name": "credentials", "mountPath": "/credentials", "readOnly": true },
            ],
        }],
        "volumes": [
            { "name": "volume", "persistentVolumeClaim": { "claimName": dv } },
            { "name": "credentials", "secret": { "secretName": crate::destination::render::import_secret_name(&dv) } },
        ],
    });
    json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": vmm.spec.destination.namespace,
            "labels": labels.clone(),
            "ownerReferences": owner_references(vmm, &vmm.spec.destination.namespace),
        },
        "spec": {
            "backoffLimit": 0,
            // Ten minutes and then 10 MiB/s at the least: a fill that has not
            // ended by then has stopped moving.
            "activeDeadlineSeconds": 600 + size / (10 << 20),
            "template": { "metadata": { "labels": labels }, "spec": pod_spec },
        },
    })
}

/// The inventory's size of disk `disk` (the disks' status is recorded only
/// once Preparing ends).
fn disk_size(vmm: &VirtualMachineMigration, disk: usize) -> u64 {
    let inventory = vmm.status.as_ref().and_then(|s| s.source_inventory.as_ref());
    inventory.and_then(|i| i.disks.get(disk)).map_or(0, |d| d.capacity_bytes.max(0) as u64)
}

/// What the fill Job's one line says.
pub(crate) fn parse_report(line: &str) -> Option<FillReport> {
    serde_json::from_str(line.trim()).ok()
}

/// Reads the artifact and writes it into the volume; the sha256 is of the
/// bytes received, which are the bytes written.
pub(crate) fn fill_volume(request: &FillRequest<'_>) -> anyhow::Result<FillReport> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ca = reqwest::Certificate::from_pem(request.ca_pem)
        .map_err(|e| anyhow::anyhow!("the staging CA is not a PEM certificate: {e}"))?;
    let client = reqwest::blocking::Client::builder()
        .tls_certs_only([ca])
        .https_only(true)
        .no_proxy()
        .connect_timeout(std::time::Duration::from_secs(30))
        .timeout(None)
        .build()?;
    let mut response = client
        .get(request.url)
        .basic_auth(request.username, Some(request.password))
        .send()
        .map_err(|e| anyhow::anyhow!("GET {}: {e}", request.url))?;
    anyhow::ensure!(response.status().is_success(), "GET {}: {}", request.url, response.status());
    if request.patch {
        return apply_patch(&mut response, request);
    }
    let length = response.content_length();
    anyhow::ensure!(
        length == Some(request.size),
        "{} serves {length:?} bytes; the disk has {}",
        request.url,
        request.size
    );
    let volume = open_volume(request.path, request.size)?;

    let (to_hasher, hasher_rx) = sync_channel::<Arc<Vec<u8>>>(IN_FLIGHT);
    let (to_writer, writer_rx) = sync_channel::<(u64, Arc<Vec<u8>>)>(IN_FLIGHT);
    let (returned, free) = sync_channel::<Arc<Vec<u8>>>(IN_FLIGHT * 2 + 2);
    let hasher = std::thread::spawn(move || hash(hasher_rx));
    let writer = std::thread::spawn(move || write(&volume, writer_rx, returned));
    let read = read_into(&mut response, request.size, &to_hasher, &to_writer, &free);
    drop((to_hasher, to_writer));
    let sha256 = hasher.join().map_err(|_| anyhow::anyhow!("the hasher panicked"))?;
    let written = writer.join().map_err(|_| anyhow::anyhow!("the writer panicked"))??;
    read?;
    Ok(FillReport { sha256, size: request.size, written })
}

/// Writes a patch's ranges into the volume as they arrive; the sha256 is
/// of the patch stream, the bytes written its ranges'.
fn apply_patch(body: &mut impl Read, request: &FillRequest<'_>) -> anyhow::Result<FillReport> {
    let volume = open_volume(request.path, request.size)?;
    let mut applier = crate::images::patch::Applier::new(request.size);
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = body.read(&mut buffer)?;
        if n == 0 {
            break;
        }
        applier.feed(&buffer[..n], &mut |at, bytes| volume.write_all_at(bytes, at))?;
    }
    let summary = applier.finish()?;
    volume.sync_data()?;
    Ok(FillReport { sha256: summary.sha256, size: request.size, written: summary.bytes })
}

/// The volume opened for writing, never truncated; a file shorter than the
/// disk (not a blank volume's image) is grown with a hole.
fn open_volume(path: &Path, size: u64) -> anyhow::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| anyhow::anyhow!("opening {}: {e}", path.display()))?;
    let meta = file.metadata()?;
    if meta.is_file() && meta.len() < size {
        file.set_len(size)?;
    }
    Ok(file)
}

fn read_into(
    body: &mut impl Read,
    size: u64,
    to_hasher: &SyncSender<Arc<Vec<u8>>>,
    to_writer: &SyncSender<(u64, Arc<Vec<u8>>)>,
    free: &Receiver<Arc<Vec<u8>>>,
) -> anyhow::Result<()> {
    let mut offset = 0u64;
    while offset < size {
        // A buffer both others are done with, or a new one while few exist.
        let mut buffer = free.try_recv().ok().and_then(|b| Arc::try_unwrap(b).ok()).unwrap_or_default();
        buffer.resize(BUFFER.min((size - offset) as usize), 0);
        let mut filled = 0;
        while filled < buffer.len() {
            let n = body.read(&mut buffer[filled..])?;
            anyhow::ensure!(n > 0, "the artifact ended after {} of {size} bytes", offset + filled as u64);
            filled += n;
        }
        let buffer = Arc::new(buffer);
        to_hasher.send(buffer.clone()).map_err(|_| anyhow::anyhow!("the hasher stopped"))?;
        to_writer.send((offset, buffer)).map_err(|_| anyhow::anyhow!("the writer stopped"))?;
        offset += filled as u64;
    }
    let mut extra = [0u8; 1];
    anyhow::ensure!(body.read(&mut extra)? == 0, "the artifact is longer than its {size} bytes");
    Ok(())
}

fn hash(rx: Receiver<Arc<Vec<u8>>>) -> String {
    let mut hasher = Sha256::new();
    for buffer in rx {
        hasher.update(&buffer[..]);
    }
    crate::images::digest::hex(&hasher.finalize())
}

/// Writes each buffer at its offset, zeros only where the volume is not
/// zero already; flushes at the end. Returns the bytes written.
fn write(
    volume: &File,
    rx: Receiver<(u64, Arc<Vec<u8>>)>,
    returned: SyncSender<Arc<Vec<u8>>>,
) -> anyhow::Result<u64> {
    let mut written = 0u64;
    let mut there = vec![0u8; ZERO_BLOCK];
    for (offset, buffer) in rx {
        let mut at = 0;
        while at < buffer.len() {
            // Runs of non-zero blocks go in one write.
            let mut end = at;
            while end < buffer.len() && !is_zero(&buffer[end..(end + ZERO_BLOCK).min(buffer.len())]) {
                end = (end + ZERO_BLOCK).min(buffer.len());
            }
            if end > at {
                volume.write_all_at(&buffer[at..end], offset + at as u64)?;
                written += (end - at) as u64;
                at = end;
                continue;
            }
            let block = &buffer[at..(at + ZERO_BLOCK).min(buffer.len())];
            let there = &mut there[..block.len()];
            volume.read_exact_at(there, offset + at as u64)?;
            if !is_zero(there) {
                volume.write_all_at(block, offset + at as u64)?;
                written += block.len() as u64;
            }
            at += block.len();
        }
        let _ = returned.try_send(buffer);
    }
    volume.sync_data()?;
    Ok(written)
}

fn is_zero(bytes: &[u8]) -> bool {
    bytes.iter().all(|b| *b == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vmm() -> VirtualMachineMigration {
        let mut vmm = crate::api::test_migration();
        vmm.status = Some(crate::api::VirtualMachineMigrationStatus {
            disks: vec![crate::api::DiskStatus {
                size_bytes: 1 << 30,
                source_sha256: Some("ab".repeat(32)),
                artifact_url: Some("https://stage:8443/artifacts/u/disk-0.raw".into()),
                artifact_format: Some("raw".into()),
                import_verification: Some(crate::api::ImportVerification::Filled),
                ..Default::default()
            }],
            ..Default::default()
        });
        vmm
    }

    #[test]
    fn the_fill_job_writes_the_volume_as_qemu_with_only_the_artifacts_credentials_and_ca() {
        let settings = VerifySettings { image: "vmmigrate:1".into(), run_as: Some((65532, 65532)) };
        let job = fill_job(&settings, &vmm(), 0, Fill::Import);
        assert_eq!(job["metadata"]["name"], "web-disk-0-fill");
        assert_eq!(job["spec"]["backoffLimit"], 0);
        assert_eq!(job["spec"]["activeDeadlineSeconds"], 600 + 102);
        let pod = &job["spec"]["template"]["spec"];
        assert_eq!(pod["securityContext"]["runAsUser"], VOLUME_OWNER);
        assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
        assert_eq!(
            pod["volumes"],
            json!([
                { "name": "volume", "persistentVolumeClaim": { "claimName": "web-disk-0" } },
                { "name": "credentials", "secret": { "secretName": "web-disk-0-import" } },
            ])
        );
        let container = &pod["containers"][0];
        assert_eq!(container["securityContext"]["capabilities"]["drop"], json!(["ALL"]));
        assert_eq!(container["volumeMounts"][1]["readOnly"], true);
        let args: Vec<&str> =
            container["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
        assert_eq!(
            args,
            [
                "fill-volume",
                "--url",
                "https://stage:8443/artifacts/u/disk-0.raw",
                "--ca",
                "/credentials/ca.pem",
                "--credentials",
                "/credentials",
                "--path",
                "/volume/disk.img",
                "--size",
                "1073741824",
                "--sha256",
                &"ab".repeat(32),
            ]
        );
    }

    fn args(job: &Value) -> Vec<String> {
        let container = &job["spec"]["template"]["spec"]["containers"][0];
        container["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap().to_owned()).collect()
    }

    #[test]
    fn a_base_fill_writes_the_staged_base_and_a_patched_import_only_the_patch() {
        let settings = VerifySettings { image: "vmmigrate:1".into(), run_as: None };
        let mut warm = vmm();
        let status = warm.status.as_mut().unwrap();
        status.source_inventory = Some(crate::api::SourceInventory {
            disks: vec![crate::api::SourceDisk { capacity_bytes: 1 << 20, ..Default::default() }],
            ..Default::default()
        });
        let base =
            Fill::Base { url: "https://stage:8443/artifacts/u/disk-0.raw.base", sha256: &"ba".repeat(32) };
        let job = fill_job(&settings, &warm, 0, base);
        assert_eq!(job["metadata"]["name"], "web-disk-0-fill-base");
        let said = args(&job);
        assert_eq!(said[2], "https://stage:8443/artifacts/u/disk-0.raw.base");
        assert_eq!(said[10..], ["1048576".to_owned(), "--sha256".into(), "ba".repeat(32)]);
        // The same volume and Secret as any fill.
        let pod = &job["spec"]["template"]["spec"];
        assert_eq!(pod["volumes"][1]["secret"]["secretName"], "web-disk-0-import");

        let d = &mut warm.status.as_mut().unwrap().disks[0];
        d.patch = Some(crate::api::DiskPatch {
            sha256: "9a".repeat(32),
            ranges: 2,
            bytes: 8192,
            base_sha256: "ba".repeat(32),
        });
        // Recorded, but the import not planned patched: the artifact, whole.
        let whole = args(&fill_job(&settings, &warm, 0, Fill::Import));
        assert!(!whole.contains(&"--patch".to_owned()) && whole[2].ends_with("disk-0.raw"));
        warm.status.as_mut().unwrap().disks[0].import_verification =
            Some(crate::api::ImportVerification::Patched);
        let job = fill_job(&settings, &warm, 0, Fill::Import);
        assert_eq!(job["metadata"]["name"], "web-disk-0-fill");
        let args = args(&job);
        assert_eq!(args[2], "https://stage:8443/artifacts/u/disk-0.raw.patch");
        assert_eq!(
            args[10..],
            ["1073741824".to_owned(), "--sha256".into(), "9a".repeat(32), "--patch".into()]
        );
    }

    #[test]
    fn a_volume_to_fill_is_a_blank_data_volume_with_no_download() {
        let dv = crate::destination::render::data_volume(&vmm(), 0);
        assert_eq!(dv["spec"]["source"], json!({ "blank": {} }));
        assert_eq!(dv["spec"]["storage"]["resources"]["requests"]["storage"], "1024Mi");
        let mut cdi = vmm();
        cdi.status.as_mut().unwrap().disks[0].import_verification =
            Some(crate::api::ImportVerification::CdiChecksum);
        let dv = crate::destination::render::data_volume(&cdi, 0);
        assert_eq!(dv["spec"]["source"]["http"]["url"], "https://stage:8443/artifacts/u/disk-0.raw");
    }

    #[test]
    fn the_report_line_is_read_back() {
        let report = FillReport { sha256: "ab".repeat(32), size: 5, written: 3 };
        let line = serde_json::to_string(&report).unwrap();
        assert_eq!(parse_report(&format!("{line}\n")), Some(report));
        assert_eq!(parse_report("error: filling /volume/disk.img: GET …: 503"), None);
    }

    #[test]
    fn writing_leaves_zero_blocks_alone_where_the_volume_is_zero_and_overwrites_them_where_it_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        // A volume with old bytes in its second block and a tail after the disk.
        let mut old = vec![0u8; 4 * ZERO_BLOCK + 100];
        old[ZERO_BLOCK + 7] = 9;
        old[4 * ZERO_BLOCK + 50] = 5;
        std::fs::write(&path, &old).unwrap();
        let volume = OpenOptions::new().read(true).write(true).open(&path).unwrap();
        // The disk: data, zeros (over old bytes), zeros (over zeros), data.
        let mut disk = vec![0u8; 4 * ZERO_BLOCK];
        disk[..ZERO_BLOCK].fill(1);
        disk[3 * ZERO_BLOCK..].fill(2);
        let (tx, rx) = sync_channel(4);
        let (returned, _free) = sync_channel(4);
        tx.send((0, Arc::new(disk[..2 * ZERO_BLOCK].to_vec()))).unwrap();
        tx.send((2 * ZERO_BLOCK as u64, Arc::new(disk[2 * ZERO_BLOCK..].to_vec()))).unwrap();
        drop(tx);
        let written = write(&volume, rx, returned).unwrap();
        let now = std::fs::read(&path).unwrap();
        assert_eq!(&now[..disk.len()], &disk[..], "the volume holds the disk");
        assert_eq!(&now[disk.len()..], &old[disk.len()..], "what follows the disk is untouched");
        // The first block, the second (zeros over its old byte), the last;
        // not the third (zeros over zeros).
        assert_eq!(written, 3 * ZERO_BLOCK as u64);
    }

    #[test]
    fn a_body_shorter_or_longer_than_the_disk_is_refused() {
        let (to_hasher, _h) = sync_channel(8);
        let (to_writer, _w) = sync_channel(8);
        let (_r, free) = sync_channel(1);
        let short = read_into(&mut &[1u8; 10][..], 20, &to_hasher, &to_writer, &free).unwrap_err();
        assert!(short.to_string().contains("ended after 10 of 20 bytes"), "{short}");
        let long = read_into(&mut &[1u8; 30][..], 20, &to_hasher, &to_writer, &free).unwrap_err();
        assert!(long.to_string().contains("longer than its 20 bytes"), "{long}");
    }

    #[test]
    fn the_hash_is_of_the_bytes_in_order() {
        let (tx, rx) = sync_channel(4);
        tx.send(Arc::new(b"abc".to_vec())).unwrap();
        tx.send(Arc::new(b"def".to_vec())).unwrap();
        drop(tx);
        let expected = crate::images::digest::hex(&Sha256::digest(b"abcdef"));
        assert_eq!(hash(rx), expected);
    }
}
