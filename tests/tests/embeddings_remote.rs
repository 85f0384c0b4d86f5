//! `/v1/embeddings` from SGLang and vLLM embedding workers (`[models.embed]`), through the mock
//! that follows both servers' released source (`tests/src/embed_mock.rs`): lockstep tokenizes
//! each input as the servers do (special tokens added), sends the ids, and returns the worker's
//! vectors only when the answer is provably the answer to what it sent; an embeddings model
//! answers nothing else, and a generation model no embeddings.

use std::time::Duration;

use base64::Engine as _;
use lockstep_core::config::Config;
use lockstep_router::app::Lockstep;
use lockstep_tests::client::{Answer, TestClient};
use lockstep_tests::embed_mock::{EmbedFault, EmbedMock, EmbedMockConfig, Flavor, mock_vector};
use lockstep_tests::harness::{Stack, TEST_TIMEOUTS};
use lockstep_tests::tokenizer;
use serde_json::{Value, json};

const MODEL: &str = "embedder";

struct Remote {
    mock: EmbedMock,
    lockstep: Lockstep,
    _dir: tempfile::TempDir,
}

fn config(mock: &EmbedMock, tok: &std::path::Path, backend: &str) -> String {
    format!(
        r#"
[server]
http_listen = "127.0.0.1:0"

[[models]]
name = "{MODEL}"
backend = "{backend}"
context_window = 64
kv_capacity_tokens = 64
tokenizer = "{tok}"

[models.embed]
workers = [{{ url = "{url}" }}]
"#,
        tok = tok.display(),
        url = mock.url()
    )
}

async fn start(cfg: EmbedMockConfig) -> Remote {
    let backend = match cfg.flavor {
        Flavor::Sglang => "sglang",
        Flavor::Vllm => "vllm",
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let tok = dir.path().join("tokenizer.json");
    let t = tokenizer::build_embedding();
    std::fs::write(&tok, t.to_string(true).expect("json")).expect("write");
    let mock = EmbedMock::start(cfg, t).await.expect("mock starts");
    let cfg = Config::parse(&config(&mock, &tok, backend)).expect("parses");
    assert!(cfg.problems().is_empty(), "{:?}", cfg.problems());
    let lockstep = Lockstep::start(cfg).await.expect("lockstep starts");
    Remote {
        mock,
        lockstep,
        _dir: dir,
    }
}

impl Remote {
    async fn post(&self, path: &str, body: Value) -> Answer {
        TestClient::default()
            .post(
                &format!("http://{}{path}", self.lockstep.http_addr),
                &body,
                Duration::from_secs(10),
            )
            .await
    }
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("list")
        .iter()
        .map(|x| x.as_f64().expect("number") as f32)
        .collect()
}

fn same(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-6)
}

/// The ids the `tokenizers` Python package gives each fixture text with the special tokens
/// (`tests/fixtures/embedding_ids.json`, from `tests/python/embedding_ids.py`): not the Rust
/// crate lockstep tokenizes with, so a mistake both Rust sides share cannot pass.
fn python_ids() -> std::collections::HashMap<String, Vec<u32>> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/embedding_ids.json");
    let f: Value = serde_json::from_str(&std::fs::read_to_string(path).expect("fixture"))
        .expect("fixture JSON");
    let ours: Value =
        serde_json::from_str(&tokenizer::build_embedding().to_string(false).expect("json"))
            .expect("tokenizer JSON");
    assert_eq!(
        f["tokenizer"], ours,
        "the fixture was made from another tokenizer: rerun tests/python/embedding_ids.py"
    );
    f["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| {
            let ids = c["ids"].as_array().expect("ids").iter();
            (
                c["text"].as_str().expect("text").to_string(),
                ids.map(|x| x.as_u64().expect("id") as u32).collect(),
            )
        })
        .collect()
}

/// Both servers' shapes: texts are tokenized with the model's special tokens (what SGLang and
/// vLLM do), sent as ids with `encoding_format: float`; the vectors are the worker's, in order,
/// in either encoding; the usage counts lockstep's tokens, which the worker's must equal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_vectors_come_back_for_the_ids_lockstep_sent() {
    let fixture = python_ids();
    for flavor in [Flavor::Sglang, Flavor::Vllm] {
        let r = start(EmbedMockConfig {
            flavor,
            ..EmbedMockConfig::default()
        })
        .await;
        let texts = ["red green blue", "the cat sat"];
        let ids: Vec<Vec<u32>> = texts.iter().map(|t| fixture[*t].clone()).collect();
        assert_eq!(ids[0].len(), 5, "three words and two special tokens");
        let a = r
            .post("/v1/embeddings", json!({"model": MODEL, "input": texts}))
            .await;
        assert_eq!(a.status, 200, "{flavor:?}: {}", a.body);
        let v = a.json();
        assert_eq!(v["model"], MODEL);
        assert_eq!(
            v["usage"]["prompt_tokens"],
            ids.iter().map(Vec::len).sum::<usize>()
        );
        for (i, want) in ids.iter().enumerate() {
            assert_eq!(v["data"][i]["index"], i);
            assert!(same(
                &floats(&v["data"][i]["embedding"]),
                &mock_vector(want, 8)
            ));
        }
        let sent = r.mock.requests().pop().expect("a request");
        assert_eq!(sent["input"], json!(ids), "ids with the special tokens");
        assert_eq!(sent["encoding_format"], "float");
        // Token ids pass as they are; base64 is encoded by lockstep from the floats.
        let b = r
            .post(
                "/v1/embeddings",
                json!({"model": MODEL, "input": [5, 6, 7], "encoding_format": "base64"}),
            )
            .await;
        assert_eq!(b.status, 200, "{}", b.body);
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b.json()["data"][0]["embedding"].as_str().expect("text"))
            .expect("base64");
        let got: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert!(same(&got, &mock_vector(&[5, 6, 7], 8)));
    }
}

/// An answer that is not provably the answer to what was sent is a 502 `embedding_failed`:
/// another token count, a missing entry, indexes out of order, vectors of two lengths, a
/// failing worker. A worker's own 400 is the caller's 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_lockstep_cannot_verify_is_an_error() {
    let r = start(EmbedMockConfig::default()).await;
    let body = json!({"model": MODEL, "input": ["red green", "blue"]});
    assert_eq!(r.post("/v1/embeddings", body.clone()).await.status, 200);
    for fault in [
        EmbedFault::CountOff,
        EmbedFault::DropLast,
        EmbedFault::SwapIndex,
        EmbedFault::ShortVector,
        EmbedFault::Status(500),
    ] {
        r.mock.set_fault(Some(fault));
        let a = r.post("/v1/embeddings", body.clone()).await;
        assert_eq!(a.status, 502, "{fault:?}: {}", a.body);
        assert_eq!(
            a.error_code().as_deref(),
            Some("embedding_failed"),
            "{}",
            a.body
        );
        assert!(!a.body.contains("\"data\""), "{}", a.body);
    }
    r.mock.set_fault(Some(EmbedFault::Status(400)));
    let a = r.post("/v1/embeddings", body.clone()).await;
    assert_eq!(a.status, 400, "{}", a.body);
    r.mock.set_fault(None);
    // The server's own refusal of `dimensions` (not a Matryoshka model) reaches the caller.
    let d = r
        .post(
            "/v1/embeddings",
            json!({"model": MODEL, "input": "red", "dimensions": 4}),
        )
        .await;
    assert_eq!(d.status, 400, "{}", d.body);
    assert!(d.body.contains("matryoshka"), "{}", d.body);
}

/// A Matryoshka model's `dimensions` go to the worker, and the answer must have them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dimensions_reach_a_matryoshka_worker() {
    let r = start(EmbedMockConfig {
        matryoshka: true,
        flavor: Flavor::Vllm,
        ..EmbedMockConfig::default()
    })
    .await;
    let a = r
        .post(
            "/v1/embeddings",
            json!({"model": MODEL, "input": ["red", "blue"], "dimensions": 4}),
        )
        .await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        a.json()["data"][1]["embedding"].as_array().map(Vec::len),
        Some(4)
    );
    assert_eq!(r.mock.requests().pop().expect("sent")["dimensions"], 4);
}

/// Bad input is refused before any worker is asked; an embeddings model answers no generation,
/// and a generation model no embeddings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_and_generation_models_refuse_each_others_requests() {
    let r = start(EmbedMockConfig::default()).await;
    let long = "red ".repeat(80);
    for (body, param) in [
        (json!({"model": MODEL, "input": ""}), "input[0]"),
        (json!({"model": MODEL, "input": ["red", long]}), "input[1]"),
        (
            json!({"model": MODEL, "input": [[1, 2], [1_000_000]]}),
            "input[1]",
        ),
        (
            json!({"model": MODEL, "input": "red", "encoding_format": "int8"}),
            "encoding_format",
        ),
        (
            json!({"model": MODEL, "input": "red", "dimensions": 0}),
            "dimensions",
        ),
    ] {
        let a = r.post("/v1/embeddings", body.clone()).await;
        assert_eq!(a.status, 400, "{body}: {}", a.body);
        assert_eq!(a.json()["error"]["param"], param, "{body}: {}", a.body);
    }
    assert!(r.mock.requests().is_empty(), "no worker asked");
    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": "red"}]}),
        ),
        ("/v1/completions", json!({"model": MODEL, "prompt": "red"})),
    ] {
        let a = r.post(path, body).await;
        assert_eq!(a.status, 400, "{}", a.body);
        assert_eq!(a.json()["error"]["param"], "model");
        assert!(a.body.contains("embeddings model"), "{}", a.body);
    }
    let pd = Stack::start_with(Default::default(), "", TEST_TIMEOUTS).await;
    let a = pd
        .post(
            "/v1/embeddings",
            json!({"model": lockstep_tests::harness::MODEL, "input": "red"}),
        )
        .await;
    assert_eq!(a.status, 400, "{}", a.body);
    assert_eq!(a.json()["error"]["param"], "model");
}

/// The configuration keeps an embeddings model to its kind: SGLang or vLLM workers, no pair
/// workers beside them.
#[test]
fn an_embeddings_model_has_embedding_workers_only() {
    let base = |backend: &str, extra: &str| {
        format!(
            r#"
[[models]]
name = "e"
backend = "{backend}"
context_window = 64
kv_capacity_tokens = 64
tokenizer = "{tok}"
{extra}
[models.embed]
workers = [{{ url = "http://127.0.0.1:9" }}]
"#,
            tok = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/mock-tokenizer.json")
        )
    };
    let ok = Config::parse(&base("vllm", "")).expect("parses");
    assert!(ok.problems().is_empty(), "{:?}", ok.problems());
    for (backend, extra, key) in [
        (
            "sglang",
            "[models.prefill]\nworkers = [{ url = \"http://127.0.0.1:8\", bootstrap_port = 1 }]\n",
            "prefill",
        ),
        ("lockstep", "", "embed"),
    ] {
        let cfg = Config::parse(&base(backend, extra)).expect("parses");
        let problems = format!("{:?}", cfg.problems());
        assert!(problems.contains(key), "{backend}: {problems}");
    }
}

/// A worker that cannot be reached (nothing was sent) is passed over for another, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_worker_is_passed_over() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tok = dir.path().join("tokenizer.json");
    let t = tokenizer::build_embedding();
    std::fs::write(&tok, t.to_string(true).expect("json")).expect("write");
    let mock = EmbedMock::start(EmbedMockConfig::default(), t)
        .await
        .expect("mock starts");
    // A port nothing listens on: bound, then closed.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr");
    let text = config(&mock, &tok, "sglang").replace(
        &format!("workers = [{{ url = \"{}\" }}]", mock.url()),
        &format!(
            "workers = [{{ url = \"http://{dead}\" }}, {{ url = \"{}\" }}]",
            mock.url()
        ),
    );
    let lockstep = Lockstep::start(Config::parse(&text).expect("parses"))
        .await
        .expect("starts");
    for _ in 0..4 {
        let a = TestClient::default()
            .post(
                &format!("http://{}/v1/embeddings", lockstep.http_addr),
                &json!({"model": MODEL, "input": "red"}),
                Duration::from_secs(10),
            )
            .await;
        assert_eq!(a.status, 200, "{}", a.body);
    }
    assert_eq!(mock.requests().len(), 4);
}

/// The official openai package (base64 by default), langchain-openai and litellm read the
/// workers' vectors through lockstep, for both servers' shapes
/// (`tests/python/embeddings_clients.py`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_clients_read_the_workers_embeddings() {
    let Some(python) = lockstep_tests::client::clients_python() else {
        return;
    };
    for flavor in [Flavor::Sglang, Flavor::Vllm] {
        let r = start(EmbedMockConfig {
            flavor,
            ..EmbedMockConfig::default()
        })
        .await;
        lockstep_tests::client::run_python_checks_in(
            &python,
            "embeddings_clients.py",
            &format!("http://{}", r.lockstep.http_addr),
            MODEL,
            &[("LOCKSTEP_EMBED_DIM", "8")],
            Duration::from_secs(120),
            "all embedding client checks passed",
        )
        .await;
    }
}

/// The mock refuses what SGLang 0.5.23's `_validate_request` refuses (so it is never friendlier
/// than the server): whitespace-only text, a negative token id, mixed lists, another encoding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mock_refuses_what_sglang_refuses() {
    let mock = EmbedMock::start(EmbedMockConfig::default(), tokenizer::build_embedding())
        .await
        .expect("mock starts");
    for (input, says) in [
        (json!("   "), "empty or whitespace only"),
        (json!(["red", " "]), "Input at index 1"),
        (json!(["red", 5]), "must be strings"),
        (json!([5, -1]), "Token ID at index 1 must be non-negative"),
        (json!([5, "x"]), "must be integers"),
        (json!([]), "Input cannot be empty"),
    ] {
        let a = TestClient::default()
            .post(
                &format!("{}/v1/embeddings", mock.url()),
                &json!({"input": input}),
                Duration::from_secs(5),
            )
            .await;
        assert_eq!(a.status, 400, "{input}: {}", a.body);
        assert!(a.body.contains(says), "{input}: {}", a.body);
    }
    let a = TestClient::default()
        .post(
            &format!("{}/v1/embeddings", mock.url()),
            &json!({"input": "red", "encoding_format": "int8"}),
            Duration::from_secs(5),
        )
        .await;
    assert_eq!(a.status, 400, "{}", a.body);
}

/// Whitespace-only text is embedded on both backends: lockstep sends its ids (the special
/// tokens alone, as Python's tokenizer gives them), which SGLang takes as ids and vLLM as it
/// takes any text; the empty text stays refused by lockstep (OpenAI's rule), before any worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whitespace_text_is_embedded_as_the_servers_embed_it() {
    let fixture = python_ids();
    for flavor in [Flavor::Sglang, Flavor::Vllm] {
        let r = start(EmbedMockConfig {
            flavor,
            ..EmbedMockConfig::default()
        })
        .await;
        for text in ["   ", " red\tgreen\n"] {
            let a = r
                .post("/v1/embeddings", json!({"model": MODEL, "input": text}))
                .await;
            assert_eq!(a.status, 200, "{flavor:?} {text:?}: {}", a.body);
            let want = &fixture[text];
            assert_eq!(
                r.mock.requests().pop().expect("sent")["input"],
                json!([want])
            );
            assert!(same(
                &floats(&a.json()["data"][0]["embedding"]),
                &mock_vector(want, 8)
            ));
            assert_eq!(a.json()["usage"]["prompt_tokens"], want.len());
        }
        let before = r.mock.requests().len();
        let a = r
            .post("/v1/embeddings", json!({"model": MODEL, "input": ""}))
            .await;
        assert_eq!(a.status, 400, "{}", a.body);
        assert_eq!(r.mock.requests().len(), before, "refused before any worker");
    }
}

/// The vLLM-flavoured mock answers what vLLM 0.33 answers: any text is embedded, whitespace and
/// the empty text included, with the ids Python's tokenizer gives; an empty list, an id outside
/// the vocabulary (negative too), an empty id list and a mixed list are 400s in vLLM's
/// `{"error": {...}}` shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_vllm_mock_answers_what_vllm_answers() {
    let fixture = python_ids();
    let mock = EmbedMock::start(
        EmbedMockConfig {
            flavor: Flavor::Vllm,
            ..EmbedMockConfig::default()
        },
        tokenizer::build_embedding(),
    )
    .await
    .expect("mock starts");
    let post = |input: Value| {
        let url = format!("{}/v1/embeddings", mock.url());
        async move {
            TestClient::default()
                .post(&url, &json!({"input": input}), Duration::from_secs(5))
                .await
        }
    };
    for text in ["   ", "", " red\tgreen\n"] {
        let a = post(json!(text)).await;
        assert_eq!(a.status, 200, "{text:?}: {}", a.body);
        assert_eq!(a.json()["usage"]["prompt_tokens"], fixture[text].len());
        assert!(same(
            &floats(&a.json()["data"][0]["embedding"]),
            &mock_vector(&fixture[text], 8)
        ));
    }
    let vocab = tokenizer::build_embedding().get_vocab_size(true);
    for (input, says) in [
        (json!([]), "You must pass at least one prompt".to_string()),
        (
            json!([5, -1]),
            "Token id -1 is out of vocabulary".to_string(),
        ),
        (
            json!([[5], [vocab]]),
            format!("Token id {vocab} is out of vocabulary"),
        ),
        (
            json!([[5], []]),
            "The decoder prompt cannot be empty".to_string(),
        ),
        (json!(["red", 5]), "validation error".to_string()),
    ] {
        let a = post(input.clone()).await;
        assert_eq!(a.status, 400, "{input}: {}", a.body);
        assert_eq!(a.json()["error"]["code"], 400, "vLLM's shape: {}", a.body);
        let message = a.json()["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(message.contains(&says), "{input}: {}", a.body);
    }
}
