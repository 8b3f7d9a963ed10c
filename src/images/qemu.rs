//! Thin async wrapper over the `qemu-img` command line.
//!
//! qemu-img runs directly, never through a shell, with every argument its own
//! argv entry. Paths are passed so that they start with `/` or `./`: qemu-img
//! would otherwise read a leading `-` as an option and a prefix such as `nbd:`
//! or `json:` as a protocol instead of a file name.

use serde::Deserialize;
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::io::AsyncReadExt;
use tokio::process::Command;

const QEMU_IMG: &str = "qemu-img";

/// What `qemu-img info` reports about an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageInfo {
    pub format: String,
    /// The size the guest sees, in bytes.
    pub virtual_size: u64,
    /// Bytes allocated on the host file system.
    pub actual_size: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum QemuError {
    #[error("qemu-img is not installed (not found in PATH)")]
    NotInstalled,
    #[error("{what} failed: {stderr}")]
    Failed { what: String, stderr: String },
    #[error("cannot parse qemu-img output: {0}")]
    Unparsable(String),
    #[error("running qemu-img: {0}")]
    Io(#[from] io::Error),
}

/// `qemu-img info --output=json [-f format] <path>`. Give the format whenever
/// it is known: probing an untrusted raw image could take it for another format.
pub async fn info(path: &Path, format: Option<&str>) -> Result<ImageInfo, QemuError> {
    let mut cmd = qemu_img();
    cmd.args(["info", "--output=json"]);
    if let Some(format) = format {
        cmd.args(["-f", format]);
    }
    cmd.arg(path_arg(path));
    let out = output(cmd).await?;
    if !out.status.success() {
        return Err(failed(format!("qemu-img info of {}", path.display()), &out.stderr));
    }
    parse_info(&out.stdout)
}

/// `qemu-img check --output=json -f <format> <path>`. Leaked clusters (exit
/// 3) waste space but lose no data, so they pass. Raw images have nothing to
/// check (qemu-img refuses) and pass too.
pub async fn check(path: &Path, format: &str) -> Result<(), QemuError> {
    if format == "raw" {
        return Ok(());
    }
    let mut cmd = qemu_img();
    cmd.args(["check", "--output=json", "-f", format]).arg(path_arg(path));
    let out = output(cmd).await?;
    match out.status.code() {
        Some(0) | Some(3) => Ok(()),
        Some(2) => Err(QemuError::Failed {
            what: format!("qemu-img check of {}", path.display()),
            stderr: format!("the image is corrupt: {}", String::from_utf8_lossy(&out.stdout).trim()),
        }),
        _ => Err(failed(format!("qemu-img check of {}", path.display()), &out.stderr)),
    }
}

/// `qemu-img convert -p -f <input_format> -O <output_format> <input> <output>`,
/// storing the progress qemu-img prints in per-mille (0..=1000) as it goes.
pub async fn convert(
    input: &Path,
    input_format: &str,
    output: &Path,
    output_format: &str,
    progress: &AtomicU64,
) -> Result<(), QemuError> {
    let mut cmd = qemu_img();
    cmd.args(["convert", "-p", "-f", input_format, "-O", output_format])
        .arg(path_arg(input))
        .arg(path_arg(output))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(spawn_error)?;
    let (Some(mut stdout), Some(mut stderr)) = (child.stdout.take(), child.stderr.take()) else {
        return Err(QemuError::Io(io::Error::other("qemu-img pipes were not captured")));
    };
    let read_progress = async {
        // "    (12.34/100%)\r" repeated; a line is whatever lies between \r or \n.
        let mut pending = Vec::new();
        let mut buf = [0u8; 512];
        loop {
            let n = stdout.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            pending.extend_from_slice(&buf[..n]);
            while let Some(end) = pending.iter().position(|&b| b == b'\r' || b == b'\n') {
                let line: Vec<u8> = pending.drain(..=end).collect();
                record_progress(&line, progress);
            }
            // Output that never ends a line is not progress; do not keep it.
            if pending.len() > 4096 {
                pending.clear();
            }
        }
        record_progress(&pending, progress);
        Ok::<_, io::Error>(())
    };
    let read_stderr = async {
        let mut text = Vec::new();
        stderr.read_to_end(&mut text).await.map(|_| text)
    };
    let (read, stderr_text) = tokio::join!(read_progress, read_stderr);
    let status = child.wait().await?;
    read?;
    let stderr_text = stderr_text?;
    if !status.success() {
        return Err(failed(format!("qemu-img convert of {}", input.display()), &stderr_text));
    }
    Ok(())
}

/// One range of `qemu-img map --output=json`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct MapRange {
    pub start: u64,
    pub length: u64,
    /// Allocated in this image (not read through to a backing file or unallocated).
    #[serde(default)]
    pub present: bool,
    #[serde(default)]
    pub zero: bool,
    #[serde(default)]
    pub data: bool,
    /// Where a data range's bytes lie in the image's data file.
    #[serde(default)]
    pub offset: Option<u64>,
}

/// `qemu-img map --output=json -f <format> <path>`: what each range of the
/// image is, and where its data lies.
pub async fn map(path: &Path, format: &str) -> Result<Vec<MapRange>, QemuError> {
    let mut cmd = qemu_img();
    cmd.args(["map", "--output=json", "-f", format]).arg(path_arg(path));
    let out = output(cmd).await?;
    if !out.status.success() {
        return Err(failed(format!("qemu-img map of {}", path.display()), &out.stderr));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| QemuError::Unparsable(format!("qemu-img map: {e}")))
}

/// The first executable `virt-v2v` in an absolute `$PATH` directory.
pub(crate) fn virt_v2v_path() -> Option<PathBuf> {
    find_executable("virt-v2v", &std::env::var_os("PATH")?)
}

/// The first executable `guestfish` in an absolute `$PATH` directory
/// (conversion pins the guest's interface names with it).
pub(crate) fn guestfish_path() -> Option<PathBuf> {
    find_executable("guestfish", &std::env::var_os("PATH")?)
}

fn find_executable(name: &str, path_var: &OsStr) -> Option<PathBuf> {
    std::env::split_paths(path_var)
        .filter(|dir| dir.is_absolute())
        .map(|dir| dir.join(name))
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

fn qemu_img() -> Command {
    let mut cmd = Command::new(QEMU_IMG);
    cmd.kill_on_drop(true).stdin(Stdio::null());
    cmd
}

async fn output(mut cmd: Command) -> Result<Output, QemuError> {
    cmd.output().await.map_err(spawn_error)
}

fn spawn_error(e: io::Error) -> QemuError {
    if e.kind() == io::ErrorKind::NotFound { QemuError::NotInstalled } else { QemuError::Io(e) }
}

fn failed(what: String, stderr: &[u8]) -> QemuError {
    QemuError::Failed { what, stderr: String::from_utf8_lossy(stderr).trim().to_owned() }
}

/// `path` as qemu-img must see it: absolute, or relative with a `./` prefix.
fn path_arg(path: &Path) -> OsString {
    if path.is_absolute() {
        path.as_os_str().to_owned()
    } else {
        let mut arg = OsString::from("./");
        arg.push(path);
        arg
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "kebab-case")]
struct InfoJson {
    format: String,
    virtual_size: u64,
    /// Optional in qemu's schema: some protocols cannot tell.
    #[serde(default)]
    actual_size: u64,
}

fn parse_info(json: &[u8]) -> Result<ImageInfo, QemuError> {
    let info: InfoJson = serde_json::from_slice(json).map_err(|e| {
        QemuError::Unparsable(format!("qemu-img info: {e}: {}", String::from_utf8_lossy(json).trim()))
    })?;
    Ok(ImageInfo { format: info.format, virtual_size: info.virtual_size, actual_size: info.actual_size })
}

fn record_progress(line: &[u8], progress: &AtomicU64) {
    if let Some(per_mille) = std::str::from_utf8(line).ok().and_then(parse_progress) {
        progress.fetch_max(per_mille, Ordering::Relaxed);
    }
}

/// Per-mille from one progress line, `"    (12.34/100%)"` giving 123.
fn parse_progress(line: &str) -> Option<u64> {
    let inner = line.trim().strip_prefix('(')?.strip_suffix("/100%)")?;
    let percent: f64 = inner.parse().ok()?;
    percent.is_finite().then(|| (percent * 10.0).floor().clamp(0.0, 1000.0) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_lines_give_per_mille_and_other_text_gives_nothing() {
        assert_eq!(parse_progress("    (0.00/100%)"), Some(0));
        assert_eq!(parse_progress("    (12.34/100%)"), Some(123));
        assert_eq!(parse_progress("(99.99/100%)"), Some(999));
        assert_eq!(parse_progress("    (100.00/100%)"), Some(1000));
        assert_eq!(parse_progress(""), None);
        assert_eq!(parse_progress("qemu-img: warning"), None);
        assert_eq!(parse_progress("(nan/100%)"), None);
    }

    #[test]
    fn progress_only_moves_forward() {
        let progress = AtomicU64::new(0);
        record_progress(b"    (50.00/100%)\r", &progress);
        record_progress(b"    (25.00/100%)\r", &progress);
        assert_eq!(progress.load(Ordering::Relaxed), 500);
    }

    #[test]
    fn info_json_is_parsed_and_actual_size_is_optional() {
        let json = br#"{
            "virtual-size": 8388608, "filename": "a.qcow2", "cluster-size": 65536,
            "format": "qcow2", "actual-size": 8654848, "dirty-flag": false,
            "format-specific": {"type": "qcow2", "data": {"compat": "1.1"}}
        }"#;
        assert_eq!(
            parse_info(json).unwrap(),
            ImageInfo { format: "qcow2".into(), virtual_size: 8388608, actual_size: 8654848 }
        );
        let no_actual = br#"{"virtual-size": 512, "format": "raw"}"#;
        assert_eq!(parse_info(no_actual).unwrap().actual_size, 0);
        assert!(matches!(parse_info(b"qemu-img: oops"), Err(QemuError::Unparsable(_))));
        assert!(matches!(parse_info(br#"{"format": "raw"}"#), Err(QemuError::Unparsable(_))));
    }

    #[test]
    fn paths_can_be_read_neither_as_options_nor_as_protocols() {
        assert_eq!(path_arg(Path::new("/a/nbd:x")), OsString::from("/a/nbd:x"));
        assert_eq!(path_arg(Path::new("-f")), OsString::from("./-f"));
        assert_eq!(path_arg(Path::new("json:{}")), OsString::from("./json:{}"));
    }

    #[test]
    fn only_executable_files_in_absolute_path_entries_are_found() {
        let dir = tempfile::tempdir().unwrap();
        let (plain, exec) = (dir.path().join("plain"), dir.path().join("exec"));
        std::fs::create_dir_all(&plain).unwrap();
        std::fs::create_dir_all(&exec).unwrap();
        let write = |p: &Path, mode| {
            std::fs::write(p, b"#!/bin/sh\n").unwrap();
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
        };
        write(&plain.join("virt-v2v"), 0o644);
        write(&exec.join("virt-v2v"), 0o755);
        let path_var = std::env::join_paths([Path::new("relative"), &plain, &exec]).unwrap();
        assert_eq!(find_executable("virt-v2v", &path_var), Some(exec.join("virt-v2v")));
        let only_plain = std::env::join_paths([&plain]).unwrap();
        assert_eq!(find_executable("virt-v2v", &only_plain), None);
    }
}
