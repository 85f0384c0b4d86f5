//! Every code's one status, body and gRPC mapping.
use super::*;

#[test]
fn a_status_message_is_capped_on_a_char_boundary() {
    let e = LockstepError::ModelNotFound {
        model: "é".repeat(20_000),
    };
    let s = e.to_status();
    assert!(
        s.message().len() <= MAX_STATUS_MESSAGE + 16,
        "{}",
        s.message().len()
    );
    assert!(s.message().ends_with("... (cut)"));
    assert_eq!(s.code(), tonic::Code::NotFound);
    let short = LockstepError::ModelNotFound { model: "m".into() }.to_status();
    assert_eq!(short.message(), "model `m` does not exist");
}

#[test]
fn every_code_has_one_status_and_a_complete_body() {
    let id = PairId::from_raw(1u64 << 60);
    let all = [
        (
            LockstepError::InvalidJson {
                message: "x".into(),
            },
            400,
        ),
        (
            LockstepError::InvalidRequest {
                message: "x".into(),
                param: Some("max_tokens".into()),
            },
            400,
        ),
        (LockstepError::BodyTooLarge { limit: 10 }, 413),
        (LockstepError::BodyTimeout { ms: 10 }, 408),
        (
            LockstepError::PromptBytesTooLong {
                bytes: 100,
                min_tokens: 20,
                limit: 10,
            },
            400,
        ),
        (
            LockstepError::PromptTooLong {
                prompt_tokens: 10,
                limit: 9,
            },
            400,
        ),
        (LockstepError::ModelNotFound { model: "m".into() }, 404),
        (
            LockstepError::ContextLengthExceeded {
                prompt_tokens: 10,
                max_tokens: 5,
                limit: 12,
                context_window: 12,
                kv_capacity: 100,
            },
            400,
        ),
        (
            LockstepError::Unsupported {
                message: "n".into(),
                param: Some("n".into()),
            },
            400,
        ),
        (
            LockstepError::PrefillRejected {
                pair_id: id,
                message: "x".into(),
            },
            502,
        ),
        (
            LockstepError::DecodeFailed {
                pair_id: id,
                message: "x".into(),
            },
            502,
        ),
        (
            LockstepError::IntegrityViolation {
                pair_id: id,
                message: "x".into(),
            },
            502,
        ),
        (
            LockstepError::EmbeddingFailed {
                message: "x".into(),
            },
            502,
        ),
        (
            LockstepError::Timeout {
                pair_id: id,
                phase: Phase::Prefill,
            },
            504,
        ),
        (
            LockstepError::NoHealthyWorker {
                model: "m".into(),
                side: "decode",
            },
            503,
        ),
        (
            LockstepError::RouteNotFound {
                method: "GET".into(),
                path: "/x".into(),
            },
            404,
        ),
        (
            LockstepError::Unavailable {
                message: "draining".into(),
            },
            503,
        ),
        (
            LockstepError::Unauthorized {
                message: "invalid API key".into(),
            },
            401,
        ),
        (LockstepError::ModelNotAllowed { model: "m".into() }, 403),
        (
            LockstepError::RateLimited {
                message: "slow down".into(),
                retry_after_s: 2,
            },
            429,
        ),
        (
            LockstepError::WorkersBusy {
                model: "m".into(),
                side: "decode",
            },
            503,
        ),
        (
            LockstepError::PrefillNotAllowed {
                prefill: "10.0.0.9:8000".into(),
            },
            403,
        ),
        (LockstepError::PrefillRequired { model: "m".into() }, 503),
        (
            LockstepError::SharedStoreUnavailable {
                message: "redis down".into(),
            },
            503,
        ),
        (
            LockstepError::TokensExhausted {
                message: "budget".into(),
                retry_after_s: 3,
            },
            429,
        ),
        (
            LockstepError::PrefillUnverified {
                prefill: "10.0.0.9:8000".into(),
            },
            503,
        ),
        (
            LockstepError::NotFound {
                kind: "response",
                id: "resp_x".into(),
            },
            404,
        ),
        (
            LockstepError::StateUnavailable {
                message: "database down".into(),
            },
            503,
        ),
        (LockstepError::IdempotencyKeyReused { key: "k".into() }, 422),
        (
            LockstepError::IdempotencyConflict {
                message: "running elsewhere".into(),
                retry: true,
            },
            409,
        ),
    ];
    // Every variant has an example here (the derived discriminants list them all).
    use strum::IntoEnumIterator;
    let shown: std::collections::HashSet<_> = all
        .iter()
        .map(|(e, _)| LockstepErrorDiscriminants::from(e))
        .collect();
    for v in LockstepErrorDiscriminants::iter() {
        assert!(shown.contains(&v), "no example of {v:?}");
    }
    let mut codes = std::collections::HashMap::new();
    for (err, status) in all {
        assert_eq!(err.status().as_u16(), status, "{err:?}");
        // A code may name several errors (the prompt alone or prompt + completion too
        // long), but always with one status and one gRPC code.
        let seen = codes.insert(err.code(), (status, err.grpc_code()));
        assert!(
            seen.is_none_or(|s| s == (status, err.grpc_code())),
            "code {} with two statuses",
            err.code()
        );
        let body = err.body();
        assert_eq!(body["error"]["code"], err.code());
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
        assert!(body["error"]["type"].is_string());
        assert!(body["error"].get("param").is_some());
        if let Some(pid) = err.pair_id() {
            assert_eq!(body["error"]["pair_id"], pid.to_string());
        }
        // The gRPC status: one code per error, the same stable code in its ErrorInfo.
        use tonic::Code;
        use tonic_types::StatusExt;
        let st = err.to_status();
        assert_eq!(st.code(), err.grpc_code());
        let expected: &[Code] = match status {
            400 | 413 | 422 => &[Code::InvalidArgument],
            409 => &[Code::Aborted],
            401 => &[Code::Unauthenticated],
            403 => &[Code::PermissionDenied],
            404 => &[Code::NotFound],
            429 => &[Code::ResourceExhausted],
            502 => &[Code::Aborted, Code::DataLoss],
            503 => &[Code::Unavailable, Code::ResourceExhausted],
            408 | 504 => &[Code::DeadlineExceeded],
            _ => &[],
        };
        assert!(expected.contains(&st.code()), "{err:?} → {:?}", st.code());
        let info = st.get_details_error_info().expect("ErrorInfo detail");
        assert_eq!(info.reason, err.code());
        assert_eq!(info.domain, "lockstep");
        assert_eq!(
            info.metadata.get("pair_id").cloned(),
            err.pair_id().map(|p| p.to_string())
        );
    }
}

#[test]
fn context_error_names_counts_and_limit() {
    let e = LockstepError::ContextLengthExceeded {
        prompt_tokens: 700,
        max_tokens: 400,
        limit: 1000,
        context_window: 1000,
        kv_capacity: 2000,
    };
    let m = e.to_string();
    for n in ["700", "400", "1100", "1000", "2000"] {
        assert!(m.contains(n), "{m} lacks {n}");
    }
}
