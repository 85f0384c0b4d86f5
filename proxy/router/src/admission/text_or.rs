//! Request fields that are a string or a list (chat content, a system prompt, a Responses
//! input), deserialized by hand rather than as `#[serde(untagged)]` enums: an untagged enum first
//! buffers the whole value (serde's private `Content`: one more copy of the text, in fresh
//! memory) and then tries each variant. Here the string is taken once, as the parser hands it
//! over; a list is read element by element as the list variant's type.

use serde::Deserialize;
use serde::de::{self, SeqAccess, Visitor};

/// A string, or a list of `T`, read without buffering; `expecting` names both in errors.
pub(crate) fn text_or_list<'de, D, T>(
    d: D,
    expecting: &'static str,
) -> Result<Result<String, Vec<T>>, D::Error>
where
    D: de::Deserializer<'de>,
    T: Deserialize<'de>,
{
    struct V<T>(&'static str, std::marker::PhantomData<T>);
    impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
        type Value = Result<String, Vec<T>>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }

        fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
            Ok(Ok(s.to_owned()))
        }

        fn visit_string<E: de::Error>(self, s: String) -> Result<Self::Value, E> {
            Ok(Ok(s))
        }

        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
            Vec::deserialize(de::value::SeqAccessDeserializer::new(seq)).map(Err)
        }
    }
    d.deserialize_any(V(expecting, std::marker::PhantomData))
}

/// `impl Deserialize` for an enum of a `String` variant and a `Vec<$item>` variant through
/// [`text_or_list`], and its JSON Schema (a string, or an array of `$item`).
macro_rules! text_or_list_enum {
    ($ty:ident, $text:ident, $list:ident($item:ty), $expecting:literal) => {
        impl schemars::JsonSchema for $ty {
            fn schema_name() -> std::borrow::Cow<'static, str> {
                stringify!($ty).into()
            }
            fn json_schema(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
                let item = g.subschema_for::<$item>();
                schemars::json_schema!({
                    "description": $expecting,
                    "anyOf": [{ "type": "string" }, { "type": "array", "items": item }],
                })
            }
        }

        impl<'de> serde::Deserialize<'de> for $ty {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<$ty, D::Error> {
                Ok(
                    match crate::admission::text_or::text_or_list(d, $expecting)? {
                        Ok(s) => $ty::$text(s),
                        Err(v) => $ty::$list(v),
                    },
                )
            }
        }
    };
}
pub(crate) use text_or_list_enum;

#[cfg(test)]
mod tests {
    use super::text_or_list;

    fn parse(json: &str) -> Result<Result<String, Vec<u32>>, String> {
        let mut d = serde_json::Deserializer::from_str(json);
        text_or_list(&mut d, "a string or a list of numbers").map_err(|e| e.to_string())
    }

    #[test]
    fn a_string_or_a_list_and_a_clear_error_for_anything_else() {
        assert_eq!(parse(r#""hi""#), Ok(Ok("hi".into())));
        // Escaped: serde_json unescapes into its scratch buffer and lends it.
        assert_eq!(parse(r#""a\nb \u00e9""#), Ok(Ok("a\nb é".into())));
        let long = "x".repeat(200_000);
        assert_eq!(parse(&format!("\"{long}\"")), Ok(Ok(long)));
        assert_eq!(parse("[1, 2, 3]"), Ok(Err(vec![1, 2, 3])));
        assert_eq!(parse("[]"), Ok(Err(vec![])));
        for bad in ["5", "true", "null", r#"{"a": 1}"#] {
            let e = parse(bad).expect_err(bad);
            assert!(
                e.contains("expected a string or a list of numbers"),
                "{bad}: {e}"
            );
        }
        // A list of the wrong elements fails as that list would.
        let e = parse(r#"["a"]"#).expect_err("strings");
        assert!(e.contains("invalid type: string"), "{e}");
    }
}
