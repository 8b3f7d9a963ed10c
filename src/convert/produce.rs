//! Turns one acquired raw disk into the artifact CDI imports. The in-process
//! runner and `vmmigrate convert` (what the Kubernetes Job runs) both call
//! [`produce`], so the two runners cannot drift apart.
//!
//! The artifact is complete only once its `.sha256` marker exists: every
//! attempt first removes what an earlier one left, writes through
//! `<output>.partial` (or virt-v2v's work directory), validates, renames,
//! and writes the marker last.

use super::artifact::{self, Marker};
use super::guest::{GuestConversionError, GuestInput, convert_guest};
use crate::api::GuestConversion;
use crate::api::Reason;
use crate::images::qemu::{self, QemuError};
use crate::machine::Failure;
use std::fmt;
use std::future::Future;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Artifacts are disk contents: readable by the owner's group (the staging
/// server), never by everyone.
const FILE_MODE: u32 = 0o640;
const DIR_MODE: u32 = 0o750;

/// How often the caller's progress counter is refreshed during a conversion.
const PROGRESS_INTERVAL: Duration = Duration::from_millis(250);

/// The artifact's disk format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputFormat {
    Raw,
    Qcow2,
}

impl OutputFormat {
    /// The qemu-img format name, also the artifact's file extension.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            OutputFormat::Raw => "raw",
            OutputFormat::Qcow2 => "qcow2",
        }
    }
}

impl fmt::Display for OutputFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, thiserror::Error)]
#[error("unknown output format {0:?} (expected raw or qcow2)")]
pub struct UnknownFormat(pub String);

impl FromStr for OutputFormat {
    type Err = UnknownFormat;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "raw" => Ok(OutputFormat::Raw),
            "qcow2" => Ok(OutputFormat::Qcow2),
            other => Err(UnknownFormat(other.to_owned())),
        }
    }
}

/// One disk to convert.
#[derive(Clone, Debug)]
pub struct ConversionRequest {
    /// The acquired copy, raw.
    pub input: PathBuf,
    /// Recorded while copying (lowercase hex).
    pub input_sha256: String,
    /// The copy's own marker file. When the input was modified after it, the
    /// input is hashed again and compared with `input_sha256` first.
    pub input_marker: Option<PathBuf>,
    /// The source disk's capacity in bytes.
    pub expected_virtual_size: u64,
    /// The artifact, e.g. `.../artifacts/<uid>/disk-0.qcow2`.
    pub output: PathBuf,
    pub format: OutputFormat,
}

#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error(
        "the acquired copy changed after its checksum was recorded: expected sha256 {expected}, found {actual}"
    )]
    InputCorrupt { expected: String, actual: String },
    #[error("the acquired copy {} does not exist", .0.display())]
    InputMissing(PathBuf),
    #[error(
        "the disk image's virtual size is {actual} bytes but the source disk's capacity is {expected} bytes"
    )]
    SizeMismatch { expected: u64, actual: u64 },
    #[error("the converted image is not valid: {0}")]
    InvalidOutput(String),
    #[error(transparent)]
    Guest(#[from] GuestConversionError),
    #[error(transparent)]
    Qemu(#[from] QemuError),
    #[error("conversion I/O error: {0}")]
    Io(#[from] io::Error),
}

impl ConvertError {
    /// The class and stable reason the state machine acts on.
    pub fn failure(&self) -> Failure {
        let message = self.to_string();
        match self {
            ConvertError::InputCorrupt { .. } => Failure::retryable(Reason::AcquiredCopyCorrupt, message),
            ConvertError::InputMissing(_) => Failure::retryable(Reason::AcquiredCopyMissing, message),
            ConvertError::SizeMismatch { .. } => Failure::needs_human(Reason::VirtualSizeMismatch, message),
            ConvertError::InvalidOutput(_) => Failure::retryable(Reason::InvalidArtifact, message),
            ConvertError::Guest(GuestConversionError::NotInstalled) => {
                Failure::needs_human(Reason::VirtV2vNotInstalled, message)
            }
            ConvertError::Guest(GuestConversionError::Io(_)) => {
                Failure::local_write(Reason::ConversionIoError, message)
            }
            // virt-v2v 2.2 finds a UEFI guest's GRUB only by a grub.cfg under
            // /boot/efi/EFI, where distributions' installers put one.
            ConvertError::Guest(GuestConversionError::Failed { tail, .. })
                if tail.contains("no bootloader detected") =>
            {
                Failure::needs_human(
                    Reason::VirtV2vFailed,
                    format!(
                        "{message} (virt-v2v looks for a UEFI guest's grub.cfg under /boot/efi/EFI/<distribution>/, where Debian's and RHEL's installers put one; a guest whose only grub.cfg is /boot/grub/grub.cfg needs one there: see docs/compatibility.md)"
                    ),
                )
            }
            // Its usual failures (guest not recognised, no drivers for it) do not go away on retry.
            ConvertError::Guest(_) => Failure::needs_human(Reason::VirtV2vFailed, message),
            ConvertError::Qemu(QemuError::NotInstalled) => {
                Failure::needs_human(Reason::QemuImgNotInstalled, message)
            }
            ConvertError::Qemu(_) => Failure::local_write(Reason::QemuImgFailed, message),
            ConvertError::Io(_) => Failure::local_write(Reason::ConversionIoError, message),
        }
    }
}

/// Produces the artifact for `req` and returns its marker (already written).
/// `progress` receives the bytes of the input done so far.
pub async fn produce(req: &ConversionRequest, progress: &AtomicU64) -> Result<Marker, ConvertError> {
    let input_size = prepare(req).await?;
    let marker = match req.format {
        OutputFormat::Raw => {
            let marker = link_raw(req, input_size).await?;
            progress.store(input_size, Ordering::Relaxed);
            marker
        }
        // Progress comes from qemu-img's own report.
        OutputFormat::Qcow2 => convert_qcow2(req, input_size, progress).await?,
    };
    artifact::write_marker(&req.output, &marker)?;
    tracing::info!(output = %req.output.display(), format = %req.format, size = marker.size, "artifact produced");
    Ok(marker)
}

/// Removes what an earlier attempt left of `req`'s output and checks its
/// input (there, still what was copied, of the source disk's size); returns
/// the input's size in bytes.
async fn prepare(req: &ConversionRequest) -> Result<u64, ConvertError> {
    if req.output == req.input {
        return Err(ConvertError::InvalidOutput(format!(
            "the output {} is the acquired copy itself",
            req.output.display()
        )));
    }
    let input_size = match tokio::fs::metadata(&req.input).await {
        Ok(meta) if meta.is_file() => meta.len(),
        Ok(_) => return Err(ConvertError::InputMissing(req.input.clone())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(ConvertError::InputMissing(req.input.clone()));
        }
        Err(e) => return Err(e.into()),
    };
    artifact::remove_with_markers(&req.output)?;
    if let Some(parent) = req.output.parent().filter(|p| !p.as_os_str().is_empty()) {
        tokio::fs::DirBuilder::new().recursive(true).mode(DIR_MODE).create(parent).await?;
    }
    verify_input(req).await?;
    let input = qemu::info(&req.input, Some("raw")).await?;
    if input.virtual_size != req.expected_virtual_size {
        return Err(ConvertError::SizeMismatch {
            expected: req.expected_virtual_size,
            actual: input.virtual_size,
        });
    }
    Ok(input_size)
}

/// A whole guest to convert: one request per disk, in the inventory's order.
pub(crate) struct GuestRequest<'a> {
    pub disks: &'a [ConversionRequest],
    pub inventory: &'a crate::api::SourceInventory,
    /// See [`GuestInput::force_tcg`].
    pub force_tcg: bool,
    /// Where virt-v2v works; emptied first and removed at the end.
    pub work: PathBuf,
    /// Where the report (JSON) is written, beside the artifacts, before
    /// their markers.
    pub report: PathBuf,
}

/// Converts a guest over all of its disks at once (virt-v2v, then its NICs'
/// names pinned) and turns each converted disk into its request's artifact,
/// validated, hashed and marked like any other; virt-v2v's log is kept as
/// `virt-v2v.log` beside the report. Returns the markers and what was done.
pub(crate) async fn produce_guest(
    guest: &GuestRequest<'_>,
) -> Result<(Vec<Marker>, GuestConversion), ConvertError> {
    let virt_v2v = qemu::virt_v2v_path().ok_or(GuestConversionError::NotInstalled)?;
    if guest.disks.is_empty() {
        return Err(ConvertError::InvalidOutput("a guest without disks".into()));
    }
    artifact::remove_if_present(&guest.report)?;
    for req in guest.disks {
        prepare(req).await?;
    }
    let inputs: Vec<PathBuf> = guest.disks.iter().map(|r| r.input.clone()).collect();
    let input = GuestInput {
        name: "guest",
        inventory: guest.inventory,
        disks: &inputs,
        // Raw always: each disk's raw sha256 is what its volume will hold.
        format: OutputFormat::Raw,
        force_tcg: guest.force_tcg,
    };
    // virt-v2v's log outlives its work directory, whatever happened.
    let kept_log = guest.report.with_file_name("virt-v2v.log");
    artifact::remove_if_present(&kept_log)?;
    let result = async {
        let converted = convert_guest(&virt_v2v, &input, &guest.work).await;
        let _ = tokio::fs::rename(guest.work.join("virt-v2v.log"), &kept_log).await;
        let (converted, mut report) = match converted {
            Ok(converted) => (converted.disks, converted.report),
            Err(GuestConversionError::Failed { tail, .. }) => {
                let log = kept_log.display().to_string();
                return Err(GuestConversionError::Failed { log, tail }.into());
            }
            Err(e) => return Err(e.into()),
        };
        report.log = kept_log.display().to_string();
        let mut sealed = Vec::with_capacity(guest.disks.len());
        for (produced, req) in converted.iter().zip(guest.disks) {
            let (marker, raw_sha256) = seal_converted(produced, req).await?;
            report.disk_sha256.push(raw_sha256);
            sealed.push((marker, req));
        }
        let json = serde_json::to_vec_pretty(&report).map_err(io::Error::other)?;
        tokio::fs::write(&guest.report, json).await?;
        // The markers last: a guest is converted once every disk has one.
        let mut markers = Vec::with_capacity(sealed.len());
        for (marker, req) in sealed {
            artifact::write_marker(&req.output, &marker)?;
            markers.push(marker);
        }
        Ok::<_, ConvertError>((markers, report))
    }
    .await;
    remove_dir_if_present(&guest.work).await?;
    let (markers, report) = result?;
    tracing::info!(disks = markers.len(), seconds = report.seconds, guest = %report.guest, "guest converted");
    Ok((markers, report))
}

/// Turns one of virt-v2v's raw disks into `req`'s artifact; returns its
/// marker and the raw bytes' sha256 (the artifact's own for raw).
async fn seal_converted(produced: &Path, req: &ConversionRequest) -> Result<(Marker, String), ConvertError> {
    match req.format {
        OutputFormat::Raw => {
            let marker = finish(produced, OutputFormat::Raw, req).await?;
            let raw = marker.sha256.clone();
            Ok((marker, raw))
        }
        OutputFormat::Qcow2 => {
            let (_, raw) = hash(produced).await?;
            let partial = artifact::partial_path(&req.output);
            let per_mille = AtomicU64::new(0);
            let result = async {
                qemu::convert(produced, "raw", &partial, "qcow2", &per_mille).await?;
                finish(&partial, OutputFormat::Qcow2, req).await
            }
            .await;
            if result.is_err() {
                let _ = artifact::remove_if_present(&partial);
            }
            Ok((result?, raw))
        }
    }
}

/// What [`produce_guest`] reported, read back (`None` when absent or unreadable).
pub(crate) fn read_guest_report(path: &Path) -> Option<GuestConversion> {
    let bytes = std::fs::read(path).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// Hashes the input again when it was written after its marker: the recorded
/// checksum no longer vouches for it. (Progress is not reported for this pass.)
async fn verify_input(req: &ConversionRequest) -> Result<(), ConvertError> {
    let Some(marker) = &req.input_marker else { return Ok(()) };
    if artifact::marker_is_fresh(&req.input, marker) {
        return Ok(());
    }
    let (_, actual) = hash(&req.input).await?;
    let expected = req.input_sha256.to_ascii_lowercase();
    if actual != expected {
        return Err(ConvertError::InputCorrupt { expected, actual });
    }
    Ok(())
}

/// Raw: the acquired copy already is the artifact, so it is linked, not
/// rewritten or hashed again. The link shares the copy's inode and mode.
async fn link_raw(req: &ConversionRequest, input_size: u64) -> Result<Marker, ConvertError> {
    match tokio::fs::hard_link(&req.input, &req.output).await {
        Ok(()) => {}
        // Another file system, or a hard link the kernel refuses
        // (fs.protected_hardlinks when the copy has another owner): copy instead.
        Err(e) if matches!(e.kind(), io::ErrorKind::CrossesDevices | io::ErrorKind::PermissionDenied) => {
            let partial = artifact::partial_path(&req.output);
            let copied = async {
                tokio::fs::copy(&req.input, &partial).await?;
                seal(&partial, &req.output).await
            }
            .await;
            if copied.is_err() {
                let _ = artifact::remove_if_present(&partial);
            }
            copied?;
        }
        Err(e) => return Err(e.into()),
    }
    Ok(Marker { size: input_size, sha256: req.input_sha256.to_ascii_lowercase() })
}

async fn convert_qcow2(
    req: &ConversionRequest,
    input_size: u64,
    progress: &AtomicU64,
) -> Result<Marker, ConvertError> {
    let partial = artifact::partial_path(&req.output);
    let result = async {
        let per_mille = AtomicU64::new(0);
        let conversion = qemu::convert(&req.input, "raw", &partial, "qcow2", &per_mille);
        mirrored(conversion, &per_mille, progress, |pm| {
            (u128::from(pm.min(1000)) * u128::from(input_size) / 1000) as u64
        })
        .await?;
        finish(&partial, OutputFormat::Qcow2, req).await
    }
    .await;
    if result.is_err() {
        let _ = artifact::remove_if_present(&partial);
    }
    result
}

/// Validates a freshly written image, hashes it and renames it to the output.
async fn finish(
    produced: &Path,
    format: OutputFormat,
    req: &ConversionRequest,
) -> Result<Marker, ConvertError> {
    qemu::check(produced, format.as_str()).await.map_err(|e| match e {
        QemuError::Failed { .. } => ConvertError::InvalidOutput(e.to_string()),
        other => other.into(),
    })?;
    let info = qemu::info(produced, Some(format.as_str())).await?;
    if info.virtual_size != req.expected_virtual_size {
        return Err(ConvertError::SizeMismatch {
            expected: req.expected_virtual_size,
            actual: info.virtual_size,
        });
    }
    let (size, sha256) = hash(produced).await?;
    seal(produced, &req.output).await?;
    Ok(Marker { size, sha256 })
}

/// Restricts, flushes and renames a finished file into place.
async fn seal(file: &Path, to: &Path) -> io::Result<()> {
    tokio::fs::set_permissions(file, std::fs::Permissions::from_mode(FILE_MODE)).await?;
    tokio::fs::File::open(file).await?.sync_all().await?;
    tokio::fs::rename(file, to).await
}

async fn hash(path: &Path) -> io::Result<(u64, String)> {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || artifact::sha256_file(&path, None)).await.map_err(io::Error::other)?
}

/// Runs `work`, copying `local` through `scale` into `progress` as it goes.
async fn mirrored<T>(
    work: impl Future<Output = T>,
    local: &AtomicU64,
    progress: &AtomicU64,
    scale: impl Fn(u64) -> u64,
) -> T {
    let publish = || progress.store(scale(local.load(Ordering::Relaxed)), Ordering::Relaxed);
    let mut tick = tokio::time::interval(PROGRESS_INTERVAL);
    let mut work = std::pin::pin!(work);
    let out = loop {
        tokio::select! {
            out = &mut work => break out,
            _ = tick.tick() => publish(),
        }
    };
    publish();
    out
}

async fn remove_dir_if_present(dir: &Path) -> io::Result<()> {
    match tokio::fs::remove_dir_all(dir).await {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}
