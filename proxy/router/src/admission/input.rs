//! What a front end asks the model to continue ([`Input`]): chat messages, or a completion-style
//! prompt as clients send it ([`Prompt`]).

use serde::Deserialize;

use lockstep_prompt::ChatMessage;

/// A completion-style prompt as clients send it: a string, a list of one string, or token ids.
#[derive(Debug)]
pub enum Prompt {
    /// One text.
    Text(String),
    /// Texts (only a list of one is served).
    Texts(Vec<String>),
    /// Token ids.
    Ids(Vec<u32>),
    /// Lists of token ids (only a list of one is served).
    Batches(Vec<Vec<u32>>),
}

impl schemars::JsonSchema for Prompt {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Prompt".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "a string, a list of one string, token ids, or a list of one list of token ids",
            "anyOf": [
                { "type": "string" },
                { "type": "array", "items": { "type": "string" } },
                { "type": "array", "items": { "type": "integer", "minimum": 0 } },
                { "type": "array", "items": { "type": "array", "items": { "type": "integer", "minimum": 0 } } },
            ],
        })
    }
}

/// A string prompt is taken as the parser hands it over (`admission::text_or`); a list is one of the
/// list forms, all its elements of one kind (an empty list is no texts).
impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Prompt, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Elem {
            Text(String),
            Id(u32),
            Batch(Vec<u32>),
        }
        const EXPECTING: &str = "a string, a list of strings, or token ids";
        let list = match crate::admission::text_or::text_or_list::<_, Elem>(d, EXPECTING)? {
            Ok(text) => return Ok(Prompt::Text(text)),
            Err(list) => list,
        };
        /// Every element through `pick`, or an error for a list of mixed kinds.
        fn all<T, E: serde::de::Error>(
            list: Vec<Elem>,
            pick: fn(Elem) -> Option<T>,
        ) -> Result<Vec<T>, E> {
            let mixed = || E::custom(format!("a prompt list mixes kinds: expected {EXPECTING}"));
            list.into_iter()
                .map(|e| pick(e).ok_or_else(mixed))
                .collect()
        }
        Ok(match list.first() {
            None | Some(Elem::Text(_)) => Prompt::Texts(all(list, |e| match e {
                Elem::Text(t) => Some(t),
                _ => None,
            })?),
            Some(Elem::Id(_)) => Prompt::Ids(all(list, |e| match e {
                Elem::Id(i) => Some(i),
                _ => None,
            })?),
            Some(Elem::Batch(_)) => Prompt::Batches(all(list, |e| match e {
                Elem::Batch(b) => Some(b),
                _ => None,
            })?),
        })
    }
}

/// What a front end asks the model to continue.
#[derive(Debug)]
pub enum Input {
    /// Chat messages, rendered through the model's chat template (step 4).
    Chat(Vec<ChatMessage>),
    /// Chat messages and the request's tool definitions, both rendered by the template.
    ChatTools(Vec<ChatMessage>, Vec<serde_json::Value>),
    /// A prompt, tokenized as it is (special tokens in text are parsed as special).
    Prompt(Prompt),
}

impl Input {
    /// Bytes of text the tokenizer would read (0 for token ids).
    pub fn text_bytes(&self) -> usize {
        match self {
            Input::Chat(m) => m.iter().map(|m| m.content.len() + m.role.len()).sum(),
            Input::ChatTools(m, t) => {
                m.iter()
                    .map(|m| m.content.len() + m.role.len())
                    .sum::<usize>()
                    + t.iter().map(|t| t.to_string().len()).sum::<usize>()
            }
            Input::Prompt(Prompt::Text(s)) => s.len(),
            Input::Prompt(Prompt::Texts(v)) => v.iter().map(String::len).sum(),
            Input::Prompt(_) => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Prompt;

    #[test]
    fn a_prompt_is_a_string_strings_ids_or_batches_of_ids() {
        let p = |j: &str| serde_json::from_str::<Prompt>(j);
        assert!(matches!(p(r#""a\u00e9""#), Ok(Prompt::Text(t)) if t == "aé"));
        assert!(matches!(p(r#"["a", "b"]"#), Ok(Prompt::Texts(t)) if t == ["a", "b"]));
        assert!(matches!(p("[1, 2]"), Ok(Prompt::Ids(i)) if i == [1, 2]));
        assert!(matches!(p("[[1], [2, 3]]"), Ok(Prompt::Batches(b)) if b == [vec![1], vec![2, 3]]));
        // An empty list is the first list form, as the untagged enum had it.
        assert!(matches!(p("[]"), Ok(Prompt::Texts(t)) if t.is_empty()));
        for bad in [
            "5",
            "null",
            r#"{"a": 1}"#,
            "[-1]",
            r#"[1, "a"]"#,
            r#"["a", 1]"#,
            "[[1], 2]",
            "[1.5]",
        ] {
            assert!(p(bad).is_err(), "{bad}");
        }
        let e = p("5").expect_err("number").to_string();
        assert!(
            e.contains("a string, a list of strings, or token ids"),
            "{e}"
        );
    }
}
