//! What the demo prints: permanent lines, and below them a block of live
//! lines (one progress bar per disk) that is redrawn in place on a terminal
//! and printed as plain, throttled lines otherwise (CI logs, pipes).

use crate::api::{DiskProgress, Phase};
use std::io::Write;
use std::time::{Duration, Instant};

/// Least time between two plain prints of the same live line.
const PLAIN_EVERY: Duration = Duration::from_secs(2);
/// Cells of a disk's progress bar.
const BAR_CELLS: usize = 20;

/// Standard output, with an optional live block at the bottom.
pub(crate) struct Screen {
    interactive: bool,
    /// The live block as last drawn (interactive) or last printed (plain).
    live: Vec<String>,
    /// Plain mode: when each live line was last printed.
    printed_at: Vec<Option<Instant>>,
}

impl Screen {
    /// `interactive`: redraw the live block in place (stdout is a terminal).
    pub(crate) fn new(interactive: bool) -> Screen {
        Screen { interactive, live: Vec::new(), printed_at: Vec::new() }
    }

    /// Prints a permanent line (above the live block).
    pub(crate) fn line(&mut self, text: &str) {
        let mut out = std::io::stdout().lock();
        if self.interactive && !self.live.is_empty() {
            let _ = write!(out, "{}", erase_lines(self.live.len()));
            let _ = writeln!(out, "{text}");
            for l in &self.live {
                let _ = writeln!(out, "{l}");
            }
        } else {
            let _ = writeln!(out, "{text}");
        }
        let _ = out.flush();
    }

    /// Replaces the live block. Plain mode prints a line when it changed and
    /// was not printed in the last two seconds.
    pub(crate) fn live(&mut self, lines: Vec<String>) {
        let mut out = std::io::stdout().lock();
        if self.interactive {
            if lines != self.live {
                let _ = write!(out, "{}", erase_lines(self.live.len()));
                for l in &lines {
                    let _ = writeln!(out, "{l}");
                }
                self.live = lines;
            }
        } else {
            self.printed_at.resize(lines.len(), None);
            self.live.resize(lines.len(), String::new());
            for (i, l) in lines.into_iter().enumerate() {
                let due = self.printed_at[i].is_none_or(|t| t.elapsed() >= PLAIN_EVERY);
                if l != self.live[i] && due {
                    let _ = writeln!(out, "{l}");
                    self.printed_at[i] = Some(Instant::now());
                    self.live[i] = l;
                }
            }
        }
        let _ = out.flush();
    }

    /// Leaves the live block as it is, drawn one last time with `last`, and
    /// starts a new one below it.
    pub(crate) fn freeze(&mut self, last: Vec<String>) {
        if self.interactive {
            self.live(last);
        } else {
            let mut out = std::io::stdout().lock();
            for (i, l) in last.into_iter().enumerate() {
                if self.live.get(i) != Some(&l) {
                    let _ = writeln!(out, "{l}");
                }
            }
            let _ = out.flush();
        }
        self.live.clear();
        self.printed_at.clear();
    }
}

/// Moves the cursor to the start of the line `n` lines up and clears to the end of the screen.
fn erase_lines(n: usize) -> String {
    if n == 0 { String::new() } else { format!("\x1b[{n}F\x1b[J") }
}

/// The elapsed-time column: `+  12.3s`.
pub(crate) fn elapsed(d: Duration) -> String {
    format!("+{:6.1}s", d.as_secs_f64())
}

/// Bytes as MiB with one decimal.
pub(crate) fn mib(bytes: i64) -> String {
    format!("{:.1} MiB", bytes.max(0) as f64 / (1024.0 * 1024.0))
}

/// One disk's progress, under 80 columns (a wrapped line would break the
/// redraw): `disk 0  █████░░░…  25%   8.0/32.0 MiB   12.5 MiB/s`.
pub(crate) fn disk_bar(disk: &DiskProgress) -> String {
    let percent = if disk.bytes_total > 0 {
        (disk.bytes_done.clamp(0, disk.bytes_total) as i128 * 100 / disk.bytes_total as i128) as usize
    } else {
        0
    };
    let filled = percent * BAR_CELLS / 100;
    let rate = if disk.bytes_per_second > 0 {
        format!("   {}/s", mib(disk.bytes_per_second))
    } else {
        String::new()
    };
    format!(
        "          disk {}  {}{} {percent:>3}%   {:.1}/{}{rate}",
        disk.index,
        "█".repeat(filled),
        "░".repeat(BAR_CELLS - filled),
        disk.bytes_done.max(0) as f64 / (1024.0 * 1024.0),
        mib(disk.bytes_total),
    )
}

/// A finished disk: the bar full, with its size.
pub(crate) fn disk_done(disk: &DiskProgress) -> String {
    disk_bar(&DiskProgress { bytes_done: disk.bytes_total, bytes_per_second: 0, ..disk.clone() })
}

/// Phases whose work is measured in bytes per disk.
pub(crate) fn has_disk_progress(phase: Phase) -> bool {
    matches!(phase, Phase::Preparing | Phase::Converting | Phase::Importing)
}

/// What a phase is doing, for someone seeing vmmigrate for the first time;
/// `real_guest` when a real guest boots on real KubeVirt (`--cluster`).
pub(crate) fn caption(phase: Phase, real_guest: bool) -> &'static str {
    match phase {
        Phase::Starting if real_guest => {
            "real KubeVirt starts the VM: a virt-launcher pod, QEMU boots the guest"
        }
        Phase::Validating if real_guest => {
            "checking the guest: its page through Service web, its guest agent, its IP address"
        }
        Phase::Pending => "accepted; the controller adds its finalizer",
        Phase::Discovering => "reading the VM over SSH: vim-cmd, the .vmx, the VMDK descriptors",
        Phase::Validated => "pre-flight checks passed (disks, firmware, networks, storage class)",
        Phase::Preparing => "powering the source off and copying its disks over SSH, hashing with sha256",
        Phase::Converting => "checking the copies with qemu-img and staging them for CDI",
        Phase::Importing => "CDI DataVolumes import from the staging server, checksum verified by CDI",
        Phase::CreatingVm => "creating the KubeVirt VirtualMachine from the discovered hardware",
        Phase::Starting => "waiting for the VirtualMachineInstance to run (simulated KubeVirt)",
        Phase::Validating => "checking the application: HTTP through Service db-web, guest agent, IP address",
        Phase::Completed => "done; staged copies cleaned up, the source stays off",
        Phase::Retryable => "a step failed; it is retried after a backoff",
        Phase::ManualInterventionRequired => "waiting for a person (see the errors)",
        Phase::Failed => "failed for good (see the errors)",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn disk(done: i64, total: i64) -> DiskProgress {
        DiskProgress { index: 1, bytes_done: done, bytes_total: total, bytes_per_second: 0 }
    }

    #[test]
    fn disk_bar_fills_in_proportion_and_shows_mib() {
        let half = disk_bar(&disk(16 << 20, 32 << 20));
        assert!(half.contains("disk 1"), "{half}");
        assert!(half.contains(&format!("{}{}", "█".repeat(10), "░".repeat(10))), "{half}");
        assert!(half.contains(" 50%") && half.contains("16.0/32.0 MiB"), "{half}");
        let widest = disk_bar(&DiskProgress { bytes_per_second: 999 << 20, ..disk(999 << 20, 999 << 20) });
        assert!(widest.chars().count() < 80, "{widest}");
        assert!(disk_bar(&disk(0, 0)).contains("  0%"));
        assert!(disk_bar(&disk(5, 1)).contains("100%"), "done beyond total is clamped");
        assert!(disk_done(&disk(3, 32 << 20)).contains("100%"));
    }

    #[test]
    fn rate_is_shown_only_when_known() {
        let mut d = disk(1 << 20, 4 << 20);
        assert!(!disk_bar(&d).contains("/s"));
        d.bytes_per_second = 3 << 20;
        assert!(disk_bar(&d).ends_with("3.0 MiB/s"));
    }

    #[test]
    fn elapsed_has_a_fixed_width() {
        assert_eq!(elapsed(Duration::from_millis(1_300)), "+   1.3s");
        assert_eq!(elapsed(Duration::from_secs(125)), "+ 125.0s");
    }

    #[test]
    fn every_phase_has_a_caption() {
        for phase in Phase::ALL {
            assert!(!caption(phase, false).is_empty() && !caption(phase, true).is_empty(), "{phase}");
        }
    }
}
