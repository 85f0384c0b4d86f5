//! What Envoy's ext_proc messages say and how the picker writes its own: the request's
//! headers as HTTP sees them, the data plane's metadata (the subset hint, the endpoint that
//! served), the destination in a header and in `envoy.lb` metadata. The stream itself is
//! `exchange.rs`'s.

use std::collections::HashMap;

use super::policy as picker;
use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap as EnvoyHeaders, HeaderValue, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as In;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use lockstep_core::error::LockstepError;

/// The header (and `envoy.lb` metadata key) naming the picked endpoint.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The `envoy.lb` metadata key the data plane names the endpoint that served in.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";
/// The metadata namespace of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The subset hint's key: the endpoints the picker must choose from.
pub const SUBSET: &str = "x-gateway-destination-endpoint-subset";

/// The `:path` and the other headers of an ext_proc header map (a header whose name or value
/// HTTP refuses is left out; pseudo-headers other than `:path` are not headers).
pub(crate) fn headers_of(h: Option<&EnvoyHeaders>) -> (String, http::HeaderMap) {
    let mut path = String::new();
    let mut headers = http::HeaderMap::new();
    for hv in h.map(|h| h.headers.as_slice()).unwrap_or_default() {
        let value = if hv.raw_value.is_empty() {
            hv.value.as_bytes()
        } else {
            &hv.raw_value
        };
        match hv.key.as_str() {
            ":path" => path = String::from_utf8_lossy(value).into_owned(),
            k if k.starts_with(':') => {}
            k => {
                if let (Ok(n), Ok(v)) = (
                    http::HeaderName::from_bytes(k.as_bytes()),
                    http::HeaderValue::from_bytes(value),
                ) {
                    headers.append(n, v);
                }
            }
        }
    }
    (path, headers)
}

/// Entry point of the `ext_proc` fuzz target (`fuzz/`, `tests/tests/fuzz_replay.rs`): one
/// ext_proc message as Envoy would send it, decoded and read as the picker reads it (headers,
/// the key and the named prefill from them, the subset hint, the served endpoint). Must return
/// whatever the bytes. Not an API.
pub fn fuzz_message(data: &[u8]) {
    use prost::Message;
    let Ok(msg) = ProcessingRequest::decode(data) else {
        return;
    };
    let metadata = msg.metadata_context.as_ref();
    let _ = subset_of(metadata);
    let _ = served_as_picked(metadata, "10.0.0.1:8000");
    let h = match &msg.request {
        Some(In::RequestHeaders(h)) | Some(In::ResponseHeaders(h)) => h.headers.as_ref(),
        Some(In::RequestTrailers(t)) => t.trailers.as_ref(),
        Some(In::ResponseTrailers(t)) => t.trailers.as_ref(),
        _ => None,
    };
    let (path, headers) = headers_of(h);
    let _ = (picker::is_open(&path), picker::admitted_api(&path));
    let _ = crate::sidecar::NamedPrefills::read(&headers);
    let _ = picker::error_body(&path, &LockstepError::BodyTimeout { ms: 1 });
}

/// The endpoint the data plane says served (`envoy.lb` / `x-gateway-destination-endpoint-served`),
/// where it says one, must be `picked`.
pub(crate) fn served_as_picked(
    metadata: Option<&Metadata>,
    picked: &str,
) -> Result<(), LockstepError> {
    let served = metadata
        .and_then(|m| m.filter_metadata.get("envoy.lb"))
        .and_then(|s| s.fields.get(SERVED))
        .and_then(|v| match &v.kind {
            Some(Kind::StringValue(s)) => Some(s.clone()),
            _ => None,
        });
    match served {
        Some(s) if s != picked => Err(LockstepError::Unavailable {
            message: format!(
                "the data plane reports endpoint {s} served the request; {picked} was picked"
            ),
        }),
        _ => Ok(()),
    }
}

pub(crate) fn header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            raw_value: value.as_bytes().to_vec(),
            ..HeaderValue::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    }
}

/// `{"envoy.lb": {"x-gateway-destination-endpoint": "<ip:port>"}}`.
pub(crate) fn destination_metadata(destination: &str) -> Struct {
    let inner = Struct {
        fields: HashMap::from([(
            DESTINATION.to_string(),
            Value {
                kind: Some(Kind::StringValue(destination.to_string())),
            },
        )]),
    };
    Struct {
        fields: HashMap::from([(
            "envoy.lb".to_string(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]),
    }
}

/// The subset hint's endpoints, where the data plane sent one.
pub(crate) fn subset_of(metadata: Option<&Metadata>) -> Option<Vec<String>> {
    let v = metadata?
        .filter_metadata
        .get(SUBSET_NAMESPACE)?
        .fields
        .get(SUBSET)?;
    match &v.kind {
        Some(Kind::ListValue(l)) => Some(
            l.values
                .iter()
                .filter_map(|v| match &v.kind {
                    Some(Kind::StringValue(s)) => Some(s.clone()),
                    _ => None,
                })
                .collect(),
        ),
        _ => Some(Vec::new()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sidecar::PREFILLER_HEADER;
    use envoy_types::pb::google::protobuf::ListValue;

    fn text(s: &str) -> Value {
        Value {
            kind: Some(Kind::StringValue(s.into())),
        }
    }

    fn metadata(ns: &str, key: &str, v: Value) -> Metadata {
        Metadata {
            filter_metadata: HashMap::from([(
                ns.to_string(),
                Struct {
                    fields: HashMap::from([(key.to_string(), v)]),
                },
            )]),
            ..Metadata::default()
        }
    }

    #[test]
    fn the_subset_hint_is_read_and_a_malformed_one_is_an_empty_subset() {
        assert_eq!(subset_of(None), None);
        let list = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![text("10.0.0.1:8000"), text("10.0.0.2:8000")],
            })),
        };
        let m = metadata(SUBSET_NAMESPACE, SUBSET, list);
        assert_eq!(
            subset_of(Some(&m)),
            Some(vec![
                "10.0.0.1:8000".to_string(),
                "10.0.0.2:8000".to_string()
            ])
        );
        // Not a list: the picker may choose from nothing (503), never from everything.
        let m = metadata(SUBSET_NAMESPACE, SUBSET, text("10.0.0.1:8000"));
        assert_eq!(subset_of(Some(&m)), Some(Vec::new()));
        let other = metadata("envoy.lb", SUBSET, text("x"));
        assert_eq!(subset_of(Some(&other)), None);
    }

    #[test]
    fn the_destination_goes_in_envoy_lb_metadata_and_a_different_served_endpoint_fails() {
        let md = destination_metadata("10.0.0.7:8000");
        let Some(Kind::StructValue(inner)) = &md.fields["envoy.lb"].kind else {
            panic!("envoy.lb is a struct");
        };
        assert_eq!(inner.fields[DESTINATION], text("10.0.0.7:8000"));
        assert!(served_as_picked(None, "10.0.0.7:8000").is_ok());
        let same = metadata("envoy.lb", SERVED, text("10.0.0.7:8000"));
        assert!(served_as_picked(Some(&same), "10.0.0.7:8000").is_ok());
        let other = metadata("envoy.lb", SERVED, text("10.0.0.8:8000"));
        let e = served_as_picked(Some(&other), "10.0.0.7:8000").expect_err("another endpoint");
        assert!(e.to_string().contains("10.0.0.8:8000"), "{e}");
    }

    #[test]
    fn header_mutations_overwrite_what_the_client_sent() {
        let h = header(PREFILLER_HEADER, "10.0.0.9:8000");
        assert_eq!(
            h.append_action,
            HeaderAppendAction::OverwriteIfExistsOrAdd as i32
        );
        let v = h.header.expect("a header");
        assert_eq!(v.raw_value, b"10.0.0.9:8000");
        assert!(v.value.is_empty(), "one of value and raw_value");
    }
}
