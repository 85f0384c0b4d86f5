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

/// The classes of all characters: a table for ASCII, sorted disjoint ranges for the rest.
struct Classes {
    ascii: [Class; 128],
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
            ranges,
        };
        for b in 0..128u8 {
            classes.ascii[b as usize] = classes.lookup(b as char);
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
        if c.is_ascii() {
            self.ascii[c as usize]
        } else {
            self.lookup(c)
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
    /// pattern.
    pub(super) fn split<'t>(&self, text: &'t str, emit: &mut impl FnMut(&'t str)) {
        if self.digits == Digits::None {
            return self.pattern(text, emit);
        }
        let mut from = 0;
        let mut i = 0;
        while let Some((c, n)) = char_at(text, i) {
            let numeric = if c.is_ascii() {
                c.is_ascii_digit()
            } else {
                c.is_numeric()
            };
            if numeric {
                let mut end = i + n;
                if self.digits == Digits::Runs {
                    while let Some((_, m)) = char_at(text, end).filter(|(d, _)| d.is_numeric()) {
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
    fn pattern<'t>(&self, s: &'t str, emit: &mut impl FnMut(&'t str)) {
        let b = s.as_bytes();
        let mut i = 0;
        while let Some((c, n)) = char_at(s, i) {
            let start = i;
            if let Some(k) = (c == '\'').then(|| contraction(&b[i + 1..])).flatten() {
                i += 1 + k;
                emit(&s[start..i]);
                continue;
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
            } else {
                while let Some((_, m)) =
                    char_at(s, at).filter(|&(d, _)| self.classes.of(d) == class)
                {
                    at += m;
                }
            }
            i = at;
            emit(&s[start..i]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Digits, Pretokenizer};

    fn words(digits: Digits, text: &str) -> Vec<&str> {
        let mut out = Vec::new();
        Pretokenizer::new(digits)
            .expect("classes")
            .split(text, &mut |w| out.push(w));
        out
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
