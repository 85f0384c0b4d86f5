//! The fuzz targets, by name: what `fuzz/fuzz_targets/*.rs` run under libFuzzer (`bench/fuzz.sh`)
//! and `tests/tests/fuzz_replay.rs` replays from the committed corpora under plain `cargo test`.
//! Every target feeds untrusted bytes to a parser the way lockstep does and must return (errors
//! are fine, panics and hangs are not); some also check a property on what parses.

use std::sync::{Arc, OnceLock};

use lockstep_core::config::Config;
use lockstep_prompt::{ChatMessage, PromptCodec};
use lockstep_router::app::Lockstep;

/// Every target.
pub const TARGETS: &[&str] = &[
    "gguf",
    "kv_transfer",
    "worker_messages",
    "data_stream",
    "sse",
    "upstream_json",
    "admission",
    "chat_template",
    "bpe",
    "responses",
    "messages",
    "tool_output",
    "grammar",
    "ext_proc",
    "kv_events",
];

/// Runs `target` on `data`.
pub fn run(target: &str, data: &[u8]) {
    match target {
        "gguf" => gguf(data),
        "kv_transfer" => kv_transfer(data),
        "worker_messages" => lockstep_worker::fuzzing::messages(data),
        "data_stream" => runtime().block_on(lockstep_worker::fuzzing::data_stream(data)),
        "sse" => runtime().block_on(lockstep_router::fuzzing::sse(data)),
        "upstream_json" => lockstep_router::fuzzing::upstream_json(data),
        "admission" => {
            let state = &router().state;
            runtime().block_on(lockstep_router::fuzzing::admission(state, data));
        }
        "responses" => {
            let state = &router().state;
            runtime().block_on(lockstep_router::fuzzing::responses(state, data));
        }
        "messages" => {
            let state = &router().state;
            runtime().block_on(lockstep_router::fuzzing::messages(state, data));
        }
        "tool_output" => lockstep_router::fuzzing::tool_output(data),
        "grammar" => lockstep_router::fuzzing::grammar(data),
        "chat_template" => chat_template(data),
        "bpe" => bpe(data),
        "ext_proc" => lockstep_gateway::picker::fuzz_message(data),
        "kv_events" => runtime().block_on(lockstep_routing::fuzzing::kv_events(data)),
        other => panic!("no fuzz target `{other}`"),
    }
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    })
}

fn config_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../config")
}

/// A router in front of SGLang workers that are never reached (admission is all that runs): the
/// mock tokenizer and an im_start chat template; context 512.
fn router() -> &'static Lockstep {
    static R: OnceLock<Lockstep> = OnceLock::new();
    R.get_or_init(|| {
        let text = format!(
            r#"
[server]
http_listen = "127.0.0.1:0"
log_level = "off"

[[models]]
name = "fuzz"
backend = "sglang"
context_window = 512
kv_capacity_tokens = 1024
tokenizer = "{}"
chat_template = {{ inline = '{{% for m in messages %}}<|im_start|>{{{{ m.role }}}} {{{{ m.content }}}}<|im_end|>{{% endfor %}}{{% if add_generation_prompt %}}<|im_start|>assistant{{% endif %}}' }}

[models.prefill]
workers = [{{ url = "http://127.0.0.1:9", bootstrap_port = 9 }}]

[models.decode]
workers = [{{ url = "http://127.0.0.1:9" }}]

[[models]]
name = "fuzz-tools"
backend = "sglang"
context_window = 512
kv_capacity_tokens = 1024
tokenizer = "{tok}"
tool_parser = "hermes"
chat_template = {{ path = "{tools}" }}

[models.prefill]
workers = [{{ url = "http://127.0.0.1:9", bootstrap_port = 9 }}]

[models.decode]
workers = [{{ url = "http://127.0.0.1:9" }}]
"#,
            config_dir().join("mock-tokenizer.json").display(),
            tok = config_dir().join("mock-tokenizer.json").display(),
            tools = config_dir().join("templates/chatml-tools.jinja").display(),
        );
        let cfg = Config::parse(&text).expect("fuzz config parses");
        runtime()
            .block_on(Lockstep::start(cfg))
            .expect("fuzz router starts")
    })
}

fn gguf(data: &[u8]) {
    use lockstep_engine::gguf::Gguf;
    if let Ok(g) = Gguf::parse(data.to_vec()) {
        let _ = lockstep_engine::model::Llama::load(&g);
        let _ = lockstep_engine::tokenizer::ModelTokenizer::from_gguf(&g);
    }
}

/// Whatever parses writes back to bytes that parse to the same set.
fn kv_transfer(data: &[u8]) {
    use lockstep_engine::transfer::KvTransfer;
    if let Ok(t) = KvTransfer::from_bytes(data) {
        let again = KvTransfer::from_bytes(&t.to_bytes()).expect("a parsed set round-trips");
        assert_eq!(again, t);
    }
}

/// Chat messages (role and content alternate, split at NUL bytes) through the template and the
/// tokenizer, with chat content literal.
fn chat_template(data: &[u8]) {
    static CODEC: OnceLock<Arc<PromptCodec>> = OnceLock::new();
    let codec = CODEC.get_or_init(|| {
        let t = tokenizers::Tokenizer::from_file(config_dir().join("mock-tokenizer.json"))
            .expect("mock tokenizer");
        PromptCodec::new(
            "fuzz",
            t,
            "{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}"
                .into(),
            String::new(),
            String::new(),
        )
        .expect("codec")
    });
    let text = String::from_utf8_lossy(data);
    let parts: Vec<&str> = text.split('\0').collect();
    let messages: Vec<ChatMessage> = parts
        .chunks(2)
        .map(|c| ChatMessage::text(c[0], c.get(1).copied().unwrap_or_default()))
        .collect();
    let _ = codec.encode_chat(&messages);
}

/// Any text through the byte-level fast path and the `tokenizers` crate, on a byte-level BPE of
/// SmolLM2's shape: the same ids, special tokens parsed and as text (the first byte picks).
fn bpe(data: &[u8]) {
    use lockstep_prompt::bpe::FastBpe;
    static TOKENIZERS: OnceLock<(tokenizers::Tokenizer, tokenizers::Tokenizer, FastBpe)> =
        OnceLock::new();
    let (parsed, literal, fast) = TOKENIZERS.get_or_init(|| {
        let t = crate::tokenizer::byte_level();
        let mut literal = t.clone();
        literal.set_encode_special_tokens(true);
        let fast = FastBpe::from_tokenizer(&t).expect("the fast path takes this shape");
        (t, literal, fast)
    });
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(rest);
    let as_text = mode & 1 == 1;
    let reference = if as_text { literal } else { parsed };
    let want = reference.encode(text.as_ref(), false).expect("encode");
    assert_eq!(fast.encode(&text, as_text), want.get_ids(), "{text:?}");
}
