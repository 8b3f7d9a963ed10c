//! The guest's serial console, read while the destination starts and is
//! checked (KubeVirt's `guest-console-log`): a guest whose initramfs cannot
//! find its root disk says so there long before any check would give up.
//! The seed's "guest boots but kernel cannot find root disk": it needs a
//! person (or a conversion), never a wait for the validation timeout. Pure.

/// Lines that say the boot gave up on the root file system: initramfs-tools
/// (Debian, Ubuntu), dracut (RHEL, Fedora, SUSE) and the kernel itself.
const GAVE_UP: &[&str] = &[
    "Gave up waiting for root file system device",
    "Gave up waiting for root device",
    "dracut-initqueue timeout",
    "Could not boot.",
    "VFS: Unable to mount root fs",
];

/// Lines shown beside them, kept for the person who reads the status.
const CONTEXT: &[&str] =
    &["ALERT!", "does not exist", "Dropping to a shell", "emergency shell", "Kernel panic"];

/// Longest excerpt kept (the status is not a log).
const MAX_EXCERPT: usize = 1024;

/// The console's lines that show the boot gave up on its root disk, with
/// the lines beside them (at most 1 KiB); `None` when it did not.
pub(crate) fn root_disk_not_found(console: &str) -> Option<String> {
    let lines: Vec<&str> = console.lines().map(|l| l.trim_end_matches('\r').trim()).collect();
    if !lines.iter().any(|l| GAVE_UP.iter().any(|g| l.contains(g))) {
        return None;
    }
    let mut excerpt = String::new();
    for line in lines.iter().filter(|l| GAVE_UP.iter().chain(CONTEXT).any(|m| l.contains(m))) {
        let clean: String = line.chars().filter(|c| !c.is_control()).collect();
        if excerpt.len() + clean.len() + 3 > MAX_EXCERPT {
            break;
        }
        if !excerpt.is_empty() {
            excerpt.push_str(" | ");
        }
        excerpt.push_str(&clean);
    }
    Some(excerpt)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a Debian guest whose initramfs holds only `vmw_pvscsi` prints on
    /// a virtio disk (recorded under QEMU, ../shared/guest-conversion-facts.md).
    const INITRAMFS_TOOLS: &str = "Begin: Running /scripts/local-block ... done.\r\n\
        done.\r\n\
        Gave up waiting for root file system device.  Common problems:\r\n\
         - Boot args (cat /proc/cmdline)\r\n\
         - Missing modules (cat /proc/modules; ls /dev)\r\n\
        ALERT!  UUID=6f1c1b2e-0d5a-4c8e-9d1e-3b8f2a7c9e10 does not exist.  Dropping to a shell!\r\n\
        \r\n\
        BusyBox v1.35.0 (Debian 1:1.35.0-4+b3) built-in shell (ash)\r\n";

    const DRACUT: &str = "[  190.2] dracut-initqueue[312]: Warning: dracut-initqueue timeout - starting timeout scripts\n\
        [  190.9] dracut-initqueue[312]: Warning: Could not boot.\n\
        [  191.0] dracut-initqueue[312]: Warning: /dev/mapper/rhel-root does not exist\n\
        Entering emergency mode. Exit the shell to continue.\n";

    #[test]
    fn initramfs_tools_and_dracut_giving_up_on_root_are_recognized_with_their_lines() {
        let found = root_disk_not_found(INITRAMFS_TOOLS).expect("initramfs-tools");
        assert!(found.starts_with("Gave up waiting for root file system device."), "{found}");
        assert!(
            found.contains("ALERT!  UUID=6f1c1b2e-0d5a-4c8e-9d1e-3b8f2a7c9e10 does not exist"),
            "{found}"
        );
        let found = root_disk_not_found(DRACUT).expect("dracut");
        assert!(
            found.contains("dracut-initqueue timeout") && found.contains("rhel-root does not exist"),
            "{found}"
        );
        let panic = "[    2.1] VFS: Cannot open root device \"sda1\"\n[    2.1] Kernel panic - not syncing: VFS: Unable to mount root fs on unknown-block(0,0)\n";
        assert!(root_disk_not_found(panic).is_some());
    }

    #[test]
    fn a_guest_that_boots_or_only_mentions_a_missing_file_is_not_a_missing_root() {
        let booted =
            "vmmigrate-guest: booted\nvmmigrate-guest: ready\nDebian GNU/Linux 12 web01 ttyS0\nweb01 login:";
        assert_eq!(root_disk_not_found(booted), None);
        assert_eq!(root_disk_not_found("cat: /etc/motd does not exist\nALERT! disk almost full"), None);
        assert_eq!(root_disk_not_found(""), None);
    }

    #[test]
    fn the_excerpt_stays_within_a_kibibyte_and_holds_no_control_characters() {
        let noisy = format!("{}\n", "ALERT! \u{1b}[31mx does not exist".repeat(40)).repeat(20)
            + "Gave up waiting for root device\n";
        let found = root_disk_not_found(&noisy).expect("found");
        assert!(found.len() <= MAX_EXCERPT, "{}", found.len());
        assert!(!found.chars().any(char::is_control));
    }
}
