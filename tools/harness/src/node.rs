//! The test cluster's one real node: containerd + runc (Debian), a kubelet and
//! kube-proxy built from their Go modules, pod networking with Debian's CNI
//! plugins (bridge, host-local, portmap, loopback), rancher's
//! local-path-provisioner as the dynamic storage provisioner, and images
//! built locally (`tools/testenv/images.sh`) and imported into containerd:
//! nothing is pulled.
//!
//! Isolation, so that tearing down leaves nothing behind:
//! - **Network**: the node lives in its own network namespace `vmmnode-<pid>-<n>`,
//!   joined to the host by a veth pair (`vn<pid>n<n>` on the host, `eth0` inside)
//!   on a /30 of 10.250.K.0/24. The CNI bridge, the pods' veths, kube-proxy's
//!   and the kubelet's iptables rules and the conntrack table are all inside
//!   it and go with it. The host gets one route, the pod network
//!   10.244.K.0/24 via the node, on the veth, so it goes with the veth.
//! - **Mounts**: containerd, the kubelet and kube-proxy run in a private
//!   mount and PID namespace (a holder `unshare --mount --propagation slave
//!   --pid --mount-proc`) with a tmpfs on `/run`, so overlay, volume and
//!   netns mounts never reach the host and vanish when the last process in
//!   it exits, and every process of the node ends with the holder.
//! - **cgroups**: pods live under `/vmmnode-<pid>-<n>` in every cgroup v1
//!   hierarchy (the kubelet's `cgroupRoot`), removed depth-first at the end.
//!
//! A guard shell in a process group of its own (a kill of the test's group
//! does not reach it) holds a pipe whose write end only this process has.
//! When the process exits, however it exits, the guard kills everything in
//! the cgroups and the namespace, removes the cgroups, the namespace and the
//! veth, and deletes its log unless something was left (then the log in
//! `/tmp/vmmnode-<pid>-<n>.guard.log` says what).

use crate::netns::run_ip as ip;
use crate::process::{Janitor, wait_until};
use std::net::Ipv4Addr;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Images the node holds, imported from `tools/testenv/images.sh`.
pub const PAUSE_IMAGE: &str = "registry.test.local/pause:3.10";
pub const BUSYBOX_IMAGE: &str = "registry.test.local/busybox:1.36";
/// The kubelet's root inside the node's mount namespace (a bind mount of
/// the node's own `kubelet` directory).
const KUBELET_ROOT: &str = "/var/lib/kubelet";
/// Host paths the node's pods use that are the node's own: inside its mount
/// namespace each is a bind mount of a directory of the node (the host
/// keeps at most the empty directory). The kubelet's root, and where
/// KubeVirt's node labeller (an init container of virt-handler, hostPath)
/// writes what libvirt says of the node.
const NODE_HOST_PATHS: [(&str, &str); 2] =
    [("kubelet", KUBELET_ROOT), ("kubevirt-node-labeller", "/var/lib/kubevirt-node-labeller")];

const GUARD_SCRIPT: &str = r#"
ns=$1; veth=$2; cg=$3; log=$4
exec 2>>"$log"
cat >/dev/null
say() { echo "$(date +%T.%N) $*" >>"$log"; }
say "guard: tearing down $ns"
cgpids() { find /sys/fs/cgroup/*/"$cg" -name cgroup.procs -exec cat {} + 2>/dev/null | sort -u; }
holder=$(cat "$log.holder" 2>/dev/null)
for sig in TERM KILL; do
  pids=$(echo $(ip netns pids "$ns" 2>/dev/null) $(cgpids) $holder)
  say "guard: $sig $pids"
  kill -"$sig" $pids 2>/dev/null
  i=0
  while [ $i -lt 50 ]; do
    left=""
    for p in $pids; do kill -0 "$p" 2>/dev/null && left="$left $p"; done
    [ -z "$left" ] && break
    sleep 0.1; i=$((i+1))
  done
done
for d in $(find /sys/fs/cgroup/*/"$cg" -depth -type d 2>/dev/null); do rmdir "$d" 2>>"$log"; done
ip netns del "$ns" 2>>"$log"
ip link del "$veth" 2>/dev/null
rm -f "$log.holder"
left=$( (ls -d /sys/fs/cgroup/*/"$cg" /run/netns/"$ns" /sys/class/net/"$veth") 2>/dev/null)
if [ -z "$left" ]; then rm -f "$log"; else say "guard: left behind: $left"; fi
exit 0
"#;

/// The node's network, cgroup root and guard; created before the API server
/// starts, because the API server listens on the host end of the veth.
pub struct NodeNet {
    pub netns: String,
    pub host_if: String,
    /// Host end of the veth: where the API server, the ESXi emulator and the
    /// Git daemon listen for pods.
    pub host_ip: Ipv4Addr,
    /// The node's IP (kubelet, kube-proxy).
    pub ip: Ipv4Addr,
    /// The pod network, `10.244.K.0/24`.
    pub pod_cidr: String,
    /// cgroup of every pod, in each v1 hierarchy: `/vmmnode-<pid>-<n>`.
    pub cgroup_root: String,
    guard_log: PathBuf,
    pipe: Mutex<Option<ChildStdin>>,
    guard: Mutex<Option<Child>>,
}

impl NodeNet {
    pub fn create() -> anyhow::Result<NodeNet> {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let pid = std::process::id();
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let netns = format!("vmmnode-{pid}-{n}");
        let host_if = format!("vn{pid}n{n}");
        anyhow::ensure!(host_if.len() <= 15, "interface name {host_if} is too long");
        let cgroup_root = netns.clone();
        let guard_log = std::env::temp_dir().join(format!("{netns}.guard.log"));
        std::fs::write(&guard_log, "")?;
        let mut guard = Command::new("sh")
            .args(["-c", GUARD_SCRIPT, "node-guard", &netns, &host_if, &cgroup_root])
            .arg(&guard_log)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()?;
        let pipe = guard.stdin.take();
        let k = free_octet(pid + n)?;
        let net = NodeNet {
            netns,
            host_if,
            host_ip: Ipv4Addr::new(10, 250, k, 1),
            ip: Ipv4Addr::new(10, 250, k, 2),
            pod_cidr: format!("10.244.{k}.0/24"),
            cgroup_root,
            guard_log,
            pipe: Mutex::new(pipe),
            guard: Mutex::new(Some(guard)),
        };
        let (ns, host) = (net.netns.as_str(), net.host_if.as_str());
        ip(&["netns", "add", ns])?;
        ip(&["link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", ns])?;
        ip(&["addr", "add", &format!("{}/30", net.host_ip), "dev", host])?;
        ip(&["link", "set", host, "up"])?;
        ip(&["-n", ns, "addr", "add", &format!("{}/30", net.ip), "dev", "eth0"])?;
        ip(&["-n", ns, "link", "set", "eth0", "up"])?;
        ip(&["-n", ns, "link", "set", "lo", "up"])?;
        ip(&["-n", ns, "route", "add", "default", "via", &net.host_ip.to_string()])?;
        ip(&["route", "add", &net.pod_cidr, "via", &net.ip.to_string(), "dev", host])?;
        // Routing between the pod bridge and eth0 happens inside the namespace.
        netns_sysctl(ns, "net.ipv4.ip_forward", "1")?;
        Ok(net)
    }

    /// Tears everything down now (the guard's work, synchronously).
    pub fn stop(&self) {
        self.pipe.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(mut guard) = self.guard.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = guard.wait();
        }
    }

    fn record_holder(&self, pid: u32) -> anyhow::Result<()> {
        let path = PathBuf::from(format!("{}.holder", self.guard_log.display()));
        Ok(std::fs::write(path, pid.to_string())?)
    }
}

impl Drop for NodeNet {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A third octet K with neither 10.250.K.0/24 nor 10.244.K.0/24 on the host.
fn free_octet(pid: u32) -> anyhow::Result<u8> {
    let out = Command::new("ip").args(["-o", "-4", "addr", "show"]).stdin(Stdio::null()).output()?;
    let routes = Command::new("ip").args(["-4", "route", "show"]).stdin(Stdio::null()).output()?;
    let listing =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&routes.stdout));
    for step in 0..256u32 {
        let k = ((pid + step) % 254 + 1) as u8;
        if !listing.contains(&format!("10.250.{k}.")) && !listing.contains(&format!("10.244.{k}.")) {
            return Ok(k);
        }
    }
    anyhow::bail!("no free 10.250.K.0/24 for a test node")
}

fn netns_sysctl(ns: &str, key: &str, value: &str) -> anyhow::Result<()> {
    let path = format!("/proc/sys/{}", key.replace('.', "/"));
    let status = Command::new("ip")
        .args(["netns", "exec", ns, "sh", "-c", &format!("echo {value} > {path}")])
        .stdin(Stdio::null())
        .status()?;
    anyhow::ensure!(status.success(), "setting {key}={value} in {ns} failed");
    Ok(())
}

/// What the node needs from the control plane.
pub struct ControlPlane<'a> {
    pub bin: &'a Path,
    /// `https://<host_ip>:<port>`.
    pub server: &'a str,
    pub ca_pem: &'a [u8],
    /// Tokens the API server accepts for `system:node:<name>` (group
    /// `system:nodes`) and `system:kube-proxy`.
    pub node_token: &'a str,
    pub proxy_token: &'a str,
}

/// The running node.
pub struct Node {
    pub name: String,
    pub host_ip: Ipv4Addr,
    pub ip: Ipv4Addr,
    pub netns: String,
    pub cgroup_root: String,
    /// Root of the node's state (containerd, kubelet, PVs under `pv/`).
    pub dir: PathBuf,
    holder: u32,
    containerd_sock: PathBuf,
    /// How long the node took from nothing to Ready with its provisioner.
    pub startup: Duration,
}

pub const NODE_NAME: &str = "vmmnode";

/// Starts containerd, imports the images, starts the kubelet and kube-proxy,
/// waits for the node to be Ready and the provisioner to be Available.
pub fn start(
    net: &NodeNet,
    janitor: &Janitor,
    cp: &ControlPlane<'_>,
    kubeconfig: &Path,
) -> anyhow::Result<Node> {
    let started = Instant::now();
    let dir = janitor.dir().join("node");
    for sub in ["containerd/root", "containerd/state", "cni/net.d", "cni/ipam", "kubelet", "pod-logs", "pv"] {
        std::fs::create_dir_all(dir.join(sub))?;
    }

    // The holder of the node's mount and PID namespaces (with a /proc of
    // that PID namespace); daemons join both with nsenter. KubeVirt's
    // virt-handler (a hostPID pod) takes PID 1's mount namespace
    // (`/proc/1/ns/mnt`, `/proc/1/root`) for the node's: in the node's PID
    // namespace, PID 1 is this holder's `sleep`, which lives in the node's
    // mount namespace. When it ends, the kernel ends every process in the
    // namespace too. nsenter forks to enter a PID namespace (a Go program
    // cannot start threads in one it did not enter), so the janitor's pids
    // of the node's daemons are nsenter's, each living as long as its
    // daemon.
    let holder = janitor.spawn(
        "mount-holder",
        Command::new("unshare").args([
            "--mount",
            "--propagation",
            "slave",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            "sleep",
            "infinity",
        ]),
    )?;
    net.record_holder(holder)?;
    let mnt = format!("/proc/{holder}/ns/mnt");
    // unshare has made the namespaces once its child (PID 1 inside) runs sleep.
    wait_until(Duration::from_secs(10), "the node's mount and PID namespaces", || {
        janitor.check_alive()?;
        let children =
            std::fs::read_to_string(format!("/proc/{holder}/task/{holder}/children")).unwrap_or_default();
        let sleeping = children.split_whitespace().any(|child| {
            std::fs::read_link(format!("/proc/{child}/exe")).is_ok_and(|exe| exe.ends_with("sleep"))
        });
        Ok(sleeping && std::fs::read_link(&mnt).ok() != std::fs::read_link("/proc/self/ns/mnt").ok())
    })?;
    let node = Node {
        name: NODE_NAME.to_owned(),
        host_ip: net.host_ip,
        ip: net.ip,
        netns: net.netns.clone(),
        cgroup_root: net.cgroup_root.clone(),
        containerd_sock: dir.join("containerd.sock"),
        dir,
        holder,
        startup: Duration::ZERO,
    };
    node.run(&["mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", "/run"])?;
    // KubeVirt's virt-handler mounts /var/run/kubevirt and the kubelet's
    // root with Bidirectional propagation (the launcher's disks and
    // sockets), which containerd allows only from shared mounts (it looks
    // the path up without following /var/run -> /run, so "/" too); and its
    // DaemonSet names host paths by their usual names. So, inside the
    // node's mount namespace, every mount is made shared as well as a slave
    // of the host's (what is mounted inside still never reaches the host),
    // and the node's own directories are bind-mounted on those paths
    // (`NODE_HOST_PATHS`).
    node.run(&["mount", "--make-rshared", "/"])?;
    for (own, path) in NODE_HOST_PATHS {
        let own = node.dir.join(own);
        std::fs::create_dir_all(&own)?;
        std::fs::create_dir_all(path)?;
        node.run(&["mount", "--bind", &own.to_string_lossy(), path])?;
        node.run(&["mount", "--make-rshared", path])?;
    }
    create_cgroup_root(&net.cgroup_root)?;
    // kube-proxy's service rules see bridged pod-to-pod traffic only with this.
    let _ = Command::new("modprobe").arg("br_netfilter").stderr(Stdio::null()).status();
    let _ = node.run(&["sh", "-c", "echo 1 > /proc/sys/net/bridge/bridge-nf-call-iptables"]);

    // containerd
    let config = node.dir.join("containerd.toml");
    std::fs::write(&config, containerd_config(&node.dir, &node.containerd_sock))?;
    janitor.spawn("containerd", node.command("containerd").arg("--config").arg(&config))?;
    node.wait_containerd(janitor)?;
    let images = crate::setup::node_images()?;
    for entry in std::fs::read_dir(&images)? {
        let path = entry?.path();
        if path.to_string_lossy().ends_with(".oci.tar") {
            // A failed import says why containerd went away, if it did.
            node.import_image(&path).map_err(|e| match janitor.check_alive() {
                Err(dead) => e.context(format!("{dead:#}")),
                Ok(()) => e,
            })?;
        }
    }

    // CNI: one bridge with the pod network; masquerade what leaves it.
    let conflist = serde_json::json!({
        "cniVersion": "1.0.0",
        "name": "vmmnode",
        "plugins": [
            {
                "type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true, "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{ "subnet": net.pod_cidr }]],
                    "routes": [{ "dst": "0.0.0.0/0" }],
                    "dataDir": node.dir.join("cni/ipam"),
                },
            },
            { "type": "portmap", "capabilities": { "portMappings": true } },
        ],
    });
    std::fs::write(node.dir.join("cni/net.d/10-vmmnode.conflist"), serde_json::to_vec_pretty(&conflist)?)?;

    // kubelet
    let node_kubeconfig = node.dir.join("kubelet.kubeconfig");
    write_token_kubeconfig(&node_kubeconfig, cp.server, cp.ca_pem, cp.node_token)?;
    let kubelet_config = node.dir.join("kubelet.yaml");
    std::fs::write(&kubelet_config, kubelet_config_yaml(&node, &net.pod_cidr))?;
    janitor.spawn(
        "kubelet",
        node.command(cp.bin.join("kubelet"))
            .arg(format!("--config={}", kubelet_config.display()))
            .arg(format!("--kubeconfig={}", node_kubeconfig.display()))
            .arg(format!("--root-dir={KUBELET_ROOT}"))
            .arg(format!("--hostname-override={}", node.name))
            .arg(format!("--node-ip={}", node.ip))
            .arg("--v=1"),
    )?;

    // kube-proxy
    let proxy_kubeconfig = node.dir.join("kube-proxy.kubeconfig");
    write_token_kubeconfig(&proxy_kubeconfig, cp.server, cp.ca_pem, cp.proxy_token)?;
    let proxy_config = node.dir.join("kube-proxy.yaml");
    std::fs::write(
        &proxy_config,
        format!(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
             clientConnection:\n  kubeconfig: {kc}\nmode: iptables\nhostnameOverride: {name}\n\
             clusterCIDR: {cidr}\nbindAddress: {ip}\nhealthzBindAddress: 127.0.0.1:10256\n\
             metricsBindAddress: 127.0.0.1:10249\nconntrack:\n  maxPerCore: 0\n  min: 0\n\
             \x20 tcpEstablishedTimeout: 0s\n  tcpCloseWaitTimeout: 0s\n",
            kc = proxy_kubeconfig.display(),
            name = node.name,
            cidr = net.pod_cidr,
            ip = node.ip,
        ),
    )?;
    janitor.spawn(
        "kube-proxy",
        node.command(cp.bin.join("kube-proxy"))
            .arg(format!("--config={}", proxy_config.display()))
            .arg("--v=1"),
    )?;

    node.wait_ready(janitor, kubeconfig, cp.bin)?;
    Ok(Node { startup: started.elapsed(), ..node })
}

impl Node {
    /// The pid of the process holding the node's mount and PID namespaces.
    pub fn holder(&self) -> u32 {
        self.holder
    }

    /// A command run inside the node's network and mount namespaces.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--mount=/proc/{}/ns/mnt", self.holder))
            .arg(format!("--pid=/proc/{}/ns/pid_for_children", self.holder))
            .arg(format!("--net=/run/netns/{}", self.netns))
            .arg("--")
            .arg(program);
        cmd
    }

    /// Runs `argv` inside the node and fails with its output when it fails.
    pub fn run(&self, argv: &[&str]) -> anyhow::Result<String> {
        let out = self.command(argv[0]).args(&argv[1..]).stdin(Stdio::null()).output()?;
        anyhow::ensure!(
            out.status.success(),
            "{} on the node failed ({}): {}",
            argv.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn ctr(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut argv = vec!["ctr", "--address"];
        let sock = self.containerd_sock.to_string_lossy().into_owned();
        argv.push(&sock);
        argv.extend(["--namespace", "k8s.io"]);
        argv.extend(args);
        self.run(&argv)
    }

    /// Imports an oci-archive into containerd (the name comes from its
    /// `io.containerd.image.name` annotation).
    pub fn import_image(&self, archive: &Path) -> anyhow::Result<()> {
        let path = archive.to_string_lossy().into_owned();
        self.ctr(&["images", "import", "--all-platforms", &path])
            .map_err(|e| anyhow::anyhow!("importing {path}: {e:#}"))?;
        Ok(())
    }

    /// The node's processes whose command line is `…/vmmigrate <subcommand> …`
    /// (a worker pod's `worker`, a fill Job's `fill-volume`).
    pub fn vmmigrate_processes(&self, subcommand: &str) -> Vec<u32> {
        self.processes()
            .into_iter()
            .filter(|pid| {
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
                args.len() > 1 && args[0].ends_with(b"vmmigrate") && args[1] == subcommand.as_bytes()
            })
            .collect()
    }

    /// Processes in the node's network namespace (containerd, the shims, the
    /// kubelet, kube-proxy) and in its pods' cgroups.
    pub fn processes(&self) -> Vec<u32> {
        let mut pids = Vec::new();
        if let Ok(out) = Command::new("ip").args(["netns", "pids", &self.netns]).output() {
            pids.extend(
                String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.trim().parse::<u32>().ok()),
            );
        }
        let root = Path::new("/sys/fs/cgroup/memory").join(&self.cgroup_root);
        let mut stack = vec![root];
        while let Some(dir) = stack.pop() {
            let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
            pids.extend(procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
            for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    stack.push(entry.path());
                }
            }
        }
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Serves `files` with busybox httpd on `<node ip>:<port>`, in the node's
    /// network namespace: an address both pods and the host reach (pods
    /// cannot reach a test network namespace: the host does not forward).
    /// The process belongs to `janitor`.
    pub fn serve_http(&self, janitor: &Janitor, port: u16, files: &[(&str, &str)]) -> anyhow::Result<()> {
        let root = janitor.dir().join(format!("www-{port}"));
        std::fs::create_dir_all(&root)?;
        for (name, content) in files {
            std::fs::write(root.join(name), content)?;
        }
        let listen = format!("{}:{port}", self.ip);
        let name = format!("httpd-{port}");
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/run/netns/{}", self.netns))
            .args(["--", "busybox", "httpd", "-f", "-p", &listen, "-h"])
            .arg(&root);
        janitor.spawn(&name, &mut cmd)?;
        let addr = std::net::SocketAddr::from((self.ip, port));
        wait_until(Duration::from_secs(10), &format!("{name} on {addr}"), || {
            janitor.check_alive()?;
            Ok(std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok())
        })
    }

    /// `kubectl` against this cluster, run on the host.
    pub fn kubectl(bin: &Path, kubeconfig: &Path, args: &[&str]) -> anyhow::Result<String> {
        let out = Command::new(bin.join("kubectl"))
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .args(args)
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "kubectl {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Waits until containerd answers on its socket.
    /// Waits until containerd answers and its CRI plugin has served: after a
    /// restart the plugin first recovers its containers, and a kubelet
    /// started then fails with "server is not initialized yet". The CRI
    /// plugin logs "Start streaming server" as the last step before it
    /// serves: it must follow the latest "starting containerd" (the log is
    /// appended to across starts, and a start killed early never says it).
    pub(crate) fn wait_containerd(&self, janitor: &Janitor) -> anyhow::Result<()> {
        let log = janitor.log_path("containerd");
        wait_until(Duration::from_secs(60), "containerd and its CRI plugin", || {
            janitor.check_alive()?;
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let started = text.rfind("msg=\"starting containerd\"");
            let served = text.rfind("msg=\"Start streaming server\"");
            let serving = matches!((started, served), (Some(s), Some(v)) if v > s);
            Ok(serving && self.ctr(&["version"]).is_ok())
        })
    }

    pub(crate) fn wait_ready(&self, janitor: &Janitor, kubeconfig: &Path, bin: &Path) -> anyhow::Result<()> {
        wait_until(Duration::from_secs(120), "node Ready", || {
            janitor.check_alive()?;
            let out = Node::kubectl(
                bin,
                kubeconfig,
                &[
                    "get",
                    "node",
                    &self.name,
                    "-o",
                    r#"jsonpath={.status.conditions[?(@.type=="Ready")].status}"#,
                ],
            );
            Ok(out.is_ok_and(|s| s.trim() == "True"))
        })?;
        let manifest =
            std::fs::read_to_string(crate::repo_root().join("tools/testenv/local-path-storage.yaml"))?
                .replace("@PV_DIR@", &self.dir.join("pv").to_string_lossy());
        let file = self.dir.join("local-path-storage.yaml");
        std::fs::write(&file, manifest)?;
        Node::kubectl(bin, kubeconfig, &["apply", "-f", &file.to_string_lossy()])?;
        wait_until(Duration::from_secs(120), "local-path-provisioner Available", || {
            janitor.check_alive()?;
            let out = Node::kubectl(
                bin,
                kubeconfig,
                &[
                    "-n",
                    "local-path-storage",
                    "get",
                    "deployment",
                    "local-path-provisioner",
                    "-o",
                    r#"jsonpath={.status.conditions[?(@.type=="Available")].status}"#,
                ],
            );
            Ok(out.is_ok_and(|s| s.trim() == "True"))
        })
    }
}

/// `/vmmnode-<pid>` in every cgroup v1 hierarchy; cpuset needs its cpus and
/// mems before anything may join.
fn create_cgroup_root(name: &str) -> anyhow::Result<()> {
    for entry in std::fs::read_dir("/sys/fs/cgroup")? {
        let hierarchy = entry?.path();
        if !hierarchy.join("tasks").exists() && !hierarchy.join("cgroup.procs").exists() {
            continue;
        }
        if hierarchy.join("cgroup.controllers").exists() {
            // The cgroup v2 mount beside the v1 hierarchies: not the kubelet's.
            continue;
        }
        let dir = hierarchy.join(name);
        std::fs::create_dir_all(&dir)?;
        for file in ["cpuset.cpus", "cpuset.mems"] {
            if let Ok(value) = std::fs::read_to_string(hierarchy.join(file)) {
                std::fs::write(dir.join(file), value.trim())?;
            }
        }
    }
    Ok(())
}

fn containerd_config(dir: &Path, sock: &Path) -> String {
    format!(
        r#"version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", "io.containerd.internal.v1.tracing", "io.containerd.tracing.processor.v1.otlp"]

[grpc]
  address = "{sock}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni}"
"#,
        root = dir.join("containerd/root").display(),
        state = dir.join("containerd/state").display(),
        sock = sock.display(),
        opt = dir.join("containerd/opt").display(),
        pause = PAUSE_IMAGE,
        cni = dir.join("cni/net.d").display(),
    )
}

fn kubelet_config_yaml(node: &Node, pod_cidr: &str) -> String {
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
failSwapOn: false
cgroupDriver: cgroupfs
cgroupRoot: /{cgroup_root}
cgroupsPerQOS: true
containerRuntimeEndpoint: unix://{sock}
address: {ip}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
authentication:
  anonymous:
    enabled: true
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
podCIDR: {pod_cidr}
podLogsDir: {logs}
resolvConf: /etc/resolv.conf
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: 50Mi
  nodefs.available: 1%
  nodefs.inodesFree: 1%
  imagefs.available: 1%
"#,
        cgroup_root = node.cgroup_root,
        sock = node.containerd_sock.display(),
        ip = node.ip,
        logs = node.dir.join("pod-logs").display(),
    )
}

/// A kubeconfig with a bearer token.
pub fn write_token_kubeconfig(path: &Path, server: &str, ca_pem: &[u8], token: &str) -> anyhow::Result<()> {
    let ca = crate::kube_env::base64_encode(ca_pem);
    std::fs::write(
        path,
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: test\nclusters:\n- name: test\n  cluster:\n    \
             server: {server}\n    certificate-authority-data: {ca}\nusers:\n- name: u\n  user:\n    token: {token}\n\
             contexts:\n- name: test\n  context:\n    cluster: test\n    user: u\n"
        ),
    )?;
    Ok(())
}
