//! Producing artifacts from acquired raw disks with the real qemu-img.
//! How a whole-guest conversion that cannot work is reported (its runs are
//! `migration_e2e::vmware_guests`).

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use vmmigrate::convert::artifact::{self, Marker};
use vmmigrate::convert::produce::{ConversionRequest, ConvertError, OutputFormat, produce};
use vmmigrate::machine::FailureClass;

const DISK_SIZE: u64 = 8 << 20;

/// An 8 MiB raw disk: patterned data with zeroed regions, so qcow2 has holes to skip.
fn write_disk(path: &Path) -> String {
    let mut data: Vec<u8> = (0..DISK_SIZE).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    data[(1 << 20)..(3 << 20)].fill(0);
    data[(6 << 20)..(6 << 20) + 4096].fill(0);
    fs::write(path, &data).unwrap();
    artifact::sha256_file(path, None).unwrap().1
}

struct Disk {
    _dir: tempfile::TempDir,
    input: PathBuf,
    sha256: String,
    artifacts: PathBuf,
}

fn disk() -> Disk {
    // qemu-img comes from a Debian package the harness installs on first use.
    vmmigrate_harness::setup::packages().expect("the Debian packages the tests need");
    let dir = tempfile::tempdir().unwrap();
    let copies = dir.path().join("copies/ns/vm/uid");
    fs::create_dir_all(&copies).unwrap();
    let input = copies.join("disk-0.raw");
    let sha256 = write_disk(&input);
    let artifacts = dir.path().join("artifacts/uid");
    Disk { input, sha256, artifacts, _dir: dir }
}

fn request(disk: &Disk, format: OutputFormat) -> ConversionRequest {
    ConversionRequest {
        input: disk.input.clone(),
        input_sha256: disk.sha256.clone(),
        input_marker: None,
        expected_virtual_size: DISK_SIZE,
        output: disk.artifacts.join(format!("disk-0.{format}")),
        format,
    }
}

#[tokio::test]
async fn raw_artifact_is_the_acquired_copy_without_an_extra_pass() {
    let disk = disk();
    let req = request(&disk, OutputFormat::Raw);
    let progress = AtomicU64::new(0);
    let marker = produce(&req, &progress).await.unwrap();

    assert_eq!(marker, Marker { size: DISK_SIZE, sha256: disk.sha256.clone() });
    assert_eq!(artifact::read_marker(&req.output), Some(marker));
    assert_eq!(fs::metadata(&req.output).unwrap().ino(), fs::metadata(&disk.input).unwrap().ino());
    assert_eq!(progress.load(Ordering::Relaxed), DISK_SIZE);
    assert!(!artifact::partial_path(&req.output).exists());
}

#[tokio::test]
async fn qcow2_artifact_round_trips_to_the_same_bytes() {
    let disk = disk();
    let req = request(&disk, OutputFormat::Qcow2);
    let progress = AtomicU64::new(0);
    let marker = produce(&req, &progress).await.unwrap();

    assert_eq!(artifact::read_marker(&req.output), Some(marker.clone()));
    assert_eq!(artifact::sha256_file(&req.output, None).unwrap(), (marker.size, marker.sha256));
    assert_eq!(progress.load(Ordering::Relaxed), DISK_SIZE);
    assert!(!artifact::partial_path(&req.output).exists());
    assert_eq!(fs::metadata(&req.output).unwrap().mode() & 0o007, 0, "artifact is world-accessible");

    let back = disk.artifacts.join("back.raw");
    let status = Command::new("qemu-img")
        .args(["convert", "-f", "qcow2", "-O", "raw"])
        .arg(&req.output)
        .arg(&back)
        .status()
        .unwrap();
    assert!(status.success());
    assert_eq!(artifact::sha256_file(&back, None).unwrap(), (DISK_SIZE, disk.sha256.clone()));
}

#[tokio::test]
async fn virtual_size_mismatch_is_reported_and_leaves_no_output() {
    let disk = disk();
    for format in [OutputFormat::Raw, OutputFormat::Qcow2] {
        let req = ConversionRequest { expected_virtual_size: DISK_SIZE + 512, ..request(&disk, format) };
        let err = produce(&req, &AtomicU64::new(0)).await.unwrap_err();

        assert!(
            matches!(err, ConvertError::SizeMismatch { expected, actual } if expected == DISK_SIZE + 512 && actual == DISK_SIZE),
            "{err:?}"
        );
        let failure = err.failure();
        assert_eq!(
            (failure.class, failure.reason.as_str()),
            (FailureClass::NeedsHuman, "VirtualSizeMismatch")
        );
        for leftover in
            [req.output.clone(), artifact::partial_path(&req.output), artifact::marker_path(&req.output)]
        {
            assert!(!leftover.exists(), "{} left behind", leftover.display());
        }
    }
}

#[tokio::test]
async fn stale_partial_output_is_removed_and_redone() {
    let disk = disk();
    let req = request(&disk, OutputFormat::Qcow2);
    fs::create_dir_all(&disk.artifacts).unwrap();
    fs::write(artifact::partial_path(&req.output), b"half a qcow2 from a crashed attempt").unwrap();
    fs::write(&req.output, b"an older artifact").unwrap();
    fs::write(artifact::marker_path(&req.output), format!("17 {}\n", "0".repeat(64))).unwrap();
    fs::write(artifact::corrupt_path(&req.output), b"").unwrap();

    let marker = produce(&req, &AtomicU64::new(0)).await.unwrap();

    assert!(!artifact::partial_path(&req.output).exists());
    assert!(!artifact::corrupt_path(&req.output).exists());
    assert_eq!(artifact::read_marker(&req.output), Some(marker.clone()));
    assert_eq!(artifact::sha256_file(&req.output, None).unwrap(), (marker.size, marker.sha256));
    let info = vmmigrate::images::qemu::info(&req.output, Some("qcow2")).await.unwrap();
    assert_eq!(info.virtual_size, DISK_SIZE);
}

#[tokio::test]
async fn input_modified_after_its_checksum_was_recorded_is_detected() {
    let disk = disk();
    artifact::write_marker(&disk.input, &Marker { size: DISK_SIZE, sha256: disk.sha256.clone() }).unwrap();
    let input_marker = artifact::marker_path(&disk.input);

    // A fresh marker is trusted: no second hashing pass.
    let req =
        ConversionRequest { input_marker: Some(input_marker.clone()), ..request(&disk, OutputFormat::Raw) };
    produce(&req, &AtomicU64::new(0)).await.unwrap();

    // Flip one byte, then make the data visibly newer than its marker.
    let mut data = fs::read(&disk.input).unwrap();
    data[4 << 20] ^= 0xff;
    fs::remove_file(&req.output).unwrap(); // the raw artifact is a hard link to the input
    fs::write(&disk.input, &data).unwrap();
    let later = fs::metadata(&input_marker).unwrap().modified().unwrap() + std::time::Duration::from_secs(1);
    fs::File::options().write(true).open(&disk.input).unwrap().set_modified(later).unwrap();

    for format in [OutputFormat::Raw, OutputFormat::Qcow2] {
        let req = ConversionRequest { input_marker: Some(input_marker.clone()), ..request(&disk, format) };
        let err = produce(&req, &AtomicU64::new(0)).await.unwrap_err();
        assert!(
            matches!(&err, ConvertError::InputCorrupt { expected, actual } if *expected == disk.sha256 && *actual != disk.sha256),
            "{err:?}"
        );
        let failure = err.failure();
        assert_eq!(
            (failure.class, failure.reason.as_str()),
            (FailureClass::Retryable, "AcquiredCopyCorrupt")
        );
        assert!(!req.output.exists());
        assert!(!artifact::marker_path(&req.output).exists());
    }
}

#[tokio::test]
async fn missing_input_is_reported_as_a_missing_copy() {
    let disk = disk();
    fs::remove_file(&disk.input).unwrap();
    let err = produce(&request(&disk, OutputFormat::Qcow2), &AtomicU64::new(0)).await.unwrap_err();
    assert!(matches!(err, ConvertError::InputMissing(_)), "{err:?}");
    assert_eq!(err.failure().reason, "AcquiredCopyMissing");
}

#[test]
fn convert_command_prints_the_marker_and_fails_with_the_reason() {
    let disk = disk();
    let output = disk.artifacts.join("disk-0.qcow2");
    let run = |expected_size: u64| {
        Command::new(env!("CARGO_BIN_EXE_vmmigrate"))
            .arg("convert")
            .arg("--input")
            .arg(&disk.input)
            .args(["--input-sha256", &disk.sha256, "--expected-size", &expected_size.to_string()])
            .arg("--output")
            .arg(&output)
            .args(["--format", "qcow2"])
            .arg("--input-marker")
            .arg(artifact::marker_path(&disk.input))
            .output()
            .unwrap()
    };

    let ok = run(DISK_SIZE);
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let stdout = String::from_utf8(ok.stdout).unwrap();
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    let printed: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let marker = artifact::read_marker(&output).unwrap();
    assert_eq!(printed, serde_json::json!({ "size": marker.size, "sha256": marker.sha256 }));

    let failed = run(DISK_SIZE * 2);
    assert_eq!(failed.status.code(), Some(1));
    let stderr = String::from_utf8(failed.stderr).unwrap();
    assert!(stderr.starts_with("error: VirtualSizeMismatch: "), "{stderr}");
    assert!(failed.stdout.is_empty());
    assert!(!output.exists());
}

#[tokio::test]
async fn qemu_img_progress_is_parsed_up_to_completion() {
    let disk = disk();
    fs::create_dir_all(&disk.artifacts).unwrap();
    let output = disk.artifacts.join("direct.qcow2");
    let per_mille = AtomicU64::new(0);
    vmmigrate::images::qemu::convert(&disk.input, "raw", &output, "qcow2", &per_mille).await.unwrap();
    assert_eq!(per_mille.load(Ordering::Relaxed), 1000);
    vmmigrate::images::qemu::check(&output, "qcow2").await.unwrap();

    // A failed conversion carries qemu-img's own words.
    let err = vmmigrate::images::qemu::convert(
        &disk.input,
        "raw",
        &disk.artifacts.join("no/such/dir/x.qcow2"),
        "qcow2",
        &AtomicU64::new(0),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("No such file or directory"), "{err}");
}

#[tokio::test]
async fn qcow2_with_broken_refcounts_fails_its_check() {
    let disk = disk();
    fs::create_dir_all(&disk.artifacts).unwrap();
    let image = disk.artifacts.join("broken.qcow2");
    vmmigrate::images::qemu::convert(&disk.input, "raw", &image, "qcow2", &AtomicU64::new(0)).await.unwrap();
    // Zero the first refcount block: every cluster in use now has refcount 0.
    let mut bytes = fs::read(&image).unwrap();
    let table = u64::from_be_bytes(bytes[48..56].try_into().unwrap()) as usize;
    let block = u64::from_be_bytes(bytes[table..table + 8].try_into().unwrap()) as usize;
    bytes[block..block + 512].fill(0);
    fs::write(&image, bytes).unwrap();

    let err = vmmigrate::images::qemu::check(&image, "qcow2").await.unwrap_err();
    assert!(err.to_string().contains("the image is corrupt"), "{err}");
    vmmigrate::images::qemu::check(&disk.input, "raw").await.unwrap();
}

#[test]
fn a_guest_conversion_that_cannot_work_needs_a_person_and_says_what_to_change() {
    use vmmigrate::convert::guest::GuestConversionError;
    let missing = ConvertError::Guest(GuestConversionError::NotInstalled).failure();
    assert_eq!((missing.class, missing.reason.as_str()), (FailureClass::NeedsHuman, "VirtV2vNotInstalled"));
    let unsigned_grub = ConvertError::Guest(GuestConversionError::Failed {
        log: "/work/artifacts/u/virt-v2v.log".into(),
        tail: "virt-v2v: error: no bootloader detected".into(),
    })
    .failure();
    assert_eq!(
        (unsigned_grub.class, unsigned_grub.reason.as_str()),
        (FailureClass::NeedsHuman, "VirtV2vFailed")
    );
    assert!(unsigned_grub.message.contains("/work/artifacts/u/virt-v2v.log"), "{}", unsigned_grub.message);
    assert!(unsigned_grub.message.contains("/boot/efi/EFI"), "{}", unsigned_grub.message);
    let other = ConvertError::Guest(GuestConversionError::Failed {
        log: "l".into(),
        tail: "virt-v2v: error: inspection could not detect the source guest".into(),
    })
    .failure();
    assert!(!other.message.contains("/boot/efi/EFI"), "{}", other.message);
    let io = ConvertError::Guest(GuestConversionError::Io(std::io::Error::other("disk full"))).failure();
    assert_eq!(io.reason, "ConversionIoError");
}
