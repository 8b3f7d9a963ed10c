//! What every HTTP server of vmmigrate shares (the webhook receiver, the
//! metrics and health endpoints, the staging server): hyper's HTTP/1.1
//! connection state machine, over TLS where the server has an identity,
//! under limits an attacker on the network cannot talk its way past.
//!
//! - **Connections**: at most [`ServerLimits::max_connections`] at once; one more
//!   is closed as soon as it is accepted and counted in
//!   [`ServerStats::refused_connections`], so a flood costs a descriptor for
//!   a moment, never memory.
//! - **Time**: the request head must arrive within [`ServerLimits::header_timeout`]
//!   (hyper closes the connection otherwise: slowloris), the whole request,
//!   body and handling included, within [`ServerLimits::request_timeout`] (408),
//!   and the connection lives at most [`ServerLimits::connection_deadline`]; a
//!   client that accepts no byte of its answer for
//!   [`ServerLimits::write_stall`] is dropped (one that never reads). A TLS
//!   handshake counts against the header timeout.
//! - **Size**: the head at most [`ServerLimits::max_head_bytes`] (hyper answers
//!   431); bodies are the handler's business, read through
//!   [`read_limited`], which refuses from `Content-Length` before reading
//!   and again while streaming.
//!
//! One request per connection (no keep-alive): the forges and Prometheus open
//! a connection per request anyway, and an idle kept-alive connection is a
//! slot an attacker could hold for free.

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::{JoinHandle, JoinSet};
use tracing::{Instrument, debug, field, info_span, warn};

/// The body of every answer: small ones whole, artifacts streamed.
pub(crate) type Body = UnsyncBoxBody<Bytes, io::Error>;
/// How long a closed connection's unread input is drained (see `linger`).
const LINGER: Duration = Duration::from_secs(2);

/// Pending connections the kernel holds for `accept`. The default of tokio's
/// `bind` (1024) overflows under a burst of connections while the process is
/// busy, and an overflowing queue makes the kernel drop handshakes and reset
/// connections that already sent their request; the kernel caps this at
/// `net.core.somaxconn` (4096 on current kernels).
const BACKLOG: u32 = 4096;

/// A listener on `addr` with a backlog of [`BACKLOG`].
pub(crate) fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket =
        if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(BACKLOG)
}

/// The limits of one server.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ServerLimits {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub request_timeout: Duration,
    /// The longest a connection lives, answer included.
    pub connection_deadline: Duration,
    /// The longest a client may accept no byte of its answer.
    pub write_stall: Duration,
    pub max_head_bytes: usize,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            max_connections: 2048,
            header_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
            // The request's time and 5 s for the answer to leave.
            connection_deadline: Duration::from_secs(15),
            write_stall: Duration::from_secs(5),
            max_head_bytes: 16 * 1024,
        }
    }
}

/// Counters of one server.
#[derive(Debug, Default)]
pub(crate) struct ServerStats {
    /// Connections closed at once because [`ServerLimits::max_connections`] were open.
    pub refused_connections: AtomicU64,
    /// Requests answered 408 because they outlived [`ServerLimits::request_timeout`].
    pub timed_out: AtomicU64,
}

/// A running server; dropping it stops it and every open connection.
pub(crate) struct Server {
    addr: SocketAddr,
    stats: Arc<ServerStats>,
    task: JoinHandle<()>,
}

impl Server {
    /// Serves `handler` on `listener` under `limits`, over TLS when `tls`
    /// is given. `name` names the server in logs.
    pub(crate) fn start<H, F>(
        listener: TcpListener,
        limits: ServerLimits,
        tls: Option<Arc<rustls::ServerConfig>>,
        name: &'static str,
        handler: H,
    ) -> io::Result<Server>
    where
        H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
        F: Future<Output = Response<Body>> + Send + 'static,
    {
        let addr = listener.local_addr()?;
        let stats = Arc::new(ServerStats::default());
        let tls = tls.map(tokio_rustls::TlsAcceptor::from);
        let task = tokio::spawn(accept_loop(listener, limits, tls, name, handler, stats.clone()));
        Ok(Server { addr, stats, task })
    }

    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub(crate) fn stats(&self) -> Arc<ServerStats> {
        self.stats.clone()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept_loop<H, F>(
    listener: TcpListener,
    limits: ServerLimits,
    tls: Option<tokio_rustls::TlsAcceptor>,
    name: &'static str,
    handler: H,
    stats: Arc<ServerStats>,
) where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    // Connections belong to this task's JoinSet: aborting it aborts them.
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let Ok(slot) = slots.clone().try_acquire_owned() else {
                        stats.refused_connections.fetch_add(1, Ordering::Relaxed);
                        debug!(server = name, %peer, "connection limit reached: closed");
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    let span = info_span!("http", server = name, %peer, target = field::Empty, status = field::Empty);
                    let connection = serve(stream, limits, tls.clone(), handler.clone(), stats.clone());
                    connections.spawn(async move {
                        connection.await;
                        drop(slot);
                    }.instrument(span));
                }
                Err(e) => {
                    // Out of descriptors and the like: back off instead of spinning.
                    warn!(server = name, error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(done) = connections.join_next() => {
                if let Err(e) = done && e.is_panic() {
                    warn!(server = name, error = %e, "connection task panicked");
                }
            }
        }
    }
}

async fn serve<H, F>(
    stream: tokio::net::TcpStream,
    limits: ServerLimits,
    tls: Option<tokio_rustls::TlsAcceptor>,
    handler: H,
    stats: Arc<ServerStats>,
) where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let service = service_fn(move |request: Request<Incoming>| {
        let handler = handler.clone();
        let stats = stats.clone();
        tracing::Span::current().record("target", request.uri().path());
        async move {
            let response = match tokio::time::timeout(limits.request_timeout, handler(request)).await {
                Ok(response) => response,
                Err(_elapsed) => {
                    stats.timed_out.fetch_add(1, Ordering::Relaxed);
                    text(StatusCode::REQUEST_TIMEOUT, "request took too long\n")
                }
            };
            tracing::Span::current().record("status", response.status().as_u16());
            Ok::<_, Infallible>(closing(response))
        }
    });
    // hyper allocates its buffers (16 KiB) when it takes a connection; a
    // connection that has sent nothing yet waits here, costing only its task.
    let started = tokio::time::Instant::now();
    // (`peek`, not `readable`: readiness may be reported before any byte.)
    match tokio::time::timeout(limits.header_timeout, stream.peek(&mut [0u8; 1])).await {
        Ok(Ok(0)) => return debug!("closed before its request"),
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return debug!(error = %e, "connection failed before its request"),
        Err(_elapsed) => return debug!("no request within the header timeout: closed"),
    }
    // Boxed: the hyper connection's state (and TLS's) is large, and a task
    // waiting above should not carry room for it.
    match tls {
        None => Box::pin(speak_http(stream, limits, started, service)).await,
        Some(acceptor) => {
            let remaining = limits.header_timeout.saturating_sub(started.elapsed());
            match tokio::time::timeout(remaining, acceptor.accept(stream)).await {
                Ok(Ok(stream)) => Box::pin(speak_http(stream, limits, started, service)).await,
                Ok(Err(e)) => debug!(error = %e, "TLS handshake failed"),
                Err(_elapsed) => debug!("no TLS handshake within the header timeout: closed"),
            }
        }
    }
}

async fn speak_http<I, S>(stream: I, limits: ServerLimits, started: tokio::time::Instant, service: S)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: hyper::service::HttpService<Incoming, ResBody = Body>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout.saturating_sub(started.elapsed()))
        .keep_alive(false)
        .max_header_size(limits.max_head_bytes)
        // The smallest hyper allows: bodies are streamed through it.
        .max_buf_size(8192);
    // `without_shutdown` hands the socket back once the answer is written,
    // so it can be closed gently (see `linger`).
    let io = TokioIo::new(StallGuard::new(stream, limits.write_stall));
    let connection = builder.serve_connection(io, service).without_shutdown();
    let deadline = limits.connection_deadline.saturating_sub(started.elapsed());
    match tokio::time::timeout(deadline, connection).await {
        Ok(Ok(parts)) => linger(parts.io.into_inner().inner).await,
        Ok(Err(e)) => debug!(error = %e, "connection ended with an error"),
        Err(_elapsed) => debug!("connection outlived its deadline: dropped"),
    }
}

/// Sends FIN, then drains what the client still sends for [`LINGER`]:
/// closing with unread input makes the kernel send RST, which can destroy an
/// answer the client has not read yet (a 413 or 401 to a body still on its
/// way). The drained bytes go to a small buffer and are dropped.
async fn linger(mut stream: impl AsyncRead + AsyncWrite + Unpin) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = stream.shutdown().await;
    let mut sink = [0u8; 1024];
    let drain = async {
        while let Ok(n) = stream.read(&mut sink).await
            && n > 0
        {}
    };
    let _ = tokio::time::timeout(LINGER, drain).await;
}

/// A stream whose writes fail with `TimedOut` once the peer has accepted
/// nothing for `limit`: hyper has no write timeout of its own, and a client
/// that stops reading would otherwise hold its connection (and a large
/// answer's buffers) until the connection deadline.
struct StallGuard<S> {
    inner: S,
    limit: Duration,
    stalled_since: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<S> StallGuard<S> {
    fn new(inner: S, limit: Duration) -> Self {
        StallGuard { inner, limit, stalled_since: None }
    }

    /// Called when a write is pending: `Err` once the stall is too long.
    fn check_stall(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        let limit = self.limit;
        let timer = self.stalled_since.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Err(io::Error::new(io::ErrorKind::TimedOut, "client stopped reading")),
            Poll::Pending => Ok(()),
        }
    }

    fn progress<T>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        match poll {
            Poll::Ready(result) => {
                self.stalled_since = None;
                Poll::Ready(result)
            }
            Poll::Pending => match self.check_stall(cx) {
                Ok(()) => Poll::Pending,
                Err(e) => Poll::Ready(Err(e)),
            },
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for StallGuard<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for StallGuard<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.progress(cx, poll)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_flush(cx);
        self.progress(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A whole body as a [`Body`].
pub(crate) fn whole(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).map_err(|never| match never {}).boxed_unsync()
}

/// Every answer says the connection ends with it.
fn closing(mut response: Response<Body>) -> Response<Body> {
    response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// A plain-text answer.
pub(crate) fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Body> {
    let mut response = Response::new(whole(body));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    response
}

/// Why a body was not read whole.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum BodyRefused {
    /// No `Content-Length` (chunked bodies are not taken: 411).
    LengthRequired,
    /// More than the limit, said by the header or found while reading (413).
    TooLarge,
    /// The bytes of all bodies being read at once are at their budget (503).
    Busy,
    /// The client went away or sent a broken body.
    Broken,
}

impl BodyRefused {
    pub(crate) fn status(&self) -> StatusCode {
        match self {
            BodyRefused::LengthRequired => StatusCode::LENGTH_REQUIRED,
            BodyRefused::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            BodyRefused::Busy => StatusCode::SERVICE_UNAVAILABLE,
            BodyRefused::Broken => StatusCode::BAD_REQUEST,
        }
    }
}

/// The declared `Content-Length`, `Err` when absent, chunked or over `limit`.
pub(crate) fn declared_length<B>(request: &Request<B>, limit: usize) -> Result<usize, BodyRefused> {
    if request.headers().contains_key(header::TRANSFER_ENCODING) {
        return Err(BodyRefused::LengthRequired);
    }
    let value = request.headers().get(header::CONTENT_LENGTH).ok_or(BodyRefused::LengthRequired)?;
    // hyper has already refused malformed and disagreeing lengths.
    let length: u64 = value.to_str().ok().and_then(|v| v.parse().ok()).ok_or(BodyRefused::Broken)?;
    if length > limit as u64 {
        return Err(BodyRefused::TooLarge);
    }
    Ok(length as usize)
}

/// Reads a body of at most `limit` bytes, handing each chunk to `inspect` as
/// it arrives (a MAC computed while reading). The bytes held count against
/// `budget` (one permit per byte) until the returned guard is dropped; a
/// body that would exceed it is refused as [`BodyRefused::Busy`].
pub(crate) async fn read_limited(
    request: Request<Incoming>,
    limit: usize,
    budget: &Arc<Semaphore>,
    mut inspect: impl FnMut(&[u8]),
) -> Result<(Vec<u8>, tokio::sync::OwnedSemaphorePermit), BodyRefused> {
    let length = declared_length(&request, limit)?;
    let permits = u32::try_from(length).map_err(|_| BodyRefused::TooLarge)?;
    let held = budget.clone().try_acquire_many_owned(permits).map_err(|_| BodyRefused::Busy)?;
    let mut body = Limited::new(request.into_body(), length);
    let mut bytes = Vec::with_capacity(length.min(64 * 1024));
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() {
                BodyRefused::TooLarge
            } else {
                BodyRefused::Broken
            }
        })?;
        if let Ok(chunk) = frame.into_data() {
            inspect(&chunk);
            bytes.extend_from_slice(&chunk);
        }
    }
    if bytes.len() != length {
        return Err(BodyRefused::Broken);
    }
    Ok((bytes, held))
}

/// Resolves on Ctrl-C or SIGTERM.
pub(crate) async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn a_client_that_stops_reading_is_cut_off_after_the_write_stall() {
        const SIZE: usize = 64 << 20;
        let limits = ServerLimits {
            write_stall: Duration::from_millis(300),
            connection_deadline: Duration::from_secs(120),
            ..ServerLimits::default()
        };
        let listener = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let server = Server::start(listener, limits, None, "test", |_request| async {
            Response::new(whole(vec![7u8; SIZE]))
        })
        .unwrap();
        let mut client = tokio::net::TcpStream::connect(server.local_addr()).await.unwrap();
        client.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n").await.unwrap();
        // The client reads nothing for well past the limit (socket buffers
        // hold a few MiB of the 64), then everything it can.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let mut received = 0;
        let mut buf = vec![0u8; 1 << 20];
        while let Ok(n) = client.read(&mut buf).await
            && n > 0
        {
            received += n;
        }
        assert!(received < SIZE, "a stalled client still got all {received} bytes");
        assert!(received > 0, "the answer had started");
    }
}
