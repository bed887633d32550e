//! Resolving a schedule's `pipeline { … }` block into a [`Pipeline`] (language.md, "Pipelines").
//!
//! Three steps, as the schedule learns what each needs:
//! 1. [`read`], before the cluster or model is known: the keys' values, rule 5 (what each
//!    schedule needs of v and m), and a `custom` order, parsed action by action with the span of
//!    each and checked by [`orders::check`], its errors placed at the offending actions.
//! 2. [`PipelineSpec::data_parallel`], once the ranks used are known: rule 2. A stage is d·t =
//!    G·N/p consecutive ranks (t, the tensor-parallel degree, 1 without a `tensor` block), and
//!    either holds whole nodes (a data-parallel mesh of G/t x d·t/G) or shares a node with other
//!    whole stages (d x 1); the `shard` meshes are laid out over that mesh.
//! 3. [`PipelineSpec::resolve`], once the model is known: rule 4 (the layers of each chunk, as
//!    listed or `balanced` by the cost model) and the built-in order from [`orders::generate`].
//!
//! Every error says which rule it breaks and shows the numbers. `stages = 1` is no pipeline:
//! the block is checked like any other and the schedule resolves to [`Pipeline::default`].

use super::values::*;
use super::Ctx;
use crate::sim::cost::CostModel;
use sched_grammar::ast::{Nested, Value, ValueKind};
use sched_grammar::diag::{did_you_mean, Diagnostic, Span};
use sched_ir::ir::ComputeKind;
use sched_ir::job::{Action, Job, Pipeline, PipelineSchedule};
use sched_ir::orders;

const KEYS: &[(&str, Shape)] = &[
    ("stages", Shape::Value),
    ("virtual", Shape::Value),
    ("schedule", Shape::Value),
    ("layers", Shape::Value),
    ("order", Shape::Block),
];

/// The most (micro-batch, chunk) pairs a pipeline's order may cover, p·v·m: each stage lists two
/// or three actions for each of its own, and the listing prints them all.
pub(crate) const MAX_ORDER_PAIRS: u64 = 1 << 20;

/// The pipeline as written and checked so far: what [`read`] found.
pub(crate) struct PipelineSpec {
    /// p, and where it is written (the block's key when defaulted).
    stages: u32,
    stages_span: Span,
    /// v.
    virtual_stages: u32,
    schedule: PipelineSchedule,
    /// Layers per chunk as listed, with the list's span; `None` for `balanced`.
    layers: Option<(Vec<u32>, Span)>,
    /// A `custom` order, checked.
    order: Option<Vec<Vec<Action>>>,
}

/// Reads and checks `pipeline { … }` for `m` micro-batches (`None` when `micro_steps` is
/// broken, which skips the rules about m). `None` after an error.
pub(crate) fn read(ctx: &mut Ctx, block: &Nested, m: Option<u32>) -> Option<PipelineSpec> {
    let r = BlockReader::for_nested(ctx, "`pipeline`", block, KEYS);
    let int = |ctx: &mut Ctx, key: &str, max: u64| match r.value(key) {
        Some(v) => expect_int(ctx, v, 1, max, &format!("`pipeline.{key}`")).map(|n| n as u32),
        None => Some(1),
    };
    let stages = int(ctx, "stages", 1 << 16);
    let virtual_stages = int(ctx, "virtual", 1 << 10);
    let schedule = match r.value("schedule") {
        Some(v) => schedule_name(ctx, v),
        None => Some(PipelineSchedule::default()),
    };
    let layers = match r.value("layers") {
        Some(v) => layers_value(ctx, v).map(|l| l.map(|l| (l, v.span))),
        None => Some(None),
    };
    let (p, v, schedule) = (stages?, virtual_stages?, schedule?);
    let at = |key: &str| r.value(key).map(|v| v.span);
    let stages_span = at("stages").unwrap_or(block.key.span);
    let schedule_span = at("schedule").unwrap_or(block.key.span);
    let name = schedule.name();

    let mut ok = rule5(ctx, &r, block, schedule, p, v, m);
    let pairs = u64::from(p) * u64::from(v) * u64::from(m.unwrap_or(1));
    if pairs > MAX_ORDER_PAIRS {
        ctx.error(
            Diagnostic::error(format!(
                "the pipeline's order would cover {pairs} (micro-batch, chunk) pairs (p·v·m = {p} x {v} x {}); the limit is {MAX_ORDER_PAIRS}",
                m.unwrap_or(1)
            ))
            .at(stages_span, format!("p = {p}")),
        );
        return None;
    }
    let order = match (schedule, r.block("order")) {
        (PipelineSchedule::Custom, Some(b)) => {
            let order = custom_order(ctx, b, p);
            match (&order, m) {
                (Some(lines), Some(m)) => ok &= check_order(ctx, b, lines, p, v, m),
                _ => ok = false,
            }
            order
        }
        (PipelineSchedule::Custom, None) => {
            ctx.error(
                Diagnostic::error("a `custom` pipeline schedule needs an `order`")
                    .at(schedule_span, "no `order` given")
                    .note(format!(
                        "add `order {{ stage 0 = \"F0 B0 …\" … }}` inside `pipeline`, one line for each of the {p} stages"
                    )),
            );
            None
        }
        (_, Some(b)) => {
            ctx.error(
                Diagnostic::error(format!(
                    "`order` is for `schedule = custom`; `{name}` makes its own order"
                ))
                .at(b.key.span, "order given")
                .also(schedule_span, format!("the schedule is `{name}`"))
                .note("write `schedule = custom` to run this order, or remove it"),
            );
            ok = false;
            None
        }
        (_, None) => None,
    };
    ok.then_some(PipelineSpec {
        stages: p,
        stages_span,
        virtual_stages: v,
        schedule,
        layers: layers?,
        order,
    })
}

/// `schedule`: one of the names, as a string (`"1f1b"`) or, where it is an identifier, bare.
fn schedule_name(ctx: &mut Ctx, v: &Value) -> Option<PipelineSchedule> {
    let names = PipelineSchedule::ALL.map(|s| s.name());
    let written = match &v.kind {
        ValueKind::String(s) => s.value.as_str(),
        ValueKind::Ident(id) => id.name.as_str(),
        k => {
            ctx.error(
                Diagnostic::error(format!(
                    "expected a pipeline schedule such as `\"1f1b\"` or `zb_h1`, found {}",
                    k.describe()
                ))
                .at(v.span, "not a schedule name"),
            );
            return None;
        }
    };
    if let Some(i) = names.iter().position(|n| *n == written) {
        return Some(PipelineSchedule::ALL[i]);
    }
    let mut d = Diagnostic::error(format!("unknown pipeline schedule `{written}`"))
        .at(v.span, "not a known schedule");
    d = match did_you_mean(written, names) {
        Some(s) if s.starts_with(|c: char| c.is_ascii_digit()) => {
            d.note(format!("did you mean `\"{s}\"`?"))
        }
        Some(s) => d.note(format!("did you mean `{s}`?")),
        None => d.note(format!(
            "the schedules are {} (`\"1f1b\"` is written as a string)",
            list(names)
        )),
    };
    ctx.error(d);
    None
}

/// `layers`: `balanced` (`None`) or a list of integers (each checked ≥ 1 by rule 4).
fn layers_value(ctx: &mut Ctx, v: &Value) -> Option<Option<Vec<u32>>> {
    match &v.kind {
        ValueKind::Ident(id) => choice(ctx, id, &["balanced"], "layer split").map(|_| None),
        ValueKind::List(items) => {
            let mut out = Some(vec![]);
            for (c, item) in items.iter().enumerate() {
                let n = expect_int(ctx, item, 0, u64::from(u32::MAX), "a chunk's layer count");
                match n {
                    Some(0) => {
                        ctx.error(
                            Diagnostic::error(format!(
                                "rule 4: every chunk holds at least one layer, but chunk {c} has 0"
                            ))
                            .at(item.span, "an empty chunk"),
                        );
                        out = None;
                    }
                    Some(n) => {
                        if let Some(l) = out.as_mut() {
                            l.push(n as u32)
                        }
                    }
                    None => out = None,
                }
            }
            out.map(Some)
        }
        _ => {
            ctx.error(
                Diagnostic::error(format!(
                    "expected `balanced` or a list of layer counts such as `[11, 10, 10, 11]`, found {}",
                    v.kind.describe()
                ))
                .at(v.span, "not a layer split"),
            );
            None
        }
    }
}

/// Rule 5: what each schedule needs of v and of m (`micro_steps`). Gives whether it holds
/// (a warning for `gpipe` with fewer micro-batches than stages).
fn rule5(
    ctx: &mut Ctx,
    r: &BlockReader,
    block: &Nested,
    schedule: PipelineSchedule,
    p: u32,
    v: u32,
    m: Option<u32>,
) -> bool {
    let name = schedule.name();
    let schedule_span = r.value("schedule").map_or(block.key.span, |v| v.span);
    let virtual_at = |d: Diagnostic| match r.value("virtual") {
        Some(value) => d
            .at(value.span, format!("v = {v}"))
            .also(schedule_span, format!("`{name}`")),
        None => d
            .at(schedule_span, format!("`{name}`"))
            .note("`virtual` is not written, so it is 1"),
    };
    let mut ok = true;
    let needs = match schedule {
        PipelineSchedule::Interleaved1F1B if v < 2 => Some("v ≥ 2 chunks per stage"),
        PipelineSchedule::Zbv if v != 2 => Some("v = 2 chunks per stage"),
        PipelineSchedule::Gpipe | PipelineSchedule::OneFOneB | PipelineSchedule::ZbH1 if v != 1 => {
            Some("v = 1 chunk per stage (only `interleaved_1f1b`, `zbv` and `custom` run more)")
        }
        _ => None,
    };
    if let Some(needs) = needs {
        ctx.error(virtual_at(Diagnostic::error(format!(
            "rule 5: `{name}` needs {needs}, but `virtual` is {v}"
        ))));
        ok = false;
    }
    let Some(m) = m else { return ok };
    let m_note = format!("m is `micro_steps`, the micro-batches of one optimizer step ({m})");
    if schedule == PipelineSchedule::Interleaved1F1B && m.checked_rem(p) != Some(0) {
        ctx.error(
            Diagnostic::error(format!(
                "rule 5: `{name}` needs m a multiple of the {p} stages, but m = {m}"
            ))
            .at(schedule_span, format!("`{name}` with p = {p}"))
            .note(m_note.clone()),
        );
        ok = false;
    }
    if m < p {
        let message =
            format!("rule 5: {m} micro-batches for {p} stages leaves stages idle (m < p)");
        if schedule == PipelineSchedule::Gpipe {
            ctx.warn(
                Diagnostic::warning(message)
                    .at(
                        r.value("stages").map_or(block.key.span, |v| v.span),
                        format!("p = {p}"),
                    )
                    .note(m_note),
            );
        } else {
            ctx.error(
                Diagnostic::error(format!("{message}: `{name}` needs m ≥ p"))
                    .at(
                        r.value("stages").map_or(block.key.span, |v| v.span),
                        format!("p = {p}"),
                    )
                    .note(m_note)
                    .note("only `gpipe` runs with fewer micro-batches than stages"),
            );
            ok = false;
        }
    }
    ok
}

/// One line of a custom order: its actions, each with its span.
type Line = Vec<(Action, Span)>;

/// The lines of `order { stage N = "…" }`, one per stage, each action read from its word.
/// `None` after an error.
fn custom_lines(ctx: &mut Ctx, block: &Nested, p: u32) -> Option<Vec<(Line, Span)>> {
    let mut ok = true;
    for a in &block.entries {
        ctx.error(
            Diagnostic::error(format!(
                "`order` holds one line per stage, `stage N = \"…\"`, not `{}`",
                a.key.name
            ))
            .at(a.key.span, "not a stage line"),
        );
        ok = false;
    }
    let mut lines: Vec<Option<(Line, Span, Span)>> = vec![None; p as usize];
    for row in &block.rows {
        if row.key.name != "stage" {
            let mut d = Diagnostic::error(format!(
                "unknown row `{} {}` in `order`: its lines are `stage N = \"…\"`",
                row.key.name, row.index.text
            ))
            .at(row.key.span, "not `stage`");
            if did_you_mean(&row.key.name, ["stage"]).is_some() {
                d = d.note("did you mean `stage`?");
            }
            ctx.error(d);
            ok = false;
            continue;
        }
        let Some(s) = row.index.value().filter(|&s| s < u64::from(p)) else {
            ctx.error(
                Diagnostic::error(format!(
                    "stage {} does not exist: the pipeline has {p} stages (0 … {})",
                    row.index.text,
                    p - 1
                ))
                .at(row.index.span, "no such stage"),
            );
            ok = false;
            continue;
        };
        let Some(text) = expect_string(ctx, &row.value) else {
            ok = false;
            continue;
        };
        if let Some((_, _, first)) = &lines[s as usize] {
            ctx.error(
                Diagnostic::error(format!("stage {s} has two lines in `order`"))
                    .at(row.span, "again here")
                    .also(*first, "first here"),
            );
            ok = false;
            continue;
        }
        let mut line = vec![];
        for (word, span) in text.words() {
            match orders::parse_action(word) {
                Some(a) => line.push((a, span)),
                None => {
                    ctx.error(
                        Diagnostic::error(format!(
                            "expected an action such as `F3`, `B3`, `I3`, `W3` or `F3.1`, found `{word}`"
                        ))
                        .at(span, "not an action")
                        .note("an action is F, B, I or W, the micro-batch, and with several chunks per stage `.` and the stage's local chunk"),
                    );
                    ok = false;
                }
            }
        }
        lines[s as usize] = Some((line, row.value.span, row.span));
    }
    let missing: Vec<String> = (0..p)
        .filter(|&s| lines[s as usize].is_none())
        .map(|s| s.to_string())
        .collect();
    if !missing.is_empty() && ok {
        ctx.error(
            Diagnostic::error(format!(
                "`order` has no line for stage {}: a custom order gives one line per stage",
                missing.join(", ")
            ))
            .at(block.key.span, format!("{p} stages need {p} lines")),
        );
        ok = false;
    }
    ok.then(|| {
        lines
            .into_iter()
            .map(|l| l.map(|(line, value, _)| (line, value)).unwrap_or_default())
            .collect()
    })
}

fn custom_order(ctx: &mut Ctx, block: &Nested, p: u32) -> Option<Vec<Vec<Action>>> {
    let lines = custom_lines(ctx, block, p)?;
    Some(
        lines
            .into_iter()
            .map(|(l, _)| l.into_iter().map(|(a, _)| a).collect())
            .collect(),
    )
}

/// The schedule rule on a custom order (`orders::check`), each error at its action, or for a
/// missing action at the stage's line.
fn check_order(
    ctx: &mut Ctx,
    block: &Nested,
    order: &[Vec<Action>],
    p: u32,
    v: u32,
    m: u32,
) -> bool {
    let pipeline = Pipeline {
        stages: p,
        virtual_stages: v,
        schedule: PipelineSchedule::Custom,
        chunks: vec![],
        order: order.to_vec(),
    };
    let errors = orders::check(&pipeline, m);
    if errors.is_empty() {
        return true;
    }
    // The spans again: the lines parsed without error, so each word is an action.
    let mut spans: Vec<(Vec<Span>, Span)> = vec![(vec![], block.key.span); p as usize];
    for row in &block.rows {
        let (Some(s), ValueKind::String(text)) = (row.index.value(), &row.value.kind) else {
            continue;
        };
        spans[s as usize] = (
            text.words().into_iter().map(|(_, s)| s).collect(),
            row.value.span,
        );
    }
    for e in errors {
        let (words, line) = &spans[e.stage as usize];
        let what = orders::action_text(e.action, v);
        let d = Diagnostic::error(format!("schedule rule: stage {}: {}", e.stage, e.message));
        let d = match e.index {
            Some(i) => d.at(words[i], what),
            None => d.at(*line, format!("no {what} in this order")),
        };
        ctx.error(d.note(
            "each micro-batch and chunk of a stage has one F and either one B or one I and one W; I and B come after their F, W after its I",
        ));
    }
    false
}

impl PipelineSpec {
    /// Rule 2: the data-parallel mesh of each stage, `(a, b)`: a GPUs in each of b nodes, for
    /// `g` GPUs per node, `n` nodes used and tensor groups of `tensor` (t, with where it is
    /// written; `None` is t = 1). `None` after an error.
    pub(crate) fn data_parallel(
        &self,
        ctx: &mut Ctx,
        g: u64,
        n: u64,
        tensor: Option<(u32, Span)>,
    ) -> Option<(u64, u64)> {
        let p = u64::from(self.stages);
        let (t, t_span) = match tensor {
            Some((t, span)) if t > 1 => (u64::from(t), Some(span)),
            _ => (1, None),
        };
        let ranks = g * n;
        let used = format!("{ranks} ranks used ({n} nodes x {g} GPUs)");
        if ranks.checked_rem(p * t) != Some(0) || ranks < p * t {
            let d = match t_span {
                None => Diagnostic::error(format!(
                    "rule 2: {p} stages cannot share the {used} evenly"
                ))
                .at(self.stages_span, format!("p = {p}"))
                .note("each stage is G·N/p consecutive ranks, so p must divide the ranks used"),
                Some(span) => Diagnostic::error(format!(
                    "rule 2: {p} stages of tensor groups of {t} cannot share the {used} evenly"
                ))
                .at(self.stages_span, format!("p = {p}"))
                .also(span, format!("t = {t}"))
                .note(format!(
                    "the ranks used are t·p·d and each stage is d·t consecutive ranks, so t·p = {} must divide them",
                    t * p
                )),
            };
            ctx.error(d);
            return None;
        }
        // d·t, the consecutive ranks of one stage.
        let dt = ranks / p;
        if dt.checked_rem(g) == Some(0) {
            return Some((g / t, dt / g));
        }
        if g.checked_rem(dt) == Some(0) {
            return Some((dt / t, 1));
        }
        let mut d = Diagnostic::error(format!(
            "rule 2: {p} stages of the {used} have {dt} ranks each, so a stage would straddle nodes of {g} GPUs"
        ))
        .at(self.stages_span, format!("p = {p}: {dt} ranks per stage"));
        if let Some(span) = t_span {
            d = d.also(span, format!("t = {t}")).note(format!(
                "with tensor groups of {t}, a stage's {dt} ranks are d·t = {} x {t}",
                dt / t
            ));
        }
        ctx.error(d.note(format!(
            "a stage holds whole nodes ({g} divides its ranks) or each node holds whole stages (its ranks divide {g})"
        )));
        None
    }

    /// Rule 4 and the order: the resolved pipeline of `job` (whose own pipeline is ignored),
    /// with the layers of each chunk as listed or `balanced` by the cost model.
    pub(crate) fn resolve(self, ctx: &mut Ctx, job: &Job) -> Option<Pipeline> {
        let (p, v) = (self.stages, self.virtual_stages);
        let count = p * v;
        let model = &job.model;
        let n = model.layers.len();
        let chunks_are = format!(
            "{p} stage{} x {v} chunk{} per stage make {count} chunk{}",
            if p == 1 { "" } else { "s" },
            if v == 1 { "" } else { "s" },
            if count == 1 { "" } else { "s" },
        );
        let chunks = match self.layers {
            Some((list, span)) => {
                let mut ok = true;
                if list.len() != count as usize {
                    ctx.error(
                        Diagnostic::error(format!(
                            "rule 4: `layers` lists {} chunks, but {chunks_are}",
                            list.len()
                        ))
                        .at(span, format!("{} entries, {count} expected", list.len())),
                    );
                    ok = false;
                }
                let sum: u64 = list.iter().map(|&l| u64::from(l)).sum();
                if sum != n as u64 {
                    ctx.error(
                        Diagnostic::error(format!(
                            "rule 4: `layers` adds up to {sum} layers, but model `{}` has {n}",
                            model.name
                        ))
                        .at(span, format!("{sum} layers"))
                        .note("the embedding and the head count as layers"),
                    );
                    ok = false;
                }
                ok.then_some(list)?
            }
            None => {
                if (count as usize) > n {
                    ctx.error(
                        Diagnostic::error(format!(
                            "rule 4: {chunks_are}, but model `{}` has only {n} layers",
                            model.name
                        ))
                        .at(self.stages_span, format!("p = {p}"))
                        .note("every chunk holds at least one layer"),
                    );
                    return None;
                }
                balanced_chunks(job, count)
            }
        };
        if p == 1 {
            return Some(Pipeline::default());
        }
        let m = job.schedule.micro_steps;
        let order = match self.order {
            Some(order) => order,
            None => orders::generate(self.schedule, p, v, m),
        };
        Some(Pipeline {
            stages: p,
            virtual_stages: v,
            schedule: self.schedule,
            chunks,
            order,
        })
    }
}

/// `layers = balanced` for `job`'s model in `k` chunks (k at most the layer count): each layer
/// costs one forward and one backward of a micro-batch by the simulator's cost model.
pub fn balanced_chunks(job: &Job, k: u32) -> Vec<u32> {
    let cost = CostModel::new(job);
    let costs: Vec<f64> = job
        .model
        .layers
        .iter()
        .map(|l| {
            cost.stream_seconds(l, ComputeKind::Forward)
                + cost.stream_seconds(l, ComputeKind::Backward)
        })
        .collect();
    balanced(&costs, k as usize)
}

/// Splits layers of the given costs into `k` contiguous chunks (k ≤ the layer count), each of
/// at least one layer, so that the largest chunk's cost is least: a bisection on that cost
/// (the fewest chunks within a cap, filled from the front), then [`even_out`] among the splits
/// that reach it. Gives the layers of each chunk.
fn balanced(costs: &[f64], k: usize) -> Vec<u32> {
    let total: f64 = costs.iter().sum();
    let largest = costs.iter().copied().fold(0.0, f64::max);
    // The fewest chunks whose cost stays within `cap`, filling each from the front.
    let fewest = |cap: f64| {
        let (mut chunks, mut sum, mut len) = (1, 0.0, 0);
        for &c in costs {
            if len > 0 && sum + c > cap {
                chunks += 1;
                (sum, len) = (0.0, 0);
            }
            sum += c;
            len += 1;
        }
        chunks
    };
    let (mut lo, mut hi) = (largest.max(total / k as f64), total.max(largest));
    for _ in 0..200 {
        let mid = lo + (hi - lo) / 2.0;
        if mid <= lo || mid >= hi {
            break;
        }
        match fewest(mid) <= k {
            true => hi = mid,
            false => lo = mid,
        }
    }
    // Fill from the front within `hi`, closing a chunk early when the layers left are just
    // enough for one each in the chunks left.
    let n = costs.len();
    let mut out = vec![];
    let (mut len, mut sum) = (0u32, 0.0);
    for (i, &c) in costs.iter().enumerate() {
        let chunks_after = k - out.len() - 1;
        if len > 0 && (sum + c > hi || n - i == chunks_after) {
            out.push(len);
            (len, sum) = (0, 0.0);
        }
        len += 1;
        sum += c;
    }
    out.push(len);
    debug_assert_eq!(out.len(), k, "a split within the found cap has k chunks");
    even_out(costs, &mut out);
    out
}

/// Moves each boundary between two neighbouring chunks to where the larger of the two is
/// least (the more even split on a tie), pass after pass until nothing moves: the largest chunk
/// never grows, and the front-filled split's short last chunks even out (`[3, 3, 3, 1]` becomes
/// `[3, 3, 2, 2]`).
fn even_out(costs: &[f64], chunks: &mut [u32]) {
    for _ in 0..64 {
        let mut moved = false;
        let mut start = 0usize;
        for j in 0..chunks.len().saturating_sub(1) {
            let len = (chunks[j] + chunks[j + 1]) as usize;
            let pair = &costs[start..start + len];
            let total: f64 = pair.iter().sum();
            let key = |left: f64| {
                let right = total - left;
                (left.max(right), (left - right).abs())
            };
            let mut best = (chunks[j], key(pair[..chunks[j] as usize].iter().sum()));
            let mut left = 0.0;
            for (i, &c) in pair[..len - 1].iter().enumerate() {
                left += c;
                let k = key(left);
                // Better by more than rounding noise, so that no pass undoes another.
                if k.0 < best.1 .0 - 1e-12 || (k.0 <= best.1 .0 + 1e-12 && k.1 < best.1 .1 - 1e-12)
                {
                    best = (i as u32 + 1, k);
                }
            }
            if best.0 != chunks[j] {
                chunks[j + 1] = len as u32 - best.0;
                chunks[j] = best.0;
                moved = true;
            }
            start += chunks[j] as usize;
        }
        if !moved {
            break;
        }
    }
}

#[cfg(test)]
#[path = "../../tests/unit/sema_pipeline.rs"]
mod tests;
