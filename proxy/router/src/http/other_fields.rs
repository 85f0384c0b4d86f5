//! Request objects read as "known fields, and the rest kept": each known field parsed as its
//! type, every other key kept (in order) for [`super::fields`] to accept or refuse. This is what
//! `#[serde(flatten)] rest: Map<String, Value>` does, without serde's buffering of the whole
//! object into an intermediate tree first (one allocation per key and value, on every request).

use std::borrow::Cow;

use serde::de::{self, Deserializer, Visitor};

/// An object key: borrowed from the body where it has no escapes.
pub(crate) struct Key<'de>(pub(crate) Cow<'de, str>);

impl<'de> serde::Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct K;
        impl<'de> Visitor<'de> for K {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a key")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v)))
            }
        }
        d.deserialize_str(K)
    }
}

/// Defines a struct of the named fields plus `rest: serde_json::Map<String, serde_json::Value>`
/// (every other key, in order), and its `Deserialize`: each named field `Default` when absent,
/// a repeated key refused.
macro_rules! known_and_rest {
    (
        $(#[$m:meta])*
        $vis:vis struct $name:ident {
            $($(#[$fm:meta])* $fvis:vis $field:ident : $ty:ty),* $(,)?
        }
    ) => {
        $(#[$m])*
        #[derive(schemars::JsonSchema)]
        $vis struct $name {
            $($(#[$fm])* $fvis $field: $ty,)*
            /// Every other key, in order: accepted or refused by [`crate::http::fields`].
            #[serde(flatten)]
            rest: serde_json::Map<String, serde_json::Value>,
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct V;
                impl<'de> serde::de::Visitor<'de> for V {
                    type Value = $name;
                    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                        f.write_str(concat!("struct ", stringify!($name)))
                    }
                    fn visit_map<A: serde::de::MapAccess<'de>>(
                        self,
                        mut map: A,
                    ) -> Result<$name, A::Error> {
                        $(let mut $field: Option<$ty> = None;)*
                        let mut rest = serde_json::Map::new();
                        while let Some(key) = map.next_key::<$crate::http::other_fields::Key<'de>>()? {
                            match key.0.as_ref() {
                                $(stringify!($field) => {
                                    if $field.is_some() {
                                        return Err(serde::de::Error::duplicate_field(
                                            stringify!($field),
                                        ));
                                    }
                                    $field = Some(map.next_value()?);
                                })*
                                _ => {
                                    let v: serde_json::Value = map.next_value()?;
                                    if rest.insert(key.0.clone().into_owned(), v).is_some() {
                                        return Err(serde::de::Error::custom(format!(
                                            "duplicate field `{}`",
                                            key.0
                                        )));
                                    }
                                }
                            }
                        }
                        Ok($name {
                            $($field: $field.unwrap_or_default(),)*
                            rest,
                        })
                    }
                }
                d.deserialize_map(V)
            }
        }
    };
}
pub(crate) use known_and_rest;

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    known_and_rest! {
        #[derive(Debug, Default, PartialEq)]
        struct Inner {
            n: Option<i64>,
        }
    }

    known_and_rest! {
        #[derive(Debug, PartialEq)]
        struct Outer {
            name: Option<String>,
            on: bool,
            inner: Inner,
        }
    }

    fn parse(v: &str) -> Result<Outer, String> {
        let de = &mut serde_json::Deserializer::from_str(v);
        serde_path_to_error::deserialize(de).map_err(|e| format!("{}: {}", e.path(), e.inner()))
    }

    #[test]
    fn known_fields_are_typed_and_the_rest_kept_in_order() {
        let o =
            parse(r#"{"zeta":1,"name":"a","inner":{"n":3,"k":[1]},"alpha":{"x":null},"on":true}"#)
                .expect("parses");
        assert_eq!(o.name.as_deref(), Some("a"));
        assert!(o.on);
        assert_eq!(o.inner.n, Some(3));
        assert_eq!(Value::Object(o.inner.rest), json!({"k": [1]}));
        let keys: Vec<&str> = o.rest.keys().map(String::as_str).collect();
        assert_eq!(keys, ["zeta", "alpha"]);
        assert_eq!(o.rest["alpha"], json!({"x": null}));
        // Absent and null: the field's default.
        let o = parse(r#"{"name":null}"#).expect("parses");
        assert_eq!((o.name, o.on, o.inner), (None, false, Inner::default()));
        // An escaped key is still the field it spells.
        assert_eq!(
            parse(r#"{"na\u006de":"b"}"#)
                .expect("parses")
                .name
                .as_deref(),
            Some("b")
        );
    }

    #[test]
    fn wrong_types_repeats_and_non_objects_are_refused_with_their_path() {
        let e = parse(r#"{"inner":{"n":"three"}}"#).expect_err("wrong type");
        assert!(e.starts_with("inner.n: invalid type: string"), "{e}");
        let e = parse(r#"{"on":null}"#).expect_err("null bool");
        assert!(e.starts_with("on: invalid type: null"), "{e}");
        let e = parse(r#"{"name":"a","name":"b"}"#).expect_err("repeated");
        assert!(e.contains("duplicate field `name`"), "{e}");
        let e = parse(r#"{"x":1,"x":2}"#).expect_err("repeated unknown");
        assert!(e.contains("duplicate field `x`"), "{e}");
        let e = parse("[1]").expect_err("not an object");
        assert!(e.contains("expected struct Outer"), "{e}");
        let e = parse(r#"{"inner":5}"#).expect_err("inner not an object");
        assert!(
            e.starts_with("inner: invalid type: integer `5`, expected struct Inner"),
            "{e}"
        );
    }
}
