//! Log-probabilities through real `lockstep worker` processes (`backend = "lockstep"`: the
//! decode worker sends each token's entry over the worker protocol) agree with the embedded
//! engine's for the same greedy request, streamed and not.

use std::time::Duration;

use lockstep_core::config::Config;
use lockstep_router::app::Lockstep;
use lockstep_tests::client::{Answer, TestClient};
use lockstep_tests::embedded::{MODEL, model_path, small_worker, start};
use lockstep_worker::Role;
use serde_json::{Value, json};

async fn post(url: &str, body: Value) -> Answer {
    let a = TestClient::default()
        .post(url, &body, Duration::from_secs(60))
        .await;
    assert_eq!(a.status, 200, "{}", a.body);
    a
}

/// Each token's (text, log-probability, alternatives) of a completion, streamed or not.
fn entries(a: &Answer, stream: bool) -> Vec<(String, f64, Vec<String>)> {
    let mut out = Vec::new();
    for o in a.objects(stream) {
        let Some(lp) = o.pointer("/choices/0/logprobs").filter(|v| !v.is_null()) else {
            continue;
        };
        let list = |k: &str| lp[k].as_array().cloned().unwrap_or_default();
        for ((t, l), top) in list("tokens")
            .iter()
            .zip(list("token_logprobs"))
            .zip(list("top_logprobs"))
        {
            let mut alts: Vec<String> = top
                .as_object()
                .map(|m| m.keys().cloned().collect())
                .unwrap_or_default();
            alts.sort();
            out.push((
                t.as_str().unwrap_or_default().to_string(),
                l.as_f64().unwrap_or(f64::NAN),
                alts,
            ));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_return_the_embedded_engines_log_probabilities() {
    let Some(model) = model_path() else { return };
    let Some(embedded) = start("").await else {
        return;
    };
    let (p, d) = (
        small_worker(Role::Prefill, &model).await,
        small_worker(Role::Decode, &model).await,
    );
    let text = format!(
        r#"
[server]
http_listen = "127.0.0.1:0"

[[models]]
name = "m"
backend = "lockstep"
context_window = 512
kv_capacity_tokens = 768

[models.engine]
gguf = "{model}"
fetch_pip = ""

[models.prefill]
workers = [{{ url = "http://{p}" }}]

[models.decode]
workers = [{{ url = "http://{d}" }}]
"#,
        model = model.display(),
        p = p.addr,
        d = d.addr,
    );
    let cfg = Config::parse(&text).expect("parses");
    let workers = Lockstep::start(cfg).await.expect("router starts");
    let via_workers = format!("http://{}/v1/completions", workers.http_addr);
    let via_engine = format!("{}/v1/completions", embedded.url);
    for stream in [false, true] {
        let body = |model: &str| {
            json!({ "model": model, "prompt": "The capital of France is", "max_tokens": 6,
                    "temperature": 0, "logprobs": 3, "stream": stream })
        };
        let w = entries(&post(&via_workers, body("m")).await, stream);
        let e = entries(&post(&via_engine, body(MODEL)).await, stream);
        assert_eq!(w.len(), 6, "stream {stream}: {w:?}");
        assert_eq!(w.len(), e.len());
        for (a, b) in w.iter().zip(&e) {
            assert_eq!((&a.0, &a.2), (&b.0, &b.2), "stream {stream}");
            assert!((a.1 - b.1).abs() < 1e-4, "stream {stream}: {a:?} {b:?}");
            assert!(a.2.contains(&a.0) && a.2.len() <= 4, "{a:?}");
        }
    }
    // Top counts beyond the bound are refused before the workers see them.
    let a = TestClient::default()
        .post(
            &via_workers,
            &json!({ "model": "m", "prompt": "x", "max_tokens": 1, "logprobs": 21 }),
            Duration::from_secs(10),
        )
        .await;
    assert_eq!(
        (a.status, a.error_code().as_deref()),
        (400, Some("invalid_request"))
    );
    // The prompt's log-probabilities: the prefill worker scores the prompt and reports them;
    // the same values as the embedded engine's.
    let echo = |model: &str| {
        json!({ "model": model, "prompt": "The capital of France is", "max_tokens": 1,
                "temperature": 0, "echo": true, "logprobs": 2 })
    };
    let values = |a: Answer| a.json()["choices"][0]["logprobs"]["token_logprobs"].clone();
    let w = values(post(&via_workers, echo("m")).await);
    let e = values(post(&via_engine, echo(MODEL)).await);
    let (w, e) = (w.as_array().expect("list"), e.as_array().expect("list"));
    assert!(
        w.len() > 2 && w.len() == e.len() && w[0].is_null(),
        "{w:?} {e:?}"
    );
    for (a, b) in w.iter().zip(e).skip(1) {
        let (a, b) = (a.as_f64().expect("a value"), b.as_f64().expect("a value"));
        assert!((a - b).abs() < 1e-3, "{a} {b}");
    }
    embedded.wait_released().await;
}

/// SGLang's `/generate` with `return_logprob`: `meta_info` as SGLang 0.5.23 writes it (an empty
/// `input_token_logprobs` for the default `logprob_start_len`, `[logprob, id, text]` per output
/// token, `output_top_logprobs` with `top_logprobs_num`), the same values as the completions
/// endpoint's for the same greedy request, cumulative in a stream as SGLang streams it; a start
/// inside the prompt is refused (prompt log-probabilities are not computed yet).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_returns_sglangs_logprob_fields() {
    let Some(s) = start("").await else { return };
    let generate = format!("{}/generate", s.url);
    let body = |stream: bool| {
        json!({ "text": "The capital of France is", "stream": stream, "return_logprob": true,
                "top_logprobs_num": 2, "return_text_in_logprobs": true,
                "sampling_params": { "max_new_tokens": 5, "temperature": 0 } })
    };
    let whole = post(&generate, body(false)).await.json();
    let meta = &whole["meta_info"];
    assert_eq!(meta["input_token_logprobs"], json!([]), "{meta}");
    assert_eq!(meta["input_top_logprobs"], json!([]), "{meta}");
    let out = meta["output_token_logprobs"]
        .as_array()
        .expect("list")
        .clone();
    assert_eq!(out.len(), 5);
    assert_eq!(meta["output_token_logprobs_length"], json!(5));
    let tops = meta["output_top_logprobs"].as_array().expect("list");
    let mut text = String::new();
    for (o, top) in out.iter().zip(tops) {
        let (lp, id, t) = (&o[0], &o[1], o[2].as_str().expect("text asked for"));
        text.push_str(t);
        assert_eq!(top.as_array().map(Vec::len), Some(2), "{top}");
        // Greedy: the chosen token is the most likely.
        assert_eq!((&top[0][0], &top[0][1]), (lp, id), "{top}");
    }
    assert_eq!(text, whole["text"].as_str().expect("text"));
    // The completions endpoint's log-probabilities for the same request.
    let c = post(
        &format!("{}/v1/completions", s.url),
        json!({ "model": MODEL, "prompt": "The capital of France is", "max_tokens": 5,
                "temperature": 0, "logprobs": 2 }),
    )
    .await
    .json();
    let lps: Vec<f64> = out.iter().filter_map(|o| o[0].as_f64()).collect();
    assert_eq!(
        json!(lps),
        c["choices"][0]["logprobs"]["token_logprobs"],
        "the same decode"
    );
    // Streamed: each event's lists are cumulative; the last one is the whole answer's.
    let a = post(&generate, body(true)).await;
    let events = a.objects(true);
    let last = events.last().expect("events");
    assert_eq!(last["meta_info"]["output_token_logprobs"], json!(out));
    // Without texts, the third entry is null; without `return_logprob` nothing is added.
    let mut plain = body(false);
    plain["return_text_in_logprobs"] = json!(false);
    let m = post(&generate, plain).await.json();
    assert!(
        m["meta_info"]["output_token_logprobs"][0][2].is_null(),
        "{m}"
    );
    let mut off = body(false);
    off["return_logprob"] = json!(false);
    let m = post(&generate, off).await.json();
    assert!(m["meta_info"].get("output_token_logprobs").is_none(), "{m}");
    for (k, v, code) in [
        ("logprob_start_len", json!(-3), "invalid_request"),
        ("top_logprobs_num", json!(21), "invalid_request"),
    ] {
        let mut b = body(false);
        b[k] = v;
        let a = TestClient::default()
            .post(&generate, &b, Duration::from_secs(10))
            .await;
        assert_eq!(
            (a.status, a.error_code().as_deref()),
            (400, Some(code)),
            "{k}"
        );
    }
    s.wait_released().await;
}

/// A completion with `echo` repeats its prompt before its text (vLLM's shape: the whole answer's
/// text, and a stream's first event); a token-id prompt is repeated as its text; a bad `echo` is
/// refused by name (`echo` with `logprobs` on other backends than the embedded engine: in
/// `admission_and_input.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_repeats_the_prompt_and_refuses_a_bad_value() {
    let Some(s) = start("").await else { return };
    let url = format!("{}/v1/completions", s.url);
    let prompt = "The capital of France is";
    let body = |echo: bool, stream: bool| {
        json!({ "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                "echo": echo, "stream": stream })
    };
    let text = |v: &Value| {
        v["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    let plain = text(&post(&url, body(false, false)).await.json());
    let echoed = text(&post(&url, body(true, false)).await.json());
    assert_eq!(echoed, format!("{prompt}{plain}"));
    let events = post(&url, body(true, true)).await.objects(true);
    let streamed: String = events.iter().map(text).collect();
    assert_eq!(streamed, echoed);
    assert!(text(&events[0]).starts_with(prompt), "{events:?}");
    // Token ids in: their text is repeated.
    let ids = json!({ "model": MODEL, "prompt": [504, 3575, 282, 4649, 314], "max_tokens": 4,
                      "temperature": 0, "echo": true });
    assert_eq!(text(&post(&url, ids).await.json()), echoed);
    for (extra, code) in [(json!({"echo": "yes"}), "invalid_request")] {
        let mut b = body(false, false);
        for (k, v) in extra.as_object().expect("object") {
            b[k] = v.clone();
        }
        let a = TestClient::default()
            .post(&url, &b, Duration::from_secs(10))
            .await;
        assert_eq!(
            (a.status, a.error_code().as_deref()),
            (400, Some(code)),
            "{extra}"
        );
        assert_eq!(a.json()["error"]["param"], json!("echo"), "{extra}");
    }
    s.wait_released().await;
}

/// Completions' `echo` with `logprobs` (how evaluation harnesses score a text): every prompt
/// token comes back before the answer's, the first with a `null` log-probability and
/// alternatives (as OpenAI and vLLM return it), the others scored; the tokens spell the prompt
/// and the answer; the same streamed and not, and from split and unified engines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_with_logprobs_scores_the_prompt() {
    let prompt = "The capital of France is";
    let mut runs: Vec<Vec<(String, f64, Vec<String>)>> = Vec::new();
    for mode in ["split", "unified"] {
        let Some(s) = start(&format!("mode = \"{mode}\"")).await else {
            return;
        };
        for stream in [false, true] {
            let body = json!({ "model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                               "echo": true, "logprobs": 2, "stream": stream,
                               "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null } });
            let a = post(&format!("{}/v1/completions", s.url), body).await;
            let objects = a.objects(stream);
            let lp: Vec<&Value> = objects
                .iter()
                .filter_map(|o| o.pointer("/choices/0/logprobs").filter(|v| !v.is_null()))
                .collect();
            let list = |k: &str| -> Vec<Value> {
                lp.iter()
                    .flat_map(|l| l[k].as_array().cloned().unwrap_or_default())
                    .collect()
            };
            let (tokens, values, tops) =
                (list("tokens"), list("token_logprobs"), list("top_logprobs"));
            let text: String = objects
                .iter()
                .filter_map(|o| o.pointer("/choices/0/text").and_then(Value::as_str))
                .collect();
            let usage = objects
                .iter()
                .rev()
                .find_map(|o| o.get("usage").filter(|u| !u.is_null()))
                .expect("usage");
            let n = (usage["prompt_tokens"].as_u64().expect("n")
                + usage["completion_tokens"].as_u64().expect("n")) as usize;
            let case = format!("{mode} stream={stream}: {}", a.body);
            assert_eq!(
                (tokens.len(), values.len(), tops.len()),
                (n, n, n),
                "{case}"
            );
            let spelled: String = tokens.iter().filter_map(Value::as_str).collect();
            assert_eq!(spelled, text, "{case}");
            assert!(text.starts_with(prompt), "{case}");
            assert!(values[0].is_null() && tops[0].is_null(), "{case}");
            let mut run = Vec::new();
            for i in 1..n {
                let v = values[i].as_f64().expect("a value");
                assert!(v <= 0.0, "{case}");
                let mut alts: Vec<String> = tops[i]
                    .as_object()
                    .expect("a map")
                    .keys()
                    .cloned()
                    .collect();
                alts.sort();
                assert!((1..=3).contains(&alts.len()), "{case}");
                run.push((tokens[i].as_str().unwrap_or_default().to_string(), v, alts));
            }
            runs.push(run);
        }
        s.wait_released().await;
    }
    for r in &runs[1..] {
        assert_eq!(r.len(), runs[0].len());
        for (a, b) in r.iter().zip(&runs[0]) {
            assert_eq!((&a.0, &a.2), (&b.0, &b.2));
            assert!((a.1 - b.1).abs() < 1e-3, "{a:?} {b:?}");
        }
    }
}

/// `/generate` with `logprob_start_len` (SGLang's prompt log-probabilities): the prompt's tokens
/// from that position as `[logprob, id, text]`, the first `null` as SGLang sends it, the values
/// the same as completions' `echo` gives; past the prompt, a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_returns_the_prompt_from_logprob_start_len() {
    let Some(s) = start("").await else { return };
    let prompt = "The capital of France is";
    let echo = post(
        &format!("{}/v1/completions", s.url),
        json!({ "model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": true,
                "logprobs": 2 }),
    )
    .await
    .json();
    let n = echo["usage"]["prompt_tokens"].as_u64().expect("n") as usize;
    let values = echo["choices"][0]["logprobs"]["token_logprobs"].clone();
    for (start_len, stream) in [(0usize, false), (2, false), (0, true)] {
        let a = post(
            &format!("{}/generate", s.url),
            json!({ "text": prompt, "return_logprob": true, "logprob_start_len": start_len,
                    "top_logprobs_num": 2, "stream": stream,
                    "sampling_params": {"max_new_tokens": 1, "temperature": 0} }),
        )
        .await;
        let last = a.objects(stream).pop().expect("an answer");
        let meta = &last["meta_info"];
        let input = meta["input_token_logprobs"].as_array().expect("input");
        let tops = meta["input_top_logprobs"].as_array().expect("tops");
        let case = format!("start {start_len} stream {stream}: {meta}");
        assert_eq!(
            (input.len(), tops.len()),
            (n - start_len, n - start_len),
            "{case}"
        );
        assert!(input[0][0].is_null() && tops[0].is_null(), "{case}");
        for (i, e) in input.iter().enumerate().skip(1) {
            let want = values[start_len + i].as_f64().expect("a value");
            let got = e[0].as_f64().expect("a value");
            assert!((got - want).abs() < 1e-4, "{case}: {got} {want}");
            assert_eq!(tops[i].as_array().map(Vec::len), Some(2), "{case}");
        }
    }
    let a = TestClient::default()
        .post(
            &format!("{}/generate", s.url),
            &json!({ "text": prompt, "return_logprob": true, "logprob_start_len": 999,
                     "sampling_params": {"max_new_tokens": 1} }),
            Duration::from_secs(10),
        )
        .await;
    assert_eq!(
        (a.status, a.error_code().as_deref()),
        (400, Some("invalid_request")),
        "{}",
        a.body
    );
    s.wait_released().await;
}
