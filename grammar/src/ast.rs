//! The syntax tree of one `.sched` file.
//!
//! The tree mirrors the structural grammar in `sched.pest`: items are blocks with a kind word and a
//! name, blocks hold entries, values are scalars or calls. Nothing here knows which keys or kinds are
//! valid; semantic analysis (in the compiler) decides that, using the spans kept on every node.
//! Literals keep their source text so that diagnostics and the formatter show what the user wrote.

use crate::diag::Span;

/// A parsed file: its items in source order.
#[derive(Clone, Debug, PartialEq)]
pub struct File {
    pub items: Vec<Item>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Item {
    Import(Import),
    Block(BlockItem),
}

impl Item {
    pub fn span(&self) -> Span {
        match self {
            Item::Import(i) => i.span,
            Item::Block(b) => b.span,
        }
    }
}

/// `import "path"`.
#[derive(Clone, Debug, PartialEq)]
pub struct Import {
    pub path: StringLit,
    pub span: Span,
}

/// `KIND NAME { … }`, for example `cluster a800 { … }`.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockItem {
    pub kind: Ident,
    pub name: Ident,
    pub body: Block,
    pub span: Span,
}

/// The braces of an item and the entries between them.
#[derive(Clone, Debug, PartialEq)]
pub struct Block {
    pub entries: Vec<Entry>,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Entry {
    Assign(Assign),
    Nested(Nested),
    Layer(LayerDecl),
    Measured(Measured),
}

impl Entry {
    pub fn span(&self) -> Span {
        match self {
            Entry::Assign(a) => a.span,
            Entry::Nested(n) => n.span,
            Entry::Layer(l) => l.span,
            Entry::Measured(m) => m.span,
        }
    }
}

/// `key = value`.
#[derive(Clone, Debug, PartialEq)]
pub struct Assign {
    pub key: Ident,
    pub value: Value,
    pub span: Span,
}

/// `key { a = 1  b = 2 }`: a nested block of assignments, and of numbered rows and inner blocks
/// (`pipeline { stages = 2  order { stage 0 = "F0 B0" } }`). The grammar allows one level of
/// inner blocks, which hold no blocks of their own; each list is in source order.
#[derive(Clone, Debug, PartialEq)]
pub struct Nested {
    pub key: Ident,
    pub entries: Vec<Assign>,
    /// Inner blocks (empty in an inner block).
    pub blocks: Vec<Nested>,
    pub rows: Vec<Row>,
    pub span: Span,
}

/// `key N = value`: a numbered row of a nested block, such as `stage 0 = "F0 B0"`.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    pub key: Ident,
    pub index: IntLit,
    pub value: Value,
    pub span: Span,
}

/// `layer NAME = KIND(args)` or `layer NAME[n] = KIND(args)`.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerDecl {
    pub name: Ident,
    pub repeat: Option<IntLit>,
    pub call: Call,
    pub span: Span,
}

/// `measured COLLECTIVE MESH { SIZE = BANDWIDTH; … }`.
#[derive(Clone, Debug, PartialEq)]
pub struct Measured {
    pub collective: Ident,
    pub mesh: Value,
    pub points: Vec<Point>,
    pub span: Span,
}

/// One `SIZE = BANDWIDTH` point of a measured table.
#[derive(Clone, Debug, PartialEq)]
pub struct Point {
    pub size: Quantity,
    pub bandwidth: Quantity,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Value {
    pub kind: ValueKind,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub enum ValueKind {
    Number(NumberLit),
    Quantity(Quantity),
    Mesh(MeshLit),
    String(StringLit),
    Ident(Ident),
    Call(Call),
    /// `[a, b, …]`: scalars only.
    List(Vec<Value>),
}

impl ValueKind {
    /// What kind of value this is, as a phrase for diagnostics ("a quantity", "a mesh", ...).
    pub fn describe(&self) -> &'static str {
        match self {
            ValueKind::Number(_) => "a number",
            ValueKind::Quantity(_) => "a quantity",
            ValueKind::Mesh(_) => "a mesh",
            ValueKind::String(_) => "a string",
            ValueKind::Ident(_) => "a name",
            ValueKind::Call(_) => "a call",
            ValueKind::List(_) => "a list",
        }
    }
}

/// `KIND(name = value, …)`.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    pub callee: Ident,
    pub args: Vec<Arg>,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Arg {
    pub name: Ident,
    pub value: Value,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ident {
    pub name: String,
    pub span: Span,
}

/// A number as written: `42`, `1_000_000`, `0.5`, `7.5e9`, `-3`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NumberLit {
    pub text: String,
    pub span: Span,
}

impl NumberLit {
    /// The text without digit separators.
    pub fn digits(&self) -> String {
        self.text.replace('_', "")
    }

    /// True when written without a fraction or exponent.
    pub fn is_integer_syntax(&self) -> bool {
        !self.text.contains(['.', 'e', 'E'])
    }

    /// The value as a float (always succeeds for grammar-produced text; overflow gives infinity).
    pub fn as_f64(&self) -> f64 {
        self.digits().parse().unwrap_or(f64::NAN)
    }
}

/// An unsigned integer literal (layer repetition counts, mesh factors).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IntLit {
    pub text: String,
    pub span: Span,
}

impl IntLit {
    /// The value, or `None` when it does not fit in 64 bits.
    pub fn value(&self) -> Option<u64> {
        self.text.replace('_', "").parse().ok()
    }
}

/// A number with a unit: `80 GiB`, `200GB/s`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quantity {
    pub number: NumberLit,
    pub unit: Ident,
    pub span: Span,
}

/// `a x b`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MeshLit {
    pub a: IntLit,
    pub b: IntLit,
}

/// A double-quoted string; `value` has its escapes resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StringLit {
    pub value: String,
    pub span: Span,
}

impl StringLit {
    /// The whitespace-separated words of the string, each with its span in the file (inside the
    /// quotes, escapes counted as written), as a pipeline order's actions are read.
    pub fn words(&self) -> Vec<(&str, Span)> {
        // Source offset of each byte of `value`: after the opening quote, each escaped `"` or
        // `\` (the only escapes a well-formed string has) taking two bytes there.
        let mut offsets = Vec::with_capacity(self.value.len() + 1);
        let mut at = self.span.start as usize + 1;
        for c in self.value.chars() {
            offsets.extend((0..c.len_utf8()).map(|k| at + k));
            at += match c {
                '"' | '\\' => 2,
                c => c.len_utf8(),
            };
        }
        offsets.push(at);
        let mut out = vec![];
        let mut start = None;
        for (i, c) in self.value.char_indices().chain([(self.value.len(), ' ')]) {
            match (c.is_whitespace(), start) {
                (true, Some(s)) => {
                    let span = Span::new(self.span.file, offsets[s], offsets[i]);
                    out.push((&self.value[s..i], span));
                    start = None;
                }
                (false, None) => start = Some(i),
                _ => {}
            }
        }
        out
    }
}
