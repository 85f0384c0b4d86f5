//! GPT-2's pre-tokenizer, after an optional digit split, as a scanner: the pieces a byte-level
//! BPE encodes one by one, exactly where `tokenizers`' `Digits` and `ByteLevel` pre-tokenizers
//! cut (their pattern's character classes are taken from `regex-syntax`, the crate that
//! pattern is compiled with; the digit split is `char::is_numeric`, as theirs).

/// How numbers are split before the pattern runs (`tokenizers`' `Digits` pre-tokenizer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Digits {
    /// No digit split.
    None,
    /// Every numeric character alone (`individual_digits: true`).
    Each,
    /// Runs of numeric characters together.
    Runs,
}

/// A character's class in GPT-2's pattern: `\p{L}`, `\p{N}`, `\s`, or anything else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Letter,
    Number,
    Space,
    Other,
}

/// The classes of all characters: a table for those of one and two bytes in UTF-8, sorted
/// disjoint ranges for the rest.
struct Classes {
    ascii: [Class; 128],
    /// U+0080 to U+07FF.
    two: Box<[Class; 0x780]>,
    ranges: Vec<(u32, u32, Class)>,
}

impl Classes {
    /// The classes as `regex-syntax` defines them.
    fn new() -> Result<Classes, String> {
        let mut ranges = Vec::new();
        for (pattern, class) in [
            (r"\p{L}", Class::Letter),
            (r"\p{N}", Class::Number),
            (r"\s", Class::Space),
        ] {
            let hir = regex_syntax::Parser::new()
                .parse(pattern)
                .map_err(|e| e.to_string())?;
            let regex_syntax::hir::HirKind::Class(regex_syntax::hir::Class::Unicode(set)) =
                hir.kind()
            else {
                return Err(format!("{pattern} is not a Unicode class"));
            };
            ranges.extend(
                set.ranges()
                    .iter()
                    .map(|r| (r.start() as u32, r.end() as u32, class)),
            );
        }
        ranges.sort_unstable_by_key(|r| r.0);
        if ranges.windows(2).any(|w| w[0].1 >= w[1].0) {
            return Err("the pattern's character classes overlap".into());
        }
        let mut classes = Classes {
            ascii: [Class::Other; 128],
            two: Box::new([Class::Other; 0x780]),
            ranges,
        };
        for b in 0..128u8 {
            classes.ascii[b as usize] = classes.lookup(b as char);
        }
        for c in 0x80..0x800u32 {
            let class = char::from_u32(c).map_or(Class::Other, |c| classes.lookup(c));
            classes.two[c as usize - 0x80] = class;
        }
        Ok(classes)
    }

    fn lookup(&self, c: char) -> Class {
        let c = c as u32;
        match self.ranges.binary_search_by(|r| r.0.cmp(&c)) {
            Ok(i) => self.ranges[i].2,
            Err(0) => Class::Other,
            Err(i) if c <= self.ranges[i - 1].1 => self.ranges[i - 1].2,
            Err(_) => Class::Other,
        }
    }

    #[inline]
    fn of(&self, c: char) -> Class {
        match c as usize {
            c @ 0..0x80 => self.ascii[c],
            c @ 0x80..0x800 => self.two[c - 0x80],
            _ => self.lookup(c),
        }
    }
}

/// The character at byte `i` of `s` and its length in bytes (`i` must be a char boundary).
#[inline]
fn char_at(s: &str, i: usize) -> Option<(char, usize)> {
    let b = *s.as_bytes().get(i)?;
    if b < 0x80 {
        return Some((b as char, 1));
    }
    let c = s[i..].chars().next()?;
    Some((c, c.len_utf8()))
}

/// GPT-2's contractions after an apostrophe: `'s|'t|'re|'ve|'m|'ll|'d`, their length in bytes
/// after the apostrophe.
#[inline]
fn contraction(rest: &[u8]) -> Option<usize> {
    match rest {
        [b's' | b't' | b'm' | b'd', ..] => Some(1),
        [b'r', b'e', ..] | [b'v', b'e', ..] | [b'l', b'l', ..] => Some(2),
        _ => None,
    }
}

/// GPT-2's pre-tokenizer with its digit split.
pub(super) struct Pretokenizer {
    digits: Digits,
    classes: Classes,
}

impl Pretokenizer {
    pub(super) fn new(digits: Digits) -> Result<Pretokenizer, String> {
        Ok(Pretokenizer {
            digits,
            classes: Classes::new()?,
        })
    }

    /// The words of `text` (which holds no added token), in order: the digit split, then the
    /// pattern. Each word is given as the rest of its piece from the word's start and the word's
    /// length in bytes (so a reader may load past the word's end without leaving the text).
    pub(super) fn split<'t>(&self, text: &'t str, emit: &mut impl FnMut(&'t [u8], usize)) {
        if self.digits == Digits::None {
            return self.pattern(text, emit);
        }
        let b = text.as_bytes();
        let mut from = 0;
        let mut i = 0;
        loop {
            // Only an ASCII digit or a non-ASCII character can be numeric.
            i = digit_or_wide(b, i);
            let Some((c, n)) = char_at(text, i) else {
                break;
            };
            if is_numeric(c) {
                let mut end = i + n;
                if self.digits == Digits::Runs {
                    while let Some((_, m)) = char_at(text, end).filter(|&(d, _)| is_numeric(d)) {
                        end += m;
                    }
                }
                self.pattern(&text[from..i], emit);
                self.pattern(&text[i..end], emit);
                from = end;
                i = end;
            } else {
                i += n;
            }
        }
        self.pattern(&text[from..], emit);
    }

    /// GPT-2's pattern, `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`,
    /// over one piece (its end is the end of the text for the lookahead).
    fn pattern<'t>(&self, s: &'t str, emit: &mut impl FnMut(&'t [u8], usize)) {
        let b = s.as_bytes();
        let mut i = 0;
        while i < b.len() {
            let start = i;
            // The common word, ` ?[A-Za-z]+`, by eight bytes at a time; a non-ASCII character
            // after it goes on by the classes.
            let first = i + usize::from(b[i] == b' ');
            i = if b.get(first).is_some_and(u8::is_ascii_alphabetic) {
                let end = ascii_letters_end(b, first + 1);
                if b.get(end).is_some_and(|&c| c >= 0x80) {
                    self.run(s, end, Class::Letter)
                } else {
                    end
                }
            } else {
                self.word_end(s, i)
            };
            // One call site, so that the caller's word handling is inlined here.
            emit(&b[start..], i - start);
        }
    }

    /// The end of the word of the pattern starting at byte `i` of `s` (before its end).
    #[inline(never)]
    fn word_end(&self, s: &str, i: usize) -> usize {
        let b = s.as_bytes();
        let Some((c, n)) = char_at(s, i) else {
            return s.len();
        };
        if let Some(k) = (c == '\'').then(|| contraction(&b[i + 1..])).flatten() {
            return i + 1 + k;
        }
        let mut class = self.classes.of(c);
        let mut at = i + n;
        if c == ' ' {
            // ` ?X+`: the space joins a following letter, number or other run.
            if let Some((d, _)) = char_at(s, at) {
                let next = self.classes.of(d);
                if next != Class::Space {
                    class = next;
                }
            }
        }
        if class == Class::Space {
            // `\s+(?!\S)`, else `\s+`: a run of spaces, less its last one when something
            // follows (that one starts the next word), unless it is the only one.
            let mut last = i;
            while let Some((_, m)) =
                char_at(s, at).filter(|&(d, _)| self.classes.of(d) == Class::Space)
            {
                last = at;
                at += m;
            }
            if at < s.len() && last > i {
                at = last;
            }
            at
        } else {
            self.run(s, at, class)
        }
    }

    /// The end of the run of `class` characters from byte `at` of `s`.
    #[inline]
    fn run(&self, s: &str, mut at: usize, class: Class) -> usize {
        while let Some((_, m)) = char_at(s, at).filter(|&(d, _)| self.classes.of(d) == class) {
            at += m;
        }
        at
    }
}

/// Eight bytes of `b` from `i` as one word, if there are eight.
#[inline]
fn eight(b: &[u8], i: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(i..i + 8)?.try_into().ok()?))
}

const HIGH: u64 = 0x8080_8080_8080_8080;

/// A byte's value in every byte of a word.
const fn lanes(v: u8) -> u64 {
    v as u64 * 0x0101_0101_0101_0101
}

/// The first index from `i` whose byte is not an ASCII letter (or `b.len()`), eight bytes at
/// a time: a byte is a letter when it is ASCII and, with the case bit set, in `a..=z`.
#[inline]
fn ascii_letters_end(b: &[u8], mut i: usize) -> usize {
    while let Some(x) = eight(b, i) {
        // No lane carries into the next: every lane is at most 0x7f before each addition.
        let folded = (x | lanes(0x20)) & !HIGH;
        let from_a = folded.wrapping_add(lanes(0x80 - b'a'));
        let past_z = folded.wrapping_add(lanes(0x80 - b'z' - 1));
        let letters = from_a & !past_z & !x & HIGH;
        let other = !letters & HIGH;
        if other != 0 {
            return i + (other.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while b.get(i).is_some_and(u8::is_ascii_alphabetic) {
        i += 1;
    }
    i
}

/// The first index from `i` whose byte is an ASCII digit or not ASCII (or `b.len()`), eight
/// bytes at a time; `i` and the answer are character boundaries.
#[inline]
fn digit_or_wide(b: &[u8], mut i: usize) -> usize {
    while let Some(x) = eight(b, i) {
        let low = x & !HIGH;
        let from_0 = low.wrapping_add(lanes(0x80 - b'0'));
        let past_9 = low.wrapping_add(lanes(0x80 - b'9' - 1));
        let hits = ((from_0 & !past_9) | x) & HIGH;
        if hits != 0 {
            return i + (hits.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while b
        .get(i)
        .is_some_and(|&c| c.is_ascii() && !c.is_ascii_digit())
    {
        i += 1;
    }
    i
}

/// `char::is_numeric` (the digit split's test), answered from a short list below U+0300, where
/// nearly all of a Latin text's characters are.
#[inline]
fn is_numeric(c: char) -> bool {
    match c as u32 {
        0..0x80 => c.is_ascii_digit(),
        0x80..0x300 => matches!(c, '\u{b2}' | '\u{b3}' | '\u{b9}' | '\u{bc}'..='\u{be}'),
        _ => c.is_numeric(),
    }
}

#[cfg(test)]
mod tests {
    use super::{Digits, Pretokenizer, ascii_letters_end, digit_or_wide, is_numeric};

    fn words(digits: Digits, text: &str) -> Vec<&str> {
        let mut out = Vec::new();
        Pretokenizer::new(digits)
            .expect("classes")
            .split(text, &mut |tail, n| {
                out.push(std::str::from_utf8(&tail[..n]).expect("a word is whole characters"))
            });
        out
    }

    /// The eight-at-a-time scans stop where a byte-by-byte walk stops, from every start, over
    /// every byte value in every lane position.
    #[test]
    fn the_wide_scans_stop_where_a_walk_stops() {
        let mut text: Vec<u8> = Vec::new();
        for v in 0..=255u8 {
            for gap in [0, 1, 3, 7, 8, 12] {
                text.extend(std::iter::repeat_n(b'q', gap));
                text.push(v);
            }
            text.extend(b"Zebra 0x9");
        }
        let walk = |from: usize, stop: &dyn Fn(u8) -> bool| {
            (from..text.len())
                .find(|&i| stop(text[i]))
                .unwrap_or(text.len())
        };
        for from in 0..=text.len() {
            assert_eq!(
                ascii_letters_end(&text, from),
                walk(from, &|c| !c.is_ascii_alphabetic()),
                "letters from {from}"
            );
            assert_eq!(
                digit_or_wide(&text, from),
                walk(from, &|c| c.is_ascii_digit() || !c.is_ascii()),
                "digits from {from}"
            );
        }
    }

    #[test]
    fn the_short_numeric_list_is_the_standard_librarys() {
        for c in (0..0x400).filter_map(char::from_u32) {
            assert_eq!(is_numeric(c), c.is_numeric(), "{c:?}");
        }
    }

    #[test]
    fn the_pattern_cuts_where_gpt2s_does() {
        let none = |t| words(Digits::None, t);
        assert_eq!(none("a  b"), ["a", " ", " b"]);
        assert_eq!(
            none("it's they're 'S"),
            ["it", "'s", " they", "'re", " '", "S"]
        );
        assert_eq!(none("x \t\ny"), ["x", " \t", "\n", "y"]);
        assert_eq!(none("end  "), ["end", "  "]);
        assert_eq!(none(" 12 ab!? ."), [" 12", " ab", "!?", " ."]);
        assert_eq!(none("\u{a0}é\u{3000}中"), ["\u{a0}", "é", "\u{3000}", "中"]);
        assert_eq!(none(".'s"), [".'", "s"]);
        assert_eq!(none(""), Vec::<&str>::new());
    }

    #[test]
    fn digits_split_before_the_pattern() {
        assert_eq!(words(Digits::Each, "a 12b"), ["a", " ", "1", "2", "b"]);
        assert_eq!(words(Digits::Runs, "a 12b٣"), ["a", " ", "12", "b", "٣"]);
        assert_eq!(words(Digits::Runs, "x ²³"), ["x", " ", "²³"]);
    }
}
