//! Starting real servers from tests without leaving any behind.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Owns a temporary directory and the processes started in it.
///
/// A janitor shell waits on a pipe whose write end only this process holds.
/// When the test process exits for any reason (end of tests, panic, SIGKILL),
/// the pipe closes and the janitor stops every recorded process (TERM, then
/// KILL after five seconds) and removes the directory. `Drop` does the same
/// synchronously. Set `VMMIGRATE_TEST_KEEP=1` to keep the directory and logs.
pub struct Janitor {
    dir: PathBuf,
    pipe: Mutex<Option<ChildStdin>>,
    janitor: Mutex<Child>,
    children: Mutex<Vec<(String, Child)>>,
    /// How each named process was started, so that a stopped one can be
    /// started again the same way ([`Janitor::start_again`]).
    specs: Mutex<std::collections::HashMap<String, Spec>>,
}

/// What [`Command`] held: its program, arguments, environment and directory.
#[derive(Clone)]
struct Spec {
    program: std::ffi::OsString,
    args: Vec<std::ffi::OsString>,
    envs: Vec<(std::ffi::OsString, Option<std::ffi::OsString>)>,
    dir: Option<PathBuf>,
}

impl Spec {
    fn of(cmd: &Command) -> Spec {
        Spec {
            program: cmd.get_program().to_owned(),
            args: cmd.get_args().map(ToOwned::to_owned).collect(),
            envs: cmd.get_envs().map(|(k, v)| (k.to_owned(), v.map(ToOwned::to_owned))).collect(),
            dir: cmd.get_current_dir().map(Path::to_path_buf),
        }
    }

    fn command(&self) -> Command {
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args);
        for (key, value) in &self.envs {
            match value {
                Some(value) => cmd.env(key, value),
                None => cmd.env_remove(key),
            };
        }
        if let Some(dir) = &self.dir {
            cmd.current_dir(dir);
        }
        cmd
    }
}

/// The janitor's shell: `sh -c JANITOR_SCRIPT janitor <dir> <keep>`; it
/// starts its work when its stdin closes.
pub const JANITOR_SCRIPT: &str = r#"
dir=$1; keep=$2
cat >/dev/null
stime() { s=$(cat "/proc/$1/stat" 2>/dev/null) || return 0; s=${s##*) }; set -- $s; [ "$1" = Z ] || echo "${20}"; }
ours() { while read -r p t; do [ -n "$t" ] && [ "$(stime "$p")" = "$t" ] && echo "$p"; done <"$dir/pids"; }
pids=$(ours 2>/dev/null)
[ -n "$pids" ] && kill -TERM $pids 2>/dev/null
i=0
while [ $i -lt 50 ]; do
  pids=$(ours 2>/dev/null)
  [ -z "$pids" ] && break
  sleep 0.1; i=$((i+1))
done
[ -n "$pids" ] && kill -KILL $pids 2>/dev/null
[ "$keep" = 1 ] || rm -rf "$dir"
"#;

impl Janitor {
    /// Creates a fresh temporary directory named after `prefix`, kept at
    /// the end if `VMMIGRATE_TEST_KEEP` is set.
    pub fn new(prefix: &str) -> anyhow::Result<Janitor> {
        Janitor::keeping(prefix, std::env::var_os("VMMIGRATE_TEST_KEEP").is_some())
    }

    /// [`Janitor::new`], keeping the directory at the end only if `keep`
    /// (a test of the janitor's own clean-up asks for it whatever the
    /// environment says).
    pub fn keeping(prefix: &str, keep: bool) -> anyhow::Result<Janitor> {
        let dir = tempfile::Builder::new().prefix(prefix).tempdir()?.keep();
        let keep = if keep { "1" } else { "0" };
        let mut janitor = Command::new("sh")
            .args(["-c", JANITOR_SCRIPT, "janitor"])
            .arg(&dir)
            .arg(keep)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let pipe = janitor.stdin.take();
        Ok(Janitor {
            dir,
            pipe: Mutex::new(pipe),
            janitor: Mutex::new(janitor),
            children: Mutex::new(Vec::new()),
            specs: Mutex::new(Default::default()),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Starts `cmd` with its output in `<dir>/<name>.log` and records its pid.
    pub fn spawn(&self, name: &str, cmd: &mut Command) -> anyhow::Result<u32> {
        self.specs.lock().expect("specs lock").insert(name.to_owned(), Spec::of(cmd));
        // Appended: a process started again keeps its earlier log above.
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.log_path(name))?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start {name} ({:?}): {e}", cmd.get_program()))?;
        let pid = child.id();
        // With the start time beside it: pids are reused (pid_max is 32,768
        // here), and a janitor that outlives its test process must not stop
        // another test's process that got a recorded pid.
        let started = start_time(pid).unwrap_or_default();
        let mut pids = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.join("pids"))?;
        writeln!(pids, "{pid} {started}")?;
        self.children.lock().expect("children lock").push((name.to_owned(), child));
        Ok(pid)
    }

    pub fn log_path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.log"))
    }

    /// Fails with the process's log tail if any started process has exited.
    pub fn check_alive(&self) -> anyhow::Result<()> {
        let mut children = self.children.lock().expect("children lock");
        for (name, child) in children.iter_mut() {
            if let Some(status) = child.try_wait()? {
                anyhow::bail!("{name} exited ({status}); last log lines:\n{}", self.log_tail(name));
            }
        }
        Ok(())
    }

    /// The last 40 lines of a process's log.
    pub fn log_tail(&self, name: &str) -> String {
        let text = std::fs::read_to_string(self.log_path(name)).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// Stops one process by name (TERM) and waits for it.
    pub fn stop(&self, name: &str) -> anyhow::Result<()> {
        let mut children = self.children.lock().expect("children lock");
        if let Some(pos) = children.iter().position(|(n, _)| n == name) {
            let (_, mut child) = children.remove(pos);
            // The kill binary sends TERM (std only offers KILL), so servers shut down cleanly.
            let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
            child.wait()?;
        }
        Ok(())
    }
}

impl Janitor {
    /// Starts a process stopped by [`Janitor::stop`] again, exactly as it
    /// was first started (same program, arguments, environment, log).
    pub fn start_again(&self, name: &str) -> anyhow::Result<u32> {
        let spec = self.specs.lock().expect("specs lock").get(name).cloned();
        let spec = spec.ok_or_else(|| anyhow::anyhow!("{name} was never started here"))?;
        anyhow::ensure!(
            !self.children.lock().expect("children lock").iter().any(|(n, _)| n == name),
            "{name} still runs"
        );
        self.spawn(name, &mut spec.command())
    }

    /// The pid of a running process by name.
    pub fn pid_of(&self, name: &str) -> Option<u32> {
        self.children.lock().expect("children lock").iter().find(|(n, _)| n == name).map(|(_, c)| c.id())
    }

    /// Stops one process and its direct children by name (SIGTERM to the
    /// children first): for a daemon started through `nsenter`, which
    /// forks it and does not pass signals on.
    pub fn stop_with_children(&self, name: &str) -> anyhow::Result<()> {
        let pid =
            self.children.lock().expect("children lock").iter().find(|(n, _)| n == name).map(|(_, c)| c.id());
        if let Some(pid) = pid {
            let _ = Command::new("pkill").args(["-TERM", "-P", &pid.to_string()]).status();
        }
        self.stop(name)
    }

    /// Stops one process by name with SIGKILL, as a crash or a power cut
    /// would, and waits for it.
    pub fn kill(&self, name: &str) -> anyhow::Result<()> {
        let mut children = self.children.lock().expect("children lock");
        if let Some(pos) = children.iter().position(|(n, _)| n == name) {
            let (_, mut child) = children.remove(pos);
            let _ = child.kill();
            child.wait()?;
        }
        Ok(())
    }
}

impl Drop for Janitor {
    fn drop(&mut self) {
        // Our own children are stopped and reaped here: unreaped, they would
        // linger as zombies that `kill -0` still finds, and the janitor would
        // wait its full five seconds for them.
        if let Ok(mut children) = self.children.lock() {
            for (_, child) in children.iter_mut() {
                // One already reaped (by `check_alive`) may have its pid reused.
                if matches!(child.try_wait(), Ok(None)) {
                    let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
                }
            }
            let deadline = Instant::now() + Duration::from_secs(5);
            for (_, child) in children.iter_mut() {
                while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(20));
                }
                if matches!(child.try_wait(), Ok(None)) {
                    let _ = child.kill();
                }
                let _ = child.wait();
            }
        }
        // Closing the pipe starts the janitor (directory removal, and any
        // process a crash left behind); waiting makes cleanup synchronous.
        if let Ok(mut pipe) = self.pipe.lock() {
            pipe.take();
        }
        if let Ok(mut janitor) = self.janitor.lock() {
            let _ = janitor.wait();
        }
    }
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Polls `check` every 50 ms until it returns true, fails, or `timeout` passes.
pub fn wait_until(
    timeout: Duration,
    what: &str,
    mut check: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if check()? {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A plain-HTTP GET on loopback, returning the body.
pub fn http_get_plain(port: u16, path: &str) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response.split_once("\r\n\r\n").map(|(_, body)| body.to_owned()).unwrap_or_default())
}

/// A plain-HTTP POST of a JSON body on loopback, returning the body.
pub fn http_post_plain(port: u16, path: &str, body: &str) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let request = format!(
        "POST {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes())?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response.split_once("\r\n\r\n").map(|(_, body)| body.to_owned()).unwrap_or_default())
}

/// The processes a janitor started in `dir` that still run (their recorded
/// start time matches: a pid reused by another process is not ours).
pub fn recorded_pids(dir: &Path) -> Vec<u32> {
    let recorded = std::fs::read_to_string(dir.join("pids")).unwrap_or_default();
    recorded
        .lines()
        .filter_map(|line| {
            let (pid, started) = line.split_once(' ')?;
            let pid = pid.parse::<u32>().ok()?;
            (start_time(pid)?.to_string() == started).then_some(pid)
        })
        .collect()
}

/// A process's start time in clock ticks since boot (field 22 of
/// `/proc/<pid>/stat`), which with the pid names one process for good.
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: the fields
    // after the last ')' are the state (3) onwards.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// A process's resident set size (0 when it is gone).
pub fn rss_bytes(pid: u32) -> u64 {
    status_kib(pid, "VmRSS") * 1024
}

/// Kilobytes under `field` (VmRSS, VmHWM, …) of `/proc/<pid>/status`; 0 when
/// the process is gone.
pub fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0)
}

/// User plus system CPU seconds a process has used (0 when it is gone).
pub fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields 14 and 15 (utime, stime) are 11 and 12 after the `(comm)`.
    let after = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or("");
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// Runs a shell pipeline under bash's `time`: (wall seconds, CPU seconds of
/// its processes). The timing report and the pipeline's stderr land in
/// `errors`; a failing pipeline panics with them (for benchmarks).
pub fn timed_shell(script: &str, errors: &Path) -> (f64, f64) {
    let wrapped = format!("TIMEFORMAT='TIMING %R %U %S'; time ( {script} ) 2>{}", errors.display());
    let status = Command::new("bash").arg("-c").arg(&wrapped).status().expect("bash");
    let report = std::fs::read_to_string(errors).unwrap_or_default();
    let timing = report.lines().rev().find_map(|l| l.strip_prefix("TIMING ")).unwrap_or("");
    let nums: Vec<f64> = timing.split_whitespace().filter_map(|v| v.parse().ok()).collect();
    assert!(status.success() && nums.len() == 3, "`{script}` failed ({status}): {report}");
    (nums[0], nums[1] + nums[2])
}
