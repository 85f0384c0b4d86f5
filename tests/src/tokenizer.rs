//! A small word-level tokenizer built in code with the `tokenizers` crate, shared by lockstep
//! (as its `tokenizer.json`) and the mock workers, so token counts are exact on both sides.

use std::collections::HashMap;
use std::path::Path;

use tokenizers::models::wordlevel::WordLevel;
use tokenizers::pre_tokenizers::whitespace::Whitespace;
use tokenizers::{AddedToken, Tokenizer};

/// Special tokens of the mock chat format.
pub const SPECIALS: [&str; 4] = ["[UNK]", "<|im_start|>", "<|im_end|>", "<|endoftext|>"];

/// The mock chat template (ChatML-like, whitespace-separated so the word-level model splits it).
pub const CHAT_TEMPLATE: &str = "{% for m in messages %}<|im_start|> {{ m.role }} {{ m.content }} <|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant{% endif %}";

const WORDS: &str = "system user assistant tool \
alpha bravo charlie delta echo foxtrot golf hotel india juliett kilo lima mike november oscar papa \
quebec romeo sierra tango uniform victor whiskey xray yankee zulu \
0 1 2 3 4 5 6 7 8 9 . , ? ! : ; ' \" ( ) - / \
the a an and or but if then else of to in on at by for with from as is are was were be been \
it this that these those i you he she we they me him her us them my your his its our their \
what which who whom whose when where why how all any both each few more most other some such \
no nor not only own same so than too very can will just should now hello hi world say tell \
write read story poem code answer question please thanks yes okay good bad new old big small \
one two three four five six seven eight nine ten hundred thousand number count list name \
secret password account billing card customer tenant prompt token model cache page memory \
red green blue black white cat dog bird fish tree house car road city sun moon star sky sea \
day night time year week today tomorrow morning evening happy sad fast slow hot cold up down";

/// The vocabulary: specials first, then the words, each with its index as id.
pub fn vocab() -> HashMap<String, u32> {
    SPECIALS
        .iter()
        .copied()
        .chain(WORDS.split_whitespace())
        .enumerate()
        .map(|(i, w)| (w.to_string(), i as u32))
        .collect()
}

/// Builds the tokenizer.
pub fn build() -> Tokenizer {
    let model = WordLevel::builder()
        .vocab(vocab().into_iter().collect())
        .unk_token("[UNK]".to_string())
        .build()
        .expect("static word-level vocabulary is valid");
    let mut tok = Tokenizer::new(model);
    tok.with_pre_tokenizer(Some(Whitespace {}));
    with_specials(tok)
}

/// [`build`] with a post-processor that adds special tokens around every text, as an embedding
/// model's (BERT's `[CLS] ... [SEP]`) does: `<|im_start|> ... <|endoftext|>`.
pub fn build_embedding() -> Tokenizer {
    use tokenizers::processors::template::TemplateProcessing;
    let v = vocab();
    let post = TemplateProcessing::builder()
        .try_single("<|im_start|> $A <|endoftext|>")
        .expect("template")
        .special_tokens(vec![
            ("<|im_start|>", v["<|im_start|>"]),
            ("<|endoftext|>", v["<|endoftext|>"]),
        ])
        .build()
        .expect("post-processor");
    let mut tok = build();
    tok.with_post_processor(Some(post));
    tok
}

/// `tok` with the mock chat format's special tokens.
fn with_specials(mut tok: Tokenizer) -> Tokenizer {
    let specials: Vec<AddedToken> = SPECIALS
        .iter()
        .map(|s| AddedToken::from(*s, true))
        .collect();
    tok.add_special_tokens(&specials);
    tok
}

/// Writes the tokenizer as `tokenizer.json` text.
pub fn to_json() -> String {
    build().to_string(true).expect("tokenizer serialises")
}

/// Writes the tokenizer to `path`.
pub fn write(path: &Path) -> std::io::Result<()> {
    std::fs::write(path, to_json())
}

/// The canary tokenizer of the probe tests: the same words (one token each) plus `cnry` and
/// every pair of hex digits as a continuing piece (WordPiece), so a probe secret such as
/// `cnry0123456789abcdef` is 9 tokens and decodes back whole; the mock's decoy answer then
/// carries another request's secret verbatim, as a real model's would.
pub fn build_canary() -> Tokenizer {
    use tokenizers::decoders::wordpiece::WordPiece as WordPieceDecoder;
    use tokenizers::models::wordpiece::WordPiece;
    let mut vocab = vocab();
    let mut add = |w: String| {
        let n = vocab.len() as u32;
        vocab.entry(w).or_insert(n);
    };
    add("cnry".into());
    for i in 0..256u32 {
        add(format!("##{i:02x}"));
    }
    for i in 0..16u32 {
        add(format!("##{i:x}"));
    }
    // Through its serialized form: the builder wants the crate's own hash map type.
    let model: WordPiece = serde_json::from_str(
        &serde_json::json!({
        "type": "WordPiece",
        "unk_token": "[UNK]",
        "continuing_subword_prefix": "##",
        "max_input_chars_per_word": 100,
        "vocab": vocab,
        })
        .to_string(),
    )
    .expect("static word-piece vocabulary is valid");
    let mut tok = Tokenizer::new(model);
    tok.with_pre_tokenizer(Some(Whitespace {}));
    tok.with_decoder(Some(WordPieceDecoder::new("##".to_string(), false)));
    with_specials(tok)
}

/// A byte-level BPE tokenizer of SmolLM2's shape (digits split one by one, then GPT-2's
/// pattern, byte-level merges; the mock chat format's special tokens), trained in code on the
/// mock vocabulary's words and some other scripts: for the byte-level fast path's fuzz target,
/// which needs the `tokenizers` crate's answers without the model file.
pub fn byte_level() -> Tokenizer {
    use tokenizers::models::TrainerWrapper;
    use tokenizers::models::bpe::{BPE, BpeTrainer};
    use tokenizers::pre_tokenizers::PreTokenizerWrapper;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::digits::Digits;
    use tokenizers::pre_tokenizers::sequence::Sequence;
    let mut tok = Tokenizer::new(BPE::default());
    tok.with_pre_tokenizer(Some(Sequence::new(vec![
        PreTokenizerWrapper::Digits(Digits::new(true)),
        PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
    ])));
    let mut trainer: TrainerWrapper = BpeTrainer::builder()
        .vocab_size(1200)
        .min_frequency(1)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    let other = "naïve café Über straße ΑΒΓ αβγ Привет мир مرحبا שלום नमस्ते 你好世界 こんにちは 한국어 it's they're we've I'll";
    let corpus = [WORDS, other, WORDS, other];
    tok.train(&mut trainer, corpus.iter())
        .expect("training on a fixed corpus succeeds");
    with_specials(tok)
}

/// [`byte_level`] with its byte-level decoder: the text of ids is the concatenation of each
/// id's bytes, as with the tokenizers of Llama 3, Qwen and SmolLM2, so a stream carried to a new
/// pair can be checked against its ids (the migration tests).
pub fn build_byte_level() -> Tokenizer {
    let mut tok = byte_level();
    tok.with_decoder(Some(tokenizers::decoders::byte_level::ByteLevel::default()));
    tok
}

#[cfg(test)]
mod tests {
    #[test]
    fn canary_secrets_round_trip_through_the_canary_tokenizer() {
        let t = super::build_canary();
        let enc = t
            .encode("<|im_start|> user cnry0123456789abcdef is a secret", false)
            .expect("encode");
        assert_eq!(enc.get_ids().len(), 2 + 9 + 3);
        let text = t.decode(enc.get_ids(), false).expect("decode");
        assert!(text.contains(" cnry0123456789abcdef is a secret"), "{text}");
    }
}
