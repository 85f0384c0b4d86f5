//! The tokenizer endpoints (`/tokenize`, `/detokenize`, `/tokenizer_info`, vLLM 0.33's shapes
//! with llama.cpp's request forms): on the real SmolLM2 model every id and text is llama.cpp's
//! (`gpu-engine/tests/fixtures/smollm2_tokens.json`, from llama-cpp-python), a chat is rendered
//! by the model's template as generation renders it, lm-evaluation-harness's `RemoteTokenizer`
//! reads them; a field lockstep cannot honour is a 400 naming it, and keys and limits apply.

use std::time::Duration;

use lockstep_tenancy::tenant::key_hash_hex;
use lockstep_tests::client::{self, Answer, TestClient};
use lockstep_tests::embedded;
use lockstep_tests::harness::{MODEL, Stack, TEST_TIMEOUTS};
use lockstep_tests::sglang_mock::MockConfig;
use serde_json::{Value, json};

fn fixture_path() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../gpu-engine/tests/fixtures/smollm2_tokens.json")
}

fn fixture() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture_path()).expect("fixture"))
        .expect("fixture JSON")
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().expect("id"))
        .collect()
}

async fn get(url: &str) -> Answer {
    TestClient::default()
        .get(url, Duration::from_secs(20))
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_agrees_with_llama_cpp_on_the_real_model() {
    let Some(e) = embedded::start("").await else {
        return;
    };
    let f = fixture();
    for p in f["prompts"].as_array().expect("prompts") {
        let want = ids(&p["ids"]);
        // vLLM's form (no special tokens asked), and llama.cpp's (none by default).
        for body in [
            json!({"prompt": p["text"], "add_special_tokens": false}),
            json!({"content": p["text"]}),
        ] {
            let a = e.post("/tokenize", body.clone()).await;
            assert_eq!(a.status, 200, "{body}: {}", a.body);
            let v = a.json();
            assert_eq!(ids(&v["tokens"]), want, "{}", p["text"]);
            assert_eq!(v["count"], want.len());
            assert_eq!(v["max_model_len"], 512);
        }
        let a = e.post("/detokenize", json!({"tokens": want})).await;
        assert_eq!(a.status, 200, "{}", a.body);
        assert_eq!(a.json()["prompt"], p["text"]);
        assert_eq!(a.json()["content"], p["text"], "llama.cpp's field");
    }
    // Token strings: the vocabulary's entries (byte-level: `Ġ` for a space).
    let a = e
        .post(
            "/tokenize",
            json!({"prompt": "Hello, world", "return_token_strs": true}),
        )
        .await;
    assert_eq!(
        a.json()["token_strs"],
        json!(["Hello", ",", "Ġworld"]),
        "{}",
        a.body
    );
    // A chat, rendered by the model's template exactly as generation renders it.
    for c in f["chats"].as_array().expect("chats") {
        let a = e
            .post("/tokenize", json!({"messages": c["messages"]}))
            .await;
        assert_eq!(a.status, 200, "{}", a.body);
        assert_eq!(ids(&a.json()["tokens"]), ids(&c["ids"]));
        // And the prompt a chat completion of those messages counts is that one.
        let g = e
            .post(
                "/v1/chat/completions",
                json!({"model": embedded::MODEL, "messages": c["messages"], "max_tokens": 1}),
            )
            .await;
        assert_eq!(g.status, 200, "{}", g.body);
        assert_eq!(g.json()["usage"]["prompt_tokens"], ids(&c["ids"]).len());
    }
    let info = get(&format!("{}/tokenizer_info", e.url)).await;
    assert_eq!(info.status, 200, "{}", info.body);
    let v = info.json();
    assert_eq!(v["eos_token"], "<|im_end|>");
    assert_eq!(v["model_max_length"], 512);
    assert!(
        v["chat_template"]
            .as_str()
            .is_some_and(|t| t.contains("<|im_start|>")),
        "{v}"
    );
    e.wait_released().await;
}

/// lm-evaluation-harness 0.4.13's `RemoteTokenizer` (`tokenizer_backend=remote`) reads lockstep:
/// ids, texts and the chat template are llama.cpp's (`tests/python/lm_eval_tokenizer.py`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lm_evaluation_harness_reads_the_tokenizer_through_lockstep() {
    let Some(e) = embedded::start("").await else {
        return;
    };
    let has = std::process::Command::new(client::python())
        .args(["-c", "import lm_eval.utils"])
        .status()
        .is_ok_and(|s| s.success());
    if !has {
        assert!(
            std::env::var_os("LOCKSTEP_REQUIRE_LM_EVAL").is_none(),
            "lm-eval is required (pip install --no-deps lm-eval==0.4.13)"
        );
        eprintln!("skipped: no lm-eval (pip install --no-deps lm-eval==0.4.13)");
        return;
    }
    let fixture = fixture_path();
    client::run_python_checks_with(
        "lm_eval_tokenizer.py",
        &e.url,
        embedded::MODEL,
        &[("LOCKSTEP_TOKEN_FIXTURE", &fixture.display().to_string())],
        Duration::from_secs(120),
        "lm-eval remote tokenizer checks passed",
    )
    .await;
}

async fn send(stack: &Stack, key: &str, path: &str, body: Value) -> Answer {
    TestClient::default()
        .send_with(
            "POST",
            &format!("{}{path}", stack.url),
            &[("authorization", &format!("Bearer {key}"))],
            body.to_string(),
            Duration::from_secs(10),
        )
        .await
}

/// What `/tokenize` cannot honour is a 400 naming the field (never dropped); the tenant's key,
/// its models and its request rate apply to all three endpoints.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_cannot_be_honoured_is_refused_and_keys_and_limits_apply() {
    let tenants = format!(
        "\n[[tenants]]\nname = \"acme\"\napi_keys_sha256 = [\"{}\"]\n\
         \n[[tenants]]\nname = \"elsewhere\"\napi_keys_sha256 = [\"{}\"]\nmodels = []\n\
         \n[[tenants]]\nname = \"slow\"\napi_keys_sha256 = [\"{}\"]\nrequests_per_second = 1\nburst = 1\n",
        key_hash_hex("acme-key"),
        key_hash_hex("elsewhere-key"),
        key_hash_hex("slow-key"),
    );
    let stack = Stack::start_full(MockConfig::default(), &tenants, "", TEST_TIMEOUTS).await;
    let ok = send(
        &stack,
        "acme-key",
        "/tokenize",
        json!({"prompt": "red green"}),
    )
    .await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    let n = ok.json()["count"].as_u64().expect("count");
    assert!(n >= 2, "{}", ok.body);
    for (body, param) in [
        (
            json!({"prompt": "red", "chat_template": "{{ x }}"}),
            "chat_template",
        ),
        (
            json!({"messages": [{"role": "user", "content": "red"}], "add_generation_prompt": false}),
            "add_generation_prompt",
        ),
        (
            json!({"messages": [{"role": "user", "content": "red"}], "continue_final_message": true}),
            "continue_final_message",
        ),
        (
            json!({"messages": [{"role": "user", "content": "red"}], "add_special_tokens": true}),
            "add_special_tokens",
        ),
        (
            json!({"messages": [{"role": "user", "content": "red"}], "tools": [{"type": "function"}]}),
            "tools",
        ),
        (json!({"prompt": "red", "mystery": 1}), "mystery"),
        (
            json!({"prompt": "red", "messages": [{"role": "user", "content": "red"}]}),
            "prompt",
        ),
        (
            json!({"content": "red", "with_pieces": true}),
            "with_pieces",
        ),
        (
            json!({"prompt": "red", "add_special_tokens": true, "add_special": false}),
            "add_special",
        ),
    ] {
        let a = send(&stack, "acme-key", "/tokenize", body.clone()).await;
        assert_eq!(a.status, 400, "{body}: {}", a.body);
        assert_eq!(a.json()["error"]["param"], param, "{body}: {}", a.body);
    }
    let a = send(
        &stack,
        "acme-key",
        "/detokenize",
        json!({"tokens": [1, -1]}),
    )
    .await;
    assert_eq!(a.status, 400, "{}", a.body);
    assert!(
        a.body.contains("Token id -1 is out of vocabulary"),
        "{}",
        a.body
    );
    let a = send(
        &stack,
        "acme-key",
        "/detokenize",
        json!({"tokens": [1], "skip_special_tokens": true}),
    )
    .await;
    assert_eq!(a.status, 400, "{}", a.body);
    // No key, a wrong one: 401 on every endpoint, the body never read.
    for path in ["/tokenize", "/detokenize"] {
        for key in ["", "wrong-key"] {
            let a = send(&stack, key, path, json!({"prompt": "red"})).await;
            assert_eq!(a.status, 401, "{path} {key:?}: {}", a.body);
        }
    }
    let a = get(&format!("{}/tokenizer_info", stack.url)).await;
    assert_eq!(a.status, 401, "{}", a.body);
    // A tenant that may not use the model does not see it.
    let a = send(
        &stack,
        "elsewhere-key",
        "/tokenize",
        json!({"model": MODEL, "prompt": "red"}),
    )
    .await;
    assert!(matches!(a.status, 403 | 404), "{} {}", a.status, a.body);
    // The tenant's request rate counts these requests too.
    let first = send(&stack, "slow-key", "/tokenize", json!({"prompt": "red"})).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let second = send(&stack, "slow-key", "/detokenize", json!({"tokens": [1]})).await;
    assert_eq!(second.status, 429, "{}", second.body);
    assert_eq!(
        stack.mock.request_count(),
        0,
        "no worker is asked to tokenize"
    );
}
