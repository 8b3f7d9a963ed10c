//! The chroot the emulated host's user is locked into: the shared system
//! user, BusyBox patched to print ESXi's prompt, the tools and libraries.

use super::*;

/// Creates the shared user once (idempotent, safe across parallel test
/// processes thanks to a file lock) and returns its uid and gid.
pub(super) fn ensure_user() -> anyhow::Result<(u32, u32)> {
    let base = Path::new(RUN_BASE);
    ensure_dir_root(base)?;
    let lock = fs::File::create(base.join("user.lock"))?;
    lock.lock()?;
    let exists =
        Command::new("id").arg(ESXI_USER).stdout(Stdio::null()).stderr(Stdio::null()).status()?.success();
    let marker = base.join("user-password");
    if !exists {
        let out = Command::new("useradd")
            .args(["--system", "--user-group", "--no-create-home", "--home-dir", "/", "--shell", "/bin/sh"])
            .args(["--comment", "vmmigrate ESXi emulator", ESXI_USER])
            .output()
            .context("useradd")?;
        // 9: the user exists already (made by someone not holding our lock).
        ensure!(
            out.status.success() || out.status.code() == Some(9),
            "useradd {ESXI_USER} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let _ = fs::remove_file(&marker);
    }
    if fs::read_to_string(&marker).ok().as_deref() != Some(ESXI_PASSWORD) {
        let mut child = Command::new("chpasswd").stdin(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
        child.stdin.take().expect("stdin").write_all(format!("{ESXI_USER}:{ESXI_PASSWORD}\n").as_bytes())?;
        let out = child.wait_with_output()?;
        ensure!(out.status.success(), "chpasswd failed: {}", String::from_utf8_lossy(&out.stderr));
        fs::write(&marker, ESXI_PASSWORD)?;
    }
    let id = |flag: &str| -> anyhow::Result<u32> {
        let out = Command::new("id").arg(flag).arg(ESXI_USER).output()?;
        ensure!(out.status.success(), "id {flag} {ESXI_USER} failed");
        Ok(String::from_utf8(out.stdout)?.trim().parse()?)
    };
    Ok((id("-u")?, id("-g")?))
}

// ---------------------------------------------------------------------------
// The chroot

/// `/run/vmmigrate-esxi`: sshd wants every component of a chroot's path
/// root-owned and not group/world-writable, which a temp or target directory
/// need not be.
pub(super) fn chroot_base() -> anyhow::Result<PathBuf> {
    let base = PathBuf::from(RUN_BASE);
    ensure_dir_root(&base)?;
    Ok(base)
}

/// Removes the chroot when dropped or when the test process exits (a shell
/// waiting on a pipe only we hold, like `Janitor`). It first kills what still
/// runs inside the chroot (session shells, dd) and the session processes of
/// this emulator's sshd listeners.
pub(super) struct ChrootGuard {
    pub(super) pipe: Option<ChildStdin>,
    pub(super) child: Child,
}

pub(super) const CHROOT_CLEANUP_SCRIPT: &str = r#"
root=$1; keep=$2
cat >/dev/null
for l in $(cat "$root/.emulator/sshd.pids" 2>/dev/null); do
  for s in /proc/[0-9]*/stat; do
    read -r pid comm state ppid rest < "$s" 2>/dev/null || continue
    [ "$ppid" = "$l" ] && kill -KILL "$pid" 2>/dev/null
  done
done
for p in /proc/[0-9]*; do
  [ "$p/root" -ef "$root" ] && kill -KILL "${p#/proc/}" 2>/dev/null
done
case $root in /*/esxi-emu-*) [ "$keep" = 1 ] || rm -rf "$root" ;; esac
"#;

impl ChrootGuard {
    pub(super) fn new(root: &Path) -> anyhow::Result<ChrootGuard> {
        let keep = if std::env::var_os("VMMIGRATE_TEST_KEEP").is_some() { "1" } else { "0" };
        let mut child = Command::new("sh")
            .args(["-c", CHROOT_CLEANUP_SCRIPT, "esxi-chroot-janitor"])
            .arg(root)
            .arg(keep)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        Ok(ChrootGuard { pipe: child.stdin.take(), child })
    }
}

impl Drop for ChrootGuard {
    fn drop(&mut self) {
        self.pipe.take();
        let _ = self.child.wait();
    }
}

pub(super) fn build_chroot(root: &Path, uid: u32, gid: u32, opts: &EsxiOptions) -> anyhow::Result<()> {
    for d in ["bin", "dev", "etc", "usr", "usr/lib", "usr/lib/esxi-emu", "var", "var/lib", "var/log", "vmfs"]
    {
        mkdir_mode(&root.join(d), 0o755)?;
    }
    mkdir_mode(&root.join(".emulator"), 0o700)?;
    mkdir_mode(&root.join("tmp"), 0o1777)?;
    for d in ["var/lib/esxi-emu", "var/lib/esxi-emu/vms", "var/log/esxi-emu"] {
        mkdir_mode(&root.join(d), 0o755)?;
        chown(root.join(d), Some(uid), Some(gid))?;
    }
    for f in ["vimcmd.log", "reads.log"] {
        put_user_file(&root.join("var/log/esxi-emu").join(f), "", uid, gid)?;
    }

    // BusyBox: applets are links to an unmodified copy; the shell is a copy
    // whose applet table is patched so that ash finds commands through PATH
    // only (Debian's build runs any applet by name, even without a link).
    let bin = root.join("bin");
    write_mode(
        &bin.join("busybox"),
        &fs::read("/bin/busybox").context("busybox-static is not installed")?,
        0o755,
    )?;
    write_mode(&bin.join("sh"), patched_shell()?, 0o755)?;
    symlink("sh", bin.join("ash"))?;
    for applet in APPLETS {
        symlink("busybox", bin.join(applet))?;
    }
    if opts.with_sha256sum {
        symlink("busybox", bin.join("sha256sum"))?;
    }
    for (name, text) in SCRIPTS_BIN {
        write_mode(&bin.join(name), text.as_bytes(), 0o755)?;
    }
    if opts.with_openssl {
        install_with_libraries(root, Path::new("/usr/bin/openssl"), &bin.join("openssl"))?;
    }
    // SFTP, which ESXi offers: the distribution's sftp-server and the two
    // libraries it needs (it is only used by the scp baseline of the benchmark).
    for file in
        ["/usr/lib/openssh/sftp-server", "/lib/x86_64-linux-gnu/libc.so.6", "/lib64/ld-linux-x86-64.so.2"]
    {
        if let Ok(bytes) = fs::read(file) {
            let dest = root.join(file.trim_start_matches('/'));
            if let Some(parent) = dest.parent() {
                fs::create_dir_all(parent)?;
            }
            write_mode(&dest, &bytes, 0o755)?;
        }
    }
    write_mode(&root.join("usr/lib/esxi-emu/session"), SESSION_SCRIPT.as_bytes(), 0o755)?;
    write_mode(&root.join("usr/lib/esxi-emu/common.sh"), COMMON_SH.as_bytes(), 0o644)?;

    for (name, minor) in [("null", 3), ("zero", 5), ("random", 8), ("urandom", 9)] {
        let path = root.join("dev").join(name);
        let status = Command::new("mknod").arg(&path).args(["c", "1", &minor.to_string()]).status()?;
        ensure!(status.success(), "mknod {} failed (the emulator needs CAP_MKNOD)", path.display());
        set_mode(&path, 0o666)?;
    }

    write_mode(
        &root.join("etc/passwd"),
        format!(
            "root:x:0:0:Administrator:/:/bin/sh\n{ESXI_USER}:x:{uid}:{gid}:ESXi emulator user:/:/bin/sh\n"
        )
        .as_bytes(),
        0o644,
    )?;
    write_mode(&root.join("etc/group"), format!("root:x:0:\n{ESXI_USER}:x:{gid}:\n").as_bytes(), 0o644)?;
    write_mode(&root.join("etc/vmware-release"), b"VMware ESXi 8.0.3 GA\n", 0o644)?;
    Ok(())
}

/// Copies a dynamically linked program into the chroot at `dest`, with the
/// libraries `ldd` names for it at their own paths.
pub(super) fn install_with_libraries(root: &Path, program: &Path, dest: &Path) -> anyhow::Result<()> {
    write_mode(dest, &fs::read(program).with_context(|| program.display().to_string())?, 0o755)?;
    let out = Command::new("ldd").arg(program).output().context("ldd")?;
    ensure!(out.status.success(), "ldd {}", program.display());
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        // `libx.so => /lib/.../libx.so (0x...)` or `/lib64/ld-linux-x86-64.so.2 (0x...)`.
        let path = line.split("=>").last().unwrap_or_default().split_whitespace().next().unwrap_or_default();
        if !path.starts_with('/') {
            continue;
        }
        let target = root.join(path.trim_start_matches('/'));
        if target.exists() {
            continue;
        }
        if let Some(parent) = target.parent() {
            fs::create_dir_all(parent)?;
        }
        write_mode(&target, &fs::read(path).with_context(|| path.to_owned())?, 0o755)?;
    }
    Ok(())
}

/// The BusyBox binary with every applet name except `sh`, `ash`, `[` and `w`
/// replaced by an unreachable name of the same length, keeping the table
/// sorted (BusyBox looks names up by ordered search).
pub(super) fn patched_shell() -> anyhow::Result<&'static [u8]> {
    static PATCHED: OnceLock<Result<Vec<u8>, String>> = OnceLock::new();
    PATCHED
        .get_or_init(|| patch_busybox().map_err(|e| format!("{e:#}")))
        .as_deref()
        .map_err(|e| anyhow::anyhow!("{e}"))
}

pub(super) fn patch_busybox() -> anyhow::Result<Vec<u8>> {
    let mut binary = fs::read("/bin/busybox").context("busybox-static is not installed")?;
    let out = Command::new("/bin/busybox").arg("--list").output()?;
    let names: Vec<Vec<u8>> =
        out.stdout.split(|b| *b == b'\n').filter(|n| !n.is_empty()).map(<[u8]>::to_vec).collect();
    let mut table: Vec<u8> = names.join(&0u8);
    table.push(0);
    let at = binary
        .windows(table.len())
        .position(|w| w == table.as_slice())
        .context("BusyBox applet table not found in /bin/busybox")?;

    const KEEP: [&[u8]; 4] = [b"sh", b"ash", b"[", b"w"];
    let successor = |s: &[u8]| -> Vec<u8> {
        let mut s = s.to_vec();
        for i in (0..s.len()).rev() {
            if s[i] < 0x7e {
                s[i] += 1;
                return s;
            }
            s[i] = 1;
        }
        panic!("no successor");
    };
    let mut patched: Vec<Vec<u8>> = Vec::with_capacity(names.len());
    for name in &names {
        if KEEP.contains(&name.as_slice()) {
            patched.push(name.clone());
            continue;
        }
        let prev = patched.last().cloned().unwrap_or_default();
        let len = name.len();
        let mut cand = [&name[..1], &vec![1u8; len - 1][..]].concat();
        if cand <= prev {
            cand = if prev.len() < len {
                [&prev[..], &vec![1u8; len - prev.len()][..]].concat()
            } else {
                successor(&prev[..len])
            };
        }
        while &cand == name || names.contains(&cand) {
            cand = successor(&cand);
        }
        patched.push(cand);
    }
    ensure!(patched.windows(2).all(|w| w[0] < w[1]), "patched BusyBox applet table is not sorted");
    let mut new_table: Vec<u8> = patched.join(&0u8);
    new_table.push(0);
    ensure!(new_table.len() == table.len(), "patched applet table changed size");
    binary[at..at + table.len()].copy_from_slice(&new_table);
    Ok(binary)
}
