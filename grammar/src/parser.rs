//! Turns source text into an [`crate::ast::File`], converting pest's errors into our diagnostics.
//!
//! pest stops at the first syntax error. To report more than one per file, the parser recovers at
//! item boundaries: after an error it skips to the next line that starts (in column 0) with a word,
//! which is how every item in a conventionally laid out file begins, and parses the rest again.
//! Items before the failing one are parsed on their own so that their spans stay right.
//!
//! The text is parsed in windows that end at such item boundaries, widened while a parse runs
//! into the end of its window: building a pest error costs time proportional to the length of
//! the input after the error, so parsing the whole rest of the file after every error would take
//! quadratic time on a file with an error on every line. A window that parses without error
//! parses the same as the whole file would there (it ends at a line break before an item, and the
//! grammar's lookaheads never reach past a complete item); an error before the window's end is
//! the same error the whole file has, since the parse never looked past it.

use crate::ast::*;
use crate::diag::{Diagnostic, FileId, Span};
use pest::iterators::Pair;
use pest::Parser as _;
use std::cell::RefCell;

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
        return Parsed {
            file: File { items: vec![] },
            errors: vec![err],
        };
    }
    let mut items = Vec::new();
    let mut errors = Vec::new();
    let mut start = 0;
    // How many items (by the column-0 rule) the next window spans.
    let mut window = 1;
    while start <= text.len() {
        let end = nth_item_start(text, start, window).unwrap_or(text.len());
        match parse_range(id, text, start, end) {
            Ok((mut more, mut found)) => {
                items.append(&mut more);
                errors.append(&mut found);
                if end == text.len() {
                    break;
                }
                start = end;
                window = (window * 2).min(1 << 12);
            }
            // The parse ran into the end of the window: widen it.
            Err((_, at)) if at >= end && end < text.len() => window *= 2,
            Err((err, at)) => {
                window = 1;
                // Keep what parsed before the failing item.
                let item_start = item_start_before(text, at).max(start);
                if let Ok((mut before, mut found)) = parse_range(id, text, start, item_start) {
                    items.append(&mut before);
                    errors.append(&mut found);
                }
                errors.push(err);
                match next_item_start(text, at) {
                    Some(next) => start = next,
                    None => break,
                }
            }
        }
    }
    Parsed {
        file: File { items },
        errors,
    }
}

/// The start of the `n`th line after the one holding `pos` that begins an item (a word in
/// column 0), if there are that many.
fn nth_item_start(text: &str, pos: usize, n: usize) -> Option<usize> {
    (0..n).try_fold(pos, |p, _| next_item_start(text, p))
}

/// Parses `text[start..end]`: its items and the errors found while building them (the error
/// recovery rules of the grammar), or the first error pest found and its byte offset.
fn parse_range(
    id: FileId,
    text: &str,
    start: usize,
    end: usize,
) -> Result<(Vec<Item>, Vec<Diagnostic>), (Diagnostic, usize)> {
    let src = &text[start..end];
    match SchedParser::parse(Rule::file, src) {
        Ok(mut pairs) => {
            let b = Builder {
                file: id,
                base: start,
                errors: RefCell::new(vec![]),
            };
            let file = pairs.next().expect("the file rule always yields one pair");
            let items = file
                .into_inner()
                .filter(|p| p.as_rule() != Rule::EOI)
                .filter_map(|p| b.item(p))
                .collect();
            Ok((items, b.errors.into_inner()))
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
    text[pos..]
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
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
        Rule::assign | Rule::nested | Rule::inner => "an entry such as `key = value`",
        Rule::row => "an entry such as `key = value`",
        Rule::list => "a list such as `[11, 10]`",
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

fn convert_error(
    id: FileId,
    text: &str,
    base: usize,
    e: pest::error::Error<Rule>,
) -> (Diagnostic, usize) {
    use pest::error::{ErrorVariant, InputLocation};
    let at = base
        + match e.location {
            InputLocation::Pos(p) => p,
            InputLocation::Span((s, _)) => s,
        };
    let positives: &[Rule] = match &e.variant {
        ErrorVariant::ParsingError { positives, .. } => positives,
        ErrorVariant::CustomError { .. } => &[],
    };
    // After a call argument, a name is only an error recovery rule's attempt (`missing_comma`).
    let in_call = positives.contains(&Rule::comma) && positives.contains(&Rule::rparen);
    let mut expected: Vec<&str> = positives
        .iter()
        .filter(|&&r| !(in_call && r == Rule::ident))
        .filter_map(|&r| phrase(r))
        .collect();
    // A value that failed inside an entry also makes pest list the separators; they add nothing.
    expected.sort_unstable();
    expected.dedup();
    let found = describe_at(text, at);
    let message = match expected.len() {
        0 => format!("unexpected {found}"),
        _ => format!("expected {}, found {found}", join_or(&expected)),
    };
    let len = token_len(text, at);
    let mut d =
        Diagnostic::error(message).at(Span::new(id, at, at + len), format!("unexpected {found}"));
    let line_start = text[..at.min(text.len())].rfind('\n').map_or(0, |i| i + 1);
    // A line that starts with a word in column 0 inside a block whose `{` is never closed: the
    // `}` was forgotten before the next item.
    if starts_item(text, line_start) && line_start > 0 {
        if let Some(pos) = unclosed(text, at, '{', '}') {
            let word = Span::new(id, line_start, line_start + token_len(text, line_start));
            let d = Diagnostic::error("expected `}` before the next item")
                .at(word, "the next item starts here")
                .also(Span::new(id, pos, pos + 1), "this `{` is not closed");
            return (d, at);
        }
    }
    // A `{` or `(` left open where the closing one is expected: show where it opened.
    for (open, close, rule) in [('{', '}', Rule::rbrace), ('(', ')', Rule::rparen)] {
        if positives.contains(&rule) {
            if let Some(pos) = unclosed(text, at, open, close) {
                d = d.also(
                    Span::new(id, pos, pos + 1),
                    format!("this `{open}` is not closed"),
                );
            }
        }
    }
    // A string left open swallows the rest of its line, closing brackets included.
    if let Some(pos) = unclosed_string(text, item_start_before(text, at), at) {
        d = d.also(
            Span::new(id, pos, pos + 1),
            "this string is not closed on its line",
        );
    }
    (d, at)
}

/// The first string between `from` and `at` that is not closed on its line, if any.
fn unclosed_string(text: &str, from: usize, at: usize) -> Option<usize> {
    let at = at.min(text.len());
    let mut bytes = text.as_bytes()[from.min(at)..at]
        .iter()
        .enumerate()
        .map(|(i, &b)| (from + i, b));
    while let Some((i, b)) = bytes.next() {
        match b {
            b'#' => {
                bytes.by_ref().find(|&(_, b)| b == b'\n')?;
            }
            b'"' => loop {
                match bytes.next() {
                    Some((_, b'\\')) => {
                        bytes.next();
                    }
                    Some((_, b'"')) => break,
                    Some((_, b'\n' | b'\r')) | None => return Some(i),
                    Some(_) => {}
                }
            },
            _ => {}
        }
    }
    None
}

/// The innermost `open` that is open at `at` and not closed before the next item starts (a line
/// beginning with a word in column 0 after the line of `at`), if any. The scan starts at the
/// item before the line of `at` and skips comments and strings.
fn unclosed(text: &str, at: usize, open: char, close: char) -> Option<usize> {
    let at = at.min(text.len());
    let line_start = text[..at].rfind('\n').map_or(0, |i| i + 1);
    let from = match line_start {
        0 => 0,
        n => item_start_before(text, n - 1),
    };
    let end = next_item_start(text, at).unwrap_or(text.len());
    let mut stack = vec![];
    let mut depth = 0usize;
    let mut bytes = text.as_bytes()[from..end]
        .iter()
        .enumerate()
        .map(|(i, &b)| (from + i, b));
    while let Some((i, b)) = bytes.next() {
        match b {
            b'#' => {
                // A comment, to the end of its line.
                if bytes.by_ref().any(|(_, b)| b == b'\n') {
                    continue;
                }
                break;
            }
            b'"' => {
                // A string, to its closing quote or the end of its line.
                while let Some((_, b)) = bytes.next() {
                    match b {
                        b'\\' => {
                            bytes.next();
                        }
                        b'"' | b'\n' => break,
                        _ => {}
                    }
                }
            }
            b if b == open as u8 && i < at => stack.push(i),
            b if b == close as u8 && i < at => {
                stack.pop();
            }
            b if b == open as u8 => depth += 1,
            b if b == close as u8 => match depth.checked_sub(1) {
                Some(d) => depth = d,
                None => return None, // the innermost open one is closed after `at`
            },
            _ => {}
        }
    }
    stack.last().copied()
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

/// Builds AST nodes from pest pairs of a slice starting at `base` in the file, and reports what
/// the grammar's error recovery rules matched.
struct Builder {
    file: FileId,
    base: usize,
    errors: RefCell<Vec<Diagnostic>>,
}

impl Builder {
    fn span(&self, p: &Pair<Rule>) -> Span {
        let s = p.as_span();
        Span::new(self.file, self.base + s.start(), self.base + s.end())
    }

    /// An item; `None` for an import whose path is a broken string (reported), so that no
    /// import of a path the user did not mean is attempted.
    fn item(&self, p: Pair<Rule>) -> Option<Item> {
        let span = self.span(&p);
        Some(match p.as_rule() {
            Rule::import => {
                let s = p
                    .into_inner()
                    .find(|p| matches!(p.as_rule(), Rule::string | Rule::bad_string))
                    .expect("import has a path");
                if s.as_rule() == Rule::bad_string {
                    self.string(s);
                    return None;
                }
                Item::Import(Import {
                    path: self.string(s),
                    span,
                })
            }
            Rule::block_item => {
                let mut inner = p.into_inner();
                let kind = self.ident(inner.next().expect("kind"));
                let name = self.ident(inner.next().expect("name"));
                let body = self.block(inner.next().expect("block"));
                Item::Block(BlockItem {
                    kind,
                    name,
                    body,
                    span,
                })
            }
            r => unreachable!("item rule {r:?}"),
        })
    }

    fn block(&self, p: Pair<Rule>) -> Block {
        let span = self.span(&p);
        let entries = p
            .into_inner()
            .filter(|p| !is_punct(p.as_rule()))
            .map(|e| self.entry(e))
            .collect();
        Block { entries, span }
    }

    fn entry(&self, p: Pair<Rule>) -> Entry {
        let span = self.span(&p);
        match p.as_rule() {
            Rule::assign => Entry::Assign(self.assign(p)),
            Rule::nested => Entry::Nested(self.nested(p)),
            Rule::layer => {
                let mut name = None;
                let mut repeat = None;
                let mut call = None;
                for q in p.into_inner() {
                    match q.as_rule() {
                        Rule::ident => name = Some(self.ident(q)),
                        Rule::repeat => {
                            let i = q
                                .into_inner()
                                .find(|p| p.as_rule() == Rule::integer)
                                .expect("count");
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
                let mut inner = p
                    .into_inner()
                    .filter(|p| !is_punct(p.as_rule()) && p.as_rule() != Rule::kw_measured);
                let collective = self.ident(inner.next().expect("collective"));
                let mesh = self.value(inner.next().expect("mesh"));
                let points = inner
                    .map(|pt| {
                        let span = self.span(&pt);
                        let mut q = pt.into_inner().filter(|p| p.as_rule() == Rule::quantity);
                        let size = self.quantity(q.next().expect("size"));
                        let bandwidth = self.quantity(q.next().expect("bandwidth"));
                        Point {
                            size,
                            bandwidth,
                            span,
                        }
                    })
                    .collect();
                Entry::Measured(Measured {
                    collective,
                    mesh,
                    points,
                    span,
                })
            }
            r => unreachable!("entry rule {r:?}"),
        }
    }

    /// A `nested` or `inner` block: its assignments, rows and inner blocks.
    fn nested(&self, p: Pair<Rule>) -> Nested {
        let span = self.span(&p);
        let mut inner = p.into_inner().filter(|p| !is_punct(p.as_rule()));
        let key = self.ident(inner.next().expect("key"));
        let mut n = Nested {
            key,
            entries: vec![],
            blocks: vec![],
            rows: vec![],
            span,
        };
        for e in inner {
            match e.as_rule() {
                Rule::assign => n.entries.push(self.assign(e)),
                Rule::inner => n.blocks.push(self.nested(e)),
                Rule::row => {
                    let span = self.span(&e);
                    let mut i = e.into_inner().filter(|p| p.as_rule() != Rule::eq);
                    let key = self.ident(i.next().expect("row key"));
                    let index = self.int(i.next().expect("row index"));
                    let value = self.value(i.next().expect("row value"));
                    n.rows.push(Row {
                        key,
                        index,
                        value,
                        span,
                    });
                }
                r => unreachable!("nested entry rule {r:?}"),
            }
        }
        n
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
            Rule::string | Rule::bad_string => ValueKind::String(self.string(p)),
            Rule::ident => ValueKind::Ident(self.ident(p)),
            Rule::call => ValueKind::Call(self.call(p)),
            Rule::list => ValueKind::List(
                p.into_inner()
                    .filter(|p| p.as_rule() == Rule::scalar)
                    .map(|v| self.value(v))
                    .collect(),
            ),
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
                let a = match a.as_rule() {
                    Rule::missing_comma => {
                        let arg = a.into_inner().next().expect("an argument");
                        let name = arg.clone().into_inner().next().expect("arg name");
                        let at = self.span(&name);
                        self.error(
                            Diagnostic::error(format!(
                                "expected `,` before the argument `{}`",
                                name.as_str()
                            ))
                            .at(at, "`,` expected before this argument")
                            .note("call arguments are separated by `,`"),
                        );
                        arg
                    }
                    _ => a,
                };
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
        NumberLit {
            text: p.as_str().to_string(),
            span: self.span(&p),
        }
    }

    fn int(&self, p: Pair<Rule>) -> IntLit {
        IntLit {
            text: p.as_str().to_string(),
            span: self.span(&p),
        }
    }

    fn ident(&self, p: Pair<Rule>) -> Ident {
        Ident {
            name: p.as_str().to_string(),
            span: self.span(&p),
        }
    }

    fn error(&self, d: Diagnostic) {
        self.errors.borrow_mut().push(d);
    }

    /// A string literal; a `bad_string` is reported (its escapes taken as written).
    fn string(&self, p: Pair<Rule>) -> StringLit {
        let span = self.span(&p);
        if p.as_rule() == Rule::bad_string {
            self.bad_string(&p);
        }
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

impl Builder {
    /// Reports what is wrong with a string that `string` did not match: escapes other than `\"`
    /// and `\\`, and a missing closing quote.
    fn bad_string(&self, p: &Pair<Rule>) {
        let span = self.span(p);
        let text = p.as_str();
        let mut bad = vec![];
        let mut chars = text.char_indices().skip(1).peekable();
        while let Some((i, c)) = chars.next() {
            if c != '\\' {
                continue;
            }
            match chars.next() {
                Some((_, '"' | '\\')) => {}
                Some((j, e)) => bad.push((i, j + e.len_utf8())),
                None => bad.push((i, i + 1)),
            }
        }
        let at = |(a, b): (usize, usize)| {
            Span::new(self.file, span.start as usize + a, span.start as usize + b)
        };
        if let Some(&first) = bad.first() {
            let escapes: Vec<String> = bad
                .iter()
                .map(|&(a, b)| format!("`{}`", &text[a..b]))
                .collect();
            let what = match escapes.as_slice() {
                [one] => format!("invalid escape {one}"),
                [init @ .., last] => format!("invalid escapes {} and {last}", init.join(", ")),
                [] => unreachable!(),
            };
            let mut d = Diagnostic::error(format!(
                "{what} in a string (only `\\\"` and `\\\\` are allowed)"
            ))
            .at(at(first), "invalid escape");
            for &b in &bad[1..] {
                d = d.at(at(b), "invalid escape");
            }
            self.error(d.note("write a backslash as `\\\\`; paths can also use `/`"));
        }
        let inner = p
            .clone()
            .into_inner()
            .next()
            .map_or(0, |i| i.as_str().len());
        let closed = 1 + inner < text.len();
        if !closed {
            self.error(
                Diagnostic::error("unclosed string")
                    .at(at((0, 1)), "this string is not closed")
                    .also(at((text.len(), text.len())), "the line ends here")
                    .note("a string must close with `\"` on the line it opens"),
            );
        }
    }
}

fn is_punct(r: Rule) -> bool {
    matches!(
        r,
        Rule::eq
            | Rule::comma
            | Rule::lbrace
            | Rule::rbrace
            | Rule::lparen
            | Rule::rparen
            | Rule::lbracket
            | Rule::rbracket
    )
}

#[cfg(test)]
#[path = "../tests/unit/parser.rs"]
mod tests;
