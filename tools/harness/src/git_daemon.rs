//! A real Git server for pods: `git daemon` (git://) serving the bare
//! repositories of a directory, fetch and push, on one address and a free
//! port. Pods of the test node reach it on the host end of the node's veth.
//! Nothing is authenticated: the address is only reachable on this machine.

use crate::process::{Janitor, free_port, wait_until};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

pub struct GitDaemon {
    pub ip: Ipv4Addr,
    pub port: u16,
    base: PathBuf,
    janitor: Janitor,
}

impl GitDaemon {
    /// Serves every repository under `base` on `ip`.
    pub fn start(ip: Ipv4Addr, base: &Path) -> anyhow::Result<GitDaemon> {
        crate::setup::packages()?;
        let janitor = Janitor::new("vmmigrate-git-daemon")?;
        let mut last = None;
        for _ in 0..5 {
            let port = free_port()?;
            let name = format!("git-daemon-{port}");
            janitor.spawn(
                &name,
                Command::new("git")
                    .arg("daemon")
                    .arg("--reuseaddr")
                    .arg("--export-all")
                    .arg("--enable=receive-pack")
                    .arg("--informative-errors")
                    .arg(format!("--listen={ip}"))
                    .arg(format!("--port={port}"))
                    .arg(format!("--base-path={}", base.display()))
                    .arg(base),
            )?;
            let addr = SocketAddr::from((ip, port));
            let up = wait_until(Duration::from_secs(10), &format!("git daemon on {addr}"), || {
                janitor.check_alive()?;
                Ok(TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok())
            });
            match up {
                Ok(()) => return Ok(GitDaemon { ip, port, base: base.to_path_buf(), janitor }),
                Err(err) => {
                    let _ = janitor.stop(&name);
                    last = Some(err);
                }
            }
        }
        Err(last.expect("one attempt"))
    }

    /// `git://<ip>:<port>/<name>` of the repository at `<base>/<name>`.
    pub fn url(&self, name: &str) -> String {
        format!("git://{}:{}/{name}", self.ip, self.port)
    }

    pub fn base(&self) -> &Path {
        &self.base
    }

    pub fn log(&self) -> String {
        self.janitor.log_tail(&format!("git-daemon-{}", self.port))
    }
}
