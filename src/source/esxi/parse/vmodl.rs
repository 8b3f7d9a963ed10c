//! The VMODL pretty-print object parser ([`Vmodl`], [`parse_vmodl`]) for the
//! `(type) { ... }` dumps of `get.guest`, `get.summary` and faults.

use super::vim_cmd::find_typed_brace;

/// A VMODL pretty-print value, as in `get.guest` / `get.summary` dumps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) enum Vmodl {
    Object {
        type_name: String,
        fields: Vec<(String, Vmodl)>,
    },
    Array {
        type_name: String,
        items: Vec<Vmodl>,
    },
    Str(String),
    /// A single-quoted managed object reference, e.g. `vim.HostSystem:ha-host`.
    Ref(String),
    /// `<unset>`
    #[default]
    Unset,
    /// A typed null, e.g. `(vim.vm.QuestionInfo) null`.
    Null,
    /// Numbers, `true`/`false`, anything else unquoted.
    Scalar(String),
}

impl Vmodl {
    /// The first field called `name` of an object.
    pub(crate) fn field(&self, name: &str) -> Option<&Vmodl> {
        match self {
            Vmodl::Object { fields, .. } => fields.iter().find(|(k, _)| k == name).map(|(_, v)| v),
            _ => None,
        }
    }

    /// Follows nested object fields, e.g. `["config", "name"]`.
    pub(crate) fn path(&self, path: &[&str]) -> Option<&Vmodl> {
        path.iter().try_fold(self, |v, name| v.field(name))
    }

    /// The text of a string, reference or scalar.
    pub(crate) fn as_str(&self) -> Option<&str> {
        match self {
            Vmodl::Str(s) | Vmodl::Ref(s) | Vmodl::Scalar(s) => Some(s),
            _ => None,
        }
    }

    /// The items of an array; empty for anything else.
    pub(crate) fn items(&self) -> &[Vmodl] {
        match self {
            Vmodl::Array { items, .. } => items,
            _ => &[],
        }
    }

    /// The type of an object or array.
    pub(crate) fn type_name(&self) -> Option<&str> {
        match self {
            Vmodl::Object { type_name, .. } | Vmodl::Array { type_name, .. } => Some(type_name),
            _ => None,
        }
    }
}

/// Nesting deeper than this makes [`parse_vmodl`] give up (returns `None`).
pub(crate) const VMODL_MAX_DEPTH: usize = 64;

/// Finds the first `(type) {` in `text` and parses the object up to its
/// matching `}`. Tolerates `, ` / `,` line ends, missing commas, `dynamicType`
/// lines, truncation (returns what was read) and stray text. `None` if there is
/// no object or nesting exceeds [`VMODL_MAX_DEPTH`].
pub(crate) fn parse_vmodl(text: &str) -> Option<Vmodl> {
    let start = find_object_start(text)?;
    let mut p = VmodlParser { s: text, pos: start, too_deep: false, no_string_end_from: usize::MAX };
    let v = p.value(0);
    if p.too_deep { None } else { v }
}

/// Byte offset of the `(` of the first `(type) {`.
fn find_object_start(text: &str) -> Option<usize> {
    find_typed_brace(text, |_| true).map(|(open, _, _)| open)
}

struct VmodlParser<'a> {
    s: &'a str,
    /// Always on a char boundary.
    pos: usize,
    too_deep: bool,
    /// A multi-line string scan from here found no closing line up to the end
    /// of the text; later scans stop here (keeps parsing linear).
    no_string_end_from: usize,
}

fn is_ident_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b'$'
}

impl VmodlParser<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.as_bytes().get(self.pos).copied()
    }

    fn rest(&self) -> &str {
        self.s.get(self.pos..).unwrap_or("")
    }

    /// Advances one byte; only call when the current byte is ASCII.
    fn bump_ascii(&mut self) {
        self.pos = self.pos.saturating_add(1).min(self.s.len());
    }

    /// Advances one char.
    fn bump_char(&mut self) {
        let len = self.rest().chars().next().map_or(1, char::len_utf8);
        self.pos = self.pos.saturating_add(len).min(self.s.len());
    }

    fn skip_inline_ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\r')) {
            self.bump_ascii();
        }
    }

    fn skip_ws_and_commas(&mut self) {
        while self.peek().is_some_and(|b| b.is_ascii_whitespace() || b == b',') {
            self.bump_ascii();
        }
    }

    /// End (exclusive) of the current line.
    fn line_end(&self) -> usize {
        self.rest().find('\n').map_or(self.s.len(), |i| self.pos.saturating_add(i))
    }

    fn value(&mut self, depth: usize) -> Option<Vmodl> {
        if depth > VMODL_MAX_DEPTH {
            self.too_deep = true;
            return None;
        }
        self.skip_inline_ws();
        match self.peek()? {
            b'(' => {
                let rest = self.rest();
                let close = rest.find([')', '\n']).unwrap_or(rest.len());
                if rest.as_bytes().get(close) != Some(&b')') {
                    // `(` without `)` on its line: keep the text, skip the line.
                    let text = rest.get(..close).unwrap_or("").trim().to_string();
                    self.pos = self.pos.saturating_add(close);
                    return Some(Vmodl::Scalar(text));
                }
                let type_name = rest.get(1..close).unwrap_or("").trim().to_string();
                self.pos = self.pos.saturating_add(close).saturating_add(1);
                self.skip_inline_ws();
                match self.peek() {
                    Some(b'{') => {
                        self.bump_ascii();
                        self.object(type_name, depth)
                    }
                    Some(b'[') => {
                        self.bump_ascii();
                        self.array(type_name, depth)
                    }
                    None | Some(b'\n' | b',' | b'}' | b']') => Some(Vmodl::Null),
                    Some(_) if self.rest().starts_with("null") => {
                        self.pos = self.pos.saturating_add(4);
                        Some(Vmodl::Null)
                    }
                    Some(_) => Some(self.plain()),
                }
            }
            b'{' => {
                self.bump_ascii();
                self.object(String::new(), depth)
            }
            b'[' => {
                self.bump_ascii();
                self.array(String::new(), depth)
            }
            _ => Some(self.plain()),
        }
    }

    fn object(&mut self, type_name: String, depth: usize) -> Option<Vmodl> {
        let mut fields = Vec::new();
        loop {
            self.skip_ws_and_commas();
            match self.peek() {
                None => break,
                Some(b'}') => {
                    self.bump_ascii();
                    break;
                }
                // Mismatched closer: let the enclosing array consume it.
                Some(b']') => break,
                Some(b) if is_ident_byte(b) => {
                    let start = self.pos;
                    while self.peek().is_some_and(is_ident_byte) {
                        self.bump_ascii();
                    }
                    let name = self.s.get(start..self.pos).unwrap_or("").to_string();
                    self.skip_inline_ws();
                    if self.peek() == Some(b'=') {
                        self.bump_ascii();
                        match self.value(depth.saturating_add(1)) {
                            Some(v) => fields.push((name, v)),
                            None if self.too_deep => return None,
                            None => break,
                        }
                    }
                }
                Some(_) => self.bump_char(),
            }
        }
        Some(Vmodl::Object { type_name, fields })
    }

    fn array(&mut self, type_name: String, depth: usize) -> Option<Vmodl> {
        let mut items = Vec::new();
        loop {
            self.skip_ws_and_commas();
            match self.peek() {
                None => break,
                Some(b']') => {
                    self.bump_ascii();
                    break;
                }
                // Mismatched closer: let the enclosing object consume it.
                Some(b'}') => break,
                Some(_) => {
                    let before = self.pos;
                    match self.value(depth.saturating_add(1)) {
                        Some(v) => items.push(v),
                        None if self.too_deep => return None,
                        None => break,
                    }
                    if self.pos == before {
                        // Cannot happen, but never loop without progress.
                        self.bump_char();
                    }
                }
            }
        }
        Some(Vmodl::Array { type_name, items })
    }

    /// A string, reference, `<unset>` or bare scalar.
    fn plain(&mut self) -> Vmodl {
        match self.peek() {
            Some(b'"') => Vmodl::Str(self.string()),
            Some(b'\'') => {
                self.bump_ascii();
                let rest = self.rest();
                let stop = rest.find(['\'', '\n']).unwrap_or(rest.len());
                let closed = rest.as_bytes().get(stop) == Some(&b'\'');
                let text = rest.get(..stop).unwrap_or("");
                let text = if closed { text } else { text.trim_end() }.to_string();
                self.pos = self.pos.saturating_add(stop).saturating_add(usize::from(closed));
                Vmodl::Ref(text)
            }
            Some(b'<') if self.rest().starts_with("<unset>") => {
                self.pos = self.pos.saturating_add("<unset>".len());
                Vmodl::Unset
            }
            _ => {
                let start = self.pos;
                while self.peek().is_some_and(|b| !matches!(b, b',' | b'\n' | b'}' | b']')) {
                    self.bump_char();
                }
                Vmodl::Scalar(self.s.get(start..self.pos).unwrap_or("").trim().to_string())
            }
        }
    }

    /// A double-quoted string. vim-cmd does not escape inner quotes, so it ends
    /// at the last quote of its line; if the first line has no closing quote,
    /// the string spans lines and ends at the last quote of the first later
    /// line where that quote is followed only by blanks, commas or closers.
    fn string(&mut self) -> String {
        self.bump_ascii();
        let body_start = self.pos;
        let first_end = self.line_end();
        let first_line = self.s.get(body_start..first_end).unwrap_or("");
        if let Some(q) = first_line.rfind('"') {
            self.pos = body_start.saturating_add(q).saturating_add(1);
            return first_line.get(..q).unwrap_or("").to_string();
        }
        let mut line_start = first_end.saturating_add(1);
        while line_start < self.no_string_end_from {
            let Some(line_rest) = self.s.get(line_start..) else { break };
            let len = line_rest.find('\n').unwrap_or(line_rest.len());
            let line = line_rest.get(..len).unwrap_or("");
            if let Some(q) = line.rfind('"') {
                let trailing = line.get(q.saturating_add(1)..).unwrap_or("");
                if trailing.bytes().all(|b| b.is_ascii_whitespace() || matches!(b, b',' | b'}' | b']')) {
                    let end = line_start.saturating_add(q);
                    self.pos = end.saturating_add(1);
                    return self.s.get(body_start..end).unwrap_or("").to_string();
                }
            }
            if len >= line_rest.len() {
                break;
            }
            line_start = line_start.saturating_add(len).saturating_add(1);
        }
        self.no_string_end_from = self.no_string_end_from.min(first_end.saturating_add(1));
        // Unterminated: the rest of the first line.
        self.pos = first_end;
        first_line.trim_end_matches('\r').to_string()
    }
}
