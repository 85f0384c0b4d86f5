//! Canary secrets: `cnry` and 16 random hex digits, one per short request, and the scan that finds
//! another request's whole secret in an answer.

use std::collections::HashSet;
use std::sync::Mutex;

/// The secret's prefix.
pub const PREFIX: &str = "cnry";
/// Hex digits after the prefix.
pub const HEX_DIGITS: usize = 16;

/// Every secret this run has sent, so an answer can be checked for one that is not its own.
#[derive(Debug, Default)]
pub struct Secrets {
    issued: Mutex<Issued>,
}

/// The most recent secrets, bounded so a probe that runs for weeks stays small: a leak is KV of a
/// request in flight or just finished, far newer than the oldest of these.
#[derive(Debug, Default)]
struct Issued {
    set: HashSet<String>,
    order: std::collections::VecDeque<String>,
}

/// Secrets remembered (about 12 MiB at most).
const REMEMBERED: usize = 1 << 17;

impl Secrets {
    /// A fresh secret, remembered before it is sent.
    pub fn issue(&self) -> String {
        let n: u64 = rand::random();
        let s = format!("{PREFIX}{n:016x}");
        let mut g = self.issued.lock().unwrap_or_else(|p| p.into_inner());
        if g.order.len() == REMEMBERED
            && let Some(old) = g.order.pop_front()
        {
            g.set.remove(&old);
        }
        g.set.insert(s.clone());
        g.order.push_back(s.clone());
        s
    }

    /// The secrets of other requests of this run that `text` holds whole (`own`, the request's
    /// own secret, is not a leak; canary-shaped words this run never sent are not either).
    pub fn foreign_in(&self, text: &str, own: Option<&str>) -> Vec<String> {
        let found = scan(text);
        if found.is_empty() {
            return found;
        }
        let issued = self.issued.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<String> = found
            .into_iter()
            .filter(|s| Some(s.as_str()) != own && issued.set.contains(s))
            .collect();
        out.sort();
        out.dedup();
        out
    }
}

/// Every canary-shaped word in `text`: the prefix and exactly 16 lowercase hex digits, not
/// followed by another hex digit.
pub fn scan(text: &str) -> Vec<String> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(off) = text[from..].find(PREFIX) {
        let start = from + off;
        let hex = start + PREFIX.len();
        let end = hex + HEX_DIGITS;
        let is_hex = |c: u8| c.is_ascii_digit() || (b'a'..=b'f').contains(&c);
        if end <= b.len()
            && b[hex..end].iter().all(|&c| is_hex(c))
            && b.get(end).is_none_or(|&c| !is_hex(c))
        {
            out.push(text[start..end].to_string());
        }
        from = start + PREFIX.len();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_whole_secrets_of_other_requests_are_foreign() {
        let s = Secrets::default();
        let (a, b) = (s.issue(), s.issue());
        assert_ne!(a, b);
        assert_eq!(a.len(), PREFIX.len() + HEX_DIGITS);
        // Its own secret is no leak; another's is.
        assert!(
            s.foreign_in(&format!("say {a} twice {a}"), Some(&a))
                .is_empty()
        );
        assert_eq!(s.foreign_in(&format!("x{b}."), Some(&a)), vec![b.clone()]);
        // Cut short, or one hex digit longer: not that secret.
        assert!(s.foreign_in(&b[..b.len() - 1], Some(&a)).is_empty());
        assert!(s.foreign_in(&format!("{b}0"), Some(&a)).is_empty());
        // Canary-shaped but never sent by this run: not a leak.
        assert!(s.foreign_in("cnry0123456789abcdef", None).is_empty());
        assert_eq!(
            scan("cnry0123456789abcdef cnryzz"),
            vec!["cnry0123456789abcdef"]
        );
    }
}
