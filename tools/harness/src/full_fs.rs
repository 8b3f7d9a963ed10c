//! A small file system of its own for a directory (the controller's work
//! directory, say), that a test fills to make writes fail with ENOSPC the
//! way a full disk does, and empties again as an operator would.
//!
//! An ext4 image on a loop device, mounted on a fresh directory (the
//! harness runs as root, as it does for the node's namespaces); unmounted
//! and detached when dropped. The host's mounts are private, so the test
//! node's mount namespace does not see one made after it started:
//! [`SmallFs::share_with`] mounts the same device at the same path inside
//! the node too, and both mounts are one file system (the kernel keeps one
//! superblock per block device), so a hostPath volume of the directory is
//! this file system inside pods as well. (Where a shared mount above the
//! directory propagates the host's mount into the node, it is there already.)

use std::path::{Path, PathBuf};
use std::process::Command;

pub struct SmallFs {
    dir: tempfile::TempDir,
    /// The image file's directory (outside the mount).
    _image: tempfile::TempDir,
    device: String,
    filler: PathBuf,
    /// The node whose mount namespace has it too (its holder's pid).
    node_holder: std::sync::Mutex<Option<u32>>,
}

impl SmallFs {
    /// A `mib`-MiB file system on a new directory.
    pub fn new(mib: u64) -> anyhow::Result<SmallFs> {
        let image_dir = tempfile::Builder::new().prefix("vmmigrate-smallfs-image").tempdir()?;
        let image = image_dir.path().join("fs.img");
        std::fs::File::create(&image)?.set_len(mib << 20)?;
        // No blocks reserved for root: the controller runs as root here.
        run(Command::new("mkfs.ext4").args(["-q", "-F", "-m", "0"]).arg(&image))?;
        let device = run(Command::new("losetup").args(["-f", "--show"]).arg(&image))?.trim().to_owned();
        let dir = tempfile::Builder::new().prefix("vmmigrate-smallfs").tempdir()?;
        if let Err(e) = run(Command::new("mount").arg(&device).arg(dir.path())) {
            let _ = Command::new("losetup").arg("-d").arg(&device).status();
            return Err(e);
        }
        // Hidden, so nothing that lists the work directory mistakes it for its own.
        let filler = dir.path().join(".filler");
        Ok(SmallFs { dir, _image: image_dir, device, filler, node_holder: Default::default() })
    }

    /// Mounts the same file system at the same path inside `node`'s mount
    /// namespace (see the module's documentation).
    pub fn share_with(&self, node: &crate::node::Node) -> anyhow::Result<()> {
        let path = self.path().to_string_lossy().into_owned();
        // Already there when the host's mount reached the node (a shared
        // mount above it propagates into the node's slave namespace).
        let there = node.run(&["findmnt", "-n", "-o", "SOURCE", "--mountpoint", &path]).unwrap_or_default();
        if there.lines().all(|source| source.trim() != self.device) {
            node.run(&["mount", &self.device, &path])?;
        }
        *self.node_holder.lock().expect("holder lock") = Some(node.holder());
        Ok(())
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Bytes still free.
    pub fn free_bytes(&self) -> u64 {
        let out = Command::new("df").args(["--output=avail", "-B1"]).arg(self.path()).output();
        out.ok()
            .and_then(|o| {
                String::from_utf8_lossy(&o.stdout).lines().nth(1).and_then(|l| l.trim().parse().ok())
            })
            .unwrap_or(0)
    }

    /// Takes free space until only `leave` bytes are left (a filler file,
    /// as another tenant's data would).
    pub fn fill_leaving(&self, leave: u64) -> anyhow::Result<()> {
        let current = std::fs::metadata(&self.filler).map(|m| m.len()).unwrap_or(0);
        let target = (current + self.free_bytes()).saturating_sub(leave);
        let file = std::fs::OpenOptions::new().create(true).write(true).truncate(false).open(&self.filler)?;
        // Written, not sparse: only written blocks take space.
        file.set_len(0)?;
        let chunk = vec![0xA5u8; 1 << 20];
        let mut written = 0u64;
        use std::io::Write;
        let mut writer = std::io::BufWriter::new(file);
        while written < target {
            let n = chunk.len().min((target - written) as usize);
            writer.write_all(&chunk[..n])?;
            written += n as u64;
        }
        writer.flush()?;
        Ok(())
    }

    /// Gives the filler's space back.
    pub fn empty(&self) -> anyhow::Result<()> {
        match std::fs::remove_file(&self.filler) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
            _ => Ok(()),
        }
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        if let Some(holder) = self.node_holder.lock().ok().and_then(|h| *h) {
            let _ = Command::new("nsenter")
                .arg(format!("--mount=/proc/{holder}/ns/mnt"))
                .args(["--", "umount", "-l"])
                .arg(self.dir.path())
                .stderr(std::process::Stdio::null())
                .status();
        }
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .stderr(std::process::Stdio::null())
            .status();
        let _ = Command::new("losetup").arg("-d").arg(&self.device).status();
    }
}

/// Runs a command; its stdout, or an error with its stderr.
fn run(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd.stdin(std::process::Stdio::null()).output()?;
    anyhow::ensure!(
        out.status.success(),
        "{:?} failed ({}): {}",
        cmd.get_program(),
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
