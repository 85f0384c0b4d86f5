//! The one range check of the sampling knobs every front end takes, parameterised by where the
//! fields sit (`""` for OpenAI's top level, `sampling_params.` for `/generate`): the bounds are
//! OpenAI's, which SGLang's and vLLM's own checks are no looser than, so what lockstep admits a
//! worker takes.

use lockstep_core::error::LockstepError;

/// The knobs, as a request gave them (`None`: not given).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Knobs {
    pub(crate) temperature: Option<f64>,
    pub(crate) top_p: Option<f64>,
    pub(crate) top_k: Option<i64>,
    pub(crate) frequency_penalty: Option<f64>,
    pub(crate) presence_penalty: Option<f64>,
}

/// The knobs' bounds: temperature in [0, 2], top_p in (0, 1], top_k -1 or 0 (off: SGLang's and
/// vLLM's spellings) or at least 1, penalties in [-2, 2]. `at` prefixes each field's name in the error's `param` and message.
pub(crate) fn check(at: &str, k: &Knobs) -> Result<(), LockstepError> {
    let bad = |name: &str, rule: &str, got: String| LockstepError::InvalidRequest {
        message: format!("`{at}{name}` must be {rule}, got {got}"),
        param: Some(format!("{at}{name}")),
    };
    if let Some(t) = k.temperature
        && !(0.0..=2.0).contains(&t)
    {
        return Err(bad("temperature", "between 0 and 2", t.to_string()));
    }
    if let Some(p) = k.top_p
        && !(p > 0.0 && p <= 1.0)
    {
        return Err(bad("top_p", "in (0, 1]", p.to_string()));
    }
    if let Some(n) = k.top_k
        && n < -1
    {
        return Err(bad("top_k", "-1 or 0 (off) or at least 1", n.to_string()));
    }
    for (name, v) in [
        ("frequency_penalty", k.frequency_penalty),
        ("presence_penalty", k.presence_penalty),
    ] {
        if let Some(v) = v
            && !(-2.0..=2.0).contains(&v)
        {
            return Err(bad(name, "between -2 and 2", v.to_string()));
        }
    }
    Ok(())
}

/// `top_k` as lockstep forwards it: off (`-1` or `0`, spelled differently by SGLang, which
/// refuses `0`, and vLLM) is not sent, so every backend reads its own "off".
pub(crate) fn top_k(k: Option<i64>) -> Option<i64> {
    k.filter(|k| *k >= 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param(at: &str, k: Knobs) -> Option<String> {
        match check(at, &k) {
            Ok(()) => None,
            Err(LockstepError::InvalidRequest { param, message }) => {
                let p = param.expect("named");
                assert!(message.starts_with(&format!("`{p}` must be")), "{message}");
                Some(p)
            }
            Err(e) => panic!("{e:?}"),
        }
    }

    #[test]
    fn each_knob_is_bounded_and_named_where_it_sits() {
        let ok = Knobs {
            temperature: Some(2.0),
            top_p: Some(1.0),
            top_k: Some(-1),
            frequency_penalty: Some(-2.0),
            presence_penalty: Some(2.0),
        };
        assert_eq!(param("", ok), None);
        for k in [0, 1, 40] {
            let knobs = Knobs {
                top_k: Some(k),
                temperature: Some(0.0),
                ..ok
            };
            assert_eq!(param("", knobs), None);
        }
        // Off, however spelled, is not sent.
        assert_eq!(
            [-1, 0, 1, 40].map(|k| top_k(Some(k))),
            [None, None, Some(1), Some(40)]
        );
        for (k, name) in [
            (
                Knobs {
                    temperature: Some(2.01),
                    ..ok
                },
                "temperature",
            ),
            (
                Knobs {
                    temperature: Some(-0.1),
                    ..ok
                },
                "temperature",
            ),
            (
                Knobs {
                    temperature: Some(f64::NAN),
                    ..ok
                },
                "temperature",
            ),
            (
                Knobs {
                    top_p: Some(0.0),
                    ..ok
                },
                "top_p",
            ),
            (
                Knobs {
                    top_p: Some(1.5),
                    ..ok
                },
                "top_p",
            ),
            (
                Knobs {
                    top_k: Some(-2),
                    ..ok
                },
                "top_k",
            ),
            (
                Knobs {
                    frequency_penalty: Some(2.5),
                    ..ok
                },
                "frequency_penalty",
            ),
            (
                Knobs {
                    presence_penalty: Some(-3.0),
                    ..ok
                },
                "presence_penalty",
            ),
        ] {
            assert_eq!(param("", k), Some(name.to_string()));
            assert_eq!(
                param("sampling_params.", k),
                Some(format!("sampling_params.{name}"))
            );
        }
    }
}
