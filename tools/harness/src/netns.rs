//! A network namespace per test, joined to the host by a veth pair, so a real
//! server can be reached at an address an EndpointSlice may carry.
//!
//! Why: the API server rejects loopback (127.0.0.0/8, ::1) and link-local
//! addresses in EndpointSlices and Endpoints, so an application behind a real
//! Service cannot simply listen on 127.0.0.1. Each `Netns` is a namespace
//! `vmmt-<pid>-<n>` with its own /30 from 10.251.0.0/16 (host end `.1`,
//! namespace end `.2`); servers run inside it with `ip netns exec`, and
//! traffic never leaves the machine. Needs root and iproute2 (`ip`).
//!
//! Nothing is left behind: a guard shell, started before the namespace exists,
//! reads a pipe whose write end only this process holds. When the process
//! exits however it exits (end of tests, panic, SIGKILL) the pipe closes and
//! the guard kills everything in the namespace and deletes it, which also
//! removes the veth pair. `Drop` does the same synchronously.

use crate::process::{Janitor, wait_until};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// One test's network namespace, the processes started in it, and a temporary directory.
pub struct Netns {
    name: String,
    /// Address of the host end of the veth pair.
    pub host_ip: Ipv4Addr,
    /// Address inside the namespace: where its servers listen.
    pub ip: Ipv4Addr,
    janitor: Option<Janitor>,
    /// Names of the processes started in the namespace, stopped one by one on drop.
    started: Mutex<Vec<String>>,
    pipe: Option<ChildStdin>,
    guard: Option<Child>,
}

const GUARD_SCRIPT: &str = r#"
ns=$1; veth=$2
cat >/dev/null
for sig in TERM KILL; do
  pids=$(ip netns pids "$ns" 2>/dev/null)
  [ -n "$pids" ] && kill -"$sig" $pids 2>/dev/null
  i=0
  while [ $i -lt 50 ] && [ -n "$(ip netns pids "$ns" 2>/dev/null)" ]; do sleep 0.1; i=$((i+1)); done
done
ip netns del "$ns" 2>/dev/null
ip link del "$veth" 2>/dev/null
exit 0
"#;

static COUNTER: AtomicU32 = AtomicU32::new(0);
/// `ip netns add` sets up /run/netns on first use; one set-up at a time avoids racing on it.
static SETUP: Mutex<()> = Mutex::new(());

impl Netns {
    /// Creates the namespace and the veth pair, both up and addressed.
    pub fn new() -> anyhow::Result<Netns> {
        crate::setup::packages()?;
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let name = format!("vmmt-{pid}-{n}");
        // Interface names are at most 15 bytes; the namespace end is `eth0` inside it.
        let host_if = format!("vh{pid}-{n}");
        anyhow::ensure!(host_if.len() <= 15, "interface name {host_if} is too long");

        let janitor = Janitor::new("vmmigrate-netns")?;
        let mut guard = Command::new("sh")
            .args(["-c", GUARD_SCRIPT, "netns-guard", &name, &host_if])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let pipe = guard.stdin.take();
        let _setup = SETUP.lock().unwrap_or_else(|e| e.into_inner());
        let (host_ip, ip) = free_subnet(pid, n)?;
        let netns = Netns {
            name,
            host_ip,
            ip,
            janitor: Some(janitor),
            started: Mutex::default(),
            pipe,
            guard: Some(guard),
        };
        let (ns, host, host_cidr, ns_cidr) =
            (netns.name.as_str(), host_if.as_str(), format!("{host_ip}/30"), format!("{ip}/30"));
        run_ip(&["netns", "add", ns])?;
        run_ip(&["link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", ns])?;
        run_ip(&["addr", "add", &host_cidr, "dev", host])?;
        run_ip(&["link", "set", host, "up"])?;
        run_ip(&["-n", ns, "addr", "add", &ns_cidr, "dev", "eth0"])?;
        run_ip(&["-n", ns, "link", "set", "eth0", "up"])?;
        run_ip(&["-n", ns, "link", "set", "lo", "up"])?;
        Ok(netns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// A temporary directory for this namespace's servers (removed with it).
    pub fn dir(&self) -> &Path {
        self.janitor().dir()
    }

    /// Starts `program args…` inside the namespace, output in `<dir>/<name>.log`.
    pub fn spawn(&self, name: &str, program: &str, args: &[&str]) -> anyhow::Result<u32> {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name, program]).args(args);
        let pid = self.janitor().spawn(name, &mut cmd)?;
        self.started.lock().unwrap_or_else(|e| e.into_inner()).push(name.to_owned());
        Ok(pid)
    }

    /// Serves `files` (name, content) with busybox httpd on `<ip>:<port>` and
    /// waits until it accepts connections. A missing file answers 404.
    pub fn serve_http(&self, port: u16, files: &[(&str, &str)]) -> anyhow::Result<()> {
        let root = self.dir().join(format!("www-{port}"));
        std::fs::create_dir_all(&root)?;
        for (name, content) in files {
            std::fs::write(root.join(name), content)?;
        }
        let listen = format!("{}:{port}", self.ip);
        let root = root.to_string_lossy().into_owned();
        let name = format!("httpd-{port}");
        self.spawn(&name, "busybox", &["httpd", "-f", "-p", &listen, "-h", &root])?;
        let addr = SocketAddr::from((self.ip, port));
        wait_until(Duration::from_secs(10), &format!("{name} on {addr}"), || {
            self.janitor().check_alive()?;
            Ok(TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok())
        })
    }

    fn janitor(&self) -> &Janitor {
        self.janitor.as_ref().expect("the janitor lives until drop")
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Processes first, then the namespace. `Janitor::stop` reaps each one; the
        // janitor's own sweep would see unreaped children as alive and wait 5 s.
        if let Some(janitor) = self.janitor.take() {
            for name in self.started.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                let _ = janitor.stop(name);
            }
        }
        self.pipe.take();
        if let Some(mut guard) = self.guard.take() {
            let _ = guard.wait();
        }
    }
}

pub(crate) fn run_ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| anyhow::anyhow!("cannot run ip (install iproute2): {e}"))?;
    anyhow::ensure!(
        out.status.success(),
        "ip {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// A /30 in 10.251.0.0/16 no host interface uses yet: the process picks the
/// third octet, the counter the fourth, so parallel test processes rarely meet;
/// taken subnets are skipped.
fn free_subnet(pid: u32, n: u32) -> anyhow::Result<(Ipv4Addr, Ipv4Addr)> {
    let out = Command::new("ip").args(["-o", "-4", "addr", "show"]).stdin(Stdio::null()).output()?;
    anyhow::ensure!(out.status.success(), "ip -o -4 addr show failed");
    let listing = String::from_utf8_lossy(&out.stdout).into_owned();
    const SLOTS: u32 = 1 << 14; // /30s in a /16
    let first = (pid % 256) * 64 + n % 64;
    for step in 0..SLOTS {
        let base = ((first + step) % SLOTS) * 4;
        let host = Ipv4Addr::new(10, 251, (base >> 8) as u8, (base & 0xff) as u8 + 1);
        if !listing.contains(&format!(" {host}/")) {
            return Ok((host, Ipv4Addr::new(10, 251, (base >> 8) as u8, (base & 0xff) as u8 + 2)));
        }
    }
    anyhow::bail!("every /30 in 10.251.0.0/16 is in use")
}
