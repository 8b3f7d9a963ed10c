//! TLS for the harness's own servers: a throw-away CA per server.

use std::sync::Arc;

/// A TLS acceptor for `host` with a certificate from a CA made for it, and
/// that CA's PEM for the client to trust.
pub fn server(host: &str, ca_name: &str) -> (tokio_rustls::TlsAcceptor, String) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(rcgen::DnType::CommonName, ca_name);
    let ca = ca_params.self_signed(&ca_key).expect("CA");
    let key = KeyPair::generate().expect("server key");
    let cert = CertificateParams::new(vec![host.to_owned()])
        .expect("server params")
        .signed_by(&key, &Issuer::new(ca_params, &ca_key))
        .expect("server certificate");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let der = rustls::pki_types::PrivatePkcs8KeyDer::from(key.serialize_der());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_no_client_auth()
        .with_single_cert(vec![cert.der().clone()], der.into())
        .expect("server config");
    (tokio_rustls::TlsAcceptor::from(Arc::new(config)), ca.pem())
}

/// The aggregation layer's client identity: a CA (`front-proxy-ca.crt`) and
/// the certificate the API server presents to extension API servers (CDI's
/// upload API) and webhooks it proxies to (`front-proxy-client.{crt,key}`),
/// written into `dir`.
pub fn front_proxy(dir: &std::path::Path) -> anyhow::Result<[std::path::PathBuf; 3]> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    };
    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(DnType::CommonName, "front-proxy-ca");
    let ca = ca_params.self_signed(&ca_key)?;
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.distinguished_name.push(DnType::CommonName, "front-proxy-client");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let cert = params.signed_by(&key, &Issuer::new(ca_params, &ca_key))?;
    let paths = [
        dir.join("front-proxy-ca.crt"),
        dir.join("front-proxy-client.crt"),
        dir.join("front-proxy-client.key"),
    ];
    std::fs::write(&paths[0], ca.pem())?;
    std::fs::write(&paths[1], cert.pem())?;
    std::fs::write(&paths[2], key.serialize_pem())?;
    Ok(paths)
}
