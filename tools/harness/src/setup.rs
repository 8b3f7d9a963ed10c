//! First use on a fresh machine: the Debian packages the real parts need, and
//! the control plane built from its Go modules, so that `cargo test` and
//! `cargo run -- demo` need nothing run before them.
//!
//! Both steps take a file lock under the cache directory: parallel test
//! processes (or a demo beside a test run) wait for the one that installs or
//! builds instead of racing it, then find the result.

use anyhow::Context as _;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// The Debian packages the harness runs: git (remotes), openssl (keys and
/// certificates), qemu-utils (disks), openssh-server and -client (the ESXi
/// emulator), busybox-static and lua5.4 (the emulated ESXi shell and
/// `vim-cmd`), iproute2 (network namespaces), ca-certificates; for the test
/// node: containerd, runc, the CNI plugins, iptables and conntrack
/// (kube-proxy), umoci, jq and mmdebstrap (images without a registry).
pub const PACKAGES: &[&str] = &[
    "git",
    "openssl",
    "ca-certificates",
    "qemu-utils",
    "openssh-server",
    "openssh-client",
    "busybox-static",
    "iproute2",
    "lua5.4",
    "containerd",
    "runc",
    "containernetworking-plugins",
    "iptables",
    "conntrack",
    "umoci",
    "jq",
    "mmdebstrap",
    // KubeVirt's images (tools/testenv/kubevirt*.sh): its one patch, and the
    // launcher monitor's file capability.
    "patch",
    "libcap2-bin",
    // The guests (tools/guest/build.sh): boot loaders, FAT and ext4 written
    // without mounts, the initramfs, and qemu-ga's libraries.
    "syslinux",
    "syslinux-common",
    "mtools",
    "systemd-boot-efi",
    "fdisk",
    "cpio",
    "zstd",
    "kmod",
    "e2fsprogs",
    "libglib2.0-0",
    "libnuma1",
    "liburing2",
    "libudev1",
    "libpcre2-8-0",
];

/// What converting and booting whole guests needs besides [`PACKAGES`]:
/// virt-v2v with the nbdkit and nbdcopy it runs without depending on them,
/// guestfish, a kernel in /boot for libguestfs's appliance, QEMU and OVMF.
pub const GUEST_CONVERSION_PACKAGES: &[&str] =
    &["virt-v2v", "nbdkit", "libnbd-bin", "guestfish", "linux-image-cloud-amd64", "qemu-system-x86", "ovmf"];

/// Installs the missing [`GUEST_CONVERSION_PACKAGES`] (and [`PACKAGES`]) once
/// per process.
pub fn guest_conversion_packages() -> anyhow::Result<()> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    packages()?;
    DONE.get_or_init(|| ensure_packages(GUEST_CONVERSION_PACKAGES).map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(anyhow::Error::msg)
}

/// Where the harness caches what it builds (`~/.cache/vmmigrate`).
pub fn cache_root() -> PathBuf {
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/root"));
    home.join(".cache/vmmigrate")
}

/// Installs the missing [`PACKAGES`] once per process: with apt-get when
/// root, otherwise an error listing them.
pub fn packages() -> anyhow::Result<()> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| ensure_packages(PACKAGES).map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(anyhow::Error::msg)
}

fn missing(packages: &[&str]) -> Vec<String> {
    packages
        .iter()
        .filter(|pkg| {
            let out =
                Command::new("dpkg-query").args(["-W", "-f=${Status}", pkg]).stderr(Stdio::null()).output();
            !out.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        })
        .map(|p| p.to_string())
        .collect()
}

fn ensure_packages(packages: &[&str]) -> anyhow::Result<()> {
    if missing(packages).is_empty() {
        return Ok(());
    }
    let _lock = lock("packages")?;
    // Another process may have installed them while we waited.
    let missing = missing(packages);
    if missing.is_empty() {
        return Ok(());
    }
    if !is_root() {
        anyhow::bail!(
            "missing Debian packages: {}; install them with `sudo apt-get install {}` (as root the harness does it itself)",
            missing.join(" "),
            missing.join(" ")
        );
    }
    eprintln!("vmmigrate-harness: installing Debian packages (first run only): {}", missing.join(" "));
    let run = |args: &[&str]| -> anyhow::Result<()> {
        let status = Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdout(Stdio::null())
            .status()
            .context("running apt-get")?;
        anyhow::ensure!(status.success(), "apt-get {} failed ({status})", args.join(" "));
        Ok(())
    };
    run(&["update", "-qq"])?;
    let mut install = vec!["install", "-y", "-qq", "--no-install-recommends"];
    install.extend(missing.iter().map(String::as_str));
    run(&install)
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.trim_ascii() == b"0")
}

/// The directory of the control-plane binaries (etcd, kube-apiserver,
/// kube-controller-manager): `VMMIGRATE_TESTENV_BIN` when set, else built by
/// `tools/testenv/build.sh` into the cache on first use, under a lock.
pub fn control_plane() -> anyhow::Result<PathBuf> {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(|| build_control_plane().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(anyhow::Error::msg)
}

fn build_control_plane() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("VMMIGRATE_TESTENV_BIN") {
        return Ok(PathBuf::from(dir));
    }
    packages()?;
    let script = crate::repo_root().join("tools/testenv/build.sh");
    // A built control plane answers at once; only a build prints progress
    // (the script's own lines on our stderr).
    let _lock = lock("testenv")?;
    let out = Command::new("bash").arg(&script).env("PATH", go_path()).stderr(Stdio::inherit()).output()?;
    anyhow::ensure!(out.status.success(), "{} failed", script.display());
    let dir = String::from_utf8(out.stdout)?.lines().last().unwrap_or_default().trim().to_owned();
    anyhow::ensure!(!dir.is_empty(), "{} printed no directory", script.display());
    Ok(PathBuf::from(dir))
}

/// Runs one of our build scripts (`bash SCRIPT ARGS…`, relative to the
/// repository) under the lock `lock_name`, its progress on our stderr, with
/// Go on the PATH; returns the directory it prints as its last line.
pub(crate) fn run_build_script(lock_name: &str, script: &str, args: &[&Path]) -> anyhow::Result<PathBuf> {
    let _lock = lock(lock_name)?;
    let script = crate::repo_root().join(script);
    let out = Command::new("bash")
        .arg(&script)
        .args(args)
        .env("PATH", go_path())
        .stderr(Stdio::inherit())
        .output()?;
    anyhow::ensure!(out.status.success(), "{} failed", script.display());
    let dir = String::from_utf8(out.stdout)?.lines().last().unwrap_or_default().trim().to_owned();
    anyhow::ensure!(!dir.is_empty(), "{} printed no directory", script.display());
    Ok(PathBuf::from(dir))
}

/// What the tests take from KubeVirt v1.8.0 and CDI v1.65.0, built from
/// their Go modules by `tools/testenv/upstream.sh` on first use, under a
/// lock: `crds/kubevirt.yaml`, `crds/cdi.yaml` and CDI's commands in `bin/`.
pub fn upstream() -> anyhow::Result<PathBuf> {
    static DIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    DIR.get_or_init(|| {
        run_build_script("testenv-upstream", "tools/testenv/upstream.sh", &[]).map_err(|e| format!("{e:#}"))
    })
    .clone()
    .map_err(anyhow::Error::msg)
}

/// The directory of the guest disk images (`bios.img`, `efi.img`,
/// `secureboot.img`, `data.img`, `nodisk.img`), built by
/// `tools/guest/build.sh` on first use, under a lock.
pub fn guest_images() -> anyhow::Result<PathBuf> {
    static DIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    DIR.get_or_init(|| {
        let build = || -> anyhow::Result<PathBuf> {
            packages()?;
            run_build_script("guest", "tools/guest/build.sh", &[&cache_root().join("guest")])
        };
        build().map_err(|e| format!("{e:#}"))
    })
    .clone()
    .map_err(anyhow::Error::msg)
}

/// The directory of the VMware-shaped guests (`vmware-bios.img`,
/// `vmware-uefi.img`, `vmware-uefi-data.img`), built by
/// `tools/guest/vmware.sh` on first use, under a lock.
pub fn vmware_guest_images() -> anyhow::Result<PathBuf> {
    static DIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    DIR.get_or_init(|| {
        let build = || -> anyhow::Result<PathBuf> {
            guest_conversion_packages()?;
            run_build_script("vmware-guest", "tools/guest/vmware.sh", &[&cache_root().join("vmware-guest")])
        };
        build().map_err(|e| format!("{e:#}"))
    })
    .clone()
    .map_err(anyhow::Error::msg)
}

/// The directory of the node's image archives (pause, busybox,
/// local-path-provisioner), built by `tools/testenv/images.sh` on first use.
pub fn node_images() -> anyhow::Result<PathBuf> {
    static DIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    DIR.get_or_init(|| {
        let build = || -> anyhow::Result<PathBuf> {
            let bin = control_plane()?;
            let _lock = lock("testenv-images")?;
            let script = crate::repo_root().join("tools/testenv/images.sh");
            let out = Command::new("bash")
                .arg(&script)
                .arg(&bin)
                .arg(cache_root().join("testenv-images"))
                .stderr(Stdio::inherit())
                .output()?;
            anyhow::ensure!(out.status.success(), "{} failed", script.display());
            let dir = String::from_utf8(out.stdout)?.lines().last().unwrap_or_default().trim().to_owned();
            Ok(PathBuf::from(dir))
        };
        build().map_err(|e| format!("{e:#}"))
    })
    .clone()
    .map_err(anyhow::Error::msg)
}

/// The release image (`tools/image/build.sh` on the release binary, built
/// from this checkout with `cargo build --release --no-default-features`)
/// as an oci-archive, with the name containerd gives it on import. Built on
/// first use under a lock; cargo and the image script skip what is current.
pub fn release_image() -> anyhow::Result<(PathBuf, String)> {
    static IMAGE: OnceLock<Result<(PathBuf, String), String>> = OnceLock::new();
    IMAGE
        .get_or_init(|| build_release_image().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(anyhow::Error::msg)
}

fn build_release_image() -> anyhow::Result<(PathBuf, String)> {
    packages()?;
    let _lock = lock("release-image")?;
    let repo = crate::repo_root();
    let target = target_dir()?;
    let started = std::time::Instant::now();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = Command::new(&cargo);
    // What `cargo test` sets for a test process (CARGO_PKG_*, CARGO_MANIFEST_DIR,
    // the library path…) is not the environment a user's `cargo build` has:
    // build scripts that watch such variables would rebuild, and the next plain
    // `cargo build --release` would rebuild once more.
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        let keep = ["CARGO_HOME", "CARGO_TARGET_DIR", "CARGO_INCREMENTAL"].contains(&key.as_ref())
            || key.starts_with("CARGO_NET_")
            || key.starts_with("CARGO_REGISTRIES_");
        if (key == "CARGO"
            || key.starts_with("CARGO_")
            || key.starts_with("__CARGO")
            || key == "OUT_DIR"
            || key == "LD_LIBRARY_PATH")
            && !keep
        {
            build.env_remove(key.as_ref());
        }
    }
    let status = build
        .args([
            "build",
            "--release",
            "--locked",
            "--no-default-features",
            "--bin",
            "vmmigrate",
            "--manifest-path",
        ])
        .arg(repo.join("Cargo.toml"))
        .env("CARGO_TARGET_DIR", &target)
        .stdout(Stdio::null())
        .status()
        .context("running cargo build --release")?;
    anyhow::ensure!(status.success(), "cargo build --release of vmmigrate failed ({status})");
    let binary = target.join("release/vmmigrate");
    let out_dir = cache_root().join("image");
    let out = Command::new("bash")
        .arg(repo.join("tools/image/build.sh"))
        .arg(&binary)
        .arg(&out_dir)
        .stderr(Stdio::null())
        .output()
        .context("running tools/image/build.sh")?;
    anyhow::ensure!(
        out.status.success(),
        "tools/image/build.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // It prints `<dir>/vmmigrate:<version>`.
    let printed = String::from_utf8(out.stdout)?;
    let version = printed.trim().rsplit(':').next().unwrap_or_default().to_owned();
    anyhow::ensure!(!version.is_empty(), "tools/image/build.sh printed no image");
    let archive = out_dir.join(format!("vmmigrate-{version}.oci.tar"));
    let name = format!("registry.example.net/platform/vmmigrate:{version}");
    eprintln!("vmmigrate-harness: release image {name} ready in {:.0}s", started.elapsed().as_secs_f64());
    Ok((archive, name))
}

/// The cargo target directory this process was built into: `CARGO_TARGET_DIR`
/// when set, else the parent of the `debug` (or `release`) directory above
/// the running executable.
fn target_dir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
        return Ok(PathBuf::from(dir));
    }
    let exe = std::env::current_exe()?;
    exe.ancestors()
        .find(|dir| dir.file_name().is_some_and(|n| n == "debug" || n == "release"))
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .ok_or_else(|| anyhow::anyhow!("cannot tell the cargo target directory from {}", exe.display()))
}

/// `PATH` with Go's usual install directories, where a fresh machine has it
/// but a plain shell does not.
pub(crate) fn go_path() -> String {
    let path = std::env::var("PATH").unwrap_or_default();
    let mut dirs: Vec<String> = path.split(':').filter(|d| !d.is_empty()).map(str::to_owned).collect();
    for extra in ["/usr/local/go/bin", "/usr/lib/go/bin"] {
        if Path::new(extra).join("go").exists() && !dirs.iter().any(|d| d == extra) {
            dirs.push(extra.to_owned());
        }
    }
    dirs.join(":")
}

/// An exclusive lock on `<cache>/<name>.lock`, held until dropped.
pub(crate) fn lock(name: &str) -> anyhow::Result<File> {
    let dir = cache_root();
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(format!("{name}.lock"));
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    if file.try_lock().is_err() {
        eprintln!("vmmigrate-harness: waiting for another process to finish ({})", path.display());
        file.lock().with_context(|| format!("locking {}", path.display()))?;
    }
    Ok(file)
}
