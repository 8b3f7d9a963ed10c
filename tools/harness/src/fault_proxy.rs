//! A TCP proxy on loopback that a test puts in a path (the controller →
//! the emulated ESXi host's sshd, say) to make the network misbehave the
//! ways networks do: pass bytes, stall them (a blackhole: the connection
//! stays open and nothing arrives, as behind a dead route or a stateful
//! firewall that lost its entry), refuse new connections, or cut every
//! connection at once.
//!
//! Plain threads, so sync and async tests alike can hold one. Each
//! connection has one thread per direction; they copy in small reads with
//! a short timeout, so a change of [`Mode`] takes effect within 50 ms.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What the proxy does with traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Bytes flow both ways.
    Pass = 0,
    /// Connections are accepted and kept, and no byte moves either way.
    Blackhole = 1,
    /// New connections are accepted and closed at once (RST-like); open
    /// ones keep passing.
    Refuse = 2,
}

struct Shared {
    mode: AtomicU8,
    stop: AtomicBool,
    /// Every open connection's two sockets, for [`FaultProxy::cut_all`].
    open: Mutex<Vec<(TcpStream, TcpStream)>>,
    accepted: AtomicU64,
    refused: AtomicU64,
    /// Milliseconds pumps spent holding bytes back while blackholed.
    stalled_ms: AtomicU64,
}

/// A running proxy; stops (and drops every connection) when dropped.
pub struct FaultProxy {
    pub port: u16,
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards to `target`.
    pub fn start(target: SocketAddr) -> anyhow::Result<FaultProxy> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let shared = Arc::new(Shared {
            mode: AtomicU8::new(Mode::Pass as u8),
            stop: AtomicBool::new(false),
            open: Mutex::new(Vec::new()),
            accepted: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            stalled_ms: AtomicU64::new(0),
        });
        let accept_shared = shared.clone();
        let thread = std::thread::spawn(move || accept_loop(listener, target, accept_shared));
        Ok(FaultProxy { port, shared, thread: Some(thread) })
    }

    pub fn set_mode(&self, mode: Mode) {
        self.shared.mode.store(mode as u8, Ordering::SeqCst);
    }

    /// Closes every open connection both ways, as a reset would.
    pub fn cut_all(&self) {
        let open = std::mem::take(&mut *self.shared.open.lock().expect("open lock"));
        for (client, server) in open {
            let _ = client.shutdown(Shutdown::Both);
            let _ = server.shutdown(Shutdown::Both);
        }
    }

    /// Connections accepted and forwarded so far.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Connections closed at once because the proxy refused them.
    pub fn refused(&self) -> u64 {
        self.shared.refused.load(Ordering::SeqCst)
    }

    /// Milliseconds connections spent with bytes held back (summed over
    /// directions): how long the blackhole was felt.
    pub fn stalled_ms(&self) -> u64 {
        self.shared.stalled_ms.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.cut_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn mode_of(shared: &Shared) -> Mode {
    match shared.mode.load(Ordering::SeqCst) {
        1 => Mode::Blackhole,
        2 => Mode::Refuse,
        _ => Mode::Pass,
    }
}

const TICK: Duration = Duration::from_millis(50);

fn accept_loop(listener: TcpListener, target: SocketAddr, shared: Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        let client = match listener.accept() {
            Ok((client, _)) => client,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(TICK);
                continue;
            }
            Err(_) => continue,
        };
        if mode_of(&shared) == Mode::Refuse {
            shared.refused.fetch_add(1, Ordering::SeqCst);
            // Closed before any byte: the client sees the connection end
            // where it expects the server's banner.
            let _ = client.shutdown(Shutdown::Both);
            continue;
        }
        let Ok(server) = TcpStream::connect_timeout(&target, Duration::from_secs(5)) else {
            continue;
        };
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        let _ = client.set_nonblocking(false);
        let pair = (client.try_clone(), server.try_clone());
        if let (Ok(c), Ok(s)) = pair {
            shared.open.lock().expect("open lock").push((c, s));
        }
        for (from, to) in [(client.try_clone(), server.try_clone()), (server.try_clone(), client.try_clone())]
        {
            let (Ok(from), Ok(to)) = (from, to) else { continue };
            let shared = shared.clone();
            std::thread::spawn(move || pump(from, to, &shared));
        }
    }
}

/// Copies `from` → `to` while the mode lets bytes pass; ends with either side.
fn pump(mut from: TcpStream, mut to: TcpStream, shared: &Shared) {
    let _ = from.set_read_timeout(Some(TICK));
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        if mode_of(shared) == Mode::Blackhole {
            std::thread::sleep(TICK);
            shared.stalled_ms.fetch_add(TICK.as_millis() as u64, Ordering::SeqCst);
            continue;
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => break,
        }
    }
    let _ = to.shutdown(Shutdown::Write);
    let _ = from.shutdown(Shutdown::Read);
}
