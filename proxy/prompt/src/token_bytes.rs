//! Every token id's own bytes, for log-probabilities' `bytes` and token texts
//! ([`super::PromptCodec::token_bytes`]): an added or special token's text; a byte-level BPE entry
//! (GPT-2's, Llama 3's, Qwen's, SmolLM2's) mapped back through the byte-to-character table, so a
//! token that is part of a UTF-8 character gives its bytes, not a replacement character; a
//! SentencePiece byte token (`<0xNN>`) its byte; any other entry its text with `▁` as a space.

use tokenizers::Tokenizer;

/// The bytes of every id of `tk`'s vocabulary, by id.
pub fn table(tk: &Tokenizer) -> Vec<Box<[u8]>> {
    let byte_level = serde_json::to_value(tk.get_decoder()).is_ok_and(|d| d["type"] == "ByteLevel");
    // GPT-2's `bytes_to_unicode`: printable Latin-1 stands for itself, the other bytes for
    // the characters from U+0100 on, in byte order.
    let mut from_char = std::collections::HashMap::new();
    let mut next = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff);
        let c = if printable {
            char::from(b)
        } else {
            next += 1;
            char::from_u32(0xff + next).unwrap_or(char::REPLACEMENT_CHARACTER)
        };
        from_char.insert(c, b);
    }
    let added = tk.get_added_tokens_decoder();
    let n = tk.get_vocab_size(true);
    (0..n as u32)
        .map(|id| {
            if let Some(a) = added.get(&id) {
                return a.content.as_bytes().into();
            }
            let Some(entry) = tk.id_to_token(id) else {
                return Box::default();
            };
            if byte_level {
                let bytes: Option<Vec<u8>> =
                    entry.chars().map(|c| from_char.get(&c).copied()).collect();
                if let Some(b) = bytes {
                    return b.into();
                }
            }
            if let Some(hex) = entry.strip_prefix("<0x").and_then(|h| h.strip_suffix('>'))
                && let Ok(b) = u8::from_str_radix(hex, 16)
                && hex.len() == 2
            {
                return vec![b].into();
            }
            entry.replace('\u{2581}', " ").into_bytes().into()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level vocabulary's entries map back to their bytes, a piece of a UTF-8 character
    /// included; an added token is its text; an id outside the vocabulary is nothing.
    #[test]
    fn token_bytes_are_the_vocabulary_entries_own() {
        let json = serde_json::json!({
            "version": "1.0",
            "added_tokens": [{"id": 4, "content": "<|im_end|>", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": {"a": 0, "\u{120}the": 1, "\u{e2}\u{122}": 2, "\u{122}": 3, "<|im_end|>": 4},
                      "merges": []},
        });
        let tok: Tokenizer = json.to_string().parse().expect("tokenizer");
        let t = table(&tok);
        let codec = |id: usize| t.get(id).map_or(&[][..], |b| &b[..]);
        assert_eq!(codec(0), b"a");
        assert_eq!(codec(1), b" the");
        assert_eq!(codec(2), &[0xe2, 0x80]);
        assert_eq!(codec(3), &[0x80]);
        assert_eq!(codec(4), b"<|im_end|>");
        assert_eq!(codec(5), b"");
    }
}
