//! Reading typed values out of blocks: keys, units, exact integers, choices.
//!
//! [`BlockReader`] sorts a block's entries by key against the keys that block allows, reporting
//! unknown keys (with a suggestion), duplicates (pointing at both) and the wrong shape (a value
//! where a block is expected, or the reverse). The `expect_*` functions turn one value into a typed
//! one or report why not, naming what was expected and what was found. They return `None` after
//! reporting, so a caller can carry on and collect every error of a file in one run.

use super::Ctx;
use sched_grammar::ast::*;
use sched_grammar::diag::{did_you_mean, Diagnostic, Span};

/// What a key of a block holds.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    Value,
    Block,
}

/// The kinds of quantity of `dsl.md`'s unit table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum UnitKind {
    Bytes,
    Bandwidth,
    Time,
    Compute,
}

impl UnitKind {
    fn phrase(self) -> &'static str {
        match self {
            UnitKind::Bytes => "bytes",
            UnitKind::Bandwidth => "a bandwidth",
            UnitKind::Time => "a time",
            UnitKind::Compute => "a compute rate",
        }
    }

    fn example(self) -> &'static str {
        match self {
            UnitKind::Bytes => "`80 GiB`",
            UnitKind::Bandwidth => "`200 GB/s` or `800 Gbps`",
            UnitKind::Time => "`10 us`",
            UnitKind::Compute => "`312 TFLOPS`",
        }
    }
}

/// Every unit: its kind and its factor to bytes, bytes per second, seconds or FLOP/s, as a
/// numerator and denominator so that byte quantities convert exactly.
const UNITS: &[(&str, UnitKind, u128, u128)] = &[
    ("B", UnitKind::Bytes, 1, 1),
    ("KB", UnitKind::Bytes, 1_000, 1),
    ("MB", UnitKind::Bytes, 1_000_000, 1),
    ("GB", UnitKind::Bytes, 1_000_000_000, 1),
    ("TB", UnitKind::Bytes, 1_000_000_000_000, 1),
    ("KiB", UnitKind::Bytes, 1 << 10, 1),
    ("MiB", UnitKind::Bytes, 1 << 20, 1),
    ("GiB", UnitKind::Bytes, 1 << 30, 1),
    ("TiB", UnitKind::Bytes, 1 << 40, 1),
    ("MB/s", UnitKind::Bandwidth, 1_000_000, 1),
    ("GB/s", UnitKind::Bandwidth, 1_000_000_000, 1),
    ("GiB/s", UnitKind::Bandwidth, 1 << 30, 1),
    ("Mbps", UnitKind::Bandwidth, 1_000_000, 8),
    ("Gbps", UnitKind::Bandwidth, 1_000_000_000, 8),
    ("ns", UnitKind::Time, 1, 1_000_000_000),
    ("us", UnitKind::Time, 1, 1_000_000),
    ("ms", UnitKind::Time, 1, 1_000),
    ("s", UnitKind::Time, 1, 1),
    ("GFLOPS", UnitKind::Compute, 1_000_000_000, 1),
    ("TFLOPS", UnitKind::Compute, 1_000_000_000_000, 1),
    ("PFLOPS", UnitKind::Compute, 1_000_000_000_000_000, 1),
];

/// The entries of one block, sorted by key.
pub(crate) struct BlockReader<'a> {
    values: Vec<(&'static str, &'a Ident, &'a Value)>,
    blocks: Vec<(&'static str, &'a Nested)>,
    pub layers: Vec<&'a LayerDecl>,
    pub measured: Vec<&'a Measured>,
    /// "key" for blocks, "argument" for calls.
    noun: &'static str,
    /// Keys already reported: suggested for a misspelt key, or written in the wrong form
    /// (`intra_node = 300 GB/s`). A missing one of these is not reported again.
    suggested: Vec<&'static str>,
}

/// What a block may hold besides keys.
#[derive(Clone, Copy, Default)]
pub(crate) struct Extras {
    pub layers: bool,
    pub measured: bool,
}

impl<'a> BlockReader<'a> {
    fn empty(noun: &'static str) -> Self {
        BlockReader {
            values: vec![],
            blocks: vec![],
            layers: vec![],
            measured: vec![],
            noun,
            suggested: vec![],
        }
    }

    /// Sorts `entries` of the block described as `what` ("cluster `a800`") against `keys`.
    pub fn new(
        ctx: &mut Ctx,
        what: &str,
        entries: &'a [Entry],
        keys: &[(&'static str, Shape)],
        extras: Extras,
    ) -> Self {
        let mut r = BlockReader::empty("key");
        for e in entries {
            match e {
                Entry::Assign(a) => {
                    r.add_value(ctx, what, &a.key, &a.value, keys);
                }
                Entry::Nested(n) => {
                    if let Some(k) = r.check_key(ctx, what, &n.key, keys, Shape::Block) {
                        r.blocks.push((k, n));
                    }
                }
                Entry::Layer(l) if extras.layers => r.layers.push(l),
                Entry::Layer(l) => ctx.error(
                    Diagnostic::error(format!("a layer cannot be declared in {what}"))
                        .at(l.span, "layer declared here")
                        .note("layers belong in a `model` block"),
                ),
                Entry::Measured(m) if extras.measured => r.measured.push(m),
                Entry::Measured(m) => ctx.error(
                    Diagnostic::error(format!("a `measured` table cannot appear in {what}"))
                        .at(m.span, "measured table here")
                        .note("measured tables belong in a `cluster` block"),
                ),
            }
        }
        r
    }

    /// Sorts the arguments of a call (`transformer(hidden = 4096, …)`) against `keys`.
    pub fn for_args(
        ctx: &mut Ctx,
        what: &str,
        args: &'a [Arg],
        keys: &[(&'static str, Shape)],
    ) -> Self {
        let mut r = BlockReader::empty("argument");
        for a in args {
            r.add_value(ctx, what, &a.name, &a.value, keys);
        }
        r
    }

    /// Sorts the entries of a nested block (`prefetch { … }`) against `keys`: its assignments
    /// and inner blocks (`pipeline { order { … } }`). Numbered rows (`stage 0 = …`) belong only
    /// in the blocks that read them on their own, so here each is an error.
    pub fn for_nested(
        ctx: &mut Ctx,
        what: &str,
        block: &'a Nested,
        keys: &[(&'static str, Shape)],
    ) -> Self {
        let mut r = BlockReader::empty("key");
        for a in &block.entries {
            r.add_value(ctx, what, &a.key, &a.value, keys);
        }
        for b in &block.blocks {
            if let Some(k) = r.check_key(ctx, what, &b.key, keys, Shape::Block) {
                r.blocks.push((k, b));
            }
        }
        for row in &block.rows {
            ctx.error(
                Diagnostic::error(format!(
                    "a numbered row such as `{} {} = …` cannot appear in {what}",
                    row.key.name, row.index.text
                ))
                .at(row.span, "row here")
                .note("rows hold a pipeline's order: `order { stage 0 = \"F0 B0\" }` inside `pipeline { … }`"),
            );
        }
        r
    }

    fn add_value(
        &mut self,
        ctx: &mut Ctx,
        what: &str,
        key: &'a Ident,
        value: &'a Value,
        keys: &[(&'static str, Shape)],
    ) {
        if let Some(k) = self.check_key(ctx, what, key, keys, Shape::Value) {
            self.values.push((k, key, value));
        }
    }

    /// Checks one key; returns its canonical name when it is allowed, has the right shape and is new.
    fn check_key(
        &mut self,
        ctx: &mut Ctx,
        what: &str,
        key: &Ident,
        keys: &[(&'static str, Shape)],
        shape: Shape,
    ) -> Option<&'static str> {
        let Some(&(name, want)) = keys.iter().find(|(k, _)| *k == key.name) else {
            let mut d =
                Diagnostic::error(format!("unknown {} `{}` in {what}", self.noun, key.name))
                    .at(key.span, format!("unknown {}", self.noun));
            d = match did_you_mean(&key.name, keys.iter().map(|(k, _)| *k)) {
                Some(s) => {
                    self.suggested.push(s);
                    d.note(format!("did you mean `{s}`?"))
                }
                None => d.note(format!(
                    "the {}s of {what} are {}",
                    self.noun,
                    list(keys.iter().map(|(k, _)| *k))
                )),
            };
            ctx.error(d);
            return None;
        };
        if want != shape {
            let msg = match want {
                Shape::Block => format!("`{name}` is a block: write `{name} {{ … }}`"),
                Shape::Value => format!("`{name}` takes a value, not a block: write `{name} = …`"),
            };
            ctx.error(Diagnostic::error(msg).at(key.span, "wrong form"));
            self.suggested.push(name);
            return None;
        }
        let earlier = self
            .values
            .iter()
            .map(|(k, id, _)| (*k, id.span))
            .chain(self.blocks.iter().map(|(k, n)| (*k, n.key.span)))
            .find(|(k, _)| *k == name);
        if let Some((_, first)) = earlier {
            ctx.error(
                Diagnostic::error(format!("`{name}` is set twice in {what}"))
                    .at(key.span, "set again here")
                    .also(first, "first set here"),
            );
            return None;
        }
        Some(name)
    }

    pub fn value(&self, key: &str) -> Option<&'a Value> {
        self.values
            .iter()
            .find(|(k, ..)| *k == key)
            .map(|(_, _, v)| *v)
    }

    pub fn block(&self, key: &str) -> Option<&'a Nested> {
        self.blocks.iter().find(|(k, _)| *k == key).map(|(_, n)| *n)
    }

    /// Span of the key `key` (for "required by" notes).
    pub fn key_span(&self, key: &str) -> Option<Span> {
        self.values
            .iter()
            .find(|(k, ..)| *k == key)
            .map(|(_, id, _)| id.span)
            .or_else(|| {
                self.blocks
                    .iter()
                    .find(|(k, _)| *k == key)
                    .map(|(_, n)| n.key.span)
            })
    }

    /// Whether `key` was already reported (misspelt, or written in the wrong form), so that its
    /// absence is no news.
    pub fn reported(&self, key: &str) -> bool {
        self.suggested.contains(&key)
    }

    /// Reports, in one error at `owner`, every key of `required` (a key and what to write for it,
    /// such as `("nodes", "nodes = 4")`) that is absent and not already reported.
    pub fn require(&self, ctx: &mut Ctx, owner: &Ident, what: &str, required: &[(&str, &str)]) {
        let missing: Vec<&(&str, &str)> = required
            .iter()
            .filter(|(k, _)| self.key_span(k).is_none() && !self.reported(k))
            .collect();
        let names = list(missing.iter().map(|(k, _)| *k));
        let d = match missing.as_slice() {
            [] => return,
            [(key, hint)] => Diagnostic::error(format!("{what} is missing `{key}`"))
                .at(owner.span, format!("`{key}` is required here"))
                .note(format!("add `{hint}`")),
            several => {
                let lines: Vec<String> = several
                    .iter()
                    .map(|(_, hint)| format!("    {hint}"))
                    .collect();
                Diagnostic::error(format!("{what} is missing {names}"))
                    .at(
                        owner.span,
                        format!("{} required {}s are missing here", several.len(), self.noun),
                    )
                    .note(format!("add them, for example:\n{}", lines.join("\n")))
            }
        };
        ctx.error(d);
    }

    /// The value of a required key; reports it missing (at `owner`) when absent.
    pub fn required(
        &self,
        ctx: &mut Ctx,
        key: &str,
        owner: &Ident,
        what: &str,
        hint: &str,
    ) -> Option<&'a Value> {
        self.require(ctx, owner, what, &[(key, &format!("{key} = {hint}"))]);
        self.value(key)
    }
}

/// Joins names as "`a`, `b` and `c`".
pub(crate) fn list<'s>(names: impl IntoIterator<Item = &'s str>) -> String {
    join(names, "and")
}

/// Joins names as "`a`, `b` and `c`", the first `max` of them and then "and N more".
pub(crate) fn list_some<'s>(names: impl IntoIterator<Item = &'s str>, max: usize) -> String {
    let names: Vec<&str> = names.into_iter().collect();
    if names.len() <= max {
        return list(names);
    }
    let shown: Vec<String> = names[..max].iter().map(|n| format!("`{n}`")).collect();
    format!("{} and {} more", shown.join(", "), names.len() - max)
}

/// Joins names as "`a`, `b` or `c`", for a choice.
pub(crate) fn list_or<'s>(names: impl IntoIterator<Item = &'s str>) -> String {
    join(names, "or")
}

fn join<'s>(names: impl IntoIterator<Item = &'s str>, conjunction: &str) -> String {
    let names: Vec<String> = names.into_iter().map(|n| format!("`{n}`")).collect();
    match names.as_slice() {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} {conjunction} {last}", init.join(", ")),
    }
}

/// A byte count for people: `4 GiB` when exact in a binary unit, else `97.6 KiB (99,968 bytes)`.
pub(crate) fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let Some(k) = (1..=UNITS.len()).rev().find(|&k| b >> (10 * k) > 0) else {
        return format!("{b} {}", if b == 1 { "byte" } else { "bytes" });
    };
    let unit = 1u64 << (10 * k);
    match b % unit {
        0 => format!("{} {}", b / unit, UNITS[k - 1]),
        _ => format!(
            "{:.1} {} ({} bytes)",
            b as f64 / unit as f64,
            UNITS[k - 1],
            crate::emit::job::thousands(b)
        ),
    }
}

/// A value as written in the source (`-3 us`, `0 TFLOPS`), for messages.
pub(crate) fn written(v: &Value) -> String {
    match &v.kind {
        ValueKind::Number(n) => n.text.clone(),
        ValueKind::Quantity(q) => format!("{} {}", q.number.text, q.unit.name),
        ValueKind::Mesh(m) => format!("{} x {}", m.a.text, m.b.text),
        ValueKind::String(s) => format!("\"{}\"", s.value),
        ValueKind::Ident(i) => i.name.clone(),
        ValueKind::Call(c) => format!("{}(…)", c.callee.name),
        ValueKind::List(_) => "[…]".to_string(),
    }
}

fn mismatch(ctx: &mut Ctx, v: &Value, expected: &str) {
    let found = match &v.kind {
        ValueKind::Quantity(q) => match unit(&q.unit.name) {
            Some((k, ..)) => format!("{} (`{}`)", k.phrase(), q.unit.name),
            None => "a quantity".to_string(),
        },
        k => k.describe().to_string(),
    };
    ctx.error(
        Diagnostic::error(format!("expected {expected}, found {found}"))
            .at(v.span, format!("expected {expected}")),
    );
}

fn unit(name: &str) -> Option<(UnitKind, u128, u128)> {
    UNITS
        .iter()
        .find(|u| u.0 == name)
        .map(|&(_, k, n, d)| (k, n, d))
}

/// A decimal number as mantissa × 10^exp10, exactly.
fn decimal(n: &NumberLit) -> Option<(bool, u128, i32)> {
    let text = n.digits();
    let (neg, text) = text
        .strip_prefix('-')
        .map_or((false, text.as_str()), |t| (true, t));
    let (num, exp) = match text.find(['e', 'E']) {
        Some(i) => (&text[..i], text[i + 1..].parse::<i32>().ok()?),
        None => (text, 0),
    };
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    let mantissa: u128 = format!("{int}{frac}").parse().ok()?;
    Some((neg, mantissa, exp.checked_sub(frac.len() as i32)?))
}

/// mantissa × 10^exp10 × num / den as an exact integer, if it is one and fits in 64 bits.
fn exact(neg: bool, mantissa: u128, exp10: i32, num: u128, den: u128) -> Result<u64, &'static str> {
    if neg && mantissa != 0 {
        return Err("negative");
    }
    let mut value = mantissa.checked_mul(num).ok_or("too large")?;
    let mut den = den;
    if exp10 >= 0 {
        let scale = 10u128.checked_pow(exp10 as u32).ok_or("too large")?;
        value = value.checked_mul(scale).ok_or("too large")?;
    } else {
        den = den
            .checked_mul(
                10u128
                    .checked_pow(exp10.unsigned_abs())
                    .ok_or("not whole")?,
            )
            .ok_or("not whole")?;
    }
    if value % den != 0 {
        return Err("not whole");
    }
    u64::try_from(value / den).map_err(|_| "too large")
}

/// A whole number within `min..=max`, written as an integer or an exact decimal (`7.5e9`).
pub(crate) fn expect_int(ctx: &mut Ctx, v: &Value, min: u64, max: u64, what: &str) -> Option<u64> {
    let ValueKind::Number(n) = &v.kind else {
        mismatch(ctx, v, "an integer");
        return None;
    };
    let result = decimal(n)
        .ok_or("too large")
        .and_then(|(neg, m, e)| exact(neg, m, e, 1, 1));
    let value = match result {
        Ok(x) => x,
        Err(why) => {
            let msg = match why {
                "negative" => format!("{what} must be at least {min}, found `{}`", n.text),
                "not whole" => format!("{what} must be a whole number, found `{}`", n.text),
                _ => format!(
                    "{what} is too large: the limit is {max}, found `{}`",
                    n.text
                ),
            };
            ctx.error(Diagnostic::error(msg).at(v.span, "not allowed here"));
            return None;
        }
    };
    in_range(ctx, v.span, value, min, max, what)
}

fn in_range(ctx: &mut Ctx, span: Span, value: u64, min: u64, max: u64, what: &str) -> Option<u64> {
    if value < min || value > max {
        let range = if max == u64::MAX {
            format!("at least {min}")
        } else {
            format!("between {min} and {max}")
        };
        ctx.error(
            Diagnostic::error(format!("{what} must be {range}, found {value}"))
                .at(span, "out of range"),
        );
        return None;
    }
    Some(value)
}

/// Any number (integer or decimal) as a float.
pub(crate) fn expect_number(ctx: &mut Ctx, v: &Value) -> Option<f64> {
    match &v.kind {
        ValueKind::Number(n) => finite(ctx, v.span, &n.text, n.as_f64()),
        _ => {
            mismatch(ctx, v, "a number");
            None
        }
    }
}

/// `x`, the value of what is written at `span` as `text`, if it is a finite float.
fn finite(ctx: &mut Ctx, span: Span, text: &str, x: f64) -> Option<f64> {
    if x.is_finite() {
        Some(x)
    } else {
        ctx.error(
            Diagnostic::error(format!(
                "`{text}` is too large: numbers are limited to about 1.8e308"
            ))
            .at(span, "too large"),
        );
        None
    }
}

/// A quantity of `kind` in base units (bytes, bytes/s, seconds, FLOP/s).
pub(crate) fn expect_quantity(ctx: &mut Ctx, v: &Value, kind: UnitKind) -> Option<f64> {
    match &v.kind {
        ValueKind::Quantity(q) => quantity(ctx, q, kind),
        ValueKind::Number(_) => {
            ctx.error(
                Diagnostic::error(format!(
                    "expected {} such as {}, found a number without a unit",
                    kind.phrase(),
                    kind.example()
                ))
                .at(v.span, "needs a unit"),
            );
            None
        }
        _ => {
            mismatch(ctx, v, kind.phrase());
            None
        }
    }
}

/// Checks a quantity's unit against `kind` and converts it.
pub(crate) fn quantity(ctx: &mut Ctx, q: &Quantity, kind: UnitKind) -> Option<f64> {
    let (k, num, den) = check_unit(ctx, q, kind)?;
    debug_assert_eq!(k, kind);
    let text = format!("{} {}", q.number.text, q.unit.name);
    finite(
        ctx,
        q.span,
        &text,
        q.number.as_f64() * num as f64 / den as f64,
    )
}

fn check_unit(ctx: &mut Ctx, q: &Quantity, kind: UnitKind) -> Option<(UnitKind, u128, u128)> {
    let Some((k, num, den)) = unit(&q.unit.name) else {
        let same_kind = UNITS.iter().filter(|u| u.1 == kind).map(|u| u.0);
        let mut d = Diagnostic::error(format!("unknown unit `{}`", q.unit.name))
            .at(q.unit.span, "unknown unit");
        d = match suggest_unit(&q.unit.name, kind) {
            Some((s, why)) => d.note(format!("did you mean `{s}`?{why}")),
            None => d.note(format!(
                "units for {} are {}",
                kind.phrase(),
                list(same_kind)
            )),
        };
        ctx.error(d);
        return None;
    };
    if k != kind {
        ctx.error(
            Diagnostic::error(format!(
                "expected {}, found {} (`{}`)",
                kind.phrase(),
                k.phrase(),
                q.unit.name
            ))
            .at(q.span, format!("this is {}", k.phrase()))
            .note(format!(
                "write {} here, for example {}",
                kind.phrase(),
                kind.example()
            )),
        );
        return None;
    }
    Some((k, num, den))
}

/// The unit meant by an unknown unit `written` where `kind` is expected, and a remark to go with
/// it (empty, or starting with a space). A rate keeps what its `b` says: `B` is bytes and `b` bits (`80 GBps` is `80 GB/s`, while
/// `80 gbps` and `80 Gb/s` are `80 Gbps`, 8 times less), so a suggestion never turns one into the
/// other. Spelled-out times (`usec`, `sec`) get their symbol; otherwise a unit differing only in
/// case, else a close one of the expected kind.
fn suggest_unit(written: &str, kind: UnitKind) -> Option<(&'static str, String)> {
    let lower = written.to_ascii_lowercase();
    let time = match lower.trim_end_matches('s') {
        "n" | "nsec" | "nanosec" | "nanosecond" => Some("ns"),
        "u" | "usec" | "microsec" | "microsecond" => Some("us"),
        "m" | "msec" | "millisec" | "millisecond" => Some("ms"),
        "" | "sec" | "second" => Some("s"),
        _ => None,
    };
    if let Some(t) = time.filter(|_| lower != "m") {
        return Some((t, String::new()));
    }
    let stem = written
        .strip_suffix("/s")
        .or_else(|| written.strip_suffix("/S"))
        .or_else(|| {
            let n = written.len().checked_sub(2)?;
            written
                .get(n..)
                .filter(|s| s.eq_ignore_ascii_case("ps"))
                .map(|_| &written[..n])
        });
    // A data rate: `…b` or `…bit` (bits) or `…B` (bytes), then `ps` or `/s`.
    let rate_stem = stem.and_then(|stem| {
        let lower_stem = stem.to_ascii_lowercase();
        if let Some(p) = lower_stem
            .strip_suffix("bits")
            .or(lower_stem.strip_suffix("bit"))
        {
            Some((p.to_string(), true))
        } else if let Some(p) = stem.strip_suffix('b') {
            Some((p.to_ascii_lowercase(), true))
        } else {
            stem.strip_suffix('B')
                .map(|p| (p.to_ascii_lowercase(), false))
        }
    });
    if let Some((prefix, bits)) = rate_stem {
        let rate = |bits: bool| {
            UNITS.iter().map(|u| u.0).find(|name| {
                let (k, _, den) = unit(name).expect("a unit of the table");
                let unit_prefix = name.trim_end_matches("bps").trim_end_matches("B/s");
                k == UnitKind::Bandwidth
                    && (den == 8) == bits
                    && unit_prefix.eq_ignore_ascii_case(&prefix)
            })
        };
        let found = rate(bits)?;
        let why = match (bits, rate(!bits)) {
            (true, Some(other)) => {
                format!(" (`b` is bits; `{other}` would be bytes per second, 8 times more)")
            }
            (false, Some(other)) => {
                format!(" (`B` is bytes; `{other}` would be bits per second, 8 times less)")
            }
            (true, None) => " (`b` is bits)".to_string(),
            (false, None) => " (`B` is bytes)".to_string(),
        };
        return Some((found, why));
    }
    let same_case = |u: &&(&str, UnitKind, u128, u128)| u.0.eq_ignore_ascii_case(written);
    if let Some(u) = UNITS
        .iter()
        .filter(|u| u.1 == kind)
        .find(same_case)
        .or_else(|| UNITS.iter().find(same_case))
    {
        return Some((u.0, String::new()));
    }
    did_you_mean(written, UNITS.iter().filter(|u| u.1 == kind).map(|u| u.0))
        .map(|u| (u, String::new()))
}

/// A byte count, exact (`0.5 GiB` is 536870912; `0.3 B` is an error).
pub(crate) fn expect_bytes(ctx: &mut Ctx, v: &Value) -> Option<u64> {
    match &v.kind {
        ValueKind::Quantity(q) => bytes(ctx, q),
        _ => expect_quantity(ctx, v, UnitKind::Bytes).map(|_| 0),
    }
}

pub(crate) fn bytes(ctx: &mut Ctx, q: &Quantity) -> Option<u64> {
    let (_, num, den) = check_unit(ctx, q, UnitKind::Bytes)?;
    let result = decimal(&q.number)
        .ok_or("too large")
        .and_then(|(neg, m, e)| exact(neg, m, e, num, den));
    match result {
        Ok(b) => Some(b),
        Err(why) => {
            let msg = match why {
                "negative" => "a size cannot be negative".to_string(),
                "not whole" => format!(
                    "`{} {}` is not a whole number of bytes",
                    q.number.text, q.unit.name
                ),
                _ => format!(
                    "`{} {}` is too large: the limit is {} bytes (just under 16 EiB)",
                    q.number.text,
                    q.unit.name,
                    u64::MAX
                ),
            };
            ctx.error(Diagnostic::error(msg).at(q.span, "invalid size"));
            None
        }
    }
}

/// One of `names`, written as a bare name; returns its index.
pub(crate) fn expect_choice(ctx: &mut Ctx, v: &Value, names: &[&str], what: &str) -> Option<usize> {
    let ValueKind::Ident(id) = &v.kind else {
        mismatch(
            ctx,
            v,
            &format!("one of {}", list_or(names.iter().copied())),
        );
        return None;
    };
    choice(ctx, id, names, what)
}

/// The value of key `key` (as quoted in messages: "`bias`") when it must be one of `names`:
/// "`reshard_after_forward` must be `true`, `false` or `node`, found `nodes`".
pub(crate) fn expect_key_choice(
    ctx: &mut Ctx,
    v: &Value,
    names: &[&str],
    key: &str,
) -> Option<usize> {
    let choices = list_or(names.iter().copied());
    let found = match &v.kind {
        ValueKind::Ident(id) => match names.iter().position(|n| *n == id.name) {
            Some(i) => return Some(i),
            None => format!("`{}`", id.name),
        },
        k => k.describe().to_string(),
    };
    let mut d = Diagnostic::error(format!("{key} must be {choices}, found {found}"))
        .at(v.span, format!("expected {choices}"));
    if let ValueKind::Ident(id) = &v.kind {
        if let Some(s) = did_you_mean(&id.name, names.iter().copied()) {
            d = d.note(format!("did you mean `{s}`?"));
        }
    }
    ctx.error(d);
    None
}

/// Resolves a name against `names`, suggesting the closest on failure.
pub(crate) fn choice(ctx: &mut Ctx, id: &Ident, names: &[&str], what: &str) -> Option<usize> {
    if let Some(i) = names.iter().position(|n| *n == id.name) {
        return Some(i);
    }
    let mut d = Diagnostic::error(format!("unknown {what} `{}`", id.name))
        .at(id.span, format!("not a known {what}"));
    d = match did_you_mean(&id.name, names.iter().copied()) {
        Some(s) => d.note(format!("did you mean `{s}`?")),
        None if names.len() == 1 => d.note(format!("expected `{}`", names[0])),
        None => d.note(format!(
            "expected one of {}",
            list_or(names.iter().copied())
        )),
    };
    ctx.error(d);
    None
}

/// `true` or `false`, for key `key` (as quoted in messages: "`bias`").
pub(crate) fn expect_bool(ctx: &mut Ctx, v: &Value, key: &str) -> Option<bool> {
    expect_key_choice(ctx, v, &["true", "false"], key).map(|i| i == 0)
}

pub(crate) fn expect_string<'a>(ctx: &mut Ctx, v: &'a Value) -> Option<&'a StringLit> {
    match &v.kind {
        ValueKind::String(s) => Some(s),
        _ => {
            mismatch(ctx, v, "a quoted string");
            None
        }
    }
}

#[cfg(test)]
#[path = "../../tests/unit/sema_values.rs"]
mod tests;
