//! A model's prompt codec: its chat template (minijinja) and its real tokenizer, so the router
//! counts exactly the tokens the workers will compute; and the fit check (invariant 5).

use std::sync::Arc;

use minijinja::Environment;
use serde::Serialize;
use tokenizers::Tokenizer;

use super::bpe::TextEncoder;
use super::segments::{self, SegmentCache};
use lockstep_core::config::{ChatTemplateConfig, ModelConfig};
use lockstep_core::error::LockstepError;

/// Token ids to text: what a pair checks its delivered text against.
pub type Detok = Arc<dyn Fn(&[u32]) -> String + Send + Sync>;

/// A chat message after validation: role and flattened text content, and for tool calling the
/// assistant's earlier calls and the call a tool message answers.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text content.
    pub content: String,
    /// An assistant message's tool calls (`{id, type, function: {name, arguments}}`, the
    /// arguments as an object, as chat templates read them).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// The call a `tool` message answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message of plain text.
    pub fn text(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            ..ChatMessage::default()
        }
    }
}

/// The chat template the configuration gives (inline, or read from its file), if any.
pub fn configured_template(model: &ModelConfig) -> Result<Option<String>, String> {
    let name = &model.name;
    Ok(match &model.chat_template {
        Some(ChatTemplateConfig::Inline(s)) => Some(s.clone()),
        Some(ChatTemplateConfig::Path(p)) => Some(
            std::fs::read_to_string(p)
                .map_err(|e| format!("model `{name}`: chat template {}: {e}", p.display()))?,
        ),
        None => None,
    })
}

/// The most a model's segment cache holds (text and ids).
const SEGMENT_CACHE_BYTES: u64 = 64 << 20;

/// The model's tokenizer and chat template, loaded once.
pub struct PromptCodec {
    /// The tokenizer, with the byte-level fast path where it is proven.
    text: TextEncoder,
    /// The special tokens' texts, to find them in chat message content (`None`: the model has
    /// none).
    specials: Option<aho_corasick::AhoCorasick>,
    /// Long prompts' pieces tokenized before, per tenant (`None`: this tokenizer cannot be
    /// cached piece by piece).
    segments: Option<SegmentCache>,
    env: Environment<'static>,
    /// The chat template's source.
    template: String,
    bos_token: String,
    eos_token: String,
    /// The longest vocabulary entry in bytes: no token covers more input than that.
    max_token_bytes: usize,
    /// Every token id's own bytes ([`PromptCodec::token_bytes`]), built when first asked.
    token_bytes: std::sync::OnceLock<Vec<Box<[u8]>>>,
}

impl std::fmt::Debug for PromptCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptCodec").finish_non_exhaustive()
    }
}

impl PromptCodec {
    /// Loads the tokenizer file and compiles the chat template of a remote-backend model.
    pub fn load(model: &ModelConfig) -> Result<Arc<PromptCodec>, String> {
        let name = &model.name;
        let path = model
            .tokenizer
            .as_ref()
            .ok_or_else(|| format!("model `{name}`: no tokenizer configured"))?;
        let tokenizer = Tokenizer::from_file(path)
            .map_err(|e| format!("model `{name}`: tokenizer {}: {e}", path.display()))?;
        // An embeddings model renders no chat: its inputs are tokenized as they are.
        let source = configured_template(model)?
            .or_else(|| {
                model
                    .embeds_remotely()
                    .then(|| "{% for m in messages %}{{ m.content }}{% endfor %}".to_string())
            })
            .ok_or_else(|| format!("model `{name}`: no chat template configured"))?;
        PromptCodec::new_with(
            model.special_tokens_in_content,
            name,
            tokenizer,
            source,
            model.bos_token.clone(),
            model.eos_token.clone(),
        )
    }

    /// Builds admission from a tokenizer and template source (the embedded engine's, taken
    /// from its model file, so the router and the engine count and render alike).
    pub fn new(
        name: &str,
        tokenizer: Tokenizer,
        template: String,
        bos_token: String,
        eos_token: String,
    ) -> Result<Arc<PromptCodec>, String> {
        PromptCodec::new_with(false, name, tokenizer, template, bos_token, eos_token)
    }

    /// [`PromptCodec::new`]; with `special_tokens_in_content`, special-token text in chat
    /// message content is parsed as special tokens (the model's `special_tokens_in_content`:
    /// only for deployments whose every caller may write raw turns).
    pub fn new_with(
        special_tokens_in_content: bool,
        name: &str,
        tokenizer: Tokenizer,
        template: String,
        bos_token: String,
        eos_token: String,
    ) -> Result<Arc<PromptCodec>, String> {
        let mut env = Environment::new();
        env.add_template_owned("chat", template.clone())
            .map_err(|e| format!("model `{name}`: chat template: {e}"))?;
        let texts: Vec<String> = tokenizer
            .get_added_tokens_decoder()
            .into_values()
            .filter(|t| t.special && !t.content.is_empty())
            .map(|t| t.content)
            .collect();
        // No automaton: `encode_chat` parses the whole rendered prompt for special tokens.
        let specials = (!texts.is_empty() && !special_tokens_in_content)
            .then(|| aho_corasick::AhoCorasick::new(&texts))
            .transpose()
            .map_err(|e| format!("model `{name}`: special tokens: {e}"))?;
        // Byte-level BPE and SentencePiece spell every input byte with at least one byte of the
        // vocabulary entry, so an entry's length bounds the input one token can cover.
        let max_token_bytes = tokenizer
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(1)
            .max(1);
        let text = TextEncoder::new(name, tokenizer);
        let segments = SegmentCache::new(&text, SEGMENT_CACHE_BYTES)
            .inspect_err(|why| tracing::info!(model = name, %why, "tokenizer segment cache off"))
            .ok();
        Ok(Arc::new(PromptCodec {
            text,
            specials,
            segments,
            env,
            template,
            bos_token,
            eos_token,
            max_token_bytes,
            token_bytes: std::sync::OnceLock::new(),
        }))
    }

    /// A floor on the tokens `bytes` of prompt text make, known without tokenizing: a token
    /// covers at most the longest vocabulary entry's bytes, with a factor of 4 to spare for
    /// normalizers that shrink text (composition, compatibility forms).
    pub fn min_tokens(&self, bytes: usize) -> u64 {
        (bytes / (4 * self.max_token_bytes)) as u64
    }

    /// Renders the chat template with `add_generation_prompt = true`.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, LockstepError> {
        self.render_chat_with(messages, None)
    }

    /// [`PromptCodec::render_chat`] with the request's `tools` (OpenAI's definitions) given to
    /// the template as `tools`.
    pub fn render_chat_with(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
    ) -> Result<String, LockstepError> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| internal_template(&e))?;
        tmpl.render(minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => true,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(|e| LockstepError::InvalidRequest {
            message: format!("the chat template cannot render these messages: {e}"),
            param: Some("messages".into()),
        })
    }

    /// Whether the chat template shows the model the `tools` it is given: a model with a tool
    /// parser whose template ignored them would answer requests with tools as if there were
    /// none. Checked once, when the model is built.
    pub fn check_renders_tools(&self) -> Result<(), String> {
        let probe = "lockstep_probe_tool";
        let tools = [
            serde_json::json!({"type": "function", "function": {"name": probe, "description": "", "parameters": {"type": "object", "properties": {}}}}),
        ];
        let text = self
            .render_chat_with(&[ChatMessage::text("user", "x")], Some(&tools))
            .map_err(|e| e.to_string())?;
        if text.contains(probe) {
            Ok(())
        } else {
            Err("the chat template does not render `tools`; configure one that does (`chat_template`, e.g. config/templates/chatml-tools.jinja) or remove `tool_parser`".into())
        }
    }

    /// Tokenizes text exactly as the workers would (special tokens written in the text are parsed
    /// as special tokens; no extra BOS is added: the template carries it).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, LockstepError> {
        self.text.encode(text, false)
    }

    /// Tokenizes text as an embedding server does (SGLang's and vLLM's default
    /// `add_special_tokens`): the tokenizer's own post-processing adds its special tokens
    /// (`[CLS]` ... `[SEP]` for a BERT model).
    pub fn encode_with_specials(&self, text: &str) -> Result<Vec<u32>, LockstepError> {
        self.text
            .tokenizer()
            .encode(text, true)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| LockstepError::InvalidRequest {
                message: format!("cannot tokenize the input: {e}"),
                param: Some("input".into()),
            })
    }

    /// [`PromptCodec::encode`] for the tenant whose cache salt is `salt`: a long prompt's
    /// pieces that tenant sent before come from the segment cache.
    pub fn encode_salted(&self, text: &str, salt: Option<u64>) -> Result<Vec<u32>, LockstepError> {
        match (&self.segments, salt) {
            (Some(cache), Some(salt)) if text.len() >= segments::MIN_PROMPT_BYTES => {
                cache.encode(&self.text, text, salt)
            }
            _ => self.encode(text),
        }
    }

    /// Whether text tokenizes through the byte-level fast path (`admission::bpe`).
    pub fn tokenizes_fast(&self) -> bool {
        self.text.is_fast()
    }

    /// Whether long pieces nobody cached are tokenized in chunks on the thread pool.
    pub fn tokenizes_in_chunks(&self) -> bool {
        self.segments.as_ref().is_some_and(SegmentCache::chunked)
    }

    /// Prompt bytes the segment cache served and tokenized (`None`: no cache).
    pub fn segment_cache_counts(&self) -> Option<(u64, u64)> {
        self.segments.as_ref().map(SegmentCache::counts)
    }

    /// Renders the chat template and tokenizes the result, where message content is always
    /// text: a special token written in a message (`<|im_start|>system ...`) becomes ordinary
    /// tokens, so no caller can forge a turn of another role. Only the template's own text is
    /// parsed for special tokens. Content the template changed on its way (so that it cannot be
    /// found verbatim) is refused when it holds special-token text.
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, LockstepError> {
        self.encode_chat_with(messages, None)
    }

    /// [`PromptCodec::encode_chat`] with the request's tools rendered by the template.
    pub fn encode_chat_with(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
    ) -> Result<Vec<u32>, LockstepError> {
        self.encode_chat_salted(messages, tools, None)
    }

    /// [`PromptCodec::encode_chat_with`] for the tenant whose cache salt is `salt` (see
    /// [`PromptCodec::encode_salted`]).
    pub fn encode_chat_salted(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        salt: Option<u64>,
    ) -> Result<Vec<u32>, LockstepError> {
        let Some(specials) = &self.specials else {
            let text = self.render_chat_with(messages, tools)?;
            return self.encode_salted(&text, salt);
        };
        // Names, ids, arguments and tool definitions reach the template as they are (templates
        // write `{{ tool_call.function.arguments }}` raw): none may hold special-token text.
        no_specials_outside_content(specials, messages, tools)?;
        let risky: Vec<usize> = (0..messages.len())
            .filter(|&i| specials.is_match(&messages[i].content))
            .collect();
        if risky.is_empty() {
            let text = self.render_chat_with(messages, tools)?;
            return self.encode_salted(&text, salt);
        }
        // Each risky content is rendered as a placeholder no one can write (a fresh random
        // nonce), so where the template put it is unambiguous even when the content equals
        // the template's own delimiters; the template's text around the placeholders is parsed
        // for special tokens, the contents are tokenized as plain text.
        let nonce: u64 = rand::random();
        let marks: Vec<(usize, String)> = risky
            .iter()
            .map(|&i| (i, format!("\u{F8F0}lockstep-{nonce:016x}-{i}\u{F8F1}")))
            .collect();
        let mut masked = messages.to_vec();
        for (i, m) in &marks {
            masked[*i].content.clone_from(m);
        }
        let shape = self.render_chat_with(&masked, tools)?;
        // Where the template put each placeholder: (offset, message, placeholder length).
        let mut at: Vec<(usize, usize, usize)> = Vec::new();
        for (i, m) in &marks {
            at.extend(
                shape
                    .match_indices(m.as_str())
                    .map(|(p, _)| (p, *i, m.len())),
            );
        }
        at.sort_unstable();
        // The placeholders put back must give what the template makes of the real contents:
        // else it transformed one (trimmed, escaped, cut), and its span is not the content.
        let mut rebuilt = String::with_capacity(shape.len());
        let mut from = 0;
        for &(p, i, len) in &at {
            rebuilt.push_str(&shape[from..p]);
            rebuilt.push_str(&messages[i].content);
            from = p + len;
        }
        rebuilt.push_str(&shape[from..]);
        let real = self.render_chat_with(messages, tools)?;
        let missing = risky.iter().find(|&&i| !at.iter().any(|&(_, j, _)| j == i));
        if let Some(&i) = missing.or_else(|| (rebuilt != real).then_some(&risky[0])) {
            return Err(LockstepError::InvalidRequest {
                message: "this message holds special-token text the chat template transforms, so lockstep cannot keep it plain text; remove the special tokens from it".into(),
                param: Some(format!("messages[{i}].content")),
            });
        }
        let mut ids = Vec::new();
        let mut from = 0;
        for (p, i, len) in at {
            ids.extend(self.encode(&shape[from..p])?);
            ids.extend(self.text.encode(&messages[i].content, true)?);
            from = p + len;
        }
        ids.extend(self.encode(&shape[from..])?);
        Ok(ids)
    }

    /// Decodes token ids to text (used for token-id prompts echoed back and for tests).
    pub fn decode(&self, ids: &[u32]) -> String {
        self.text.tokenizer().decode(ids, false).unwrap_or_default()
    }

    /// Token ids to text, where the text of ids is always the concatenation of each id's bytes
    /// (a byte-level decoder: GPT-2's, Llama 3's, Qwen's, SmolLM2's), for a migration to check
    /// the delivered text against the delivered ids. `None` for other decoders: a
    /// SentencePiece-style one strips the leading space of a text's start, so the text of a
    /// continuation is not what follows the text.
    pub fn concat_decoder(self: &Arc<Self>) -> Option<Detok> {
        let decoder = serde_json::to_value(self.text.tokenizer().get_decoder()).ok()?;
        if decoder["type"] != "ByteLevel" {
            return None;
        }
        let me = self.clone();
        Some(Arc::new(move |ids: &[u32]| me.decode(ids)))
    }

    /// The bytes token `id` stands for (empty for an id outside the vocabulary): an added or
    /// special token's text; a byte-level BPE entry (GPT-2's, Llama 3's, Qwen's, SmolLM2's)
    /// mapped back through the byte-to-character table, so a token that is part of a UTF-8
    /// character gives its bytes, not a replacement character; a SentencePiece byte token
    /// (`<0xNN>`) its byte; any other entry its text with `▁` as a space.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        let table = self
            .token_bytes
            .get_or_init(|| super::token_bytes::table(self.text.tokenizer()));
        table.get(id as usize).map_or(&[], |b| &b[..])
    }

    /// The vocabulary size, to validate client-sent token ids.
    pub fn vocab_size(&self) -> usize {
        self.text.tokenizer().get_vocab_size(true)
    }

    /// Each id's vocabulary entry (`Ġhello` in a byte-level vocabulary, `<|im_start|>` for an
    /// added token; empty outside the vocabulary), as a tokenizer's `convert_ids_to_tokens`.
    pub fn token_strings(&self, ids: &[u32]) -> Vec<String> {
        let t = self.text.tokenizer();
        ids.iter()
            .map(|id| t.id_to_token(*id).unwrap_or_default())
            .collect()
    }

    /// The chat template's source, as the model renders it.
    pub fn chat_template(&self) -> &str {
        &self.template
    }

    /// The template's `bos_token` and `eos_token`.
    pub fn bos_eos(&self) -> (&str, &str) {
        (&self.bos_token, &self.eos_token)
    }
}

/// Refuses special-token text in any string the template receives besides message content:
/// tool-call names, ids and arguments in history, `tool_call_id`s, and the tool definitions
/// (keys included).
fn no_specials_outside_content(
    specials: &aho_corasick::AhoCorasick,
    messages: &[ChatMessage],
    tools: Option<&[serde_json::Value]>,
) -> Result<(), LockstepError> {
    fn holds(specials: &aho_corasick::AhoCorasick, v: &serde_json::Value) -> bool {
        use serde_json::Value;
        match v {
            Value::String(s) => specials.is_match(s),
            Value::Array(a) => a.iter().any(|v| holds(specials, v)),
            Value::Object(o) => o
                .iter()
                .any(|(k, v)| specials.is_match(k) || holds(specials, v)),
            _ => false,
        }
    }
    let refuse = |param: String| {
        LockstepError::InvalidRequest {
        message: "special-token text is only accepted in message content (where it is kept plain text); remove it from this field".into(),
        param: Some(param),
    }
    };
    for (i, m) in messages.iter().enumerate() {
        if specials.is_match(&m.role) {
            return Err(refuse(format!("messages[{i}].role")));
        }
        if m.tool_calls.iter().flatten().any(|c| holds(specials, c)) {
            return Err(refuse(format!("messages[{i}].tool_calls")));
        }
        if m.tool_call_id
            .as_ref()
            .is_some_and(|id| specials.is_match(id))
        {
            return Err(refuse(format!("messages[{i}].tool_call_id")));
        }
    }
    if tools.into_iter().flatten().any(|t| holds(specials, t)) {
        return Err(refuse("tools".into()));
    }
    Ok(())
}

fn internal_template(e: &minijinja::Error) -> LockstepError {
    LockstepError::Unavailable {
        message: format!("chat template unavailable: {e}"),
    }
}

/// Refuses a request whose prompt plus completion exceeds the smaller of the context window and
/// the KV capacity.
pub fn check_fits(
    prompt_tokens: u64,
    max_tokens: u64,
    context_window: u64,
    kv_capacity: u64,
) -> Result<(), LockstepError> {
    let limit = context_window.min(kv_capacity);
    if prompt_tokens.saturating_add(max_tokens) > limit {
        return Err(LockstepError::ContextLengthExceeded {
            prompt_tokens,
            max_tokens,
            limit,
            context_window,
            kv_capacity,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fits_uses_smaller_of_window_and_capacity() {
        assert!(check_fits(10, 10, 20, 100).is_ok());
        assert!(check_fits(10, 11, 20, 100).is_err());
        assert!(check_fits(10, 10, 100, 19).is_err());
        assert!(check_fits(u64::MAX, u64::MAX, 100, 100).is_err());
        match check_fits(15, 10, 20, 30) {
            Err(LockstepError::ContextLengthExceeded { limit, .. }) => assert_eq!(limit, 20),
            other => panic!("unexpected {other:?}"),
        }
    }

    /// The bundled tool template renders tools, an assistant's calls and a tool's result in the
    /// Hermes format the `hermes` parser reads, and plain chat exactly as ChatML.
    #[test]
    fn the_tool_template_renders_tools_calls_and_results() {
        let source = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../config/templates/chatml-tools.jinja"
        ))
        .expect("template");
        let tok = Tokenizer::new(tokenizers::models::bpe::BPE::default());
        let codec =
            PromptCodec::new("m", tok, source, String::new(), String::new()).expect("codec");
        let tools = vec![
            serde_json::json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}),
        ];
        let msgs = vec![
            ChatMessage::text("user", "Weather?"),
            ChatMessage {
                role: "assistant".into(),
                tool_calls: Some(vec![
                    serde_json::json!({"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"city": "Paris"}}}),
                ]),
                ..ChatMessage::default()
            },
            ChatMessage {
                role: "tool".into(),
                content: "sunny".into(),
                tool_call_id: Some("c1".into()),
                ..ChatMessage::default()
            },
        ];
        assert_eq!(codec.check_renders_tools(), Ok(()));
        let got = codec
            .render_chat_with(&msgs, Some(&tools))
            .expect("renders");
        let want = concat!(
            "<|im_start|>system\nYou can call functions. Their signatures, one per line, in <tools></tools>:\n<tools>\n",
            "{\"function\":{\"name\":\"f\",\"parameters\":{\"type\":\"object\"}},\"type\":\"function\"}\n</tools>\n",
            "To call one, answer with only:\n<tool_call>\n{\"name\": \"<function name>\", \"arguments\": {<the arguments>}}\n</tool_call><|im_end|>\n",
            "<|im_start|>user\nWeather?<|im_end|>\n",
            "<|im_start|>assistant\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"city\":\"Paris\"}}\n</tool_call><|im_end|>\n",
            "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n",
            "<|im_start|>assistant\n",
        );
        assert_eq!(got, want);
        let plain = codec
            .render_chat(&[
                ChatMessage::text("system", "Be brief."),
                ChatMessage::text("user", "Hi"),
            ])
            .expect("renders");
        assert_eq!(
            plain,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        // A template that ignores `tools` is caught.
        let tok = Tokenizer::new(tokenizers::models::bpe::BPE::default());
        let plain = PromptCodec::new(
            "m",
            tok,
            "{% for m in messages %}{{ m.content }}{% endfor %}".into(),
            String::new(),
            String::new(),
        )
        .expect("codec");
        assert!(plain.check_renders_tools().is_err());
    }
}
