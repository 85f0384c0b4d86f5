//! The model's tokenizer and chat template, built from GGUF metadata.
//!
//! `tokenizer.ggml.model = "gpt2"` is byte-level BPE. The `smollm` pre-tokenizer (as llama.cpp
//! defines it) first isolates every digit, then applies the GPT-2 split; that is exactly the
//! `tokenizers` pipeline `Digits(individual) → ByteLevel`. Control tokens (`token_type` 3) become
//! special added tokens, so special tokens written in a prompt are parsed as special, as
//! llama.cpp, vLLM and SGLang do.

use std::collections::BTreeMap;

use serde_json::{Value as Json, json};

use crate::gguf::{Gguf, Value};

/// Why a tokenizer could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenizerError {
    /// A metadata key is missing or has the wrong type.
    #[error("GGUF tokenizer metadata `{0}` is missing or malformed")]
    Metadata(&'static str),
    /// A tokenizer model or pre-tokenizer this engine does not implement.
    #[error("unsupported tokenizer: {0}")]
    Unsupported(String),
    /// The `tokenizers` crate refused the built definition.
    #[error("tokenizer construction failed: {0}")]
    Build(String),
    /// The chat template does not compile or render.
    #[error("chat template: {0}")]
    Template(String),
}

/// Tokenizer plus the special ids and chat template a model needs.
pub struct ModelTokenizer {
    /// The `tokenizers` tokenizer.
    pub inner: tokenizers::Tokenizer,
    /// Begin-of-sequence id.
    pub bos: u32,
    /// End-of-sequence id.
    pub eos: u32,
    /// Whether prompts get a BOS prepended (`tokenizer.ggml.add_bos_token`).
    pub add_bos: bool,
    /// The chat template source, when the model has one.
    pub chat_template: Option<String>,
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

fn strings<'a>(
    g: &'a Gguf<impl AsRef<[u8]>>,
    key: &'static str,
) -> Result<Vec<&'a str>, TokenizerError> {
    match g.get(key) {
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_str().ok_or(TokenizerError::Metadata(key)))
            .collect(),
        _ => Err(TokenizerError::Metadata(key)),
    }
}

/// The `tokenizer.json` definition equivalent to the GGUF's tokenizer metadata.
pub fn tokenizer_json(g: &Gguf<impl AsRef<[u8]>>) -> Result<Json, TokenizerError> {
    let model = g
        .get("tokenizer.ggml.model")
        .and_then(Value::as_str)
        .ok_or(TokenizerError::Metadata("tokenizer.ggml.model"))?;
    if model != "gpt2" {
        return Err(TokenizerError::Unsupported(format!(
            "tokenizer model `{model}` (gpt2 byte-level BPE is supported)"
        )));
    }
    let pre = g
        .get("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("default");
    let pre_tokenizer = match pre {
        "smollm" => json!({ "type": "Sequence", "pretokenizers": [
            { "type": "Digits", "individual_digits": true },
            { "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true },
        ]}),
        "gpt-2" | "default" => {
            json!({ "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true })
        }
        other => {
            return Err(TokenizerError::Unsupported(format!(
                "pre-tokenizer `{other}`"
            )));
        }
    };
    let tokens = strings(g, "tokenizer.ggml.tokens")?;
    let merges = strings(g, "tokenizer.ggml.merges")?;
    let types: Vec<u64> = match g.get("tokenizer.ggml.token_type") {
        Some(Value::Array(v)) if v.len() == tokens.len() => {
            v.iter().map(|x| x.as_u64().unwrap_or(1)).collect()
        }
        _ => return Err(TokenizerError::Metadata("tokenizer.ggml.token_type")),
    };
    let vocab: BTreeMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (*t, i)).collect();
    let added: Vec<Json> = tokens
        .iter()
        .zip(&types)
        .enumerate()
        .filter(|(_, (_, ty))| **ty == 3 || **ty == 4)
        .map(|(id, (t, ty))| json!({ "id": id, "content": t, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": *ty == 3 }))
        .collect();
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": { "type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true },
        "model": { "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null,
                   "fuse_unk": false, "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges },
    }))
}

impl ModelTokenizer {
    /// Builds the tokenizer from a GGUF file's metadata.
    pub fn from_gguf(g: &Gguf<impl AsRef<[u8]>>) -> Result<ModelTokenizer, TokenizerError> {
        let def = tokenizer_json(g)?;
        let inner: tokenizers::Tokenizer = def
            .to_string()
            .parse()
            .map_err(|e: tokenizers::Error| TokenizerError::Build(e.to_string()))?;
        let id = |k: &'static str| {
            g.get(k)
                .and_then(Value::as_u64)
                .map(|v| v as u32)
                .ok_or(TokenizerError::Metadata(k))
        };
        Ok(ModelTokenizer {
            inner,
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos: id("tokenizer.ggml.eos_token_id")?,
            add_bos: matches!(
                g.get("tokenizer.ggml.add_bos_token"),
                Some(Value::Bool(true))
            ),
            chat_template: g
                .get("tokenizer.chat_template")
                .and_then(Value::as_str)
                .map(str::to_string),
        })
    }

    /// Token ids of `text` (special tokens in the text are parsed as special; BOS as the model says).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| TokenizerError::Build(e.to_string()))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if self.add_bos {
            ids.push(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, false).unwrap_or_default()
    }

    /// Renders the model's chat template (`add_generation_prompt = true`).
    pub fn render_chat(&self, messages: &[(String, String)]) -> Result<String, TokenizerError> {
        let src = self
            .chat_template
            .as_deref()
            .ok_or_else(|| TokenizerError::Template("the model has no chat template".into()))?;
        let mut env = minijinja::Environment::new();
        env.add_template("chat", src)
            .map_err(|e| TokenizerError::Template(e.to_string()))?;
        let msgs: Vec<Json> = messages
            .iter()
            .map(|(r, c)| json!({ "role": r, "content": c }))
            .collect();
        let bos = self.decode(&[self.bos]);
        let eos = self.decode(&[self.eos]);
        env.get_template("chat")
            .and_then(|t| t.render(minijinja::context! { messages => msgs, add_generation_prompt => true, bos_token => bos, eos_token => eos }))
            .map_err(|e| TokenizerError::Template(e.to_string()))
    }
}
