//! Turns source text into an [`crate::ast::File`], converting pest's errors into our diagnostics.
//!
//! pest stops at the first syntax error. To report more than one per file, the parser recovers at
//! item boundaries: after an error it skips to the next line that starts (in column 0) with a word,
//! which is how every item in a conventionally laid out file begins, and parses the rest again.
//! Items before the failing one are parsed on their own so that their spans stay right.

use crate::ast::*;
use crate::diag::{Diagnostic, FileId, Span};
use pest::iterators::Pair;
use pest::Parser as _;

#[derive(pest_derive::Parser)]
#[grammar = "sched.pest"]
struct SchedParser;

/// Files larger than this are refused before parsing.
pub const MAX_FILE_BYTES: usize = 8 << 20;

/// The result of parsing one file: the items that parsed, and every syntax error found.
#[derive(Debug)]
pub struct Parsed {
    pub file: File,
    pub errors: Vec<Diagnostic>,
}

/// Parses `text` as the contents of file `id`.
pub fn parse(id: FileId, text: &str) -> Parsed {
    if text.len() > MAX_FILE_BYTES {
        let err = Diagnostic::error(format!(
            "file is {} bytes; the limit is {} bytes ({} MiB)",
            text.len(),
            MAX_FILE_BYTES,
            MAX_FILE_BYTES >> 20
        ))
        .at(Span::new(id, 0, 0), "file too large");
        return Parsed { file: File { items: vec![] }, errors: vec![err] };
    }
    let mut items = Vec::new();
    let mut errors = Vec::new();
    let mut start = 0;
    while start <= text.len() {
        match parse_from(id, text, start) {
            Ok(mut more) => {
                items.append(&mut more);
                break;
            }
            Err((err, at)) => {
                errors.push(err);
                // Keep what parsed before the failing item.
                let item_start = item_start_before(text, at).max(start);
                if let Ok(mut before) = parse_range(id, text, start, item_start) {
                    items.append(&mut before);
                }
                match next_item_start(text, at) {
                    Some(next) => start = next,
                    None => break,
                }
            }
        }
    }
    Parsed { file: File { items }, errors }
}

/// Parses `text[start..]`, returning items or the first error and its byte offset.
fn parse_from(id: FileId, text: &str, start: usize) -> Result<Vec<Item>, (Diagnostic, usize)> {
    parse_range(id, text, start, text.len())
}

fn parse_range(id: FileId, text: &str, start: usize, end: usize) -> Result<Vec<Item>, (Diagnostic, usize)> {
    let src = &text[start..end];
    match SchedParser::parse(Rule::file, src) {
        Ok(mut pairs) => {
            let b = Builder { file: id, base: start };
            let file = pairs.next().expect("the file rule always yields one pair");
            Ok(file.into_inner().filter(|p| p.as_rule() != Rule::EOI).map(|p| b.item(p)).collect())
        }
        Err(e) => Err(convert_error(id, text, start, e)),
    }
}

/// Start of the line, at or before `at`, that begins with a word in column 0 (0 if none).
fn item_start_before(text: &str, at: usize) -> usize {
    let mut line_start = text[..at.min(text.len())].rfind('\n').map_or(0, |i| i + 1);
    loop {
        if starts_item(text, line_start) || line_start == 0 {
            return line_start;
        }
        line_start = text[..line_start - 1].rfind('\n').map_or(0, |i| i + 1);
    }
}

/// Start of the first line after the one holding `at` that begins with a word in column 0.
fn next_item_start(text: &str, at: usize) -> Option<usize> {
    let mut pos = text[at.min(text.len())..].find('\n')? + at + 1;
    loop {
        if starts_item(text, pos) {
            return Some(pos);
        }
        pos = text[pos..].find('\n')? + pos + 1;
    }
}

fn starts_item(text: &str, pos: usize) -> bool {
    text[pos..].chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
}

/// How a grammar rule is named when the parser says what it expected.
fn phrase(rule: Rule) -> Option<&'static str> {
    Some(match rule {
        Rule::import | Rule::kw_import => "`import`",
        Rule::block_item => "an item such as `model NAME { … }`",
        Rule::ident => "a name",
        Rule::string => "a quoted string",
        Rule::block | Rule::lbrace => "`{`",
        Rule::rbrace => "`}`",
        Rule::assign | Rule::nested => "an entry such as `key = value`",
        Rule::layer | Rule::kw_layer => "a layer such as `layer NAME = KIND(…)`",
        Rule::measured | Rule::kw_measured => "a `measured` table",
        Rule::point => "a point such as `64 MiB = 95 GB/s`",
        Rule::value | Rule::scalar => "a value such as `8`, `80 GiB`, `8 x 2` or `bf16`",
        Rule::call => "a call such as `transformer(hidden = 4096, …)`",
        Rule::arg => "an argument such as `hidden = 4096`",
        Rule::mesh => "a mesh such as `8 x 2`",
        Rule::quantity => "a quantity such as `80 GiB`",
        Rule::unit => "a unit",
        Rule::number => "a number",
        Rule::integer => "an integer",
        Rule::eq => "`=`",
        Rule::comma => "`,`",
        Rule::lparen => "`(`",
        Rule::rparen => "`)`",
        Rule::lbracket => "`[`",
        Rule::rbracket => "`]`",
        Rule::EOI => "end of file",
        _ => return None,
    })
}

fn convert_error(id: FileId, text: &str, base: usize, e: pest::error::Error<Rule>) -> (Diagnostic, usize) {
    use pest::error::{ErrorVariant, InputLocation};
    let at = base
        + match e.location {
            InputLocation::Pos(p) => p,
            InputLocation::Span((s, _)) => s,
        };
    let mut expected: Vec<&str> = match &e.variant {
        ErrorVariant::ParsingError { positives, .. } => positives.iter().filter_map(|&r| phrase(r)).collect(),
        ErrorVariant::CustomError { .. } => vec![],
    };
    // A value that failed inside an entry also makes pest list the separators; they add nothing.
    expected.sort_unstable();
    expected.dedup();
    let found = describe_at(text, at);
    let message = match expected.len() {
        0 => format!("unexpected {found}"),
        _ => format!("expected {}, found {found}", join_or(&expected)),
    };
    let len = token_len(text, at);
    (Diagnostic::error(message).at(Span::new(id, at, at + len), format!("unexpected {found}")), at)
}

fn join_or(items: &[&str]) -> String {
    match items {
        [] => String::new(),
        [one] => one.to_string(),
        [init @ .., last] => format!("{} or {}", init.join(", "), last),
    }
}

/// Length in bytes of the token starting at `at`, for underlining.
fn token_len(text: &str, at: usize) -> usize {
    let rest = &text[at.min(text.len())..];
    let mut chars = rest.char_indices();
    match chars.next() {
        None => 0,
        Some((_, '\n')) => 0,
        Some((_, c)) if c.is_ascii_alphanumeric() || c == '_' => rest
            .char_indices()
            .find(|&(_, c)| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(rest.len(), |(i, _)| i),
        Some((_, c)) => c.len_utf8(),
    }
}

fn describe_at(text: &str, at: usize) -> String {
    let len = token_len(text, at);
    match text[at.min(text.len())..].chars().next() {
        None => "end of file".to_string(),
        Some('\n') | Some('\r') => "end of line".to_string(),
        Some(_) => format!("`{}`", &text[at..at + len]),
    }
}

/// Builds AST nodes from pest pairs of a slice starting at `base` in the file.
struct Builder {
    file: FileId,
    base: usize,
}

impl Builder {
    fn span(&self, p: &Pair<Rule>) -> Span {
        let s = p.as_span();
        Span::new(self.file, self.base + s.start(), self.base + s.end())
    }

    fn item(&self, p: Pair<Rule>) -> Item {
        let span = self.span(&p);
        match p.as_rule() {
            Rule::import => {
                let s = p.into_inner().find(|p| p.as_rule() == Rule::string).expect("import has a path");
                Item::Import(Import { path: self.string(s), span })
            }
            Rule::block_item => {
                let mut inner = p.into_inner();
                let kind = self.ident(inner.next().expect("kind"));
                let name = self.ident(inner.next().expect("name"));
                let body = self.block(inner.next().expect("block"));
                Item::Block(BlockItem { kind, name, body, span })
            }
            r => unreachable!("item rule {r:?}"),
        }
    }

    fn block(&self, p: Pair<Rule>) -> Block {
        let span = self.span(&p);
        let entries = p.into_inner().filter(|p| !is_punct(p.as_rule())).map(|e| self.entry(e)).collect();
        Block { entries, span }
    }

    fn entry(&self, p: Pair<Rule>) -> Entry {
        let span = self.span(&p);
        match p.as_rule() {
            Rule::assign => Entry::Assign(self.assign(p)),
            Rule::nested => {
                let mut inner = p.into_inner().filter(|p| !is_punct(p.as_rule()));
                let key = self.ident(inner.next().expect("key"));
                let entries = inner.map(|a| self.assign(a)).collect();
                Entry::Nested(Nested { key, entries, span })
            }
            Rule::layer => {
                let mut name = None;
                let mut repeat = None;
                let mut call = None;
                for q in p.into_inner() {
                    match q.as_rule() {
                        Rule::ident => name = Some(self.ident(q)),
                        Rule::repeat => {
                            let i = q.into_inner().find(|p| p.as_rule() == Rule::integer).expect("count");
                            repeat = Some(self.int(i));
                        }
                        Rule::call => call = Some(self.call(q)),
                        _ => {}
                    }
                }
                Entry::Layer(LayerDecl {
                    name: name.expect("layer name"),
                    repeat,
                    call: call.expect("layer call"),
                    span,
                })
            }
            Rule::measured => {
                let mut inner = p.into_inner().filter(|p| !is_punct(p.as_rule()) && p.as_rule() != Rule::kw_measured);
                let collective = self.ident(inner.next().expect("collective"));
                let mesh = self.value(inner.next().expect("mesh"));
                let points = inner
                    .map(|pt| {
                        let span = self.span(&pt);
                        let mut q = pt.into_inner().filter(|p| p.as_rule() == Rule::quantity);
                        let size = self.quantity(q.next().expect("size"));
                        let bandwidth = self.quantity(q.next().expect("bandwidth"));
                        Point { size, bandwidth, span }
                    })
                    .collect();
                Entry::Measured(Measured { collective, mesh, points, span })
            }
            r => unreachable!("entry rule {r:?}"),
        }
    }

    fn assign(&self, p: Pair<Rule>) -> Assign {
        let span = self.span(&p);
        let mut inner = p.into_inner().filter(|p| p.as_rule() != Rule::eq);
        let key = self.ident(inner.next().expect("key"));
        let value = self.value(inner.next().expect("value"));
        Assign { key, value, span }
    }

    /// A `value` or `scalar` pair (or the scalar inside one).
    fn value(&self, p: Pair<Rule>) -> Value {
        let p = match p.as_rule() {
            Rule::value | Rule::scalar => p.into_inner().next().expect("a value holds one scalar"),
            _ => p,
        };
        let span = self.span(&p);
        let kind = match p.as_rule() {
            Rule::number => ValueKind::Number(self.number(p)),
            Rule::quantity => ValueKind::Quantity(self.quantity(p)),
            Rule::mesh => {
                let mut i = p.into_inner();
                let a = self.int(i.next().expect("a"));
                let b = self.int(i.next().expect("b"));
                ValueKind::Mesh(MeshLit { a, b })
            }
            Rule::string => ValueKind::String(self.string(p)),
            Rule::ident => ValueKind::Ident(self.ident(p)),
            Rule::call => ValueKind::Call(self.call(p)),
            r => unreachable!("value rule {r:?}"),
        };
        Value { kind, span }
    }

    fn call(&self, p: Pair<Rule>) -> Call {
        let span = self.span(&p);
        let mut inner = p.into_inner().filter(|p| !is_punct(p.as_rule()));
        let callee = self.ident(inner.next().expect("callee"));
        let args = inner
            .map(|a| {
                let span = self.span(&a);
                let mut i = a.into_inner().filter(|p| p.as_rule() != Rule::eq);
                let name = self.ident(i.next().expect("arg name"));
                let value = self.value(i.next().expect("arg value"));
                Arg { name, value, span }
            })
            .collect();
        Call { callee, args, span }
    }

    fn quantity(&self, p: Pair<Rule>) -> Quantity {
        let span = self.span(&p);
        let mut i = p.into_inner();
        let number = self.number(i.next().expect("number"));
        let unit = self.ident(i.next().expect("unit"));
        Quantity { number, unit, span }
    }

    fn number(&self, p: Pair<Rule>) -> NumberLit {
        NumberLit { text: p.as_str().to_string(), span: self.span(&p) }
    }

    fn int(&self, p: Pair<Rule>) -> IntLit {
        IntLit { text: p.as_str().to_string(), span: self.span(&p) }
    }

    fn ident(&self, p: Pair<Rule>) -> Ident {
        Ident { name: p.as_str().to_string(), span: self.span(&p) }
    }

    fn string(&self, p: Pair<Rule>) -> StringLit {
        let span = self.span(&p);
        let raw = p.into_inner().next().map_or("", |i| i.as_str());
        let mut value = String::with_capacity(raw.len());
        let mut chars = raw.chars();
        while let Some(c) = chars.next() {
            if c == '\\' {
                value.extend(chars.next());
            } else {
                value.push(c);
            }
        }
        StringLit { value, span }
    }
}

fn is_punct(r: Rule) -> bool {
    matches!(
        r,
        Rule::eq | Rule::comma | Rule::lbrace | Rule::rbrace | Rule::lparen | Rule::rparen | Rule::lbracket | Rule::rbracket
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(src: &str) -> File {
        let p = parse(FileId(0), src);
        assert!(p.errors.is_empty(), "{:?}", p.errors);
        p.file
    }

    #[test]
    fn spec_example_shapes() {
        let f = ok(r#"
import "clusters/a800.sched"   # comment
model m {
    dtype = bf16; seq_len = 4096
    layer block[32] = transformer(hidden = 4096, heads = 32,
                                  ffn = 11008,
    )
}
schedule s { shard { params = 8 x 1  grads = 8x2 } prefetch { forward = 1  backward = 1  max_live = 4 GiB }
  preset = mics(partition = 8) }
cluster c { measured all_gather 8 x 2 { 1 MiB = 20 GB/s; 64MiB = 95 GB/s } }
"#);
        assert_eq!(f.items.len(), 4);
        let Item::Block(s) = &f.items[2] else { panic!() };
        let Entry::Nested(shard) = &s.body.entries[0] else { panic!() };
        assert!(matches!(shard.entries[1].value.kind, ValueKind::Mesh(_)));
        let Entry::Nested(pf) = &s.body.entries[1] else { panic!() };
        assert_eq!(pf.entries.len(), 3);
        let ValueKind::Quantity(q) = &pf.entries[2].value.kind else { panic!() };
        assert_eq!((q.number.text.as_str(), q.unit.name.as_str()), ("4", "GiB"));
    }

    #[test]
    fn several_errors_are_reported() {
        let p = parse(FileId(0), "model a {\n  x = = 1\n}\nmodel b { ok = 1 }\nschedule c {\n  y = \n}\n");
        assert_eq!(p.errors.len(), 2, "{:?}", p.errors);
        assert_eq!(p.file.items.len(), 1);
    }

    #[test]
    fn quantity_needs_the_end_of_the_entry() {
        let f = ok("model m { a = 80 GBps\n b = 1  c = 2 }");
        let Item::Block(m) = &f.items[0] else { panic!() };
        assert_eq!(m.body.entries.len(), 3);
    }
}
