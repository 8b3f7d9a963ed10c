//! SSH to an ESXi host with russh: the host key is checked against the pinned
//! `SHA256:` fingerprint (no trust on first use), passwords go through
//! keyboard-interactive first (ESXi's PAM) and plain `password` second, and
//! every remote command is built from validated, single-quoted arguments.

use crate::api::Reason;
use crate::machine::Failure;
use russh::ChannelMsg;
use russh::client::{self, Handle, KeyboardInteractiveAuthResponse};
use russh::keys::{HashAlg, PrivateKeyWithHashAlg, PublicKey};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Who we log in as. `Debug` never shows the secret.
#[derive(Clone)]
pub struct Credentials {
    pub username: String,
    pub secret: Secret,
}

/// A password or an OpenSSH private key (PEM text).
#[derive(Clone)]
pub enum Secret {
    Password(String),
    PrivateKey(String),
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.secret {
            Secret::Password(_) => "password",
            Secret::PrivateKey(_) => "private key",
        };
        write!(f, "Credentials {{ username: {:?}, secret: <{kind} redacted> }}", self.username)
    }
}

/// Where to connect and which host key to accept.
#[derive(Clone, Debug)]
pub struct Target {
    pub host: String,
    pub port: u16,
    /// Pinned fingerprint, `SHA256:<base64>`.
    pub host_key: String,
    /// Bound on connecting, authenticating and on each command.
    pub timeout: Duration,
}

/// Most stdout one command may print. The longest an ESXi host prints is
/// `vim-cmd vmsvc/getallvms` (about 150 bytes per VM: 8 MiB is 50,000 VMs);
/// a host that prints more is broken or hostile, and is not buffered.
pub(crate) const MAX_OUTPUT: usize = 8 * 1024 * 1024;

/// Classified SSH errors.
#[derive(Debug, thiserror::Error)]
pub enum SshError {
    #[error(
        "the host presented key {presented}, not the pinned {expected}; if the host was reinstalled, verify the new key out of band and update spec.source.hostKey"
    )]
    HostKeyMismatch { expected: String, presented: String },
    #[error("authentication as {user:?} failed ({detail})")]
    AuthenticationFailed { user: String, detail: String },
    #[error("cannot connect to {addr}: {detail}")]
    Connect { addr: String, detail: String },
    #[error("{what} timed out after {secs}s")]
    Timeout { what: String, secs: u64 },
    #[error("SSH protocol error: {0}")]
    Protocol(String),
    #[error("{what} printed more than {limit} bytes: not what an ESXi host prints; stopped reading")]
    OutputTooLarge { what: String, limit: usize },
    #[error("invalid remote argument: {0}")]
    InvalidArgument(String),
    #[error("the private key cannot be read: {0}")]
    BadKey(String),
}

impl SshError {
    /// The controller's view of this error.
    pub(crate) fn failure(&self) -> Failure {
        let message = self.to_string();
        match self {
            SshError::HostKeyMismatch { .. } => Failure::needs_human(Reason::HostKeyMismatch, message),
            SshError::AuthenticationFailed { .. } => {
                Failure::needs_human(Reason::SSHAuthenticationFailed, message)
            }
            SshError::BadKey(_) => Failure::needs_human(Reason::InvalidCredentials, message),
            SshError::InvalidArgument(_) => Failure::terminal(Reason::UnsafeArgument, message),
            SshError::Connect { .. } => Failure::retryable(Reason::SSHConnectFailed, message),
            SshError::Timeout { .. } => Failure::retryable(Reason::SSHTimeout, message),
            SshError::Protocol(_) => Failure::retryable(Reason::SSHError, message),
            SshError::OutputTooLarge { .. } => Failure::needs_human(Reason::UnparsableOutput, message),
        }
    }
}

impl From<russh::Error> for SshError {
    fn from(e: russh::Error) -> Self {
        SshError::Protocol(e.to_string())
    }
}

/// Quotes one argument for a POSIX shell (ESXi's BusyBox ash): the result is
/// always exactly one word, whatever it contains. NUL cannot be passed and is
/// rejected.
pub(crate) fn quote(arg: &str) -> Result<String, SshError> {
    if arg.contains('\0') {
        return Err(SshError::InvalidArgument(format!("{arg:?} contains a NUL byte")));
    }
    Ok(format!("'{}'", arg.replace('\'', r#"'"'"'"#)))
}

/// A remote command line built from a program and arguments, each quoted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteCommand {
    line: String,
    /// A short description for errors and logs (no secrets, no user data).
    pub what: String,
}

impl RemoteCommand {
    /// `program` must be a plain command name or absolute path.
    pub fn new(program: &str) -> Result<RemoteCommand, SshError> {
        let plain = !program.is_empty()
            && program.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'/' | b'.' | b'_' | b'-'));
        if !plain {
            return Err(SshError::InvalidArgument(format!("program name {program:?}")));
        }
        Ok(RemoteCommand { line: program.to_owned(), what: program.to_owned() })
    }

    pub fn arg(mut self, arg: &str) -> Result<RemoteCommand, SshError> {
        self.line.push(' ');
        self.line.push_str(&quote(arg)?);
        Ok(self)
    }

    /// Appends shell syntax written by us (redirections, `||`), never user data.
    pub(crate) fn raw(mut self, text: &'static str) -> RemoteCommand {
        self.line.push(' ');
        self.line.push_str(text);
        self
    }

    pub(crate) fn line(&self) -> &str {
        &self.line
    }
}

/// What a remote command printed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Output {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// `None` when the server closed the channel without an exit status.
    pub exit_status: Option<u32>,
}

impl Output {
    pub(crate) fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
    /// stdout and stderr together (vim-cmd prints faults on either).
    pub(crate) fn text(&self) -> String {
        format!("{}{}", String::from_utf8_lossy(&self.stdout), String::from_utf8_lossy(&self.stderr))
    }
}

/// The fingerprint as `ssh-keygen -lf` prints it.
pub(crate) fn fingerprint(key: &PublicKey) -> String {
    key.fingerprint(HashAlg::Sha256).to_string()
}

struct PinnedHostKey {
    expected: String,
    presented: Arc<Mutex<Option<String>>>,
}

impl client::Handler for PinnedHostKey {
    type Error = russh::Error;

    async fn check_server_key(
        &mut self,
        key: &russh::keys::PublicKeyOrCertificate,
    ) -> Result<bool, Self::Error> {
        let presented = match key {
            russh::keys::PublicKeyOrCertificate::PublicKey { key, .. } => fingerprint(key),
            // A certificate is not what was pinned.
            russh::keys::PublicKeyOrCertificate::Certificate(cert) => {
                cert.public_key().fingerprint(HashAlg::Sha256).to_string()
            }
        };
        let ok = presented == self.expected;
        if let Ok(mut slot) = self.presented.lock() {
            *slot = Some(presented);
        }
        Ok(ok)
    }
}

/// The algorithms an ESXi 8 host in FIPS mode offers, most preferred first.
fn client_config(timeout: Duration) -> client::Config {
    use russh::{Preferred, cipher, kex, mac};
    let preferred = Preferred {
        kex: std::borrow::Cow::Borrowed(&[
            kex::ECDH_SHA2_NISTP256,
            kex::ECDH_SHA2_NISTP384,
            kex::ECDH_SHA2_NISTP521,
            kex::DH_G14_SHA256,
            kex::EXTENSION_SUPPORT_AS_CLIENT,
        ]),
        cipher: std::borrow::Cow::Borrowed(&[
            cipher::AES_256_GCM,
            cipher::AES_128_GCM,
            cipher::AES_256_CTR,
            cipher::AES_192_CTR,
            cipher::AES_128_CTR,
        ]),
        mac: std::borrow::Cow::Borrowed(&[
            mac::HMAC_SHA256,
            mac::HMAC_SHA512,
            mac::HMAC_SHA256_ETM,
            mac::HMAC_SHA512_ETM,
        ]),
        ..Preferred::default()
    };
    client::Config {
        preferred,
        inactivity_timeout: Some(timeout.max(Duration::from_secs(30)) * 4),
        keepalive_interval: Some(Duration::from_secs(15)),
        keepalive_max: 4,
        // Large windows and packets: disk streams are the bulk of the traffic.
        window_size: 16 * 1024 * 1024,
        maximum_packet_size: 256 * 1024,
        nodelay: true,
        ..Default::default()
    }
}

/// One authenticated SSH connection; cheap to share, channels are opened per command.
pub struct Session {
    handle: Handle<PinnedHostKey>,
    timeout: Duration,
}

impl Session {
    pub async fn connect(target: &Target, credentials: &Credentials) -> Result<Session, SshError> {
        let addr = format!("{}:{}", target.host, target.port);
        let presented = Arc::new(Mutex::new(None));
        let handler = PinnedHostKey { expected: target.host_key.clone(), presented: presented.clone() };
        let config = Arc::new(client_config(target.timeout));
        let connecting = client::connect(config, (target.host.as_str(), target.port), handler);
        let mut handle = match tokio::time::timeout(target.timeout, connecting).await {
            Err(_) => {
                return Err(SshError::Timeout {
                    what: format!("connecting to {addr}"),
                    secs: target.timeout.as_secs(),
                });
            }
            Ok(Ok(handle)) => handle,
            Ok(Err(err)) => {
                let seen = presented.lock().ok().and_then(|p| p.clone());
                return Err(match (err, seen) {
                    (_, Some(p)) if p != target.host_key => {
                        SshError::HostKeyMismatch { expected: target.host_key.clone(), presented: p }
                    }
                    (russh::Error::IO(e), _) => SshError::Connect { addr, detail: e.to_string() },
                    (russh::Error::Disconnect, _) => {
                        SshError::Connect { addr, detail: "the server closed the connection".into() }
                    }
                    (e, _) => SshError::Protocol(e.to_string()),
                });
            }
        };
        let authenticated =
            tokio::time::timeout(target.timeout, authenticate(&mut handle, credentials)).await;
        match authenticated {
            Err(_) => {
                Err(SshError::Timeout { what: "authentication".into(), secs: target.timeout.as_secs() })
            }
            Ok(Err(e)) => Err(e),
            Ok(Ok(())) => Ok(Session { handle, timeout: target.timeout }),
        }
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.handle.is_closed()
    }

    /// Runs one command to completion, bounded by the session timeout and
    /// [`MAX_OUTPUT`].
    pub async fn run(&self, cmd: &RemoteCommand) -> Result<Output, SshError> {
        self.run_with_timeout(cmd, self.timeout).await
    }

    pub(crate) async fn run_with_timeout(
        &self,
        cmd: &RemoteCommand,
        timeout: Duration,
    ) -> Result<Output, SshError> {
        match tokio::time::timeout(timeout, self.run_unbounded(cmd)).await {
            Ok(result) => result,
            Err(_) => Err(SshError::Timeout { what: cmd.what.clone(), secs: timeout.as_secs() }),
        }
    }

    async fn run_unbounded(&self, cmd: &RemoteCommand) -> Result<Output, SshError> {
        let mut out = Output::default();
        self.stream(
            cmd,
            |chunk| {
                if out.stdout.len() + chunk.len() > MAX_OUTPUT {
                    return Err(SshError::OutputTooLarge { what: cmd.what.clone(), limit: MAX_OUTPUT });
                }
                out.stdout.extend_from_slice(chunk);
                Ok(())
            },
            &mut out.stderr,
        )
        .await
        .map(|status| {
            out.exit_status = status;
            out
        })
    }

    /// Runs a command and hands each stdout chunk to `sink` as it arrives
    /// (no overall timeout; the connection's inactivity timeout applies).
    /// Returns the exit status, or `None` when the channel closed without one
    /// (for instance when the connection was cut).
    pub(crate) async fn stream(
        &self,
        cmd: &RemoteCommand,
        mut sink: impl FnMut(&[u8]) -> Result<(), SshError>,
        stderr: &mut Vec<u8>,
    ) -> Result<Option<u32>, SshError> {
        let mut channel = self.handle.channel_open_session().await?;
        channel.exec(true, cmd.line()).await?;
        let mut status = None;
        while let Some(msg) = channel.wait().await {
            match msg {
                ChannelMsg::Data { data } => sink(&data)?,
                // Keep a bounded amount of stderr for error messages.
                ChannelMsg::ExtendedData { data, .. } if stderr.len() < 64 * 1024 => {
                    stderr.extend_from_slice(&data)
                }
                ChannelMsg::ExitStatus { exit_status } => status = Some(exit_status),
                ChannelMsg::Close => break,
                _ => {}
            }
        }
        Ok(status)
    }

    /// Opens a channel running `cmd`; the caller reads its messages.
    pub(crate) async fn exec_channel(
        &self,
        cmd: &RemoteCommand,
    ) -> Result<russh::Channel<client::Msg>, SshError> {
        let channel = self.handle.channel_open_session().await?;
        channel.exec(true, cmd.line()).await?;
        Ok(channel)
    }
}

async fn authenticate(handle: &mut Handle<PinnedHostKey>, credentials: &Credentials) -> Result<(), SshError> {
    let user = credentials.username.clone();
    match &credentials.secret {
        Secret::PrivateKey(pem) => {
            let key =
                russh::keys::decode_secret_key(pem, None).map_err(|e| SshError::BadKey(e.to_string()))?;
            let hash = handle.best_supported_rsa_hash().await?.flatten();
            let result =
                handle.authenticate_publickey(&user, PrivateKeyWithHashAlg::new(Arc::new(key), hash)).await?;
            if result.success() {
                Ok(())
            } else {
                Err(SshError::AuthenticationFailed {
                    user,
                    detail: "the host refused the private key".into(),
                })
            }
        }
        Secret::Password(password) => {
            // ESXi takes passwords through PAM, as keyboard-interactive.
            let mut reply = handle.authenticate_keyboard_interactive_start(&user, None).await?;
            for _ in 0..8 {
                match reply {
                    KeyboardInteractiveAuthResponse::Success => return Ok(()),
                    KeyboardInteractiveAuthResponse::Failure { .. } => break,
                    KeyboardInteractiveAuthResponse::InfoRequest { prompts, .. } => {
                        let answers = prompts
                            .iter()
                            .map(|p| if p.echo { String::new() } else { password.clone() })
                            .collect();
                        reply = handle.authenticate_keyboard_interactive_respond(answers).await?;
                    }
                }
            }
            let result = handle.authenticate_password(&user, password.clone()).await?;
            if result.success() {
                Ok(())
            } else {
                Err(SshError::AuthenticationFailed { user, detail: "wrong user name or password".into() })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quote_makes_one_word_of_anything() {
        assert_eq!(quote("web 01").unwrap(), "'web 01'");
        assert_eq!(quote("x'; rm -rf /; '").unwrap(), r#"'x'"'"'; rm -rf /; '"'"''"#);
        assert_eq!(quote("").unwrap(), "''");
        assert!(quote("a\0b").is_err());
    }

    #[test]
    fn quoted_arguments_survive_a_real_posix_shell_literally() {
        let hostile = ["x'; rm -rf /; '", "$(id)", "`id`", "a\nb", "\"q\"", "*", "-n", "\\", "; echo pwned"];
        for arg in hostile {
            let cmd = RemoteCommand::new("printf").unwrap().arg("%s").unwrap().arg(arg).unwrap();
            let out = std::process::Command::new("sh").arg("-c").arg(cmd.line()).output().unwrap();
            assert_eq!(String::from_utf8_lossy(&out.stdout), arg, "{}", cmd.line());
        }
    }

    #[test]
    fn program_names_cannot_smuggle_shell() {
        assert!(RemoteCommand::new("vim-cmd").is_ok());
        assert!(RemoteCommand::new("/bin/vim-cmd").is_ok());
        assert!(RemoteCommand::new("vim-cmd; reboot").is_err());
        assert!(RemoteCommand::new("").is_err());
    }

    #[test]
    fn credentials_never_print_their_secret() {
        let c = Credentials { username: "root".into(), secret: Secret::Password("hunter2".into()) };
        let shown = format!("{c:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("redacted"));
    }
}
