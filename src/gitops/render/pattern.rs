//! The CRD's patterns, matched with the `regex` crate (linear time, no
//! recursion on the input) in Go's RE2 dialect, which the API server uses.
//!
//! The two dialects share their syntax; where a pattern would mean something
//! else in Rust, [`translate`] rewrites it to Go's meaning: `\d \w \s \b` and
//! their negations are ASCII-only, and inside a class `[`, `&` and `~` are
//! literals (not nested classes or set operations). Syntax the crate rejects
//! yields `None` and is left to the API server.

use regex::{Regex, RegexBuilder};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// Bounds for a hostile pattern: compiled program size and group nesting.
const SIZE_LIMIT: usize = 1 << 20;
const NEST_LIMIT: u32 = 100;

/// A compiled pattern; `None` from `compile` for syntax the crate lacks (the
/// API server still checks those).
#[derive(Clone, Debug)]
pub(super) struct Pattern(Regex);

impl Pattern {
    pub(super) fn compile(source: &str) -> Option<Pattern> {
        RegexBuilder::new(&translate(source))
            .size_limit(SIZE_LIMIT)
            .nest_limit(NEST_LIMIT)
            .build()
            .ok()
            .map(Pattern)
    }

    /// [`Pattern::compile`], remembered per source (the CRD has a handful).
    pub(super) fn cached(source: &str) -> Option<Pattern> {
        static CACHE: OnceLock<Mutex<HashMap<String, Option<Pattern>>>> = OnceLock::new();
        let mut cache = CACHE.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
        cache.entry(source.to_owned()).or_insert_with(|| Pattern::compile(source)).clone()
    }

    /// Whether the pattern matches somewhere in `text` (Go's `MatchString`).
    pub(super) fn is_match(&self, text: &str) -> bool {
        self.0.is_match(text)
    }
}

/// Rewrites the places where Rust's dialect differs from Go's to Go's meaning.
fn translate(source: &str) -> String {
    let mut out = String::with_capacity(source.len() + 16);
    let mut chars = source.chars().peekable();
    let mut in_class = false;
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(e @ ('d' | 'D' | 'w' | 'W' | 's' | 'S')) => out.push_str(perl_class(e, in_class)),
                Some(e @ ('b' | 'B')) if !in_class => {
                    out.push_str(if e == 'b' { r"(?-u:\b)" } else { r"(?-u:\B)" })
                }
                Some(e) => {
                    out.push('\\');
                    out.push(e);
                }
                None => out.push('\\'),
            },
            '[' if !in_class => {
                in_class = true;
                out.push('[');
                if chars.peek() == Some(&'^') {
                    out.push(chars.next().unwrap_or('^'));
                }
                // A leading `]` is a literal in both dialects.
                if chars.peek() == Some(&']') {
                    chars.next();
                    out.push_str(r"\]");
                }
            }
            // `[:alpha:]` is a POSIX class in both; any other `[` is a literal in Go.
            '[' if chars.peek() == Some(&':') => {
                out.push('[');
                for p in chars.by_ref() {
                    out.push(p);
                    if p == ']' {
                        break;
                    }
                }
            }
            '[' | '&' | '~' if in_class => {
                out.push('\\');
                out.push(c);
            }
            ']' if in_class => {
                in_class = false;
                out.push(']');
            }
            _ => out.push(c),
        }
    }
    out
}

/// Go's ASCII-only Perl classes, spelled for inside or outside a class.
fn perl_class(e: char, in_class: bool) -> &'static str {
    match (e, in_class) {
        ('d', false) => "[0-9]",
        ('d', true) => "0-9",
        ('D', _) => "[^0-9]",
        ('w', false) => "[0-9A-Za-z_]",
        ('w', true) => "0-9A-Za-z_",
        ('W', _) => "[^0-9A-Za-z_]",
        ('s', false) => r"[\t\n\f\r ]",
        ('s', true) => r"\t\n\f\r ",
        _ => r"[^\t\n\f\r ]",
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::*;
    use super::*;

    #[test]
    fn patterns_of_the_crd_match_like_re2() {
        let host_key = Pattern::compile(r"^SHA256:[A-Za-z0-9+/]{43}=?$").unwrap();
        assert!(host_key.is_match(HOST_KEY));
        assert!(host_key.is_match(&format!("{HOST_KEY}=")));
        assert!(!host_key.is_match("SHA256:short"));
        assert!(!host_key.is_match(&format!("{HOST_KEY}xx")));
        let label = Pattern::compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$").unwrap();
        for ok in ["a", "web-01", "0a"] {
            assert!(label.is_match(ok), "{ok}");
        }
        for bad in ["", "-a", "a-", "Web", "a.b", "a_b"] {
            assert!(!label.is_match(bad), "{bad}");
        }
        let quantity = Pattern::compile(r"^[0-9]+(Ki|Mi|Gi|Ti|k|M|G|T)?$").unwrap();
        assert!(quantity.is_match("4Gi") && quantity.is_match("512") && !quantity.is_match("4GB"));
        let vmid = Pattern::compile(r"^[0-9]{1,9}$").unwrap();
        assert!(vmid.is_match("1") && vmid.is_match("123456789") && !vmid.is_match("1234567890"));
        let slash = Pattern::compile("^/").unwrap();
        assert!(slash.is_match("/health") && !slash.is_match("health"));
        let unanchored = Pattern::compile(r"b\d+|x(?:y|z)*").unwrap();
        assert!(unanchored.is_match("aab12") && unanchored.is_match("x") && !unanchored.is_match("ab"));
        // Syntax the crate rejects is left to the API server; Unicode classes are RE2 too.
        assert!(Pattern::compile(r"\p{L}").unwrap().is_match("é"));
        assert!(Pattern::compile("(a").is_none());
        assert!(Pattern::compile(r"(a)\1").is_none());
        // Go's meaning where Rust's dialect differs: ASCII Perl classes and
        // word boundaries, `[` and `&&` as literals inside a class.
        assert!(!Pattern::compile(r"^\d$").unwrap().is_match("٣"));
        assert!(Pattern::compile(r"^[\D]$").unwrap().is_match("٣"));
        assert!(!Pattern::compile(r"^\w+$").unwrap().is_match("é"));
        assert!(!Pattern::compile(r"^\s$").unwrap().is_match("\u{a0}"));
        assert!(Pattern::compile(r"^\S$").unwrap().is_match("\u{a0}"));
        assert!(Pattern::compile(r"a\b").unwrap().is_match("aé"));
        assert!(Pattern::compile(r"^[[a]+$").unwrap().is_match("[a["));
        assert!(Pattern::compile(r"^[a&&b]+$").unwrap().is_match("a&b"));
        assert!(Pattern::compile(r"^[[:digit:]x]+$").unwrap().is_match("1x2"));
        assert!(Pattern::compile(r"^[]a]+$").unwrap().is_match("]a"));
        // Long input: linear, no recursion on the input.
        assert!(label.is_match(&"a".repeat(100_000)));
    }
}
