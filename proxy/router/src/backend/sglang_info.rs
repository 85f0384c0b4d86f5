//! The SGLang deployment check: one `/server_info` read per worker at start, at every reload and
//! in `lockstep check`, and what lockstep requires of it (SGLang 0.5.23: `/server_info` returns
//! the resolved server arguments flat plus the scheduler's figures, `srt/utils/common.py`
//! `build_server_info`, `srt/entrypoints/http_server.py`; `/get_server_info` is its deprecated
//! alias, asked only when `/server_info` is missing).
//!
//! Fails closed: a worker that answers what lockstep cannot accept stops the model from serving;
//! one that does not answer gets no pairs until it answers and passes ([`verify_one`], run by
//! the model's background checks), since its KV checksum, role and stream mode are unknown.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::Value;

use super::client::UpstreamClient;
use super::{Deployment, Side};
use crate::config::{ModelConfig, WorkerConfig, deployment_check};

/// How a decode worker streams `/generate` output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamMode {
    /// Each event carries the whole text so far (SGLang's default).
    Cumulative,
    /// Each event carries only its new text (`--incremental-streaming-output`).
    Incremental,
}

/// What the check found: the limits admission uses and each decode worker's stream mode (by
/// URL, without a trailing slash).
#[derive(Debug, Clone, PartialEq)]
pub struct Verified {
    /// Limits for admission.
    pub deployment: Deployment,
    /// Stream mode of each decode worker.
    pub stream_modes: HashMap<String, StreamMode>,
}

/// The layout keys SGLang's KV checksum needs equal on both ends; where they differ it switches
/// itself off without a word (`srt/disaggregation/base/conn.py` `should_verify_kv_checksum`).
const LAYOUT_KEYS: [&str; 4] = ["page_size", "kv_cache_dtype", "tp_size", "pp_size"];

/// One worker's `/server_info` answer, with its side and configuration.
pub type Info = (Side, WorkerConfig, Value);

/// Reads every worker's `/server_info` and checks them ([`check`]). A worker that does not
/// answer at all is left unverified (it gets no pairs until [`verify_one`] passes for it); one
/// that answers what lockstep cannot accept is a problem.
pub async fn verify(
    client: &UpstreamClient,
    m: &ModelConfig,
) -> Result<(Verified, Vec<Info>), String> {
    let mut infos = Vec::new();
    let mut problems = Vec::new();
    let mut unverified = Vec::new();
    for (side, w) in workers(m) {
        match server_info(client, m, side, w).await {
            Ok(v) => infos.push((side, w.clone(), v)),
            Err(Fetch::Unreachable(e)) => {
                tracing::warn!(model = %m.name, worker = %w.url, error = %e, "SGLang worker did not answer /server_info: it gets no pairs until it answers and passes the deployment check");
                unverified.push((w.url.trim_end_matches('/').to_string(), e));
            }
            Err(Fetch::Refused(e)) => problems.push(format!(
                "model `{}`: {} worker {}: {e}",
                m.name,
                side.as_str(),
                w.url
            )),
        }
    }
    let checked = check(m, &infos);
    match checked {
        Ok(mut v) if problems.is_empty() => {
            v.deployment.unverified = unverified;
            Ok((v, infos))
        }
        Ok(_) => Err(problems.join("\n")),
        Err(more) => {
            problems.push(more);
            Err(problems.join("\n"))
        }
    }
}

/// Checks one worker the deployment check could not reach, together with those it verified
/// (`known`): it passes when the whole set passes. Returns its answer and what the set gives.
pub async fn verify_one(
    client: &UpstreamClient,
    m: &ModelConfig,
    url: &str,
    known: &[Info],
) -> Result<(Info, Verified), String> {
    let (side, w) = workers(m)
        .find(|(_, w)| w.url.trim_end_matches('/') == url)
        .ok_or_else(|| format!("worker {url} is not in model `{}`", m.name))?;
    let v = server_info(client, m, side, w).await.map_err(|e| match e {
        Fetch::Unreachable(e) | Fetch::Refused(e) => e,
    })?;
    let mut all = known.to_vec();
    all.push((side, w.clone(), v.clone()));
    let checked = check(m, &all)?;
    Ok(((side, w.clone(), v), checked))
}

/// Every worker of `m` with its side.
fn workers(m: &ModelConfig) -> impl Iterator<Item = (Side, &WorkerConfig)> {
    (m.prefill.workers.iter().map(|w| (Side::Prefill, w)))
        .chain(m.decode.workers.iter().map(|w| (Side::Decode, w)))
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

/// A key of a `/server_info` answer: top level, or in the first `internal_states` entry (where
/// some releases put the scheduler's figures).
fn field<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    v.get(key)
        .filter(|x| !x.is_null())
        .or_else(|| v.pointer(&format!("/internal_states/0/{key}")))
        .filter(|x| !x.is_null())
}

/// What lockstep requires of the workers' `/server_info` answers: each in the role of its pool,
/// one real transfer backend, prefill bootstrap ports as configured, decode text to read, and
/// (unless `sglang.require_kv_checksum = false`) the KV checksum on everywhere with equal
/// layouts. Takes the smallest reported capacity and prompt limit. Lists every problem.
pub fn check(m: &ModelConfig, infos: &[Info]) -> Result<Verified, String> {
    let mut problems = Vec::new();
    let mut say = |w: &WorkerConfig, side: Side, what: String| {
        problems.push(format!(
            "model `{}`: {} worker {}: {what}",
            m.name,
            side.as_str(),
            w.url
        ))
    };
    let mut capacity = m.kv_capacity_tokens;
    let mut source = "configured kv_capacity_tokens".to_string();
    let mut prompt_limit: Option<u64> = None;
    let mut stream_modes = HashMap::new();
    let mut transfer: Option<(&str, &str)> = None;
    let mut layout: Option<(&str, Vec<Option<&Value>>)> = None;
    for (side, w, v) in infos {
        let side = *side;
        let mode = field(v, "disaggregation_mode").and_then(Value::as_str);
        if mode != Some(side.as_str()) {
            say(
                w,
                side,
                format!(
                    "runs with disaggregation_mode = {}, not `{}`: a server outside PD mode would compute the whole request on its own",
                    mode.map_or("(none)".to_string(), |s| format!("`{s}`")),
                    side.as_str()
                ),
            );
        }
        match field(v, "disaggregation_transfer_backend").and_then(Value::as_str) {
            Some("fake") => say(w, side, "runs disaggregation_transfer_backend = `fake`: its decode generates without receiving any KV".into()),
            Some(t) => match transfer {
                Some((seen, at)) if seen != t => say(w, side, format!("runs disaggregation_transfer_backend = `{t}`, but {at} runs `{seen}`")),
                Some(_) => {}
                None => transfer = Some((t, &w.url)),
            },
            None => say(w, side, "reports no disaggregation_transfer_backend".into()),
        }
        if side == Side::Prefill
            && let (Some(want), Some(got)) = (
                w.bootstrap_port,
                field(v, "disaggregation_bootstrap_port").and_then(Value::as_u64),
            )
            && u64::from(want) != got
        {
            say(
                w,
                side,
                format!(
                    "its bootstrap server listens on port {got}, but lockstep is configured to send decodes to {want}"
                ),
            );
        }
        if side == Side::Decode {
            if field(v, "skip_tokenizer_init").and_then(Value::as_bool) == Some(true) {
                say(w, side, "runs with skip_tokenizer_init: its stream carries no text, and lockstep does not detokenize SGLang output".into());
            }
            let mode = if field(v, "incremental_streaming_output").and_then(Value::as_bool)
                == Some(true)
            {
                StreamMode::Incremental
            } else {
                StreamMode::Cumulative
            };
            stream_modes.insert(w.url.trim_end_matches('/').to_string(), mode);
        }
        if m.sglang.require_kv_checksum {
            if field(v, "disaggregation_enable_kv_checksum").and_then(Value::as_bool) != Some(true)
            {
                say(w, side, "runs without --disaggregation-enable-kv-checksum, so nothing would verify the KV its decodes read; start every prefill and decode worker with it (or set sglang.require_kv_checksum = false, UNSAFE)".into());
            }
            let mine: Vec<Option<&Value>> = LAYOUT_KEYS.iter().map(|k| field(v, k)).collect();
            match &layout {
                None => layout = Some((&w.url, mine)),
                Some((at, first)) => {
                    for (k, (a, b)) in LAYOUT_KEYS.iter().zip(first.iter().zip(&mine)) {
                        if a != b {
                            say(
                                w,
                                side,
                                format!(
                                    "{k} = {} differs from {at}'s {}; SGLang silently skips its KV checksum between workers whose layouts differ",
                                    b.map_or("(none)".into(), Value::to_string),
                                    a.map_or("(none)".into(), Value::to_string)
                                ),
                            );
                        }
                    }
                }
            }
        }
        if let Some(c) = field(v, "max_total_num_tokens").and_then(Value::as_u64)
            && c < capacity
        {
            capacity = c;
            source = format!("reported by worker {}", w.url);
        }
        // The scheduler refuses `len(input_ids) >= max_req_input_len`
        // (`srt/managers/scheduler.py`, `_add_request_to_queue`).
        if let Some(limit) = field(v, "max_req_input_len").and_then(Value::as_u64) {
            let limit = limit.saturating_sub(1);
            prompt_limit = Some(prompt_limit.map_or(limit, |p| p.min(limit)));
        }
    }
    if let Err(e) = deployment_check(&m.name, m.context_window, m.headroom, capacity, &source) {
        problems.push(e);
    }
    if problems.is_empty() {
        Ok(Verified {
            deployment: Deployment {
                kv_capacity: capacity,
                max_prompt_tokens: prompt_limit,
                unverified: Vec::new(),
                kv_lease_ms: None,
            },
            stream_modes,
        })
    } else {
        Err(problems.join("\n"))
    }
}

#[cfg(test)]
mod tests {
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
        crate::config::Config::parse(&text)
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

    fn run(m: &ModelConfig, p: Value, d: Value) -> Result<Verified, String> {
        check(
            m,
            &[
                (Side::Prefill, m.prefill.workers[0].clone(), p),
                (Side::Decode, m.decode.workers[0].clone(), d),
            ],
        )
    }

    #[test]
    fn a_correct_deployment_gives_its_limits_and_stream_modes() {
        let m = model("");
        let v = run(&m, info("prefill"), info("decode")).expect("ok");
        assert_eq!(v.deployment.kv_capacity, 3000);
        assert_eq!(v.deployment.max_prompt_tokens, Some(993));
        assert_eq!(v.stream_modes["http://d"], StreamMode::Cumulative);
        let mut d = info("decode");
        d["incremental_streaming_output"] = json!(true);
        // Figures nested in internal_states are read too.
        d["max_req_input_len"] = Value::Null;
        d["internal_states"] = json!([{ "max_req_input_len": 500 }]);
        let v = run(&m, info("prefill"), d).expect("ok");
        assert_eq!(v.stream_modes["http://d"], StreamMode::Incremental);
        assert_eq!(v.deployment.max_prompt_tokens, Some(499));
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
                "runs `mooncake`",
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
}
