//! A worker's URL taken apart once, so that a request to one of its paths is addressed without
//! a URL formatted and parsed per request, nor the `Host` header formatted per request (what
//! hyper's client does when a request has none: five allocations a half, in all).

use http::HeaderValue;
use http::uri::{Authority, PathAndQuery, Scheme, Uri};

/// Where a worker's paths are: its scheme and authority, and the `Host` header they give.
#[derive(Debug, Clone)]
pub struct Origin {
    scheme: Scheme,
    authority: Authority,
    host: HeaderValue,
}

/// One request target: the URI, and the `Host` header to send (`None`: hyper writes it).
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// The request's URI.
    pub uri: Uri,
    /// The `Host` header, as hyper's client would write it.
    pub host: Option<HeaderValue>,
}

impl Origin {
    /// The origin of `url`, when it is one: `None` for a URL with a path, query or user info
    /// of its own (its paths are then formatted per request), or one that does not parse.
    pub fn of(url: &str) -> Option<Origin> {
        let uri: Uri = url.parse().ok()?;
        let authority = uri.authority()?.clone();
        let plain = uri.path_and_query().is_none_or(|p| p.as_str() == "/");
        if !plain || authority.as_str().contains('@') {
            return None;
        }
        let scheme = uri.scheme()?.clone();
        // hyper's client names the port only where it is not the scheme's default.
        let default = match scheme.as_str() {
            "http" => 80,
            "https" => 443,
            _ => return None,
        };
        let host = match authority.port_u16() {
            Some(p) if p != default => format!("{}:{p}", authority.host()),
            _ => authority.host().to_string(),
        };
        Some(Origin {
            scheme,
            authority,
            host: HeaderValue::from_str(&host).ok()?,
        })
    }

    /// `path` (absolute, e.g. `/generate`) on this origin. Clones of the parts share their
    /// bytes: no allocation.
    pub fn endpoint(&self, path: &'static str) -> Result<Endpoint, String> {
        let uri = Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(PathAndQuery::from_static(path))
            .build()
            .map_err(|e| format!("bad path {path}: {e}"))?;
        Ok(Endpoint {
            uri,
            host: Some(self.host.clone()),
        })
    }
}

/// `path` on the worker at `url` (no trailing slash), through `origin` where it has one.
pub fn endpoint(
    origin: Option<&Origin>,
    url: &str,
    path: &'static str,
) -> Result<Endpoint, String> {
    if let Some(o) = origin {
        return o.endpoint(path);
    }
    let uri = format!("{url}{path}")
        .parse()
        .map_err(|e| format!("bad request for {url}{path}: {e}"))?;
    Ok(Endpoint { uri, host: None })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `Host` header hyper's legacy client writes for `uri` (hyper-util 0.1,
    /// `client/legacy/client.rs`, `send_request`: the host, and the port where it is not the
    /// scheme's default).
    fn hyper_host(uri: &Uri) -> String {
        let host = uri.host().expect("a host");
        match (uri.scheme_str(), uri.port_u16()) {
            (Some("http"), Some(80)) | (Some("https"), Some(443)) | (_, None) => host.to_string(),
            (_, Some(p)) => format!("{host}:{p}"),
        }
    }

    #[test]
    fn an_endpoint_is_the_formatted_url_with_the_host_hyper_would_write() {
        for url in [
            "http://127.0.0.1:30001",
            "http://127.0.0.1:80",
            "http://worker-a",
            "https://worker-a:443",
            "https://worker-a:8443",
            "http://[::1]:8000",
            "http://Worker.Example:9",
            "http://127.0.0.1:30001/",
        ] {
            let base = url.trim_end_matches('/');
            let origin = Origin::of(base).unwrap_or_else(|| panic!("{url} is an origin"));
            for path in ["/generate", "/v1/completions", "/abort_request"] {
                let ep = endpoint(Some(&origin), base, path).expect("endpoint");
                let formatted: Uri = format!("{base}{path}").parse().expect("parses");
                assert_eq!(ep.uri, formatted, "{url}{path}");
                assert_eq!(ep.uri.to_string(), formatted.to_string());
                let host = ep.host.expect("a host header");
                assert_eq!(
                    host.to_str().expect("ascii"),
                    hyper_host(&formatted),
                    "{url}"
                );
            }
        }
    }

    #[test]
    fn a_url_with_a_path_of_its_own_is_formatted_per_request() {
        for url in [
            "http://h:1/prefix",
            "http://h:1/?q=1",
            "http://user:pw@h:1",
            "h:1",
            "/x",
        ] {
            assert!(Origin::of(url).is_none(), "{url}");
        }
        let ep = endpoint(None, "http://h:1/prefix", "/generate").expect("endpoint");
        assert_eq!(ep.uri.to_string(), "http://h:1/prefix/generate");
        assert!(ep.host.is_none(), "hyper writes it");
        assert!(endpoint(None, "http://bad host", "/generate").is_err());
    }
}
