//! Host and user keys, and files written with the modes sshd insists on.

use super::*;

pub(super) fn keygen(path: &Path, args: &[&str]) -> anyhow::Result<Child> {
    Ok(Command::new("ssh-keygen")
        .args(["-q", "-N", "", "-C", "vmmigrate-esxi-emulator"])
        .args(args)
        .arg("-f")
        .arg(path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()?)
}

pub(super) trait WaitOk {
    fn wait_ok(self, what: &str) -> anyhow::Result<()>;
}

impl WaitOk for Child {
    fn wait_ok(mut self, what: &str) -> anyhow::Result<()> {
        let status = self.wait()?;
        ensure!(status.success(), "{what} failed ({status})");
        Ok(())
    }
}

/// The ECDSA host key and the two client keys, generated concurrently.
pub(super) fn generate_keys(dir: &Path) -> anyhow::Result<()> {
    let children = [
        keygen(&dir.join("ssh_host_ecdsa_key"), &["-t", "ecdsa", "-b", "256"])?,
        keygen(&dir.join("id_rsa"), &["-t", "rsa", "-b", "3072"])?,
        keygen(&dir.join("id_ed25519"), &["-t", "ed25519"])?,
    ];
    for child in children {
        child.wait_ok("ssh-keygen")?;
    }
    Ok(())
}

pub(super) fn set_mode(path: &Path, mode: u32) -> anyhow::Result<()> {
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .with_context(|| format!("chmod {}", path.display()))
}

pub(super) fn mkdir_mode(path: &Path, mode: u32) -> anyhow::Result<()> {
    match fs::create_dir(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e).with_context(|| format!("mkdir {}", path.display())),
    }
    set_mode(path, mode)
}

/// A root-owned directory, 0755, created if missing.
pub(super) fn ensure_dir_root(path: &Path) -> anyhow::Result<()> {
    fs::create_dir_all(path).with_context(|| format!("mkdir -p {}", path.display()))?;
    set_mode(path, 0o755)
}

pub(super) fn write_mode(path: &Path, contents: &[u8], mode: u32) -> anyhow::Result<()> {
    fs::write(path, contents).with_context(|| format!("write {}", path.display()))?;
    set_mode(path, mode)
}

/// Replaces a file atomically and gives it to the emulator's user, so the
/// scripts running as that user can change it.
pub(super) fn put_user_file(path: &Path, contents: &str, uid: u32, gid: u32) -> anyhow::Result<()> {
    let Some(name) = path.file_name() else { bail!("no file name in {}", path.display()) };
    let tmp = path.with_file_name(format!(".{}.harness-tmp", name.to_string_lossy()));
    write_mode(&tmp, contents.as_bytes(), 0o644)?;
    chown(&tmp, Some(uid), Some(gid))?;
    fs::rename(&tmp, path).with_context(|| format!("rename to {}", path.display()))?;
    Ok(())
}
