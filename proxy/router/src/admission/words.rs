//! Keys for one call's table of words: a short word packed into integers.

/// A word of 2 to 16 bytes as a key that tells it from every other such word: its length and
/// two loads that together cover all its bytes (overlapping where it is shorter than the two);
/// `None` for other lengths.
#[inline]
pub(super) fn pack(b: &[u8]) -> Option<(u64, u64, u8)> {
    let n = b.len();
    let (lo, hi) = match n {
        8..=16 => (
            u64::from_le_bytes(b[..8].try_into().ok()?),
            u64::from_le_bytes(b[n - 8..].try_into().ok()?),
        ),
        4..=7 => (
            u64::from(u32::from_le_bytes(b[..4].try_into().ok()?)),
            u64::from(u32::from_le_bytes(b[n - 4..].try_into().ok()?)),
        ),
        2..=3 => (
            u64::from(u16::from_le_bytes(b[..2].try_into().ok()?)),
            u64::from(u16::from_le_bytes(b[n - 2..].try_into().ok()?)),
        ),
        _ => return None,
    };
    Some((lo, hi, n as u8))
}

#[cfg(test)]
mod tests {
    /// Every word of 2 to 16 bytes over two byte values (all 131,068 of them) packs to its own key,
    /// so no byte of any position is left out of it; other lengths do not pack.
    #[test]
    fn packed_words_are_told_apart_at_every_length() {
        let mut keys = std::collections::HashSet::new();
        let mut count = 0;
        for n in 2..=16u32 {
            for bits in 0..1u32 << n {
                let word: Vec<u8> = (0..n).map(|i| b'a' + (bits >> i & 1) as u8).collect();
                assert!(keys.insert(super::pack(&word).expect("packs")), "{word:?}");
                count += 1;
            }
        }
        assert_eq!(keys.len(), count);
        for n in [0, 1, 17, 40] {
            assert_eq!(super::pack(&vec![b'x'; n]), None);
        }
    }
}
