//! TLS on lockstep's listeners (rustls, ring provider): `server.tls_cert_file` and
//! `server.tls_key_file` (PEM) turn the HTTP and admin listeners into HTTPS (HTTP/1.1 and h2 by
//! ALPN). Certificates are read at start; a restart picks up new ones.

use std::path::Path;
use std::sync::Arc;

use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The server configuration for a certificate chain and its key.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, String> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .and_then(|it| it.collect())
        .map_err(|e| format!("server.tls_cert_file {}: {e}", cert.display()))?;
    if chain.is_empty() {
        return Err(format!(
            "server.tls_cert_file {}: no certificate in it",
            cert.display()
        ));
    }
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| format!("server.tls_key_file {}: {e}", key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| format!("server.tls_cert_file / tls_key_file: {e}"))?;
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}
