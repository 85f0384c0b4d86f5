//! The machine's migration refusals one by one: each condition that keeps a committed
//! stream from moving to a new pair, with the stream that does move as the control.

use super::machine::{Action, Env, Limits, Machine, Observation};
use crate::backend::Side;

const SENT: u64 = 3;

fn limits(decode_counts_prompt: bool) -> Limits {
    Limits {
        expected: SENT,
        decode_counts_prompt,
        max_retries: 2,
        max_migrations: 2,
        max_migrated_tokens: 16,
        max_new: 16,
        resumable: true,
    }
}

#[test]
fn nothing_migrates_without_the_delivered_ids_or_on_a_backend_that_cannot_resume() {
    let env = Env {
        client_open: true,
        draining: false,
        unsent: Some(0),
    };
    let crash = Observation::HalfFailed {
        side: Side::Decode,
        retry_safe: false,
        integrity: false,
        migratable: true,
    };
    let first = |tokens| Observation::Decode {
        prompt_tokens: Some(SENT),
        digest: None,
        last: false,
        tokens,
    };
    let run_with = |limits: Limits, tokens: Option<u32>, unsent: Option<u64>| {
        let mut m = Machine::new(limits);
        let mut all = Vec::new();
        for input in [
            Observation::Picked,
            Observation::Prefill {
                prompt_tokens: SENT,
                digest: None,
            },
            first(tokens),
            Observation::Delivered,
            Observation::Delivered,
        ] {
            all.extend(m.step(input, env));
        }
        all.extend(m.step(crash, Env { unsent, ..env }));
        (m, all)
    };
    let run = |limits: Limits, tokens: Option<u32>| run_with(limits, tokens, Some(0));
    let migrated = |all: &[Action]| all.iter().any(|a| matches!(a, Action::Migrate { .. }));
    let (m, all) = run(limits(true), Some(1));
    assert!(migrated(&all), "{all:?}");
    assert_eq!((m.expected(), m.migrations()), (SENT + 1, 1));
    let (_, all) = run(limits(true), None);
    assert!(!migrated(&all), "ids unknown: {all:?}");
    // The delivered text is not known to be the delivered ids': nothing is carried.
    let (_, all) = run_with(limits(true), Some(1), None);
    assert!(!migrated(&all), "text unknown: {all:?}");
    // The client lacks the last token's text (half a character): it is generated again.
    let (m, all) = run_with(limits(true), Some(1), Some(1));
    assert!(
        all.contains(&Action::Migrate {
            verdict: super::machine::Verdict::Half {
                side: Side::Decode,
                retry_safe: false,
                integrity: false,
                migratable: true
            },
            carried: 0
        }),
        "{all:?}"
    );
    assert_eq!(m.expected(), SENT);
    let (_, all) = run_with(limits(true), Some(1), Some(2));
    assert!(!migrated(&all), "more unsent than delivered: {all:?}");
    let (_, all) = run(
        Limits {
            resumable: false,
            ..limits(true)
        },
        Some(1),
    );
    assert!(!migrated(&all), "not resumable: {all:?}");
    let (_, all) = run(
        Limits {
            max_migrations: 0,
            ..limits(true)
        },
        Some(1),
    );
    assert!(!migrated(&all), "max_migrations 0: {all:?}");
    let (_, all) = run(
        Limits {
            max_migrated_tokens: 0,
            ..limits(true)
        },
        Some(1),
    );
    assert!(!migrated(&all), "over max_migrated_tokens: {all:?}");
    let (_, all) = run(
        Limits {
            max_new: 1,
            ..limits(true)
        },
        Some(1),
    );
    assert!(!migrated(&all), "no tokens left: {all:?}");
}

#[test]
fn only_the_tokens_whose_text_the_client_has_whole_are_carried() {
    use super::lifecycle::unsent;
    use lockstep_prompt::Detok;
    // Ids are bytes; their text is the bytes as UTF-8, a split character as U+FFFD.
    let detok: Detok = std::sync::Arc::new(|ids: &[u32]| {
        let bytes: Vec<u8> = ids.iter().map(|&b| b as u8).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    });
    let ids = |s: &[u8]| s.iter().map(|&b| u32::from(b)).collect::<Vec<u32>>();
    let d = Some(&detok);
    assert_eq!(unsent(d, &ids(b"ab"), "ab", &[]), Some(0));
    // Half of `é` was delivered as a token, not as text: it is generated again.
    assert_eq!(unsent(d, &ids(&[b'a', 0xC3]), "a", &[]), Some(1));
    // A worker holding text back for a stop string: its ids are ahead of its text.
    assert_eq!(unsent(d, &ids(b"abc"), "a", &["zzz".into()]), Some(2));
    // Text that is no prefix of the ids' is not the stream's: nothing is carried.
    assert_eq!(unsent(d, &ids(b"abc"), "xy", &[]), None);
    // The text ends with the start of a stop string: the new pair could not match it whole.
    assert_eq!(unsent(d, &ids(b"abE"), "abE", &["END".into()]), None);
    assert_eq!(unsent(d, &ids(b"abE"), "abE", &["XYZ".into()]), Some(0));
    // No byte-level detokenizer: nothing can be proven.
    assert_eq!(unsent(None, &ids(b"ab"), "ab", &[]), None);
}
