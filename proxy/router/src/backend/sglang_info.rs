//! The SGLang deployment check: one `/server_info` read per worker at start, at every reload and
//! in `lockstep check`, and what lockstep requires of it (SGLang 0.5.23: `/server_info` returns
//! the resolved server arguments flat plus the scheduler's figures, `srt/utils/common.py`
//! `build_server_info`, `srt/entrypoints/http_server.py`; `/get_server_info` is its deprecated
//! alias, asked only when `/server_info` is missing).
//!
//! Fails closed: a worker that answers what lockstep cannot accept stops the model from serving;
//! one that does not answer gets no pairs until it answers and passes
//! ([`super::check::fold_member`], run by the model's background checks), since its KV
//! checksum, role and stream mode are unknown. The set is checked by the one fold
//! ([`super::check::fold`]): this file reads one worker's answer ([`read`]).

use std::time::Duration;

use serde_json::Value;

use super::Side;
use super::check::{ProbeError, WorkerReport};
use super::client::UpstreamClient;
use lockstep_core::config::{ModelConfig, WorkerConfig};

/// How a decode worker streams `/generate` output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamMode {
    /// Each event carries the whole text so far (SGLang's default).
    Cumulative,
    /// Each event carries only its new text (`--incremental-streaming-output`).
    Incremental,
}

/// The layout keys SGLang's KV checksum needs equal on both ends; where they differ it switches
/// itself off without a word (`srt/disaggregation/base/conn.py` `should_verify_kv_checksum`).
const LAYOUT_KEYS: [&str; 4] = ["page_size", "kv_cache_dtype", "tp_size", "pp_size"];

/// One worker's `/server_info`, read ([`read`]): what it reports, and for a decode worker how it
/// streams.
pub async fn probe_worker(
    client: &UpstreamClient,
    m: &ModelConfig,
    side: Side,
    w: &WorkerConfig,
) -> Result<(WorkerReport, Option<StreamMode>), ProbeError> {
    match server_info(client, m, side, w).await {
        Ok(v) => Ok(read(m, side, w, &v)),
        Err(Fetch::Unreachable(e)) => Err(ProbeError::Unreachable(e)),
        Err(Fetch::Refused(e)) => Err(ProbeError::Refused(e)),
    }
}

/// Why a `/server_info` read failed.
enum Fetch {
    /// No answer (connect error, timeout, broken exchange).
    Unreachable(String),
    /// An answer lockstep cannot accept (401, another error status, not JSON).
    Refused(String),
}

/// One worker's `/server_info` (or `/get_server_info` where the first is 404), with its pool's
/// credentials.
async fn server_info(
    client: &UpstreamClient,
    m: &ModelConfig,
    side: Side,
    w: &WorkerConfig,
) -> Result<Value, Fetch> {
    let pool = match side {
        Side::Prefill => &m.prefill,
        Side::Decode => &m.decode,
    };
    let auth = pool.auth_headers();
    let base = w.url.trim_end_matches('/');
    let mut last = String::new();
    for path in ["/server_info", "/get_server_info"] {
        let url = format!("{base}{path}");
        let get = client.get_collect_with(&url, &auth);
        let (status, body) = tokio::time::timeout(Duration::from_secs(5), get)
            .await
            .map_err(|_| Fetch::Unreachable(format!("{path} did not answer within 5 s")))?
            .map_err(|e| {
                Fetch::Unreachable(match e {
                    super::client::CallError::Connect(m) => format!("unreachable: {m}"),
                    super::client::CallError::Transport(m) => format!("{path}: {m}"),
                })
            })?;
        if status == 404 {
            last = format!("{path} answered 404");
            continue;
        }
        if status == 401 || status == 403 {
            return Err(Fetch::Refused(format!(
                "{path} answered {status}: the worker wants an API key; set this pool's api_key to its --api-key"
            )));
        }
        if !(200..300).contains(&status) {
            return Err(Fetch::Refused(format!("{path} answered {status}")));
        }
        return serde_json::from_slice(&body)
            .map_err(|e| Fetch::Refused(format!("{path} is not JSON: {e}")));
    }
    Err(Fetch::Refused(format!(
        "{last}: not an SGLang server (no /server_info)"
    )))
}

/// The `/server_info` fields lockstep reads (the deployment check): all a sidecar passes on of
/// its engine's page, whose other fields include the engine's own API keys
/// (sgl-project/sglang#30166).
pub const SERVER_INFO_FIELDS: &[&str] = &[
    "version",
    "disaggregation_mode",
    "disaggregation_transfer_backend",
    "disaggregation_bootstrap_port",
    "disaggregation_enable_kv_checksum",
    "incremental_streaming_output",
    "enable_deterministic_inference",
    "skip_tokenizer_init",
    "page_size",
    "kv_cache_dtype",
    "tp_size",
    "pp_size",
    "max_total_num_tokens",
    "max_req_input_len",
];

/// `v` (a `/server_info` answer) with only [`SERVER_INFO_FIELDS`], at the top level and in the
/// first `internal_states` entry, where [`field`] reads them.
pub fn allowed_server_info(v: &Value) -> Value {
    let keep = |o: &serde_json::Map<String, Value>| -> serde_json::Map<String, Value> {
        o.iter()
            .filter(|(k, _)| SERVER_INFO_FIELDS.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    };
    let Some(top) = v.as_object() else {
        return Value::Object(serde_json::Map::new());
    };
    let mut out = keep(top);
    if let Some(first) = v.pointer("/internal_states/0").and_then(Value::as_object) {
        out.insert(
            "internal_states".into(),
            Value::Array(vec![Value::Object(keep(first))]),
        );
    }
    Value::Object(out)
}

/// A key of a `/server_info` answer: top level, or in the first `internal_states` entry (where
/// some releases put the scheduler's figures).
fn field<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    v.get(key)
        .filter(|x| !x.is_null())
        .or_else(|| v.pointer(&format!("/internal_states/0/{key}")))
        .filter(|x| !x.is_null())
}

/// What lockstep requires of one worker's `/server_info`: the role of its pool, one real
/// transfer backend (the same on every worker), prefill bootstrap ports as configured, decode
/// text to read, and (unless `sglang.require_kv_checksum = false`) the KV checksum on, with the
/// layout every worker shares. Its capacity and prompt limit; a decode worker's stream mode.
pub fn read(
    m: &ModelConfig,
    side: Side,
    w: &WorkerConfig,
    v: &Value,
) -> (WorkerReport, Option<StreamMode>) {
    let mut r = WorkerReport::default();
    let mode = field(v, "disaggregation_mode").and_then(Value::as_str);
    if mode != Some(side.as_str()) {
        r.problems.push(format!(
            "runs with disaggregation_mode = {}, not `{}`: a server outside PD mode would compute the whole request on its own",
            mode.map_or("(none)".to_string(), |s| format!("`{s}`")),
            side.as_str()
        ));
    }
    match field(v, "disaggregation_transfer_backend").and_then(Value::as_str) {
        Some("fake") => r.problems.push("runs disaggregation_transfer_backend = `fake`: its decode generates without receiving any KV".into()),
        Some(t) => r.share(
            "disaggregation_transfer_backend",
            format!("`{t}`"),
            "a decode can only receive KV over the transfer backend its prefill sends on",
        ),
        None => r.problems.push("reports no disaggregation_transfer_backend".into()),
    }
    if side == Side::Prefill && w.bootstrap_port.is_none() {
        // A configured prefill must name one (config validation); a discovered one names it by
        // annotation or the pool's `discovery.bootstrap_port`.
        r.problems.push(format!(
            "has no bootstrap port for its decodes to fetch KV from: annotate its pod with `{}` or set the pool's discovery.bootstrap_port",
            lockstep_core::config::BOOTSTRAP_PORT_ANNOTATION
        ));
    }
    if side == Side::Prefill
        && let (Some(want), Some(got)) = (
            w.bootstrap_port,
            field(v, "disaggregation_bootstrap_port").and_then(Value::as_u64),
        )
        && u64::from(want) != got
    {
        r.problems.push(format!(
            "its bootstrap server listens on port {got}, but lockstep is configured to send decodes to {want}"
        ));
    }
    // The prefill samples the first token, the decode the rest: one seeding rule for both.
    r.share(
        "enable_deterministic_inference",
        field(v, "enable_deterministic_inference")
            .and_then(Value::as_bool)
            .unwrap_or(false)
            .to_string(),
        "the prefill samples the first token and the decode the rest: both must seed unseeded requests alike",
    );
    let mut stream = None;
    if side == Side::Decode {
        if field(v, "skip_tokenizer_init").and_then(Value::as_bool) == Some(true) {
            r.problems.push("runs with skip_tokenizer_init: its stream carries no text, and lockstep does not detokenize SGLang output".into());
        }
        stream = Some(
            if field(v, "incremental_streaming_output").and_then(Value::as_bool) == Some(true) {
                StreamMode::Incremental
            } else {
                StreamMode::Cumulative
            },
        );
    }
    if m.sglang.require_kv_checksum {
        if field(v, "disaggregation_enable_kv_checksum").and_then(Value::as_bool) != Some(true) {
            r.problems.push("runs without --disaggregation-enable-kv-checksum, so nothing would verify the KV its decodes read; start every prefill and decode worker with it (or set sglang.require_kv_checksum = false, UNSAFE)".into());
        }
        for k in LAYOUT_KEYS {
            r.share(
                k,
                field(v, k).map_or("(none)".into(), Value::to_string),
                "SGLang silently skips its KV checksum between workers whose layouts differ",
            );
        }
    }
    r.kv_tokens = field(v, "max_total_num_tokens").and_then(Value::as_u64);
    // The scheduler refuses `len(input_ids) >= max_req_input_len`
    // (`srt/managers/scheduler.py`, `_add_request_to_queue`).
    r.max_prompt_tokens = field(v, "max_req_input_len")
        .and_then(Value::as_u64)
        .map(|l| l.saturating_sub(1));
    (r, stream)
}

#[cfg(test)]
mod tests {
    use super::super::Deployment;
    use super::super::check::{Probed, fold};
    use super::*;
    use serde_json::json;

    fn model(text_extra: &str) -> ModelConfig {
        let text = format!(
            r#"
[[models]]
name = "m"
backend = "sglang"
context_window = 1000
kv_capacity_tokens = 4000
tokenizer = "/t.json"
chat_template = {{ inline = "x" }}
{text_extra}
[models.prefill]
workers = [{{ url = "http://p", bootstrap_port = 8998 }}]
[models.decode]
workers = [{{ url = "http://d/" }}]
"#
        );
        lockstep_core::config::Config::parse(&text)
            .expect("config")
            .models
            .remove(0)
    }

    fn info(role: &str) -> Value {
        json!({
            "disaggregation_mode": role, "disaggregation_transfer_backend": "mooncake",
            "disaggregation_bootstrap_port": 8998, "disaggregation_enable_kv_checksum": true,
            "incremental_streaming_output": false, "skip_tokenizer_init": false,
            "page_size": 16, "kv_cache_dtype": "auto", "tp_size": 1, "pp_size": 1,
            "max_total_num_tokens": 3000, "max_req_input_len": 994,
        })
    }

    /// Both workers' answers through the one fold; the limits and the decode's stream mode.
    fn run(m: &ModelConfig, p: Value, d: Value) -> Result<(Deployment, StreamMode), String> {
        let (pr, _) = read(m, Side::Prefill, &m.prefill.workers[0], &p);
        let (dr, mode) = read(m, Side::Decode, &m.decode.workers[0], &d);
        let set = [
            ("http://p", Side::Prefill, pr),
            ("http://d", Side::Decode, dr),
        ]
        .map(|(url, side, report)| Probed {
            side,
            url: url.into(),
            report,
        });
        fold(m, &set).map(|dep| (dep, mode.expect("a decode's stream mode")))
    }

    #[test]
    fn a_correct_deployment_gives_its_limits_and_stream_modes() {
        let m = model("");
        let (dep, mode) = run(&m, info("prefill"), info("decode")).expect("ok");
        assert_eq!(dep.kv_capacity, 3000);
        assert_eq!(dep.max_prompt_tokens, Some(993));
        assert_eq!(mode, StreamMode::Cumulative);
        let mut d = info("decode");
        d["incremental_streaming_output"] = json!(true);
        // Figures nested in internal_states are read too.
        d["max_req_input_len"] = Value::Null;
        d["internal_states"] = json!([{ "max_req_input_len": 500 }]);
        let (dep, mode) = run(&m, info("prefill"), d).expect("ok");
        assert_eq!(mode, StreamMode::Incremental);
        assert_eq!(dep.max_prompt_tokens, Some(499));
    }

    /// The prefill samples the first token, the decode the rest: a deterministic half beside a
    /// sampling one would seed a request's tokens by two rules.
    #[test]
    fn both_halves_must_seed_alike() {
        let m = model("");
        let mut p = info("prefill");
        p["enable_deterministic_inference"] = json!(true);
        let e = run(&m, p.clone(), info("decode")).expect_err("mixed");
        assert!(e.contains("enable_deterministic_inference"), "{e}");
        let mut d = info("decode");
        d["enable_deterministic_inference"] = json!(true);
        run(&m, p, d).expect("both deterministic");
    }

    #[test]
    fn every_unsafe_setting_is_refused_with_its_reason() {
        let m = model("");
        let cases: Vec<(&str, Value, &str)> = vec![
            (
                "decode",
                json!({"disaggregation_enable_kv_checksum": false}),
                "--disaggregation-enable-kv-checksum",
            ),
            (
                "prefill",
                json!({"disaggregation_enable_kv_checksum": null}),
                "--disaggregation-enable-kv-checksum",
            ),
            ("decode", json!({"page_size": 32}), "page_size = 32"),
            ("decode", json!({"tp_size": 2}), "tp_size = 2"),
            (
                "decode",
                json!({"kv_cache_dtype": "fp8_e4m3"}),
                "kv_cache_dtype",
            ),
            ("decode", json!({"pp_size": 2}), "pp_size"),
            (
                "decode",
                json!({"skip_tokenizer_init": true}),
                "skip_tokenizer_init",
            ),
            (
                "decode",
                json!({"disaggregation_mode": "null"}),
                "disaggregation_mode = `null`",
            ),
            (
                "prefill",
                json!({"disaggregation_mode": "decode"}),
                "not `prefill`",
            ),
            (
                "decode",
                json!({"disaggregation_transfer_backend": "fake"}),
                "`fake`",
            ),
            (
                "decode",
                json!({"disaggregation_transfer_backend": "nixl"}),
                "disaggregation_transfer_backend = `nixl` differs from http://p's `mooncake`",
            ),
            (
                "prefill",
                json!({"disaggregation_bootstrap_port": 9000}),
                "port 9000",
            ),
            (
                "decode",
                json!({"max_total_num_tokens": 900}),
                "deployment check failed",
            ),
        ];
        for (role, patch, why) in cases {
            let (mut p, mut d) = (info("prefill"), info("decode"));
            let target = if role == "prefill" { &mut p } else { &mut d };
            for (k, val) in patch.as_object().expect("object") {
                target[k] = val.clone();
            }
            let e = run(&m, p, d).expect_err(why);
            assert!(e.contains(why), "{why}: {e}");
            assert!(
                e.contains(&format!("{role} worker")) || why.contains("deployment"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_prefill_without_a_bootstrap_port_is_refused() {
        let m = model("");
        let mut w = m.prefill.workers[0].clone();
        w.bootstrap_port = None;
        let (r, _) = read(&m, Side::Prefill, &w, &info("prefill"));
        assert!(
            r.problems
                .iter()
                .any(|p| p.contains("sglang.ai/bootstrap-port")),
            "{:?}",
            r.problems
        );
        let (r, _) = read(&m, Side::Prefill, &m.prefill.workers[0], &info("prefill"));
        assert!(r.problems.is_empty(), "{:?}", r.problems);
    }

    #[test]
    fn the_checksum_requirement_can_be_waived() {
        let m = model("[models.sglang]\nrequire_kv_checksum = false");
        let mut d = info("decode");
        d["disaggregation_enable_kv_checksum"] = json!(false);
        d["page_size"] = json!(64);
        assert!(run(&m, info("prefill"), d).is_ok());
        // The other requirements stay.
        let mut d = info("decode");
        d["skip_tokenizer_init"] = json!(true);
        assert!(run(&m, info("prefill"), d).is_err());
    }

    /// What a sidecar passes on of its engine's `/server_info` is all the deployment check reads
    /// (the same verdict on every variation the check knows) and never the engine's keys.
    #[test]
    fn the_allowed_server_info_fields_are_all_the_check_reads() {
        let m = model("");
        let mut d = info("decode");
        d["api_key"] = json!("engine-secret");
        d["admin_api_key"] = json!("admin-secret");
        d["internal_states"] = json!([{ "max_req_input_len": 500, "api_key": "x" }]);
        d["max_req_input_len"] = Value::Null;
        let cut = allowed_server_info(&d);
        let text = cut.to_string();
        assert!(
            !text.contains("secret") && !text.contains("api_key"),
            "{text}"
        );
        let full = run(&m, info("prefill"), d.clone()).expect("ok");
        let kept = run(&m, allowed_server_info(&info("prefill")), cut).expect("ok");
        assert_eq!(full.0.max_prompt_tokens, kept.0.max_prompt_tokens);
        assert_eq!(full.0.kv_capacity, kept.0.kv_capacity);
        assert_eq!(full.1, kept.1);
        for (role, patch) in [
            (
                "decode",
                json!({"disaggregation_enable_kv_checksum": false}),
            ),
            ("decode", json!({"page_size": 32})),
            ("decode", json!({"tp_size": 2})),
            ("decode", json!({"kv_cache_dtype": "fp8_e4m3"})),
            ("decode", json!({"pp_size": 2})),
            ("decode", json!({"skip_tokenizer_init": true})),
            ("decode", json!({"incremental_streaming_output": true})),
            ("prefill", json!({"disaggregation_mode": "decode"})),
            ("decode", json!({"disaggregation_transfer_backend": "fake"})),
            ("prefill", json!({"disaggregation_bootstrap_port": 9000})),
            ("decode", json!({"max_total_num_tokens": 900})),
        ] {
            let (mut p, mut d) = (info("prefill"), info("decode"));
            let target = if role == "prefill" { &mut p } else { &mut d };
            for (k, val) in patch.as_object().expect("object") {
                target[k] = val.clone();
            }
            let full = run(&m, p.clone(), d.clone())
                .map(|(dep, mode)| (dep.kv_capacity, dep.max_prompt_tokens, mode));
            let kept = run(&m, allowed_server_info(&p), allowed_server_info(&d))
                .map(|(dep, mode)| (dep.kv_capacity, dep.max_prompt_tokens, mode));
            assert_eq!(full, kept, "{patch}");
        }
    }
}
