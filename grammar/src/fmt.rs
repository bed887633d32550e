//! The canonical layout of a `.sched` file: the formatter behind `schedc fmt`.
//!
//! [`format()`] prints a parsed file so that two files with the same syntax tree and comments print
//! the same, and formatting its own output changes nothing.
//!
//! # Layout
//!
//! - Items in source order with one blank line between them; consecutive `import`s sit on adjacent
//!   lines. Indentation is four spaces; a tab is printed only inside a string or comment that
//!   holds one. The output has no trailing whitespace and ends with exactly one newline (an empty
//!   file stays empty).
//! - `KIND NAME {`, one entry per line, `}`; an empty block is `KIND NAME {}`. A run of blank lines
//!   between two entries becomes one blank line, and none is kept right after `{` or before `}`.
//! - `key = value`. The keys of a run of consecutive assignments are padded so that the `=` signs
//!   line up; a run ends at a blank line, an own-line comment or any other kind of entry.
//! - Values: numbers as written (`1_000_000`, `7.5e9`), quantities as `NUMBER UNIT`, meshes as
//!   `a x b`, strings double-quoted with `\"` and `\\` escaped, names as written.
//! - A nested block sits on one line, `key { a = 1  b = 2 }`, when no comment lies inside it, the
//!   line fits in 100 columns and the line parses back to the same entries (entries on one line
//!   are only separated by spaces, so a value can run into the next key: `a = 8  x1 = 2` reads
//!   `8  x1` as a mesh); otherwise it is laid out like a block. A `measured` table is the same
//!   with `; ` between its points. A block that holds an inner block or numbered rows
//!   (`pipeline { … order { stage 0 = "F0 B0" } }`) is always laid out like a block; a row is
//!   printed `key N = value` and aligned with the assignments around it.
//! - A call (`layer NAME[n] = KIND(args)`, `preset = mics(…)`) sits on one line if it fits in 100
//!   columns. Otherwise its arguments are filled greedily onto lines that start just after the `(`.
//!   A call with a comment between its arguments gets one argument per line. A list
//!   (`layers = [11, 10, 10]`) is laid out the same way, after its `[`.
//!
//! # Comments
//!
//! Comments are not in the syntax tree. [`format()`] scans the source for them (a `#` outside a
//! string literal, to the end of its line) and places them by byte offset against the spans of the
//! nodes, in two phases. Gathering walks the tree in source order and takes the comments from one
//! cursor, handing each to exactly one place in a layout tree, so none is lost or duplicated;
//! printing then lays that tree out. The text of a comment is kept verbatim, trailing
//! whitespace trimmed.
//!
//! - A comment alone on its line stays on its own line, before the node that follows it and at
//!   that node's indentation. One before a `}` stays inside the block; one at the end of the file
//!   stays at the end. Blank lines around it follow the rule for entries.
//! - A comment after code stays after that code, two spaces before the `#`: after the line of the
//!   entry it followed, or after the `{` line. When that line already has a comment (source lines
//!   were joined) it goes on its own line instead.
//! - In a call or a list, a comment between two arguments stays after the argument it followed,
//!   and the call gets one argument per line. Comments before the first argument move to their own lines above
//!   the entry, and comments after the last one move after the `)`.

use crate::ast::{
    Arg, Assign, Call, Entry, File, Item, Nested, Point, Quantity, Row, Value, ValueKind,
};
use crate::diag::{FileId, Span};
use std::iter::Peekable;

/// Lines longer than this are broken where the layout allows.
const MAX_WIDTH: usize = 100;
const INDENT: &str = "    ";

/// Prints `file`, parsed without errors from `source`, in canonical layout with its comments.
pub fn format(source: &str, file: &File) -> String {
    let body = Gather::new(source).file(file);
    let mut printer = Printer::default();
    printer.body(&body, 0);
    printer.finish()
}

/// A `#` comment found in the source.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Comment {
    start: usize,
    end: usize,
    /// From the `#`, trailing whitespace trimmed.
    text: String,
    /// Nothing but whitespace comes before it on its line.
    own_line: bool,
}

impl Comment {
    fn at(source: &str, start: usize, end: usize) -> Comment {
        let line_start = source[..start].rfind(['\n', '\r']).map_or(0, |i| i + 1);
        Comment {
            start,
            end,
            text: source[start..end].trim_end().to_string(),
            own_line: source[line_start..start].trim().is_empty(),
        }
    }
}

/// Every comment in `source`, in order. The bytes looked at (`"`, `\`, `#`, line breaks) are
/// ASCII, so they never occur inside a multi-byte character. Line breaks are the grammar's
/// (`NEWLINE`): `\n`, `\r\n` and a lone `\r`, which ends a comment or a string as `\n` does.
fn scan_comments(source: &str) -> Vec<Comment> {
    let bytes = source.as_bytes();
    let mut comments = Vec::new();
    let mut in_string = false;
    let mut i = 0;
    while i < bytes.len() {
        match (in_string, bytes[i]) {
            (true, b'\\') => i += 1,
            (true, b'"' | b'\n' | b'\r') => in_string = false,
            (false, b'"') => in_string = true,
            (false, b'#') => {
                let end = source[i..]
                    .find(['\n', '\r'])
                    .map_or(source.len(), |n| i + n);
                comments.push(Comment::at(source, i, end));
                i = end;
            }
            _ => {}
        }
        i += 1;
    }
    comments
}

// ---------------------------------------------------------------------------------------------
// The layout tree: nodes with their comments in place, before any decision about lines.

/// The inside of a pair of braces, or the whole file.
#[derive(Debug, Default)]
struct Body {
    /// A comment after the `{` on its line.
    opening: Option<Comment>,
    slots: Vec<Slot>,
}

#[derive(Debug)]
enum Slot {
    Blank,
    /// A comment on its own line.
    Comment(Comment),
    /// A node and the comment after its last line.
    Node(Node, Option<Comment>),
}

#[derive(Debug)]
enum Node {
    /// An import or a measured point: always one line.
    Text(String),
    /// `key = value`. Only assignments have `aligned` keys; a layer's key is `layer NAME[n]`.
    Pair {
        key: String,
        aligned: bool,
        value: Val,
    },
    /// `head { … }`: an item, a nested block or a measured table.
    Braced {
        head: String,
        body: Body,
        one_line: OneLine,
    },
}

#[derive(Debug)]
enum Val {
    Text(String),
    Call(CallDoc),
}

/// A call, `callee(args)`, or a list, `[args]`.
#[derive(Debug)]
struct CallDoc {
    /// `callee(` or `[`.
    open: String,
    /// `)` or `]`.
    close: &'static str,
    args: Vec<ArgDoc>,
}

/// One argument and the comments between it and the next argument.
#[derive(Debug)]
struct ArgDoc {
    text: String,
    comments: Vec<Comment>,
}

/// Whether a braced node may sit on one line, and what separates its entries there.
#[derive(Clone, Copy, Debug)]
enum OneLine {
    Never,
    Spaced,
    Semicolons,
}

impl OneLine {
    fn separator(self) -> Option<&'static str> {
        match self {
            OneLine::Never => None,
            OneLine::Spaced => Some("  "),
            OneLine::Semicolons => Some("; "),
        }
    }
}

impl Body {
    fn has_comments(&self) -> bool {
        self.opening.is_some()
            || self.slots.iter().any(|slot| match slot {
                Slot::Blank => false,
                Slot::Comment(_) => true,
                Slot::Node(node, trailing) => trailing.is_some() || node.has_comments(),
            })
    }

    fn nodes(&self) -> impl Iterator<Item = &Node> {
        self.slots.iter().filter_map(|slot| match slot {
            Slot::Node(node, _) => Some(node),
            _ => None,
        })
    }
}

impl Node {
    fn has_comments(&self) -> bool {
        match self {
            Node::Text(_) => false,
            Node::Pair { value, .. } => matches!(value, Val::Call(call) if call.has_comments()),
            Node::Braced { body, .. } => body.has_comments(),
        }
    }

    /// The node on one line, ignoring width (it has no comments inside).
    fn flat(&self) -> String {
        match self {
            Node::Text(text) => text.clone(),
            Node::Pair { key, value, .. } => format!("{key} = {}", value.flat()),
            Node::Braced {
                head,
                body,
                one_line,
            } => braced_line(head, body, one_line.separator().unwrap_or("  ")),
        }
    }
}

impl Val {
    fn flat(&self) -> String {
        match self {
            Val::Text(text) => text.clone(),
            Val::Call(call) => call.flat(),
        }
    }
}

impl CallDoc {
    fn plain(call: &Call) -> CallDoc {
        let args = call.args.iter().map(|arg| ArgDoc {
            text: arg_text(arg),
            comments: vec![],
        });
        CallDoc {
            open: format!("{}(", call.callee.name),
            close: ")",
            args: args.collect(),
        }
    }

    fn list(items: &[Value]) -> CallDoc {
        let args = items.iter().map(|item| ArgDoc {
            text: scalar(item),
            comments: vec![],
        });
        CallDoc {
            open: "[".into(),
            close: "]",
            args: args.collect(),
        }
    }

    fn has_comments(&self) -> bool {
        self.args.iter().any(|arg| !arg.comments.is_empty())
    }

    fn flat(&self) -> String {
        let args: Vec<&str> = self.args.iter().map(|arg| arg.text.as_str()).collect();
        format!("{}{}{}", self.open, args.join(", "), self.close)
    }

    /// Argument `i` as it ends its line or is followed by the next: with `,` or the closing
    /// `)` or `]`.
    fn piece(&self, i: usize) -> String {
        let close = if i + 1 == self.args.len() {
            self.close
        } else {
            ","
        };
        format!("{}{close}", self.args[i].text)
    }
}

// ---------------------------------------------------------------------------------------------
// Gathering: the syntax tree and the comments into a layout tree.

/// Walks the tree in source order, taking comments from one cursor as it passes them.
struct Gather<'s> {
    source: &'s str,
    comments: Peekable<std::vec::IntoIter<Comment>>,
}

/// A gathered node, with the comments from inside it that print outside it: `before` on their
/// own lines above it, `after` behind it.
struct Gathered {
    before: Vec<Comment>,
    node: Node,
    after: Vec<Comment>,
}

impl Gathered {
    fn plain(node: Node) -> Gathered {
        Gathered {
            before: vec![],
            node,
            after: vec![],
        }
    }
}

/// How blank lines before a node (or the comments that lead up to it) are decided.
#[derive(Clone, Copy)]
enum Spacing {
    /// Entries: one blank line where the source has at least one.
    Source,
    /// Items: always one blank line after an item, none between two imports.
    Items { tight: bool },
}

/// Something that can sit in a body.
trait Child {
    fn span(&self) -> Span;
    fn gather(&self, g: &mut Gather) -> Gathered;
}

impl<'s> Gather<'s> {
    fn new(source: &'s str) -> Gather<'s> {
        Gather {
            source,
            comments: scan_comments(source).into_iter().peekable(),
        }
    }

    /// The comments not yet taken that start before `pos`.
    fn take_before(&mut self, pos: usize) -> Vec<Comment> {
        std::iter::from_fn(|| self.comments.next_if(|c| c.start < pos)).collect()
    }

    fn file(&mut self, file: &File) -> Body {
        let mut seq = Seq::new(false);
        let mut prev_import = false;
        for item in &file.items {
            let import = matches!(item, Item::Import(_));
            self.place(
                &mut seq,
                item,
                Spacing::Items {
                    tight: prev_import && import,
                },
            );
            prev_import = import;
        }
        self.lead_in(&mut seq, usize::MAX, Spacing::Source);
        seq.body
    }

    /// The body of a braced node whose `}` is at `close`.
    fn body<T: Child>(&mut self, children: &[T], close: u32) -> Body {
        let mut seq = Seq::new(true);
        for child in children {
            self.place(&mut seq, child, Spacing::Source);
        }
        self.lead_in(&mut seq, close as usize, Spacing::Source);
        seq.body
    }

    /// Adds `child` to `seq`, after the comments that come before it.
    fn place<T: Child>(&mut self, seq: &mut Seq, child: &T, spacing: Spacing) {
        let span = child.span();
        self.lead_in(seq, span.start as usize, spacing);
        let blank = self.blank_before(seq, span.start as usize, spacing);
        let gathered = child.gather(self);
        seq.push_node(gathered, blank, span.end as usize);
    }

    /// Adds the comments before `pos`: after the code they follow where they can, else on their
    /// own lines.
    fn lead_in(&mut self, seq: &mut Seq, pos: usize, spacing: Spacing) {
        for comment in self.take_before(pos) {
            if let Some(comment) = seq.attach_if_trailing(comment) {
                let blank = self.blank_before(seq, comment.start, spacing);
                seq.push_comment(comment, blank);
            }
        }
    }

    /// Whether a blank line goes before what starts at `pos`.
    fn blank_before(&self, seq: &Seq, pos: usize, spacing: Spacing) -> bool {
        if seq.body.slots.is_empty() {
            return false;
        }
        match spacing {
            Spacing::Items { tight: true } => false,
            Spacing::Items { tight: false } if seq.last_is_node() => true,
            _ => has_blank_line(self.source.get(seq.prev_end..pos).unwrap_or("")),
        }
    }

    fn braced<T: Child>(
        &mut self,
        head: String,
        children: &[T],
        span: Span,
        one_line: OneLine,
    ) -> Gathered {
        let body = self.body(children, span.end - 1);
        Gathered::plain(Node::Braced {
            head,
            body,
            one_line,
        })
    }

    fn pair(&mut self, key: String, aligned: bool, value: &Value) -> Gathered {
        match &value.kind {
            ValueKind::Call(call) => self.call_pair(key, aligned, call),
            ValueKind::List(items) => {
                let starts = items.iter().map(|item| item.span.start as usize);
                let doc = CallDoc::list(items);
                self.delimited_pair(key, aligned, doc, starts.collect(), value.span.end as usize)
            }
            _ => Gathered::plain(Node::Pair {
                key,
                aligned,
                value: Val::Text(scalar(value)),
            }),
        }
    }

    fn call_pair(&mut self, key: String, aligned: bool, call: &Call) -> Gathered {
        let starts = call.args.iter().map(|arg| arg.span.start as usize);
        let doc = CallDoc::plain(call);
        self.delimited_pair(key, aligned, doc, starts.collect(), call.span.end as usize)
    }

    /// `key = ` a call or a list whose arguments start at `starts` and which ends at `end`, with
    /// the comments between its arguments.
    fn delimited_pair(
        &mut self,
        key: String,
        aligned: bool,
        mut doc: CallDoc,
        starts: Vec<usize>,
        end: usize,
    ) -> Gathered {
        let first = starts.first().copied().unwrap_or(end);
        let before = self.take_before(first);
        for (i, arg) in doc.args.iter_mut().enumerate() {
            let next = starts.get(i + 1).copied().unwrap_or(end);
            arg.comments = self.take_before(next);
        }
        let after = doc
            .args
            .last_mut()
            .map(|arg| std::mem::take(&mut arg.comments))
            .unwrap_or_default();
        Gathered {
            before,
            node: Node::Pair {
                key,
                aligned,
                value: Val::Call(doc),
            },
            after,
        }
    }
}

impl Child for Item {
    fn span(&self) -> Span {
        Item::span(self)
    }

    fn gather(&self, g: &mut Gather) -> Gathered {
        match self {
            Item::Import(import) => {
                Gathered::plain(Node::Text(format!("import {}", quote(&import.path.value))))
            }
            Item::Block(block) => {
                let head = format!("{} {}", block.kind.name, block.name.name);
                g.braced(head, &block.body.entries, block.body.span, OneLine::Never)
            }
        }
    }
}

impl Child for Entry {
    fn span(&self) -> Span {
        Entry::span(self)
    }

    fn gather(&self, g: &mut Gather) -> Gathered {
        match self {
            Entry::Assign(assign) => assign.gather(g),
            Entry::Nested(nested) => nested.gather(g),
            Entry::Layer(layer) => {
                let repeat = layer
                    .repeat
                    .as_ref()
                    .map_or(String::new(), |n| format!("[{}]", n.text));
                g.call_pair(
                    format!("layer {}{repeat}", layer.name.name),
                    false,
                    &layer.call,
                )
            }
            Entry::Measured(m) => {
                let head = format!("measured {} {}", m.collective.name, scalar(&m.mesh));
                g.braced(head, &m.points, m.span, OneLine::Semicolons)
            }
        }
    }
}

impl Child for Assign {
    fn span(&self) -> Span {
        self.span
    }

    fn gather(&self, g: &mut Gather) -> Gathered {
        g.pair(self.key.name.clone(), true, &self.value)
    }
}

/// One entry of a nested block, which keeps its assignments, rows and inner blocks apart.
enum NestedEntry<'a> {
    Assign(&'a Assign),
    Row(&'a Row),
    Block(&'a Nested),
}

impl Child for NestedEntry<'_> {
    fn span(&self) -> Span {
        match self {
            NestedEntry::Assign(a) => a.span,
            NestedEntry::Row(r) => r.span,
            NestedEntry::Block(b) => b.span,
        }
    }

    fn gather(&self, g: &mut Gather) -> Gathered {
        match self {
            NestedEntry::Assign(a) => a.gather(g),
            NestedEntry::Row(r) => {
                g.pair(format!("{} {}", r.key.name, r.index.text), true, &r.value)
            }
            NestedEntry::Block(b) => b.gather(g),
        }
    }
}

impl Child for Nested {
    fn span(&self) -> Span {
        self.span
    }

    fn gather(&self, g: &mut Gather) -> Gathered {
        let mut children: Vec<NestedEntry> = self.entries.iter().map(NestedEntry::Assign).collect();
        children.extend(self.rows.iter().map(NestedEntry::Row));
        children.extend(self.blocks.iter().map(NestedEntry::Block));
        children.sort_by_key(|c| c.span().start);
        let one_line = match self.rows.is_empty() && self.blocks.is_empty() {
            true => OneLine::Spaced,
            false => OneLine::Never,
        };
        g.braced(self.key.name.clone(), &children, self.span, one_line)
    }
}

impl Child for Point {
    fn span(&self) -> Span {
        self.span
    }

    fn gather(&self, _: &mut Gather) -> Gathered {
        Gathered::plain(Node::Text(format!(
            "{} = {}",
            quantity(&self.size),
            quantity(&self.bandwidth)
        )))
    }
}

/// A body being gathered, and where in the source its last slot ended.
struct Seq {
    body: Body,
    /// Whether the body has a `{` line that a comment can follow.
    braced: bool,
    prev_end: usize,
}

impl Seq {
    fn new(braced: bool) -> Seq {
        Seq {
            body: Body::default(),
            braced,
            prev_end: 0,
        }
    }

    fn last_is_node(&self) -> bool {
        matches!(self.body.slots.last(), Some(Slot::Node(..)))
    }

    /// Puts a comment that follows code after the line of the node before it, or of the `{`,
    /// if that line has none yet. Gives back a comment that must go on its own line.
    fn attach_if_trailing(&mut self, comment: Comment) -> Option<Comment> {
        match comment.own_line {
            true => Some(comment),
            false => self.attach(comment).err(),
        }
    }

    fn attach(&mut self, comment: Comment) -> Result<(), Comment> {
        let end = comment.end;
        let place = match self.body.slots.last_mut() {
            Some(Slot::Node(_, trailing)) => trailing,
            None if self.braced => &mut self.body.opening,
            _ => return Err(comment),
        };
        if place.is_some() {
            return Err(comment);
        }
        *place = Some(comment);
        self.prev_end = self.prev_end.max(end);
        Ok(())
    }

    fn push_comment(&mut self, comment: Comment, blank: bool) {
        if blank {
            self.body.slots.push(Slot::Blank);
        }
        self.prev_end = self.prev_end.max(comment.end);
        self.body.slots.push(Slot::Comment(comment));
    }

    fn push_node(&mut self, gathered: Gathered, blank: bool, end: usize) {
        let Gathered {
            before,
            node,
            after,
        } = gathered;
        if blank {
            self.body.slots.push(Slot::Blank);
        }
        self.body
            .slots
            .extend(before.into_iter().map(Slot::Comment));
        self.body.slots.push(Slot::Node(node, None));
        self.prev_end = end;
        for comment in after {
            if let Some(comment) = self.attach_if_trailing(comment) {
                self.push_comment(comment, false);
            }
        }
    }
}

/// Whether `gap`, the text between two things, holds a line with nothing on it.
fn has_blank_line(gap: &str) -> bool {
    let gap = gap.replace("\r\n", "\n").replace('\r', "\n");
    let lines: Vec<&str> = gap.split('\n').collect();
    lines.len() > 2
        && lines[1..lines.len() - 1]
            .iter()
            .any(|line| line.trim().is_empty())
}

fn scalar(value: &Value) -> String {
    match &value.kind {
        ValueKind::Number(n) => n.text.clone(),
        ValueKind::Quantity(q) => quantity(q),
        ValueKind::Mesh(m) => format!("{} x {}", m.a.text, m.b.text),
        ValueKind::String(s) => quote(&s.value),
        ValueKind::Ident(i) => i.name.clone(),
        ValueKind::Call(call) => CallDoc::plain(call).flat(),
        ValueKind::List(items) => CallDoc::list(items).flat(),
    }
}

fn quantity(q: &Quantity) -> String {
    format!("{} {}", q.number.text, q.unit.name)
}

fn arg_text(arg: &Arg) -> String {
    format!("{} = {}", arg.name.name, scalar(&arg.value))
}

fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        if matches!(c, '"' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

// ---------------------------------------------------------------------------------------------
// Printing: the layout tree into lines.

#[derive(Default)]
struct Printer {
    lines: Vec<String>,
}

impl Printer {
    fn finish(self) -> String {
        match self.lines.is_empty() {
            true => String::new(),
            false => self.lines.join("\n") + "\n",
        }
    }

    fn push(&mut self, depth: usize, text: &str) {
        self.lines.push(format!("{}{text}", INDENT.repeat(depth)));
    }

    /// Puts a comment after the last line printed.
    fn trail(&mut self, comment: &Comment) {
        let line = self
            .lines
            .last_mut()
            .expect("a trailing comment follows a printed line");
        line.push_str("  ");
        line.push_str(&comment.text);
    }

    fn body(&mut self, body: &Body, depth: usize) {
        for (slot, key_width) in body.slots.iter().zip(key_widths(&body.slots)) {
            match slot {
                Slot::Blank => self.lines.push(String::new()),
                Slot::Comment(comment) => self.push(depth, &comment.text),
                Slot::Node(node, trailing) => {
                    self.node(node, depth, key_width);
                    if let Some(comment) = trailing {
                        self.trail(comment);
                    }
                }
            }
        }
    }

    fn node(&mut self, node: &Node, depth: usize, key_width: usize) {
        match node {
            Node::Text(text) => self.push(depth, text),
            Node::Pair { key, value, .. } => {
                // Padded by hand: a runtime width in `format!` is limited to `u16::MAX` and
                // panics beyond it, and keys can be arbitrarily long.
                let pad = key_width.saturating_sub(width(key));
                let prefix = format!("{}{key}{} = ", INDENT.repeat(depth), " ".repeat(pad));
                match value {
                    Val::Text(text) => self.lines.push(prefix + text),
                    Val::Call(call) => self.lines.extend(call_lines(prefix, call)),
                }
            }
            Node::Braced {
                head,
                body,
                one_line,
            } => self.braced(head, body, *one_line, depth),
        }
    }

    fn braced(&mut self, head: &str, body: &Body, one_line: OneLine, depth: usize) {
        if let Some(line) = braced_one_line(head, body, one_line, depth) {
            return self.push(depth, &line);
        }
        self.push(depth, &format!("{head} {{"));
        if let Some(comment) = &body.opening {
            self.trail(comment);
        }
        self.body(body, depth + 1);
        self.push(depth, "}");
    }
}

/// For each slot, the width its key is padded to: the widest key in its run of assignments.
fn key_widths(slots: &[Slot]) -> Vec<usize> {
    fn aligned_key(slot: &Slot) -> Option<&str> {
        match slot {
            Slot::Node(Node::Pair { key, aligned, .. }, _) if *aligned => Some(key),
            _ => None,
        }
    }
    slots
        .chunk_by(|a, b| aligned_key(a).is_some() && aligned_key(b).is_some())
        .flat_map(|run| {
            let width = run
                .iter()
                .filter_map(aligned_key)
                .map(width)
                .max()
                .unwrap_or(0);
            run.iter().map(move |_| width)
        })
        .collect()
}

/// `head {}`, or `head { a  b }` with `separator` between the entries.
fn braced_line(head: &str, body: &Body, separator: &str) -> String {
    let entries: Vec<String> = body.nodes().map(Node::flat).collect();
    match entries.is_empty() {
        true => format!("{head} {{}}"),
        false => format!("{head} {{ {} }}", entries.join(separator)),
    }
}

/// The braced node on one line, when it is empty or may sit on one line, fits and reads back.
fn braced_one_line(head: &str, body: &Body, one_line: OneLine, depth: usize) -> Option<String> {
    if body.has_comments() {
        return None;
    }
    if body.slots.is_empty() {
        return Some(braced_line(head, body, ""));
    }
    let line = braced_line(head, body, one_line.separator()?);
    (fits(depth, &line) && reads_back(&line)).then_some(line)
}

/// Whether `line`, one entry of a block, parses back to an entry that prints as `line` again.
fn reads_back(line: &str) -> bool {
    let snippet = format!("_ _ {{ {line} }}");
    let parsed = crate::parser::parse(FileId::default(), &snippet);
    let [Item::Block(item)] = parsed.file.items.as_slice() else {
        return false;
    };
    let [entry] = item.body.entries.as_slice() else {
        return false;
    };
    parsed.errors.is_empty() && entry.gather(&mut Gather::new(&snippet)).node.flat() == line
}

fn width(text: &str) -> usize {
    text.chars().count()
}

fn fits(depth: usize, line: &str) -> bool {
    depth * INDENT.len() + width(line) <= MAX_WIDTH
}

/// The lines of `prefix` followed by a call.
fn call_lines(prefix: String, call: &CallDoc) -> Vec<String> {
    let head = format!("{prefix}{}", call.open);
    match (call.args.is_empty(), call.has_comments()) {
        (true, _) => vec![head + call.close],
        (false, false) => filled(head, call),
        (false, true) => one_per_line(head, call),
    }
}

/// Arguments filled greedily onto lines of at most [`MAX_WIDTH`], continuing after the `(`.
fn filled(head: String, call: &CallDoc) -> Vec<String> {
    let pad = " ".repeat(width(&head));
    let mut lines = vec![head];
    for i in 0..call.args.len() {
        let piece = call.piece(i);
        let line = lines.last_mut().expect("lines start with the head");
        if i == 0 || width(line) + 1 + width(&piece) <= MAX_WIDTH {
            line.push_str(if i == 0 { "" } else { " " });
            line.push_str(&piece);
        } else {
            lines.push(format!("{pad}{piece}"));
        }
    }
    lines
}

/// One argument per line, each followed by the comments that followed it in the source.
fn one_per_line(head: String, call: &CallDoc) -> Vec<String> {
    let pad = " ".repeat(width(&head));
    let mut lines = Vec::new();
    for (i, arg) in call.args.iter().enumerate() {
        let mut line = format!("{}{}", if i == 0 { &head } else { &pad }, call.piece(i));
        let mut comments = arg.comments.iter().peekable();
        if let Some(comment) = comments.next_if(|c| !c.own_line) {
            line = format!("{line}  {}", comment.text);
        }
        lines.push(line);
        lines.extend(comments.map(|comment| format!("{pad}{}", comment.text)));
    }
    lines
}

#[cfg(test)]
#[path = "../tests/unit/fmt.rs"]
mod tests;
