//! Resolving a schedule's `tensor { … }` block into a [`Tensor`] (language.md, "Tensor
//! parallelism").
//!
//! Three steps, as the schedule learns what each needs (as for the `pipeline` block):
//! 1. [`read`], before the cluster or model is known: `size` (t ≥ 1) and `sequence`.
//!    `sequence = true` with `size = 1` is a warning (sequence parallelism over one rank does
//!    nothing) and resolves to no tensor parallelism.
//! 2. [`TensorSpec::rule1`], once the ranks are known: t divides the GPUs per node used (a
//!    tensor group never spans nodes). Rule 2 with t (a stage is d·t consecutive ranks) is the
//!    pipeline's ([`super::pipeline::PipelineSpec::data_parallel`]); without a pipeline the
//!    data-parallel mesh is `G/t x N` ([`TensorSpec::data_parallel`]).
//! 3. [`TensorSpec::rule3`], once the model is known: with t > 1, `heads`, `kv_heads` and
//!    `ffn` of every transformer and mlp layer divide by t, with `sequence = true` so does
//!    `seq_len`, and no layer is `dense`. Each error is at `size` (or `sequence`), with the
//!    model's value it concerns as a second place.
//!
//! Every error says which rule it breaks and shows the numbers. Lowering tensor parallelism is
//! not written yet: [`not_lowered`] is the refusal every command that compiles reports, while
//! `schedc check` accepts the schedule.

use super::values::*;
use super::Ctx;
use sched_grammar::ast::{BlockItem, Entry, LayerDecl, Nested};
use sched_grammar::diag::{Diagnostic, Span};
use sched_ir::job::{Job, Layer, LayerKind, Model, Tensor};

const KEYS: &[(&str, Shape)] = &[("size", Shape::Value), ("sequence", Shape::Value)];

/// What rule 3 says tensor parallelism splits by `ffn`.
const FFN: &str = "the ffn width of every transformer and mlp layer";

/// The tensor block as written and checked so far: what [`read`] found.
pub(crate) struct TensorSpec {
    /// t, and where it is written (the block's key when defaulted).
    pub size: u32,
    pub size_span: Span,
    pub sequence: bool,
    /// Where `sequence` is written (the block's key when defaulted).
    sequence_span: Span,
}

/// Reads and checks `tensor { … }`. `None` after an error.
pub(crate) fn read(ctx: &mut Ctx, block: &Nested) -> Option<TensorSpec> {
    let r = BlockReader::for_nested(ctx, "`tensor`", block, KEYS);
    let size = match r.value("size") {
        Some(v) => expect_int(ctx, v, 1, 1 << 16, "`tensor.size`").map(|n| n as u32),
        None => Some(1),
    };
    let sequence = match r.value("sequence") {
        Some(v) => expect_bool(ctx, v, "`tensor.sequence`"),
        None => Some(false),
    };
    let (size, sequence) = (size?, sequence?);
    let size_span = r.value("size").map_or(block.key.span, |v| v.span);
    let sequence_span = r.value("sequence").map_or(block.key.span, |v| v.span);
    if sequence && size == 1 {
        let d = Diagnostic::warning(
            "sequence parallelism over a tensor group of one rank does nothing: `sequence = true` is ignored with `size = 1`",
        )
        .at(sequence_span, "sequence = true");
        let d = match r.value("size") {
            Some(v) => d.also(v.span, "t = 1"),
            None => d.note("`size` is not written, so it is 1"),
        };
        ctx.warn(d.note(
            "sequence parallelism splits the sequence over the t ranks of a tensor group; set `size` above 1, or remove `sequence`",
        ));
    }
    Some(TensorSpec {
        size,
        size_span,
        sequence,
        sequence_span,
    })
}

impl TensorSpec {
    /// The resolved tensor parallelism (the default, none, with t = 1).
    pub fn resolve(&self) -> Tensor {
        match self.size {
            1 => Tensor::default(),
            size => Tensor {
                size,
                sequence: self.sequence,
            },
        }
    }

    /// Rule 1: t divides the `g` GPUs per node used, so a tensor group never spans nodes.
    pub fn rule1(&self, ctx: &mut Ctx, g: u64) -> bool {
        let t = u64::from(self.size);
        if g.checked_rem(t) == Some(0) {
            return true;
        }
        ctx.error(
            Diagnostic::error(format!(
                "rule 1: a tensor group of t = {t} ranks must lie inside one node, so t must divide the {g} GPUs per node used"
            ))
            .at(self.size_span, format!("{t} does not divide {g}"))
            .note("a tensor group is t consecutive ranks; its collectives run on every layer, over the node's fast links"),
        );
        false
    }

    /// The data-parallel mesh `(a, b)` without a pipeline, for `g` GPUs per node (rule 1 holding)
    /// and `n` nodes: the ranks of one tensor index, `g/t` in each node.
    pub fn data_parallel(&self, g: u64, n: u64) -> (u64, u64) {
        (g / u64::from(self.size), n)
    }

    /// Rule 3 on `model` (defined by `item`, whose spans the errors point at as a second place):
    /// with t > 1 every transformer's and mlp's `heads`, `kv_heads` and `ffn` divide by t, with
    /// `sequence` so does `seq_len`, and no layer is `dense`. Gives whether it holds.
    pub fn rule3(&self, ctx: &mut Ctx, model: &Model, item: Option<&BlockItem>) -> bool {
        let t = u64::from(self.size);
        if t == 1 {
            return true;
        }
        // Each declaration once, at its first layer (a repeated layer's copies are alike).
        let layers: Vec<(&str, &Layer, Option<&LayerDecl>)> = match item {
            Some(item) => item
                .body
                .entries
                .iter()
                .filter_map(|e| match e {
                    Entry::Layer(d) => Some(d),
                    _ => None,
                })
                .filter_map(|d| {
                    let first = format!("{}[0]", d.name.name);
                    let layer = model
                        .layers
                        .iter()
                        .find(|l| l.name == d.name.name || l.name == first)?;
                    Some((d.name.name.as_str(), layer, Some(d)))
                })
                .collect(),
            None => model
                .layers
                .iter()
                .map(|l| (l.name.as_str(), l, None))
                .collect(),
        };
        let mut ok = true;
        for (name, layer, decl) in layers {
            let arg = |key: &str| -> Option<Span> {
                let a = decl?.call.args.iter().find(|a| a.name.name == key)?;
                Some(a.value.span)
            };
            let kind = layer.kind.name();
            let mut split = |ctx: &mut Ctx, key: &str, value: u64, what: &str| {
                if value.is_multiple_of(t) {
                    return;
                }
                let mut d = Diagnostic::error(format!(
                    "rule 3: tensor parallelism over t = {t} ranks splits {what}, but {kind} layer `{name}` has {key} = {value}, not a multiple of {t}"
                ))
                .at(self.size_span, format!("t = {t}"));
                if let Some(span) = arg(key) {
                    d = d.also(span, format!("{key} = {value}"));
                }
                ctx.error(d.note(
                    "each rank of a tensor group holds 1/t of the heads and of the ffn width (Megatron-LM's column- and row-parallel products)",
                ));
                ok = false;
            };
            match layer.kind {
                LayerKind::Transformer(s) => {
                    split(
                        ctx,
                        "heads",
                        s.heads,
                        "the attention heads of every transformer",
                    );
                    // Not written, `kv_heads` is `heads`, already checked.
                    if arg("kv_heads").is_some() || decl.is_none() {
                        let what = "the key and value heads of every transformer";
                        split(ctx, "kv_heads", s.kv_heads, what);
                    }
                    split(ctx, "ffn", s.ffn, FFN);
                }
                LayerKind::Mlp(m) => split(ctx, "ffn", m.ffn, FFN),
                LayerKind::Dense { .. } => {
                    let mut d = Diagnostic::error(format!(
                        "rule 3: `dense` layers cannot be split by tensor parallelism, but layer `{name}` of model `{}` is one (t = {t})",
                        model.name
                    ))
                    .at(self.size_span, format!("t = {t}"));
                    if let Some(decl) = decl {
                        d = d.also(decl.call.callee.span, "a dense layer");
                    }
                    ctx.error(d.note(
                        "a `dense` layer is opaque (a parameter count and FLOPs), so nothing says how to split it; describe it as transformer or mlp layers, or write `size = 1`",
                    ));
                    ok = false;
                }
                LayerKind::Embedding { .. } | LayerKind::LmHead { .. } => {}
            }
        }
        if self.sequence && !model.seq_len.is_multiple_of(t) {
            let mut d = Diagnostic::error(format!(
                "rule 3: sequence parallelism splits the sequence over the t = {t} ranks of a tensor group, but model `{}` has seq_len = {}, not a multiple of {t}",
                model.name, model.seq_len
            ))
            .at(self.sequence_span, "sequence = true")
            .also(self.size_span, format!("t = {t}"));
            let seq_len = item.and_then(|i| {
                i.body.entries.iter().find_map(|e| match e {
                    Entry::Assign(a) if a.key.name == "seq_len" => Some(a.value.span),
                    _ => None,
                })
            });
            if let Some(span) = seq_len {
                d = d.also(span, format!("seq_len = {}", model.seq_len));
            }
            ctx.error(d);
            ok = false;
        }
        ok
    }
}

/// Why `job`, resolved from `item`, cannot be compiled yet although it checks: with tensor
/// parallelism (t > 1), full recomputation and split backwards (`I`/`W` actions: `zb_h1`, `zbv`,
/// a custom order with them) are not lowered for tensor-parallel layers. An error at `size`,
/// which every command that compiles reports instead of compiling
/// ([`super::Analysis::not_lowered`]).
pub(crate) fn not_lowered(item: &BlockItem, job: &Job) -> Option<Diagnostic> {
    let t = job.schedule.tensor.size;
    let what = job.tensor_not_lowered()?;
    let size = item.body.entries.iter().find_map(|e| match e {
        Entry::Nested(n) if n.key.name == "tensor" => Some(
            n.entries
                .iter()
                .find(|a| a.key.name == "size")
                .map_or(n.key.span, |a| a.value.span),
        ),
        _ => None,
    });
    let d = Diagnostic::error(format!(
        "tensor parallelism (t = {t}) with {what} is not lowered yet: schedule `{}` checks, but cannot be compiled, simulated or planned",
        job.schedule.name
    ))
    .note("tensor-parallel layers run their forward and whole backward as Megatron's phases; recomputing them, and splitting their backward into `I` and `W`, are the next steps of issue 30 (docs/parallel.md)")
    .note("drop the recompute or use a schedule with whole backwards (gpipe, 1f1b, interleaved_1f1b), or write `size = 1`");
    Some(match size {
        Some(span) => d.at(span, format!("t = {t}")),
        None => d,
    })
}
