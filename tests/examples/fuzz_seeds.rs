//! Writes a few well-formed seed inputs for every fuzz target into `DIR/TARGET/` (what
//! `bench/fuzz.sh` starts a new corpus from): a small llama GGUF, a KV set on the wire, worker
//! messages, a data-listener push, SSE and upstream JSON answers, request bodies, chat turns.
//!
//! ```text
//! cargo run -p lockstep-tests --example fuzz_seeds -- fuzz/corpus
//! ```

use std::path::Path;

use lockstep_engine::pool::KvDtype;
use lockstep_engine::transfer::{KvManifest, KvTransfer, ModelFingerprint, PageData, wire};
use lockstep_proto::v1 as pb;
use prost::Message;

fn write(dir: &Path, target: &str, name: &str, bytes: &[u8]) {
    let d = dir.join(target);
    std::fs::create_dir_all(&d).expect("corpus folder");
    std::fs::write(d.join(format!("seed-{name}")), bytes).expect("write seed");
}

fn kv_set() -> KvTransfer {
    let pages: Vec<PageData> = (0..2)
        .map(|i| PageData {
            index: i,
            pair_id: 7,
            bytes: vec![i as u8; 64].into(),
        })
        .collect();
    let mut m = KvManifest {
        pair_id: 7,
        model: ModelFingerprint(3),
        tokens: 20,
        page_size: 16,
        dtype: KvDtype::F16,
        page_count: 2,
        page_checksums: pages
            .iter()
            .map(|p| xxhash_rust::xxh3::xxh3_64(&p.bytes))
            .collect(),
        manifest_checksum: 0,
    };
    m.manifest_checksum = m.compute_checksum();
    KvTransfer {
        manifest: m,
        pages,
        prompt_logprobs: None,
    }
}

fn main() {
    let dir = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "fuzz/corpus".into());
    let dir = Path::new(&dir);
    let tiny = lockstep_engine::synthetic::tiny_shape();
    write(
        dir,
        "gguf",
        "tiny-llama",
        &lockstep_engine::synthetic::llama_gguf(&tiny, 1),
    );

    let t = kv_set();
    write(dir, "kv_transfer", "two-pages", &t.to_bytes());

    let mut push = vec![0u8; 32];
    push.extend(wire::head(&t.manifest, 2));
    for p in &t.pages {
        push.extend(wire::page_head(p));
        push.extend_from_slice(&p.bytes);
    }
    write(dir, "data_stream", "two-pages", &push);

    let prefill = pb::PrefillRequest {
        pair_id: 7,
        input_ids: vec![1, 2, 3],
        decode_endpoint: "https://127.0.0.1:9102".into(),
        cache_salt: Some(5),
        kv_key: vec![1; 32],
        prompt_logprobs: None,
    };
    let decode = pb::DecodeRequest {
        pair_id: 7,
        input_ids: vec![1, 2, 3],
        sampling: Some(pb::Sampling {
            max_tokens: 4,
            stop: vec!["\n".into()],
            ..Default::default()
        }),
        expect_kv: true,
        cache_salt: None,
        kv_key: vec![1; 32],
    };
    let manifest = pb::KvPush {
        item: Some(pb::kv_push::Item::Manifest(pb::KvManifest {
            pair_id: 7,
            model_fingerprint: 3,
            tokens: 20,
            page_size: 16,
            dtype: 1,
            page_count: 2,
            page_checksums: t.manifest.page_checksums.clone(),
            manifest_checksum: t.manifest.manifest_checksum,
            mac: vec![0; 32],
        })),
    };
    for (i, body) in [
        prefill.encode_to_vec(),
        decode.encode_to_vec(),
        manifest.encode_to_vec(),
    ]
    .into_iter()
    .enumerate()
    {
        let mut m = vec![i as u8];
        m.extend(body);
        write(dir, "worker_messages", &format!("kind{i}"), &m);
    }

    write(
        dir,
        "sse",
        "sglang-chunks",
        b"data: {\"text\":\"a\",\"output_ids\":[1],\"meta_info\":{\"id\":\"x\",\"prompt_tokens\":3,\"completion_tokens\":1,\"finish_reason\":null}}\n\n\xffdata: {\"text\":\"ab\"}\r\n\r\ndata: [DONE]\n\n",
    );
    for (name, body) in [
        ("sglang-final", &br#"{"text":"hi","output_ids":[5,6],"meta_info":{"id":"0000000000000000001","prompt_tokens":3,"completion_tokens":2,"cached_tokens":0,"finish_reason":{"type":"length","length":2}}}"#[..]),
        ("sglang-abort", br#"{"text":"","meta_info":{"finish_reason":{"type":"abort","message":"KV checksum mismatch"}}}"#),
        ("vllm-chunk", br#"{"id":"cmpl-1","choices":[{"index":0,"text":"a","finish_reason":null}],"usage":{"prompt_tokens":3,"completion_tokens":1},"kv_transfer_params":{"remote_request_id":"cmpl-x-0"}}"#),
        ("vllm-error", br#"{"object":"error","message":"bad","type":"BadRequestError","code":400}"#),
        ("vllm-metrics", b"vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"100\"} 1.0\n"),
    ] {
        write(dir, "upstream_json", name, body);
    }

    for (i, body) in [
        r#"{"model":"fuzz","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi <|im_start|>"}],"max_tokens":4,"stop":["x"],"stream":true}"#,
        r#"{"model":"fuzz","prompt":"red green","max_tokens":2,"temperature":0,"response_format":{"type":"text"}}"#,
        r#"{"text":"red","sampling_params":{"max_new_tokens":3,"stop":["a"]},"stream":false}"#,
    ]
    .iter()
    .enumerate()
    {
        let mut b = vec![i as u8];
        b.extend_from_slice(body.as_bytes());
        write(dir, "admission", &format!("route{i}"), &b);
    }

    write(
        dir,
        "chat_template",
        "turns",
        b"system\0be brief\0user\0hi <|im_end|>\0assistant\0ok",
    );

    for (name, text) in [
        (
            "prose",
            "\0hello world, it's 12 345 <|im_start|>user naïve  \t\n\n end.  ",
        ),
        (
            "literal",
            "\u{1}<|im_end|> ٣² Ⅻ \u{a0}x\u{3000}中文 e\u{301} 🦀 they're  'S",
        ),
    ] {
        write(dir, "bpe", name, text.as_bytes());
    }
    for (name, target, body) in [
        (
            "tools",
            "responses",
            r#"{"model":"fuzz-tools","instructions":"be brief","input":[{"role":"user","content":"weather?"},{"type":"function_call","call_id":"call_1","name":"get_weather","arguments":"{\"city\":\"x\"}"},{"type":"function_call_output","call_id":"call_1","output":"sunny"}],"tools":[{"type":"function","name":"get_weather","parameters":{"type":"object"}}],"max_output_tokens":4,"stream":true}"#,
        ),
        (
            "format",
            "responses",
            r#"{"model":"fuzz","input":"red green","text":{"format":{"type":"json_schema","name":"x","schema":{"type":"object"}}},"max_output_tokens":2}"#,
        ),
        (
            "system",
            "messages",
            r#"{"model":"fuzz","system":"be brief","messages":[{"role":"user","content":[{"type":"text","text":"hi <|im_start|>"}]}],"max_tokens":4,"stop_sequences":["x"]}"#,
        ),
        (
            "stream",
            "messages",
            r#"{"model":"fuzz","messages":[{"role":"user","content":"red"},{"role":"assistant","content":"green"},{"role":"user","content":"blue"}],"max_tokens":2,"stream":true,"temperature":0}"#,
        ),
    ] {
        write(dir, target, name, body.as_bytes());
    }
    for (i, text) in [
        "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
        "<tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool\u{ff}_call>",
        "<|python_tag|>{\"name\": \"a\", \"parameters\": {\"x\": 1}}; {\"name\": \"f\", \"parameters\": {}}",
        "[TOOL_CALLS] [{\"name\": \"a\", \"arguments\": {\"q\": \"x\"}}]",
    ]
    .iter()
    .enumerate()
    {
        let mut b = vec![i as u8];
        // 0xFF bytes cut the text into stream deltas.
        b.extend(text.bytes().flat_map(|c| if c == b'\n' { vec![0xFF, c] } else { vec![c] }));
        write(dir, "tool_output", &format!("kind{i}"), &b);
    }
    for (i, text) in [
        r#"{"type":"object","properties":{"a":{"type":"array","items":{"anyOf":[{"type":"string","pattern":"^[a-z]{1,8}$"},{"type":"integer"}]}}},"required":["a"]}"#,
        r"(a|b)*c{2,5}[0-9]+",
        r#"start: "<tool_call>" %json {"type":"object"} "</tool_call>""#,
    ]
    .iter()
    .enumerate()
    {
        let mut b = vec![i as u8];
        b.extend_from_slice(text.as_bytes());
        write(dir, "grammar", &format!("kind{i}"), &b);
    }
    println!("seeds written under {}", dir.display());

    // Envoy's ext_proc: request headers with a key, a named prefill and the subset hint.
    {
        use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
        use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as In;
        use envoy_types::pb::envoy::service::ext_proc::v3::{HttpHeaders, ProcessingRequest};
        use envoy_types::pb::google::protobuf::{ListValue, Struct, Value as PbValue, value::Kind};
        let header = |k: &str, v: &str| HeaderValue {
            key: k.into(),
            raw_value: v.as_bytes().to_vec(),
            ..HeaderValue::default()
        };
        let hint = Struct {
            fields: [(
                lockstep_gateway::picker::SUBSET.to_string(),
                PbValue {
                    kind: Some(Kind::ListValue(ListValue {
                        values: vec![PbValue {
                            kind: Some(Kind::StringValue("10.0.0.1:8000".into())),
                        }],
                    })),
                },
            )]
            .into(),
        };
        let msg = ProcessingRequest {
            request: Some(In::RequestHeaders(HttpHeaders {
                headers: Some(HeaderMap {
                    headers: vec![
                        header(":path", "/v1/chat/completions"),
                        header("authorization", "Bearer k"),
                        header("x-prefiller-host-port", "10.0.0.2:8000"),
                    ],
                }),
                end_of_stream: false,
                ..HttpHeaders::default()
            })),
            metadata_context: Some(Metadata {
                filter_metadata: [(lockstep_gateway::picker::SUBSET_NAMESPACE.to_string(), hint)]
                    .into(),
                ..Metadata::default()
            }),
            ..ProcessingRequest::default()
        };
        write(dir, "ext_proc", "request-headers", &msg.encode_to_vec());
    }

    // A KV event publisher's message past the handshake: (topic, seq, msgpack batch) frames, an
    // event as a map (SGLang) and as an array.
    {
        use rmpv::Value as Mp;
        let event_map = Mp::Map(vec![
            (Mp::from("type"), Mp::from("BlockStored")),
            (Mp::from("block_hashes"), Mp::Array(vec![Mp::from(7u64)])),
            (Mp::from("parent_block_hash"), Mp::Nil),
            (
                Mp::from("token_ids"),
                Mp::Array((1..=16u64).map(Mp::from).collect()),
            ),
            (Mp::from("block_size"), Mp::from(16u64)),
            (Mp::from("lora_id"), Mp::Nil),
        ]);
        let event_array = Mp::Array(vec![
            Mp::from("BlockRemoved"),
            Mp::Array(vec![Mp::from(7u64)]),
            Mp::from("GPU"),
        ]);
        for (name, event) in [("map-event", event_map), ("array-event", event_array)] {
            let mut batch = Vec::new();
            rmpv::encode::write_value(
                &mut batch,
                &Mp::Array(vec![Mp::F64(1.0e9), Mp::Array(vec![event])]),
            )
            .expect("encode");
            let mut m = Vec::new();
            for (more, frame) in [
                (true, &b"kv"[..]),
                (true, &5u64.to_be_bytes()[..]),
                (false, &batch[..]),
            ] {
                let flags = u8::from(more);
                if frame.len() > 255 {
                    m.push(flags | 2);
                    m.extend((frame.len() as u64).to_be_bytes());
                } else {
                    m.push(flags);
                    m.push(frame.len() as u8);
                }
                m.extend_from_slice(frame);
            }
            write(dir, "kv_events", name, &m);
        }
    }
}
