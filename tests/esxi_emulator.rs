//! Smoke tests of the ESXi emulator (tests/support/esxi_emulator.rs) with the
//! system OpenSSH client: the emulated host says what esxi-facts.md says a
//! real host says, keeps state, refuses what a FIPS-mode ESXi 8 refuses and
//! injects its faults.

use crate::support::esxi_emulator::{EsxiEmulator, EsxiOptions};
use std::io::Read;
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

/// One emulator for the tests that do not change its state or count bytes.
fn shared() -> &'static EsxiEmulator {
    static SHARED: OnceLock<EsxiEmulator> = OnceLock::new();
    SHARED.get_or_init(|| EsxiEmulator::start(EsxiOptions::default()).expect("start the ESXi emulator"))
}

fn own(opts: EsxiOptions) -> EsxiEmulator {
    EsxiEmulator::start(opts).expect("start the ESXi emulator")
}

/// Runs one remote command with the RSA key.
fn ssh(emu: &EsxiEmulator, command: &str) -> Output {
    emu.ssh_command().arg(command).output().expect("run ssh")
}

/// Runs a command that must succeed and returns its stdout.
fn run(emu: &EsxiEmulator, command: &str) -> String {
    let out = ssh(emu, command);
    assert!(
        out.status.success(),
        "`{command}` failed ({}): {}\nsshd log:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        emu.sshd_log_tail()
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

/// Single-quotes a word for the remote shell.
fn sq(word: &str) -> String {
    format!("'{}'", word.replace('\'', r#"'"'"'"#))
}

fn columns(line: &str) -> Vec<String> {
    let mut cols = Vec::new();
    let mut rest = line.trim_end();
    while let Some(pos) = rest.find("   ") {
        cols.push(rest[..pos].to_owned());
        rest = rest[pos..].trim_start();
    }
    cols.push(rest.to_owned());
    cols
}

#[test]
fn getallvms_lists_every_vm_in_esxi_format() {
    let emu = shared();
    let out = run(emu, "vim-cmd vmsvc/getallvms");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "Skipping invalid VM '99'", "{out}");
    assert!(lines[1].starts_with("Vmid          Name   "), "{out}");
    assert!(lines[1].ends_with("Version   Annotation"), "{out}");

    let rows: Vec<Vec<String>> = lines[2..]
        .iter()
        .filter(|l| l.chars().next().is_some_and(|c| c.is_ascii_digit()))
        .map(|l| columns(l))
        .collect();
    let expected = [
        ("1", "web 01", "[datastore1] web 01/web 01.vmx", "ubuntu64Guest", "vmx-21"),
        ("2", "db-02", "[datastore1] db-02/db-02.vmx", "debian11_64Guest", "vmx-21"),
        ("3", "snap-vm", "[datastore1] snap-vm/snap-vm.vmx", "rhel8_64Guest", "vmx-19"),
        ("4", "question-vm", "[datastore1] question-vm/question-vm.vmx", "windows2019srv_64Guest", "vmx-19"),
        (
            "5",
            "x'; rm -rf /; '",
            "[datastore1] x'; rm -rf %2f; '/x'; rm -rf %2f; '.vmx",
            "other4xLinux64Guest",
            "vmx-21",
        ),
        ("6", "no-tools", "[datastore1] no-tools/no-tools.vmx", "centos7_64Guest", "vmx-21"),
    ];
    assert_eq!(rows.len(), expected.len(), "{out}");
    for (row, (id, name, file, guest, version)) in rows.iter().zip(expected) {
        assert_eq!(&row[..5], [id, name, file, guest, version], "{out}");
    }
    assert_eq!(rows[0].get(5).map(String::as_str), Some("Public web server"));
    // An empty annotation leaves trailing blanks; a multi-line one continues without a Vmid.
    let snap = lines.iter().find(|l| l.starts_with("3 ")).expect("snap-vm row");
    assert!(snap.ends_with("vmx-19    "), "{snap:?}");
    let db = lines.iter().position(|l| l.starts_with("2 ")).expect("db-02 row");
    assert!(lines[db].ends_with("PostgreSQL primary"), "{out}");
    assert_eq!(lines[db + 1], "owner: dba team", "{out}");

    assert_eq!(run(emu, "vmware -v"), "VMware ESXi 8.0.3 build-24022510\n");
}

#[test]
fn power_changes_persist_and_power_offs_are_counted() {
    let emu = own(EsxiOptions::default());
    assert_eq!(run(&emu, "vim-cmd vmsvc/power.getstate 1"), "Retrieved runtime info\nPowered on\n");
    assert_eq!(run(&emu, "vim-cmd vmsvc/power.off 1"), "Powering off VM:\n");
    assert_eq!(run(&emu, "vim-cmd vmsvc/power.getstate 1"), "Retrieved runtime info\nPowered off\n");
    assert_eq!(emu.vm_power("1"), "off");
    assert_eq!(emu.power_off_transitions("1"), 1);

    // Wrong state: the InvalidPowerState fault, and nothing counted.
    let again = run(&emu, "vim-cmd vmsvc/power.off 1");
    assert!(
        again.starts_with("Powering off VM:\nPower off failed: (vim.fault.InvalidPowerState) {\n"),
        "{again}"
    );
    assert!(again.contains("existingState = \"poweredOff\""), "{again}");
    assert_eq!(emu.power_off_transitions("1"), 1);
    assert_eq!(run(&emu, "vim-cmd vmsvc/power.on 1"), "Powering on VM:\n");
    assert_eq!(emu.vm_power("1"), "on");

    // A knob change is visible to the host and is not a transition.
    emu.set_power("1", false);
    assert_eq!(run(&emu, "vim-cmd vmsvc/power.getstate 1"), "Retrieved runtime info\nPowered off\n");
    assert_eq!(emu.power_off_transitions("1"), 1);
}

#[test]
fn guest_shutdown_completes_after_polls_unless_tools_are_missing_or_it_hangs() {
    let emu = own(EsxiOptions::default());
    assert_eq!(run(&emu, "vim-cmd vmsvc/power.shutdown 2"), "");
    assert_eq!(run(&emu, "vim-cmd vmsvc/power.getstate 2"), "Retrieved runtime info\nPowered on\n");
    assert_eq!(run(&emu, "vim-cmd vmsvc/power.getstate 2"), "Retrieved runtime info\nPowered off\n");
    assert_eq!(emu.power_off_transitions("2"), 1);

    let no_tools = String::from_utf8(ssh(&emu, "vim-cmd vmsvc/power.shutdown 6").stdout).unwrap();
    assert!(
        no_tools.contains(
            "Cannot complete operation because VMware Tools is not running in this virtual machine."
        ),
        "{no_tools}"
    );
    assert_eq!(emu.vm_power("6"), "on");

    emu.set_shutdown_hangs(true);
    assert_eq!(run(&emu, "vim-cmd vmsvc/power.shutdown 1"), "");
    for _ in 0..4 {
        assert_eq!(run(&emu, "vim-cmd vmsvc/power.getstate 1"), "Retrieved runtime info\nPowered on\n");
    }
    assert_eq!(run(&emu, "vim-cmd vmsvc/power.off 1"), "Powering off VM:\n");
    assert_eq!(emu.power_off_transitions("1"), 1);

    emu.set_tools_running("1", false);
    emu.set_power("1", true);
    let guest = run(&emu, "vim-cmd vmsvc/get.guest 1");
    assert!(guest.contains("toolsRunningStatus = \"guestToolsNotRunning\""), "{guest}");
}

#[test]
fn unknown_vmid_prints_the_not_found_fault() {
    let out = ssh(shared(), "vim-cmd vmsvc/power.getstate 42");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "(vim.fault.NotFound) {\n   faultCause = (vmodl.MethodFault) null,\n   faultMessage = <unset>\n   \
         msg = \"Unable to find a VM corresponding to \"42\"\"\n}\n"
    );
}

#[test]
fn hostile_vm_name_reaches_vim_cmd_as_one_argument() {
    let emu = shared();
    let hostile = "x'; rm -rf /; '";
    let out = ssh(emu, &format!("vim-cmd vmsvc/get.summary {}", sq(hostile)));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("(vim.fault.NotFound)"), "{text}");
    let calls = emu.vimcmd_invocations();
    assert!(
        calls.iter().any(|argv| argv == &["vmsvc/get.summary".to_owned(), hostile.to_owned()]),
        "{calls:?}"
    );
    // Nothing was removed, and the VM itself is reported by its id.
    let summary = run(emu, "vim-cmd vmsvc/get.summary 5");
    assert!(summary.contains("name = \"x'; rm -rf /; '\", "), "{summary}");
    assert!(emu.host_path("/bin/vim-cmd").exists());
}

#[test]
fn shell_is_busybox_ash_without_bash_tr_python_or_md5sum() {
    let emu = shared();
    let out = run(
        emu,
        "for c in bash tr python python3 md5sum sha256sum dd cat awk; do \
         command -v $c >/dev/null 2>&1 && echo \"$c yes\" || echo \"$c no\"; done",
    );
    assert_eq!(
        out, "bash no\ntr no\npython no\npython3 no\nmd5sum no\nsha256sum yes\ndd yes\ncat yes\nawk yes\n",
        "{out}"
    );
    let tr = ssh(emu, "echo abc | tr a b");
    assert_eq!(tr.status.code(), Some(127), "{}", String::from_utf8_lossy(&tr.stderr));
    assert_eq!(run(emu, "echo $0; ls /bin/sh /bin/ash"), "/bin/sh\n/bin/ash\n/bin/sh\n");
}

#[test]
fn sha256sum_and_openssl_are_absent_when_disabled() {
    let emu = own(EsxiOptions { with_sha256sum: false, with_openssl: false, ..Default::default() });
    assert_eq!(run(&emu, "command -v sha256sum || echo none"), "none\n");
    assert_eq!(run(&emu, "command -v openssl || echo none"), "none\n");
}

#[test]
fn openssl_hashes_a_disk_as_announced() {
    let emu = shared();
    let (path, _, sha, _) = emu.disk_files("1").remove(0);
    let out = run(emu, &format!("openssl dgst -sha256 -r {}", sq(&path)));
    assert_eq!(out.split_whitespace().next(), Some(sha.as_str()), "{out}");
}

#[test]
fn flat_disk_is_readable_and_hashes_as_announced_but_is_not_writable() {
    let emu = shared();
    let (path, real, sha, size) = emu.disk_files("1").remove(0);
    assert_eq!(path, "/vmfs/volumes/datastore1/web 01/web 01-flat.vmdk");
    assert_eq!(size, 64 << 20);
    assert_eq!(std::fs::metadata(&real).unwrap().len(), size);

    let remote = run(emu, &format!("sha256sum {}", sq(&path)));
    assert_eq!(remote.split_whitespace().next(), Some(sha.as_str()));
    let data = emu.ssh_command().arg(format!("cat {}", sq(&path))).output().unwrap().stdout;
    assert_eq!(data.len() as u64, size);
    assert_eq!(&data[..], &std::fs::read(&real).unwrap()[..]);
    // Known data, with all-zero 1 MiB regions for sparse handling.
    assert!(data[..1 << 20].iter().all(|b| *b != 0));
    assert!(data[2 << 20..3 << 20].iter().all(|b| *b == 0));

    let write = ssh(emu, &format!("echo x | dd of={} conv=notrunc", sq(&path)));
    assert!(!write.status.success(), "dd of= succeeded on the datastore");
    let remove = ssh(emu, &format!("rm -f {}", sq(&path)));
    assert!(!remove.status.success(), "rm succeeded on the datastore");
    assert_eq!(std::fs::metadata(&real).unwrap().len(), size);

    let descriptor = run(emu, "cat '/vmfs/volumes/datastore1/web 01/web 01.vmdk'");
    assert!(descriptor.contains("createType=\"vmfs\""), "{descriptor}");
    assert!(descriptor.contains("RW 131072 VMFS \"web 01-flat.vmdk\""), "{descriptor}");
    let vmx = run(emu, "cat /vmfs/volumes/datastore1/db-02/db-02.vmx");
    assert!(vmx.starts_with(".encoding = \"UTF-8\"\n"), "{vmx}");
    assert!(vmx.contains("firmware = \"efi\"\n"), "{vmx}");
    assert!(vmx.contains("ethernet1.virtualDev = \"e1000\"\n"), "{vmx}");
}

#[test]
fn dd_range_read_is_accounted_in_bytes_served() {
    let emu = own(EsxiOptions::default());
    let (path, real, _, _) = emu.disk_files("2").remove(0);
    assert_eq!(emu.bytes_served(), 0);
    let out = emu
        .ssh_command()
        .arg(format!("dd if={} bs=65536 skip=3 count=5 2>/dev/null", sq(&path)))
        .output()
        .unwrap();
    assert!(out.status.success());
    let expected = &std::fs::read(&real).unwrap()[3 * 65536..8 * 65536];
    assert_eq!(out.stdout.len(), expected.len());
    assert!(out.stdout == expected, "the range read returned other bytes");
    assert_eq!(emu.bytes_served(), 5 * 65536);
    let reads = emu.disk_reads();
    assert_eq!(reads.len(), 1, "{reads:?}");
    assert_eq!(
        (reads[0].tool.as_str(), reads[0].offset, reads[0].length),
        ("dd", 3 * 65536, Some(5 * 65536))
    );

    // dd's own report still reaches the client.
    let report = run(&emu, &format!("dd if={} bs=1M count=1 2>&1 >/dev/null", sq(&path)));
    assert_eq!(report, "1+0 records in\n1+0 records out\n");
    assert_eq!(emu.bytes_served(), 5 * 65536 + (1 << 20));
}

#[test]
fn cut_after_bytes_drops_the_connection_mid_read() {
    let emu = own(EsxiOptions::default());
    let (path, real, _, size) = emu.disk_files("1").remove(0);
    emu.set_cut_after_bytes(Some(100_000));
    let mut child = emu
        .ssh_command()
        .arg(format!("cat {}", sq(&path)))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut data = Vec::new();
    child.stdout.take().unwrap().read_to_end(&mut data).unwrap();
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    // 255: ssh lost the connection (a closed channel would give cat's status).
    assert_eq!(status.code(), Some(255), "{stderr}");
    assert!(data.len() <= 100_000 && (data.len() as u64) < size, "{} bytes", data.len());
    assert_eq!(&data[..], &std::fs::read(&real).unwrap()[..data.len()]);
    assert_eq!(emu.bytes_served(), 100_000);
    assert_eq!(emu.disk_reads()[0].outcome, "cut");

    // One-shot: the next read is whole.
    let again = emu.ssh_command().arg(format!("cat {}", sq(&path))).output().unwrap();
    assert!(again.status.success());
    assert_eq!(again.stdout.len() as u64, size);
    assert_eq!(emu.bytes_served(), 100_000 + size);

    // The budget spans reads: 3 whole 1 MiB chunks, then half of the 4th.
    emu.set_cut_after_bytes(Some(3 * (1 << 20) + (1 << 19)));
    let chunks = emu
        .ssh_command()
        .arg(format!(
            "for k in 0 1 2 3 4 5; do dd if={} bs=1M skip=$k count=1 2>/dev/null || exit 3; done",
            sq(&path)
        ))
        .output()
        .unwrap();
    assert_eq!(chunks.status.code(), Some(255));
    // What reached the client before the kill depends on sshd's timing; the log is exact.
    assert!((3 << 20..=3 * (1 << 20) + (1 << 19)).contains(&chunks.stdout.len()), "{}", chunks.stdout.len());
    let outcomes: Vec<(u64, String)> =
        emu.disk_reads()[2..].iter().map(|r| (r.delivered, r.outcome.clone())).collect();
    assert_eq!(
        outcomes,
        [(1 << 20, "ok"), (1 << 20, "ok"), (1 << 20, "ok"), (1 << 19, "cut")].map(|(n, o)| (n, o.to_owned()))
    );
}

#[test]
fn ed25519_key_is_refused_while_rsa_key_and_password_work() {
    let emu = shared();
    assert_eq!(run(emu, "echo rsa-ok"), "rsa-ok\n");

    let ed = Command::new("ssh")
        .args(["-F", "/dev/null", "-p", &emu.port.to_string(), "-i"])
        .arg(emu.ed25519_key_path())
        .arg("-o")
        .arg(format!("UserKnownHostsFile={}", emu.known_hosts_path().display()))
        .args(["-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes"])
        .arg(format!("{}@127.0.0.1", emu.username))
        .arg("echo ed25519-ok")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(ed.status.code(), Some(255));
    assert!(String::from_utf8_lossy(&ed.stderr).contains("Permission denied"), "{ed:?}");
    assert!(emu.ed25519_key_openssh.starts_with("-----BEGIN OPENSSH PRIVATE KEY-----"));
    assert!(emu.rsa_key_openssh.starts_with("-----BEGIN OPENSSH PRIVATE KEY-----"));

    // The password, answered through keyboard-interactive (PAM).
    let dir = tempfile::tempdir().unwrap();
    let askpass = dir.path().join("askpass");
    std::fs::write(&askpass, format!("#!/bin/sh\necho '{}'\n", emu.password)).unwrap();
    std::fs::set_permissions(&askpass, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let pw = Command::new("ssh")
        .args(["-F", "/dev/null", "-p", &emu.port.to_string()])
        .arg("-o")
        .arg(format!("UserKnownHostsFile={}", emu.known_hosts_path().display()))
        .args([
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            "PubkeyAuthentication=no",
            "-o",
            "PreferredAuthentications=keyboard-interactive",
            "-o",
            "NumberOfPasswordPrompts=1",
        ])
        .arg(format!("{}@127.0.0.1", emu.username))
        .arg("echo password-ok")
        .env("SSH_ASKPASS", &askpass)
        .env("SSH_ASKPASS_REQUIRE", "force")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&pw.stdout),
        "password-ok\n",
        "{}",
        String::from_utf8_lossy(&pw.stderr)
    );
}

#[test]
fn changing_the_host_key_changes_the_fingerprint_and_breaks_old_known_hosts() {
    let mut emu = own(EsxiOptions::default());
    let before = emu.host_key_fingerprint();
    assert!(before.starts_with("SHA256:") && before.len() == 50, "{before}");
    assert!(emu.host_public_key().starts_with("ecdsa-sha2-nistp256 "));
    let old_known_hosts = std::fs::read(emu.known_hosts_path()).unwrap();
    assert_eq!(run(&emu, "echo before"), "before\n");

    emu.change_host_key().expect("change the host key");
    assert_ne!(emu.host_key_fingerprint(), before);
    assert_eq!(run(&emu, "echo after"), "after\n");

    std::fs::write(emu.known_hosts_path(), old_known_hosts).unwrap();
    let out = ssh(&emu, "echo must-not-run");
    assert_eq!(out.status.code(), Some(255));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("REMOTE HOST IDENTIFICATION HAS CHANGED"),
        "{out:?}"
    );
}

#[test]
fn refused_logins_are_denied_until_allowed_again() {
    let emu = own(EsxiOptions::default());
    emu.refuse_logins(true).expect("refuse logins");
    let out = ssh(&emu, "echo must-not-run");
    assert_eq!(out.status.code(), Some(255));
    assert!(String::from_utf8_lossy(&out.stderr).contains("Permission denied"), "{out:?}");
    emu.refuse_logins(false).expect("allow logins");
    assert_eq!(run(&emu, "echo back"), "back\n");
}

#[test]
fn parallel_vim_cmd_calls_are_serialised_and_all_logged() {
    let emu = own(EsxiOptions::default());
    let out = run(
        &emu,
        "for i in 1 2 3 4 5 6 7 8; do vim-cmd vmsvc/power.getstate 2 >/dev/null & done; \
         vim-cmd vmsvc/power.off 1 & vim-cmd vmsvc/power.off 1 & wait; echo done",
    );
    assert!(out.ends_with("done\n"), "{out}");
    assert_eq!(out.matches("Powering off VM:\n").count(), 2, "{out}");
    assert_eq!(out.matches("(vim.fault.InvalidPowerState)").count(), 1, "{out}");
    let calls = emu.vimcmd_invocations();
    assert_eq!(calls.len(), 10, "{calls:?}");
    assert_eq!(calls.iter().filter(|c| c[0] == "vmsvc/power.off").count(), 2);
    // One of the two power.off calls found the VM already off.
    assert_eq!(emu.power_off_transitions("1"), 1);
    assert_eq!(emu.vm_power("1"), "off");
}

/// sha256 (hex) of the disk `qemu-img` reads through `descriptor` (its whole chain), as raw.
fn chain_sha256(descriptor: &std::path::Path) -> String {
    let out = tempfile::NamedTempFile::new().unwrap();
    let status = Command::new("qemu-img")
        .args(["convert", "-f", "vmdk", "-O", "raw"])
        .arg(descriptor)
        .arg(out.path())
        .status()
        .expect("qemu-img");
    assert!(status.success(), "qemu-img convert {}", descriptor.display());
    file_sha256(out.path())
}

fn file_sha256(path: &std::path::Path) -> String {
    use sha2::Digest;
    let mut hasher = sha2::Sha256::new();
    let mut file = std::fs::File::open(path).unwrap();
    std::io::copy(&mut file, &mut hasher).unwrap();
    hasher.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

fn wait_for_guest_blocks(emu: &EsxiEmulator, at_least: u64) {
    vmmigrate_harness::process::wait_until(std::time::Duration::from_secs(30), "guest writes", || {
        Ok(emu.guest_blocks_written() >= at_least)
    })
    .unwrap();
}

/// A snapshot freezes the base while the running guest writes to the delta,
/// in the format each VMFS version writes; the real `qemu-img` reads the
/// chain; removing the snapshot consolidates the delta into the base with
/// exactly the bytes `qemu-img` read.
#[test]
fn a_snapshot_freezes_the_base_qemu_img_reads_the_delta_chain_and_removal_consolidates_it() {
    use crate::support::esxi_snapshots::GuestWrites;
    use crate::support::vmdk_delta::DeltaFormat;
    for (format, suffix) in
        [(DeltaFormat::SeSparse, "-sesparse.vmdk"), (DeltaFormat::VmfsSparse, "-delta.vmdk")]
    {
        let emu =
            own(EsxiOptions { pair_disk_mib: Some((8, 4)), snapshot_format: format, ..Default::default() });
        let writer = emu
            .start_guest_writes("12", GuestWrites { blocks_per_second: 2000, seed: 7, ..Default::default() });
        wait_for_guest_blocks(&emu, 50);
        let created = run(&emu, "vim-cmd vmsvc/snapshot.create 12 vmmigrate-pair 'warm copy' 0 1");
        assert_eq!(created, "Create Snapshot:\n", "{format:?}");
        let bases: Vec<String> = emu.disk_files("12").iter().map(|d| file_sha256(&d.1)).collect();
        let at_snapshot = emu.guest_blocks_written();
        wait_for_guest_blocks(&emu, at_snapshot + 200);
        // The base extents are frozen while the guest goes on writing.
        let after: Vec<String> = emu.disk_files("12").iter().map(|d| file_sha256(&d.1)).collect();
        assert_eq!(after, bases, "{format:?}: the base changed under a snapshot");
        let vmx = run(&emu, "cat /vmfs/volumes/datastore1/pair/pair.vmx");
        assert!(vmx.contains("scsi0:0.fileName = \"pair-000001.vmdk\""), "{vmx}");
        assert!(vmx.contains("scsi0:1.fileName = \"pair_1-000001.vmdk\""), "{vmx}");
        let descriptor = run(&emu, "cat /vmfs/volumes/datastore1/pair/pair-000001.vmdk");
        assert!(descriptor.contains(&format!("\"pair-000001{suffix}\"")), "{descriptor}");
        assert!(descriptor.contains("parentFileNameHint=\"pair.vmdk\""), "{descriptor}");
        let listed = run(&emu, "vim-cmd vmsvc/snapshot.get 12");
        assert!(listed.contains("--Snapshot Name        : vmmigrate-pair"), "{listed}");
        assert!(listed.contains("--Snapshot State       : powered on"), "{listed}");
        let id = listed
            .lines()
            .find_map(|l| l.strip_prefix("--Snapshot Id        : "))
            .expect("snapshot id")
            .trim()
            .to_owned();

        // The guest stops with the VM: what it wrote is now fixed.
        emu.set_power("12", false);
        drop(writer);
        let tops = emu.disk_tops("12");
        let through_qemu: Vec<String> = tops.iter().map(|t| chain_sha256(t)).collect();
        assert_ne!(through_qemu, bases, "{format:?}: the delta holds the guest's writes");
        let deltas = emu.delta_files("12");
        assert!(
            deltas.iter().all(|d| d.len() == 1 && d[0].to_string_lossy().ends_with(suffix)),
            "{deltas:?}"
        );

        let removed = run(&emu, &format!("vim-cmd vmsvc/snapshot.remove 12 {id}"));
        assert_eq!(removed, "Remove Snapshot:\n");
        let consolidated: Vec<String> = emu.disk_files("12").iter().map(|d| file_sha256(&d.1)).collect();
        assert_eq!(consolidated, through_qemu, "{format:?}: consolidation wrote what qemu-img read");
        assert_eq!(run(&emu, "vim-cmd vmsvc/snapshot.get 12"), "Get Snapshot:\n");
        let vmx = run(&emu, "cat /vmfs/volumes/datastore1/pair/pair.vmx");
        assert!(vmx.contains("scsi0:0.fileName = \"pair.vmdk\""), "{vmx}");
        assert!(deltas.iter().flatten().all(|d| !d.exists()), "the deltas are gone");
    }
}

/// As on a host, no guest write lands once a power-off has returned: the
/// guest writer and `vim-cmd`'s power-off take the same lock, so while it is
/// held neither writes, and after the power-off nothing more is written.
#[test]
fn a_guest_write_never_lands_after_the_power_off_returns() {
    use crate::support::esxi_snapshots::GuestWrites;
    let emu = own(EsxiOptions { pair_disk_mib: Some((4, 4)), ..Default::default() });
    let _writer =
        emu.start_guest_writes("12", GuestWrites { blocks_per_second: 2000, seed: 3, ..Default::default() });
    wait_for_guest_blocks(&emu, 50);
    let held = emu.hold_power_lock("12");
    let before = emu.guest_blocks_written();
    std::thread::scope(|s| {
        let off = s.spawn(|| run(&emu, "vim-cmd vmsvc/power.off 12"));
        // An observation window, not a wait for readiness: at 2,000 blocks
        // a second a writer that ignored the lock would write hundreds.
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert_eq!(emu.guest_blocks_written(), before, "the guest wrote while the power lock was held");
        assert_eq!(emu.vm_power("12"), "on", "the power went off while its lock was held");
        assert!(!off.is_finished(), "power.off returned while its lock was held");
        drop(held);
        off.join().expect("power.off");
    });
    assert_eq!(emu.vm_power("12"), "off");
    let after_off = emu.guest_blocks_written();
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(emu.guest_blocks_written(), after_off, "a guest write landed after the power-off returned");
}

#[test]
fn snapshot_remove_of_an_unknown_snapshot_is_a_fault() {
    let emu = own(EsxiOptions { pair_disk_mib: Some((1, 1)), ..Default::default() });
    let out = ssh(&emu, "vim-cmd vmsvc/snapshot.remove 12 42");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("snapshot 42 does not exist"), "{out:?}");
}
