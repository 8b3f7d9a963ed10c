//! A real Git smart-HTTP server on loopback, over TLS, that demands
//! credentials, as a forge does for a private repository: `git
//! http-backend` (git's own CGI program, fetch and push) behind a small
//! HTTPS/1.1 front (a CA of its own, written to [`GitHttp::ca_file`]) that answers 401
//! with a `Basic` challenge to any request without the one user and
//! password it was given, and records what it saw. One request per
//! connection (`Connection: close`); request bodies by `Content-Length` or
//! chunked (git uses both), gzip left to http-backend as CGI allows.
//!
//! [`GitHttp::go_down`] closes the listening socket, so the remote is
//! unreachable as a forge that is down is (connections refused);
//! [`GitHttp::come_back`] listens again on the same address.

use base64::Engine as _;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;

/// One request as the server saw it.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: String,
    /// Path and query, as sent.
    pub target: String,
    /// Whether it carried the expected credentials.
    pub authorized: bool,
}

/// The running server; stops when dropped.
pub struct GitHttp {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    site: Arc<Site>,
    /// The accept loop; `None` while the server is down.
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
    ca: tempfile::NamedTempFile,
}

/// What every connection is served with.
struct Site {
    acceptor: tokio_rustls::TlsAcceptor,
    root: PathBuf,
    user: String,
    expected: String,
}

impl Drop for GitHttp {
    fn drop(&mut self) {
        if let Some(task) = self.task.get_mut().map(Option::take).unwrap_or_default() {
            task.abort();
        }
    }
}

impl GitHttp {
    /// Serves the bare repositories under `root` to `user`:`password` only.
    pub async fn start(root: &Path, user: &str, password: &str) -> GitHttp {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the git HTTP server");
        let addr = listener.local_addr().expect("git HTTP address");
        let (acceptor, ca_pem) = crate::tls::server("127.0.0.1", "git test CA");
        let mut ca = tempfile::NamedTempFile::new().expect("CA file");
        std::io::Write::write_all(&mut ca, ca_pem.as_bytes()).expect("writing the CA");
        let pair = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        let site = Arc::new(Site {
            acceptor,
            root: root.to_path_buf(),
            user: user.to_owned(),
            expected: format!("Basic {pair}"),
        });
        let seen = Arc::new(Mutex::new(Vec::new()));
        let task = accept_loop(listener, site.clone(), seen.clone());
        GitHttp { addr, seen, site, task: Mutex::new(Some(task)), ca }
    }

    /// Closes the listening socket: from now on connections are refused
    /// (ones already accepted finish).
    pub fn go_down(&self) {
        if let Some(task) = self.task.lock().expect("git HTTP task").take() {
            task.abort();
        }
    }

    /// Listens again on the same address.
    pub async fn come_back(&self) {
        let listener = TcpListener::bind(self.addr).await.expect("listen again on the git HTTP address");
        let task = accept_loop(listener, self.site.clone(), self.seen.clone());
        if let Some(old) = self.task.lock().expect("git HTTP task").replace(task) {
            old.abort();
        }
    }

    /// `https://127.0.0.1:<port>/<repo>`.
    pub fn url(&self, repo: &str) -> String {
        format!("https://{}/{repo}", self.addr)
    }

    /// The PEM file of the CA that signed the server's certificate.
    pub fn ca_file(&self) -> &Path {
        self.ca.path()
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("git HTTP log").clone()
    }
}

fn accept_loop(
    listener: TcpListener,
    site: Arc<Site>,
    seen: Arc<Mutex<Vec<Seen>>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (site, seen) = (site.clone(), seen.clone());
            tokio::spawn(async move {
                // A broken connection is the client's problem; the test sees it there.
                if let Ok(stream) = site.acceptor.accept(stream).await {
                    let _ = serve(stream, &site.root, &site.user, &site.expected, &seen).await;
                }
            });
        }
    })
}

async fn serve<S: AsyncRead + AsyncWrite + Unpin>(
    stream: S,
    root: &PathBuf,
    user: &str,
    expected: &str,
    seen: &Mutex<Vec<Seen>>,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).await?;
    let mut parts = line.split_whitespace();
    let (method, target) =
        (parts.next().unwrap_or_default().to_owned(), parts.next().unwrap_or_default().to_owned());
    let mut headers = BTreeMap::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).await? == 0 || line.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            headers.insert(name.trim().to_ascii_lowercase(), value.trim().to_owned());
        }
    }
    let authorized = headers.get("authorization").map(String::as_str) == Some(expected);
    seen.lock().expect("git HTTP log").push(Seen {
        method: method.clone(),
        target: target.clone(),
        authorized,
    });
    let mut stream = reader;
    if !authorized {
        let answer = "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Basic realm=\"git\"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        stream.get_mut().write_all(answer.as_bytes()).await?;
        return stream.get_mut().shutdown().await;
    }
    let body = read_body(&mut stream, &headers).await?;
    let (path, query) = target.split_once('?').unwrap_or((target.as_str(), ""));
    let mut cgi = tokio::process::Command::new("git");
    cgi.arg("http-backend")
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("GIT_PROJECT_ROOT", root)
        .env("GIT_HTTP_EXPORT_ALL", "1")
        .env("REQUEST_METHOD", &method)
        .env("PATH_INFO", path)
        .env("QUERY_STRING", query)
        .env("CONTENT_LENGTH", body.len().to_string())
        .env("REMOTE_USER", user)
        .env("REMOTE_ADDR", "127.0.0.1")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    for (header, variable) in [
        ("content-type", "CONTENT_TYPE"),
        ("content-encoding", "HTTP_CONTENT_ENCODING"),
        ("git-protocol", "GIT_PROTOCOL"),
    ] {
        if let Some(value) = headers.get(header) {
            cgi.env(variable, value);
        }
    }
    let mut child = cgi.spawn()?;
    let mut stdin = child.stdin.take().expect("piped stdin");
    let feed = async move {
        let _ = stdin.write_all(&body).await;
    };
    let (_, output) = tokio::join!(feed, child.wait_with_output());
    let output = output?.stdout;
    // CGI: header lines, a blank line, the body; `Status:` gives the code.
    let split = output
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| (p, p + 4))
        .or_else(|| output.windows(2).position(|w| w == b"\n\n").map(|p| (p, p + 2)))
        .unwrap_or((output.len(), output.len()));
    let head = String::from_utf8_lossy(&output[..split.0]).into_owned();
    let mut status = "200 OK".to_owned();
    let mut answer = String::new();
    for header in head.lines().map(str::trim_end).filter(|l| !l.is_empty()) {
        match header.split_once(':') {
            Some((name, value)) if name.eq_ignore_ascii_case("status") => status = value.trim().to_owned(),
            _ => answer.push_str(&format!("{header}\r\n")),
        }
    }
    let content = &output[split.1..];
    let head = format!(
        "HTTP/1.1 {status}\r\n{answer}Content-Length: {}\r\nConnection: close\r\n\r\n",
        content.len()
    );
    let stream = stream.get_mut();
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(content).await?;
    stream.shutdown().await
}

async fn read_body<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut BufReader<S>,
    headers: &BTreeMap<String, String>,
) -> std::io::Result<Vec<u8>> {
    if headers.get("transfer-encoding").is_some_and(|t| t.eq_ignore_ascii_case("chunked")) {
        let mut body = Vec::new();
        let mut line = String::new();
        loop {
            line.clear();
            stream.read_line(&mut line).await?;
            let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or("0"), 16).unwrap_or(0);
            if size == 0 {
                // The trailer section ends with a blank line.
                loop {
                    line.clear();
                    if stream.read_line(&mut line).await? == 0 || line.trim().is_empty() {
                        return Ok(body);
                    }
                }
            }
            let start = body.len();
            body.resize(start + size, 0);
            stream.read_exact(&mut body[start..]).await?;
            line.clear();
            stream.read_line(&mut line).await?;
        }
    }
    let length = headers.get("content-length").and_then(|l| l.parse().ok()).unwrap_or(0);
    let mut body = vec![0u8; length];
    stream.read_exact(&mut body).await?;
    Ok(body)
}
