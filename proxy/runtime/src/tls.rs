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

/// The certificate files of the worker plane (`[worker.tls]` on a worker, `[worker_plane.tls]`
/// on the router): every member presents `cert_file` (with `key_file`) and accepts only peers
/// whose certificate chains to `ca_file`, both ways (mutual TLS).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PlaneTlsFiles {
    /// This member's certificate chain (PEM). Its names (DNS or IP SANs) must match the host of
    /// the URL its peers use.
    pub cert_file: std::path::PathBuf,
    /// Its private key (PEM).
    pub key_file: std::path::PathBuf,
    /// The plane's CA (PEM): peers must chain to it.
    pub ca_file: std::path::PathBuf,
}

impl PlaneTlsFiles {
    /// Makes relative paths relative to the config file's directory.
    pub fn resolve_paths(&mut self, base: &Path) {
        for p in [&mut self.cert_file, &mut self.key_file, &mut self.ca_file] {
            crate::toml_file::resolve(p, base);
        }
    }
}

/// Mutual TLS on the worker plane: a server side (client certificates required and verified
/// against the plane's CA) and a client side (presents this member's certificate, verifies the
/// peer's against the same CA), reloadable from the files (new connections use the new ones).
pub struct PlaneTls {
    files: PlaneTlsFiles,
    server: arc_swap::ArcSwap<rustls::ServerConfig>,
    client: arc_swap::ArcSwap<rustls::ClientConfig>,
    /// The CA file's bytes as last loaded, and a count bumped each time a reload changes them:
    /// connections authenticated under an earlier CA are closed ([`PlaneTls::ca_changes`]).
    ca: std::sync::Mutex<Vec<u8>>,
    ca_generation: tokio::sync::watch::Sender<u64>,
}

impl std::fmt::Debug for PlaneTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlaneTls")
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

fn plane_configs(
    f: &PlaneTlsFiles,
) -> Result<(Arc<rustls::ServerConfig>, Arc<rustls::ClientConfig>), String> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&f.cert_file)
        .and_then(|it| it.collect())
        .map_err(|e| format!("tls.cert_file {}: {e}", f.cert_file.display()))?;
    if chain.is_empty() {
        return Err(format!(
            "tls.cert_file {}: no certificate in it",
            f.cert_file.display()
        ));
    }
    let key = PrivateKeyDer::from_pem_file(&f.key_file)
        .map_err(|e| format!("tls.key_file {}: {e}", f.key_file.display()))?;
    let mut roots = rustls::RootCertStore::empty();
    let cas: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&f.ca_file)
        .and_then(|it| it.collect())
        .map_err(|e| format!("tls.ca_file {}: {e}", f.ca_file.display()))?;
    for ca in cas {
        roots
            .add(ca)
            .map_err(|e| format!("tls.ca_file {}: {e}", f.ca_file.display()))?;
    }
    if roots.is_empty() {
        return Err(format!(
            "tls.ca_file {}: no certificate in it",
            f.ca_file.display()
        ));
    }
    let roots = Arc::new(roots);
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        roots.clone(),
        provider.clone(),
    )
    .build()
    .map_err(|e| format!("tls.ca_file {}: {e}", f.ca_file.display()))?;
    let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain.clone(), key.clone_key())
        .map_err(|e| format!("tls.cert_file / key_file: {e}"))?;
    server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let mut client = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .map_err(|e| format!("tls.cert_file / key_file: {e}"))?;
    client.alpn_protocols = vec![b"h2".to_vec()];
    Ok((Arc::new(server), Arc::new(client)))
}

impl PlaneTls {
    /// Reads the files.
    pub fn load(files: &PlaneTlsFiles) -> Result<Arc<PlaneTls>, String> {
        let (server, client) = plane_configs(files)?;
        Ok(Arc::new(PlaneTls {
            files: files.clone(),
            server: arc_swap::ArcSwap::new(server),
            client: arc_swap::ArcSwap::new(client),
            ca: std::sync::Mutex::new(std::fs::read(&files.ca_file).unwrap_or_default()),
            ca_generation: tokio::sync::watch::Sender::new(0),
        }))
    }

    /// Reads the files again (certificate rotation); on an error the old ones stay. New
    /// connections use the new ones; when the CA itself changed, every open connection of the
    /// plane is told to close (its peer was authenticated under the old CA).
    pub fn reload(&self) -> Result<(), String> {
        let (server, client) = plane_configs(&self.files)?;
        let ca = std::fs::read(&self.files.ca_file).unwrap_or_default();
        self.server.store(server);
        self.client.store(client);
        let mut last = self.ca.lock().unwrap_or_else(|p| p.into_inner());
        if *last != ca {
            *last = ca;
            self.ca_generation.send_modify(|g| *g += 1);
            tracing::info!(
                "worker plane CA changed: closing the connections opened under the old one"
            );
        }
        Ok(())
    }

    /// Changes when a reload changes the CA: a connection watching it closes.
    pub fn ca_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.ca_generation.subscribe()
    }

    /// The server side now.
    pub fn server(&self) -> Arc<rustls::ServerConfig> {
        self.server.load_full()
    }

    /// Opens a connection to `host:port` and completes the handshake, verifying the peer's
    /// certificate for `host` against the plane's CA and presenting this member's.
    pub async fn connect(
        &self,
        host: &str,
        port: u16,
    ) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let name = rustls::pki_types::ServerName::try_from(host.to_string())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let tcp = tokio::net::TcpStream::connect((host, port)).await?;
        tcp.set_nodelay(true)?;
        tokio_rustls::TlsConnector::from(self.client.load_full())
            .connect(name, tcp)
            .await
    }
}

/// The TLS side of a listener: fixed (the router's HTTPS) or the worker plane's (reloadable).
#[derive(Debug, Clone)]
pub enum ServerTls {
    /// One configuration for the listener's life.
    Fixed(Arc<rustls::ServerConfig>),
    /// The worker plane's current one (mutual TLS).
    Plane(Arc<PlaneTls>),
}

impl ServerTls {
    /// Where the plane's CA changes are announced (none for a fixed configuration).
    pub fn ca_changes(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        match self {
            ServerTls::Fixed(_) => None,
            ServerTls::Plane(p) => Some(p.ca_changes()),
        }
    }

    /// The configuration for the next connection.
    pub fn current(&self) -> Arc<rustls::ServerConfig> {
        match self {
            ServerTls::Fixed(c) => c.clone(),
            ServerTls::Plane(p) => p.server(),
        }
    }
}

/// A lazily connecting channel to a worker endpoint: `http://host:port` in plaintext (only
/// without `tls`), `https://host:port` over the plane's mutual TLS (only with it). h2 with no
/// Nagle delay and adaptive windows (KV pushes are bulk streams). The router and the workers
/// both use it.
pub fn worker_channel(
    url: &str,
    connect_timeout: std::time::Duration,
    tls: Option<&Arc<PlaneTls>>,
) -> Result<tonic::transport::Channel, String> {
    let endpoint = tonic::transport::Endpoint::from_shared(url.to_string())
        .map_err(|e| format!("bad worker endpoint `{url}`: {e}"))?
        .connect_timeout(connect_timeout)
        .tcp_nodelay(true)
        .http2_adaptive_window(true);
    let https = endpoint.uri().scheme_str() == Some("https");
    match (https, tls) {
        (false, None) => Ok(endpoint.connect_lazy()),
        (true, Some(tls)) => {
            let tls = tls.clone();
            let connector = tower::service_fn(move |uri: http::Uri| {
                let tls = tls.clone();
                async move {
                    let host = uri.host().unwrap_or_default().to_string();
                    let port = uri.port_u16().unwrap_or(443);
                    let s = tls.connect(&host, port).await?;
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
                }
            });
            Ok(endpoint.connect_with_connector_lazy(connector))
        }
        (true, None) => Err(format!(
            "worker endpoint `{url}` is https but no worker-plane TLS is configured"
        )),
        (false, Some(_)) => Err(format!(
            "worker endpoint `{url}` is plaintext but the worker plane uses TLS: use https://"
        )),
    }
}
