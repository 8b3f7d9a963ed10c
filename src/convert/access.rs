//! Who may fetch a staged artifact, and how they know they reached us.
//!
//! The staging server serves TLS only and answers an artifact only to a
//! request that carries that artifact's own credentials (HTTP basic auth,
//! which CDI's importer sends from the DataVolume's `secretRef`: keys
//! `accessKeyId` and `secretKey`). A credential opens one file of one
//! migration and nothing else, so a Secret read in one tenant's namespace
//! gives nothing of another's disks.
//!
//! Credentials are stateless: the secret of `<uid>/disk-<n>.<ext>` is an
//! HMAC-SHA256 of that name under a staging key made once and kept in the
//! work directory, so the server checks a request without a table, and a
//! controller restart (or a new leader on the same volume) accepts the
//! Secrets already handed out.
//!
//! The TLS identity is a CA made once and kept beside the key, and a server
//! certificate it signs at every start for the host of `--staging-url`
//! (renaming the Service needs no new CA). CDI trusts the CA through the
//! DataVolume's `certConfigMap`, one ConfigMap key holding its PEM.
//!
//! ```text
//! <work>/staging-tls/hmac.key   32 random bytes, hex (mode 0600)
//! <work>/staging-tls/ca.key     the CA's private key, PEM (mode 0600)
//! <work>/staging-tls/ca.pem     the CA certificate, PEM
//! ```
//!
//! The directory lies outside `staging/`, and the server's path rules
//! (`staging::resolve`) could not name it anyway.

use crate::ports::ImportAccess;
use anyhow::{Context, bail};
use base64::Engine as _;
use hmac::{Hmac, Mac};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
    KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use sha2::Sha256;
use std::fs;
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

type HmacSha256 = Hmac<Sha256>;

/// Bound into every credential, so the key can serve other purposes later
/// without a credential of one being valid for another.
const CONTEXT: &[u8] = b"vmmigrate staging artifact v1\0";
/// The realm of the 401 answers.
pub(crate) const REALM: &str = "vmmigrate-staging";

/// The staging key and TLS identity of one work directory.
pub struct StagingAccess {
    key: [u8; 32],
    ca_pem: String,
    /// The CA's key, PEM: held by the controller (it signs its workers'
    /// certificates), never by a worker.
    ca_key_pem: Option<String>,
    tls: Arc<rustls::ServerConfig>,
}

/// What one migration's worker pod holds (its Secret): the key its
/// artifacts' credentials and its control token derive from, and a server
/// certificate for the names it is reached by, signed by the staging CA.
/// Nothing in it opens another migration's artifacts.
#[derive(Clone)]
pub struct WorkerIdentity {
    pub key_hex: String,
    pub cert_pem: String,
    pub key_pem: String,
    pub ca_pem: String,
}

impl std::fmt::Debug for WorkerIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerIdentity").finish_non_exhaustive()
    }
}

/// Bound into the key of one migration's worker.
const WORKER_CONTEXT: &[u8] = b"vmmigrate worker key v1\0";
/// Bound into the token the controller presents to a worker.
const CONTROL_CONTEXT: &[u8] = b"vmmigrate worker control v1\0";

impl std::fmt::Debug for StagingAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingAccess").finish_non_exhaustive()
    }
}

impl StagingAccess {
    /// The directory under `work_dir` that holds the key and the CA.
    pub fn dir(work_dir: &Path) -> PathBuf {
        work_dir.join("staging-tls")
    }

    /// Loads the key and CA from `dir`, making whichever is missing, and
    /// signs a server certificate for the host of `staging_url`, which must
    /// be `https://`.
    pub fn load_or_create(dir: &Path, staging_url: &str) -> anyhow::Result<StagingAccess> {
        let host = url_host(staging_url)?;
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let key = load_or_create_key(&dir.join("hmac.key"))?;
        let (ca_key, ca_pem) = load_or_create_ca(dir)?;
        let tls = server_config(std::slice::from_ref(&host), &ca_key)
            .with_context(|| format!("making the staging server's certificate for {host}"))?;
        Ok(StagingAccess { key, ca_pem, ca_key_pem: Some(ca_key.serialize_pem()), tls: Arc::new(tls) })
    }

    /// The access of migration `uid`'s worker: a key of its own (an HMAC of
    /// the uid under this key), so what the worker holds opens its own
    /// artifacts and nothing else. The controller computes the same to hand
    /// CDI the credentials and to reach the worker.
    pub fn for_migration(&self, uid: &str) -> StagingAccess {
        let mut mac = HmacSha256::new_from_slice(&self.key).expect("HMAC takes any key length");
        mac.update(WORKER_CONTEXT);
        mac.update(uid.as_bytes());
        let key: [u8; 32] = mac.finalize().into_bytes().into();
        StagingAccess { key, ca_pem: self.ca_pem.clone(), ca_key_pem: None, tls: self.tls.clone() }
    }

    /// Migration `uid`'s worker identity, with a certificate for `names`
    /// (DNS names or IP addresses). Only the controller's access can sign.
    pub fn worker_identity(&self, uid: &str, names: &[String]) -> anyhow::Result<WorkerIdentity> {
        let ca_key = KeyPair::from_pem(self.ca_key_pem.as_deref().context("this access holds no CA key")?)?;
        let key = KeyPair::generate()?;
        let cert = server_params(names)?.signed_by(&key, &Issuer::new(ca_params(), &ca_key))?;
        Ok(WorkerIdentity {
            key_hex: crate::convert::artifact::hex(&self.for_migration(uid).key),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            ca_pem: self.ca_pem.clone(),
        })
    }

    /// A worker's access from what its Secret holds.
    pub(crate) fn from_worker(identity: &WorkerIdentity) -> anyhow::Result<StagingAccess> {
        use rustls::pki_types::pem::PemObject as _;
        let key = unhex(identity.key_hex.trim())
            .filter(|b| b.len() == 32)
            .context("the key is not 64 hex digits")?;
        let chain = CertificateDer::pem_slice_iter(identity.cert_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .context("parsing the worker certificate")?;
        let key_der =
            PrivateKeyDer::from_pem_slice(identity.key_pem.as_bytes()).context("parsing the worker key")?;
        Ok(StagingAccess {
            key: key.try_into().expect("length checked"),
            ca_pem: identity.ca_pem.clone(),
            ca_key_pem: None,
            tls: Arc::new(tls_config(chain, key_der)?),
        })
    }

    /// The bearer token that opens this worker's control API.
    pub fn control_token(&self) -> String {
        let mut mac = HmacSha256::new_from_slice(&self.key).expect("HMAC takes any key length");
        mac.update(CONTROL_CONTEXT);
        crate::convert::artifact::hex(&mac.finalize().into_bytes())
    }

    /// Whether an `Authorization` header carries this worker's control token
    /// (compared in constant time).
    pub(crate) fn allows_control(&self, authorization: Option<&[u8]>) -> bool {
        let Some(value) = authorization.and_then(|v| std::str::from_utf8(v).ok()) else { return false };
        let Some(token) = value.trim().strip_prefix("Bearer ").and_then(|t| unhex(t.trim())) else {
            return false;
        };
        let mut mac = HmacSha256::new_from_slice(&self.key).expect("HMAC takes any key length");
        mac.update(CONTROL_CONTEXT);
        mac.verify_slice(&token).is_ok()
    }

    /// A TLS client configuration that trusts the staging CA and nothing else.
    pub fn client_tls(&self) -> anyhow::Result<rustls::ClientConfig> {
        use rustls::pki_types::pem::PemObject as _;
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(self.ca_pem.as_bytes()) {
            roots.add(cert.context("parsing the staging CA")?)?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(config)
    }

    /// The credentials of artifact `file` (`disk-<n>.<ext>`) of migration `uid`.
    pub fn credential(&self, uid: &str, file: &str) -> ImportAccess {
        let access_key_id = format!("{uid}/{file}");
        let secret_key = crate::convert::artifact::hex(&self.mac(&access_key_id).finalize().into_bytes());
        ImportAccess { access_key_id, secret_key, ca_pem: self.ca_pem.clone() }
    }

    /// Whether an `Authorization` header value carries the credentials of
    /// `file` of `uid` (the MAC compared in constant time).
    pub(crate) fn allows(&self, authorization: Option<&[u8]>, uid: &str, file: &str) -> bool {
        let Some((user, password)) = authorization.and_then(basic_credentials) else { return false };
        let name = format!("{uid}/{}", super::staging::companion_of(file));
        if user != name {
            return false;
        }
        let Some(tag) = unhex(&password) else { return false };
        self.mac(&name).verify_slice(&tag).is_ok()
    }

    /// The CA certificate, PEM, for CDI's `certConfigMap`.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// The server's TLS configuration (its certificate for the staging
    /// URL's host, signed by the CA above).
    pub fn tls(&self) -> Arc<rustls::ServerConfig> {
        self.tls.clone()
    }

    fn mac(&self, name: &str) -> HmacSha256 {
        let mut mac = HmacSha256::new_from_slice(&self.key).expect("HMAC takes any key length");
        mac.update(CONTEXT);
        mac.update(name.as_bytes());
        mac
    }
}

/// `user` and `password` of `Basic <base64(user:password)>`.
fn basic_credentials(value: &[u8]) -> Option<(String, String)> {
    let value = std::str::from_utf8(value).ok()?.trim();
    let (scheme, encoded) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD.decode(encoded.trim()).ok()?;
    let (user, password) = std::str::from_utf8(&decoded).ok()?.split_once(':')?;
    Some((user.to_owned(), password.to_owned()))
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok()).collect()
}

/// The host of an `https://` URL (brackets of an IPv6 literal removed).
fn url_host(url: &str) -> anyhow::Result<String> {
    let Some(rest) = url.strip_prefix("https://") else {
        bail!("staging URL {url:?} must start with https:// (the staging server serves TLS only)");
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split_once(']').map(|(h, _)| h).unwrap_or_default(),
        None => authority.rsplit_once(':').map_or(authority, |(h, _)| h),
    };
    if host.is_empty() || authority.contains('@') {
        bail!("staging URL {url:?} names no host (or carries credentials, which it must not)");
    }
    Ok(host.to_owned())
}

/// Writes `bytes` to `path` through a private temporary file and a rename,
/// so a crash leaves the old file or the new one, never half of one.
fn write_private(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("creating {}", tmp.display()))?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("renaming {} into place", tmp.display()))
}

fn load_or_create_key(path: &Path) -> anyhow::Result<[u8; 32]> {
    match fs::read_to_string(path) {
        Ok(text) => {
            let bytes = unhex(text.trim()).filter(|b| b.len() == 32);
            let bytes = bytes.with_context(|| format!("{} is not 64 hex digits", path.display()))?;
            Ok(bytes.try_into().expect("length checked"))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut key = [0u8; 32];
            ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut key)
                .map_err(|_| anyhow::anyhow!("the system random source failed"))?;
            write_private(path, format!("{}\n", crate::convert::artifact::hex(&key)).as_bytes())?;
            Ok(key)
        }
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// The CA's parameters. Fixed, so the issuer of every server certificate
/// matches the subject of the CA kept on disk.
fn ca_params() -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, "vmmigrate staging CA");
    params.distinguished_name = name;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params
}

fn load_or_create_ca(dir: &Path) -> anyhow::Result<(KeyPair, String)> {
    let (key_path, cert_path) = (dir.join("ca.key"), dir.join("ca.pem"));
    if let (Ok(key), Ok(cert)) = (fs::read_to_string(&key_path), fs::read_to_string(&cert_path)) {
        let key = KeyPair::from_pem(&key).with_context(|| format!("parsing {}", key_path.display()))?;
        return Ok((key, cert));
    }
    let key = KeyPair::generate().context("generating the staging CA key")?;
    let cert = ca_params().self_signed(&key).context("signing the staging CA")?;
    // The key first: a CA certificate on disk always has its key.
    write_private(&key_path, key.serialize_pem().as_bytes())?;
    write_private(&cert_path, cert.pem().as_bytes())?;
    Ok((key, cert.pem()))
}

/// A server certificate's parameters for `names` (DNS names or IP addresses).
fn server_params(names: &[String]) -> anyhow::Result<CertificateParams> {
    let mut params = CertificateParams::new(names.to_vec())?;
    params
        .distinguished_name
        .push(DnType::CommonName, names.first().map(String::as_str).unwrap_or("vmmigrate"));
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    Ok(params)
}

fn server_config(names: &[String], ca_key: &KeyPair) -> anyhow::Result<rustls::ServerConfig> {
    let key = KeyPair::generate()?;
    let issuer = Issuer::new(ca_params(), ca_key);
    let cert = server_params(names)?.signed_by(&key, &issuer)?;
    let key_der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    tls_config(vec![CertificateDer::from(cert.der().to_vec())], key_der)
}

fn tls_config(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> anyhow::Result<rustls::ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn basic(user: &str, password: &str) -> String {
        format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}")))
    }

    #[test]
    fn a_credential_opens_its_own_artifact_and_no_other() {
        let dir = tempfile::tempdir().unwrap();
        let access = StagingAccess::load_or_create(dir.path(), "https://staging.example:8443").unwrap();
        let own = access.credential("uid-a", "disk-0.raw");
        let header = basic(&own.access_key_id, &own.secret_key);
        assert!(access.allows(Some(header.as_bytes()), "uid-a", "disk-0.raw"));
        assert!(!access.allows(Some(header.as_bytes()), "uid-a", "disk-1.raw"), "another disk");
        assert!(!access.allows(Some(header.as_bytes()), "uid-b", "disk-0.raw"), "another migration");
        // The right name with another artifact's secret.
        let other = access.credential("uid-b", "disk-0.raw");
        let swapped = basic(&own.access_key_id, &other.secret_key);
        assert!(!access.allows(Some(swapped.as_bytes()), "uid-a", "disk-0.raw"));
        assert!(!access.allows(None, "uid-a", "disk-0.raw"));
        assert!(!access.allows(Some(b"Bearer abc"), "uid-a", "disk-0.raw"));
        let empty = basic(&own.access_key_id, "");
        assert!(!access.allows(Some(empty.as_bytes()), "uid-a", "disk-0.raw"));
    }

    #[test]
    fn a_raw_disks_credential_opens_its_warm_base_and_patch_and_no_other_disks() {
        let dir = tempfile::tempdir().unwrap();
        let access = StagingAccess::load_or_create(dir.path(), "https://staging.example:8443").unwrap();
        let own = access.credential("uid-a", "disk-0.raw");
        let header = basic(&own.access_key_id, &own.secret_key);
        for file in ["disk-0.raw.base", "disk-0.raw.patch"] {
            assert!(access.allows(Some(header.as_bytes()), "uid-a", file), "{file}");
        }
        for file in ["disk-1.raw.base", "disk-1.raw.patch", "disk-0.qcow2.patch", "disk-0.raw.other"] {
            assert!(!access.allows(Some(header.as_bytes()), "uid-a", file), "{file}");
        }
        assert!(!access.allows(Some(header.as_bytes()), "uid-b", "disk-0.raw.patch"), "another migration");
    }

    #[test]
    fn key_and_ca_survive_a_restart_and_a_new_work_directory_gets_new_ones() {
        let dir = tempfile::tempdir().unwrap();
        let first = StagingAccess::load_or_create(dir.path(), "https://a.example").unwrap();
        let again = StagingAccess::load_or_create(dir.path(), "https://b.example:9000/x").unwrap();
        assert_eq!(first.credential("u", "disk-0.raw"), again.credential("u", "disk-0.raw"));
        assert_eq!(first.ca_pem(), again.ca_pem());
        let other_dir = tempfile::tempdir().unwrap();
        let other = StagingAccess::load_or_create(other_dir.path(), "https://a.example").unwrap();
        assert_ne!(
            first.credential("u", "disk-0.raw").secret_key,
            other.credential("u", "disk-0.raw").secret_key
        );
        use std::os::unix::fs::PermissionsExt;
        for private in ["hmac.key", "ca.key"] {
            let mode = fs::metadata(dir.path().join(private)).unwrap().permissions().mode();
            assert_eq!(mode & 0o077, 0, "{private} is readable by others");
        }
    }

    #[test]
    fn a_plain_http_or_hostless_staging_url_is_refused_with_its_reason() {
        let dir = tempfile::tempdir().unwrap();
        let plain = StagingAccess::load_or_create(dir.path(), "http://staging:8080").unwrap_err();
        assert!(format!("{plain:#}").contains("must start with https://"), "{plain:#}");
        let hostless = StagingAccess::load_or_create(dir.path(), "https://:8443").unwrap_err();
        assert!(format!("{hostless:#}").contains("names no host"), "{hostless:#}");
        assert_eq!(url_host("https://[::1]:8443/").unwrap(), "::1");
        assert_eq!(
            url_host("https://vmmigrate-staging.vmmigrate-system.svc:8443").unwrap(),
            "vmmigrate-staging.vmmigrate-system.svc"
        );
    }

    #[test]
    fn the_secret_never_reaches_debug_output() {
        let dir = tempfile::tempdir().unwrap();
        let access = StagingAccess::load_or_create(dir.path(), "https://s").unwrap();
        let credential = access.credential("u", "disk-0.raw");
        assert!(!format!("{credential:?}").contains(&credential.secret_key));
    }

    #[test]
    fn a_workers_identity_opens_its_own_migrations_artifacts_and_no_other() {
        let dir = tempfile::tempdir().unwrap();
        let controller = StagingAccess::load_or_create(dir.path(), "https://s").unwrap();
        let names = ["w.apps.svc".to_owned(), "10.96.0.7".to_owned()];
        let identity = controller.worker_identity("uid-a", &names).unwrap();
        let worker = StagingAccess::from_worker(&identity).unwrap();
        // What the controller hands CDI for migration a, the worker accepts.
        let own = controller.for_migration("uid-a").credential("uid-a", "disk-0.raw");
        assert!(worker.allows(
            Some(basic(&own.access_key_id, &own.secret_key).as_bytes()),
            "uid-a",
            "disk-0.raw"
        ));
        // Another migration's credentials, even signed by the controller's
        // key for that migration, open nothing here; the worker's key is not
        // the controller's.
        let other = controller.for_migration("uid-b").credential("uid-b", "disk-0.raw");
        assert!(!worker.allows(
            Some(basic(&other.access_key_id, &other.secret_key).as_bytes()),
            "uid-b",
            "disk-0.raw"
        ));
        let global = controller.credential("uid-a", "disk-0.raw");
        assert!(!worker.allows(
            Some(basic(&global.access_key_id, &global.secret_key).as_bytes()),
            "uid-a",
            "disk-0.raw"
        ));
        assert_ne!(
            identity.key_hex,
            crate::convert::artifact::hex(&controller.key),
            "not the controller's key"
        );
        // The worker cannot sign: it holds no CA key.
        assert!(worker.worker_identity("uid-b", &names).is_err());
        assert!(!format!("{identity:?}").contains(&identity.key_hex));
    }

    #[test]
    fn a_workers_control_api_opens_only_to_its_own_token() {
        let dir = tempfile::tempdir().unwrap();
        let controller = StagingAccess::load_or_create(dir.path(), "https://s").unwrap();
        let worker =
            StagingAccess::from_worker(&controller.worker_identity("uid-a", &["w".into()]).unwrap()).unwrap();
        let bearer = |token: &str| format!("Bearer {token}");
        let own = controller.for_migration("uid-a").control_token();
        assert!(worker.allows_control(Some(bearer(&own).as_bytes())));
        let other = controller.for_migration("uid-b").control_token();
        assert!(!worker.allows_control(Some(bearer(&other).as_bytes())));
        assert!(!worker.allows_control(Some(bearer(&controller.control_token()).as_bytes())));
        assert!(!worker.allows_control(Some(format!("Basic {own}").as_bytes())));
        assert!(!worker.allows_control(Some(b"Bearer not-hex")));
        assert!(!worker.allows_control(None));
    }

    #[test]
    fn a_workers_certificate_is_trusted_by_the_controllers_client_for_the_names_it_was_made_for() {
        let dir = tempfile::tempdir().unwrap();
        let controller = StagingAccess::load_or_create(dir.path(), "https://s").unwrap();
        let identity =
            controller.worker_identity("uid-a", &["w.apps.svc".into(), "10.96.0.7".into()]).unwrap();
        use rustls::pki_types::pem::PemObject as _;
        let cert = CertificateDer::from_pem_slice(identity.cert_pem.as_bytes()).unwrap();
        let roots = {
            let mut roots = rustls::RootCertStore::empty();
            roots.add(CertificateDer::from_pem_slice(controller.ca_pem().as_bytes()).unwrap()).unwrap();
            Arc::new(roots)
        };
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            roots,
            Arc::new(rustls::crypto::ring::default_provider()),
        )
        .build()
        .unwrap();
        use rustls::client::danger::ServerCertVerifier as _;
        let now = rustls::pki_types::UnixTime::now();
        let name = |n: &str| rustls::pki_types::ServerName::try_from(n.to_owned()).unwrap();
        for ok in ["w.apps.svc", "10.96.0.7"] {
            assert!(verifier.verify_server_cert(&cert, &[], &name(ok), &[], now).is_ok(), "{ok}");
        }
        assert!(verifier.verify_server_cert(&cert, &[], &name("other.apps.svc"), &[], now).is_err());
        assert!(controller.client_tls().is_ok());
    }
}
