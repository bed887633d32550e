//! Pipeline orders: the action lists of the built-in schedules, and the well-formedness check
//! every order (built-in or the user's `custom` one) must pass before it is lowered.
//!
//! An order is one list of [`Action`]s per stage, run in list order. Chunks are named by the
//! stage's *local* chunk index (0 … v−1, see [`Pipeline::local_chunk`]); with Megatron's placement
//! stage s holds chunks s, p+s, 2p+s, …; with `zbv`'s V placement stage s holds chunk s (local 0)
//! and chunk 2p−1−s (local 1).
//!
//! The built-in schedules, for p stages, v chunks per stage and m micro-batches:
//!
//! - `gpipe`: every F in micro-batch order, then every B in the same order.
//! - `1f1b`: p−s−1 warm-up F on stage s, then F and B alternating, then the remaining B; at most
//!   p−s micro-batches are in flight (F done, B not yet) on stage s.
//! - `interleaved_1f1b` (Megatron-LM's interleaved schedule, m a multiple of p): the m·v forward
//!   passes of a stage are taken in groups of p micro-batches, chunk after chunk (micro-batches
//!   0 … p−1 of local chunk 0, then of chunk 1, …, then micro-batches p … 2p−1 of chunk 0, …);
//!   backward passes go through the chunks in reverse. Stage s warms up with (p−s−1)·2 + (v−1)·p
//!   forward passes (all of them when m = p, as Megatron does), then alternates one forward and
//!   one backward, then drains the backward passes.
//! - `zb_h1` (Qi et al., "Zero Bubble Pipeline Parallelism", ZB-H1): 1F1B's order with each B
//!   split into I (input gradient) and W (weight gradients). Stage s runs the same warm-up F and
//!   then F and I alternating, so as many micro-batches are in flight as in 1F1B; its first s
//!   W are deferred (each later I is followed by the oldest pending W) and the deferred W run
//!   at the end, where 1F1B leaves stage s idle.
//! - `zbv` (the same paper's V schedule, v = 2 with the V placement): stage s runs
//!   2(p−s)−1 forward passes of its first chunk, then s pairs of forward passes of its second
//!   and first chunk, then p−s rounds of forward, I and W of its second chunk; the steady state
//!   alternates F, I, W of the first chunk with F, I, W of the second; the cool-down runs the
//!   remaining I passes (s pairs of both chunks, then p−s of the first chunk, each with a W of
//!   the first chunk) and then every pending W. With fewer than 2p−1 micro-batches the order
//!   is that of 2p−1 with the missing micro-batches' actions left out.
//!
//! [`check`] proves what the verifier's schedule rule (spec §3.4) needs of any order: every
//! (micro-batch, local chunk) of a stage has one F and either one B or one I and one W, no I or
//! B before its F, no W before its I, and nothing outside the m micro-batches and v chunks. It
//! does not look across stages: whether the stages can run their lists together without waiting
//! on each other forever is the verifier's deadlock proof.

use crate::job::{Action, ActionKind, Pipeline, PipelineSchedule};
use std::collections::HashMap;

/// The order of every stage for a built-in `schedule` with `p` stages, `v` chunks per stage and
/// `m` micro-batches. `custom` has no built-in order: it gives `p` empty lists.
///
/// The inputs are those the language's rules allow: `interleaved_1f1b` needs m a multiple of p,
/// `zbv` v = 2, `gpipe`, `1f1b` and `zb_h1` v = 1 (they use local chunk 0 only), and every
/// schedule but `gpipe` m ≥ p. Other inputs still give lists, which [`check`] may reject.
pub fn generate(schedule: PipelineSchedule, p: u32, v: u32, m: u32) -> Vec<Vec<Action>> {
    (0..p)
        .map(|s| match schedule {
            PipelineSchedule::Gpipe => gpipe(m),
            PipelineSchedule::OneFOneB => one_f_one_b(p, s, m),
            PipelineSchedule::Interleaved1F1B => interleaved(p, v.max(1), s, m),
            PipelineSchedule::ZbH1 => zb_h1(p, s, m),
            PipelineSchedule::Zbv => zbv(p, s, m),
            PipelineSchedule::Custom => vec![],
        })
        .collect()
}

fn act(kind: ActionKind, micro: u32, chunk: u32) -> Action {
    Action { kind, micro, chunk }
}

fn gpipe(m: u32) -> Vec<Action> {
    let f = (0..m).map(|i| act(ActionKind::F, i, 0));
    let b = (0..m).map(|i| act(ActionKind::B, i, 0));
    f.chain(b).collect()
}

fn one_f_one_b(p: u32, s: u32, m: u32) -> Vec<Action> {
    let warmup = (p - s - 1).min(m);
    let mut out: Vec<Action> = (0..warmup).map(|i| act(ActionKind::F, i, 0)).collect();
    for i in 0..m - warmup {
        out.push(act(ActionKind::F, warmup + i, 0));
        out.push(act(ActionKind::B, i, 0));
    }
    out.extend((m - warmup..m).map(|i| act(ActionKind::B, i, 0)));
    out
}

fn interleaved(p: u32, v: u32, s: u32, m: u32) -> Vec<Action> {
    let total = m * v;
    let group = p * v;
    // The k-th forward (backward) pass of the stage: micro-batches go in groups of p, each
    // group through the chunks in order (backward: in reverse).
    let micro = |k: u32| (k / group) * p + k % p;
    let forward = |k: u32| act(ActionKind::F, micro(k), (k % group) / p);
    let backward = |k: u32| act(ActionKind::B, micro(k), v - 1 - (k % group) / p);
    let warmup = match m == p {
        true => total,
        false => ((p - s - 1) * 2 + (v - 1) * p).min(total),
    };
    let mut out: Vec<Action> = (0..warmup).map(forward).collect();
    for k in 0..total - warmup {
        out.push(forward(warmup + k));
        out.push(backward(k));
    }
    out.extend((total - warmup..total).map(backward));
    out
}

fn zb_h1(p: u32, s: u32, m: u32) -> Vec<Action> {
    let warmup = (p - s - 1).min(m);
    let mut out: Vec<Action> = (0..warmup).map(|i| act(ActionKind::F, i, 0)).collect();
    let mut next_w = 0;
    for i in 0..m {
        if warmup + i < m {
            out.push(act(ActionKind::F, warmup + i, 0));
        }
        out.push(act(ActionKind::I, i, 0));
        // The first s weight passes are deferred to the end.
        if i >= s {
            out.push(act(ActionKind::W, next_w, 0));
            next_w += 1;
        }
    }
    out.extend((next_w..m).map(|i| act(ActionKind::W, i, 0)));
    out
}

fn zbv(p: u32, s: u32, m: u32) -> Vec<Action> {
    use ActionKind::{F, I, W};
    // Built for at least 2p−1 micro-batches; the extra ones are dropped at the end.
    let n = m.max(2 * p - 1);
    let mut v = VOrder::default();
    for _ in 0..2 * (p - s) - 1 {
        v.push(F, 0);
    }
    for _ in 0..s {
        v.push(F, 1);
        v.push(F, 0);
    }
    for _ in 0..p - s {
        v.push(F, 1);
        v.push(I, 1);
        v.push(W, 1);
    }
    while v.count(F, 1) < v.count(F, 0) || v.count(F, 0) < n {
        if v.count(F, 0) < n {
            v.push(F, 0);
        }
        v.push(I, 0);
        v.push(W, 0);
        v.push(F, 1);
        v.push(I, 1);
        v.push(W, 1);
    }
    for _ in 0..s {
        v.push(I, 0);
        v.push(I, 1);
    }
    for _ in 0..p - s {
        v.push(I, 0);
        v.push(W, 0);
    }
    for chunk in [1, 0] {
        while v.count(W, chunk) < v.count(I, chunk) {
            v.push(W, chunk);
        }
    }
    v.out.retain(|a| a.micro < m);
    v.out
}

/// A `zbv` order being built: the actions so far and how many of each kind each chunk has.
#[derive(Default)]
struct VOrder {
    out: Vec<Action>,
    /// F, I and W so far, per local chunk.
    counts: [[u32; 2]; 3],
}

impl VOrder {
    fn row(kind: ActionKind) -> usize {
        match kind {
            ActionKind::F => 0,
            ActionKind::I | ActionKind::B => 1,
            ActionKind::W => 2,
        }
    }

    fn count(&self, kind: ActionKind, chunk: u32) -> u32 {
        self.counts[Self::row(kind)][chunk as usize]
    }

    /// Appends the next micro-batch's `kind` pass of `chunk`.
    fn push(&mut self, kind: ActionKind, chunk: u32) {
        let n = &mut self.counts[Self::row(kind)][chunk as usize];
        self.out.push(act(kind, *n, chunk));
        *n += 1;
    }
}

/// One way an order breaks the rules of [`check`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OrderError {
    pub stage: u32,
    /// The offending action's position in the stage's list; `None` for an action that is missing.
    pub index: Option<usize>,
    /// The offending action, or the missing one.
    pub action: Action,
    /// What is wrong, in words that stand beside the action ("B2 comes before its F2").
    pub message: String,
}

/// An action as the language writes it: `F3`, and with more than one chunk per stage `F3.1`
/// (`F3.0` for local chunk 0).
pub fn action_text(a: Action, v: u32) -> String {
    match v > 1 {
        true => format!("{}{}.{}", a.kind.letter(), a.micro, a.chunk),
        false => a.to_string(),
    }
}

/// A stage's order as the language writes it: its actions separated by spaces.
pub fn order_text(actions: &[Action], v: u32) -> String {
    let words: Vec<String> = actions.iter().map(|&a| action_text(a, v)).collect();
    words.join(" ")
}

/// Reads one action: a letter `F`, `B`, `I` or `W`, the micro-batch, and optionally `.` and the
/// stage's local chunk (0 when left out). `None` when the word is not an action.
pub fn parse_action(word: &str) -> Option<Action> {
    let mut chars = word.chars();
    let kind = match chars.next()? {
        'F' => ActionKind::F,
        'B' => ActionKind::B,
        'I' => ActionKind::I,
        'W' => ActionKind::W,
        _ => return None,
    };
    let rest = chars.as_str();
    let (micro, chunk) = match rest.split_once('.') {
        Some((micro, chunk)) => (micro, Some(chunk)),
        None => (rest, None),
    };
    let number = |s: &str| -> Option<u32> {
        match !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
            true => s.parse().ok(),
            false => None,
        }
    };
    Some(Action {
        kind,
        micro: number(micro)?,
        chunk: match chunk {
            Some(c) => number(c)?,
            None => 0,
        },
    })
}

/// Where the actions of one (micro-batch, local chunk) sit in a stage's list.
#[derive(Default)]
struct Seen {
    f: Option<usize>,
    b: Option<usize>,
    i: Option<usize>,
    w: Option<usize>,
}

/// Every violation of the schedule rule in `pipeline.order` with `m` micro-batches: each
/// (micro-batch, local chunk) of every stage has exactly one F and either one B or one I and
/// one W; no I or B comes before its F, no W before its I; micro-batches are below m and chunks
/// below v. A stage without a list counts as an empty list. Errors come stage by stage, those at
/// an action in list order, then the missing actions.
pub fn check(pipeline: &Pipeline, m: u32) -> Vec<OrderError> {
    let v = pipeline.virtual_stages;
    let mut errors = vec![];
    let empty = vec![];
    for s in 0..pipeline.stages {
        let list = pipeline.order.get(s as usize).unwrap_or(&empty);
        let mut seen: HashMap<(u32, u32), Seen> = HashMap::new();
        let mut err = |index: Option<usize>, action: Action, message: String| {
            errors.push(OrderError {
                stage: s,
                index,
                action,
                message,
            })
        };
        for (idx, &a) in list.iter().enumerate() {
            let name = action_text(a, v);
            if a.micro >= m {
                err(
                    Some(idx),
                    a,
                    format!(
                        "{name} names micro-batch {}, but there are {m} (0 … {})",
                        a.micro,
                        m.saturating_sub(1)
                    ),
                );
                continue;
            }
            if a.chunk >= v {
                err(
                    Some(idx),
                    a,
                    format!(
                        "{name} names local chunk {}, but each stage has {v} (0 … {})",
                        a.chunk,
                        v - 1
                    ),
                );
                continue;
            }
            let st = seen.entry((a.micro, a.chunk)).or_default();
            let twin = |kind| action_text(Action { kind, ..a }, v);
            let slot = match a.kind {
                ActionKind::F => &mut st.f,
                ActionKind::B => &mut st.b,
                ActionKind::I => &mut st.i,
                ActionKind::W => &mut st.w,
            };
            if let Some(first) = *slot {
                err(
                    Some(idx),
                    a,
                    format!("{name} appears twice (first at position {})", first + 1),
                );
                continue;
            }
            *slot = Some(idx);
            let split = st.i.or(st.w);
            match a.kind {
                ActionKind::F => {}
                ActionKind::B if split.is_some() => err(
                    Some(idx),
                    a,
                    format!(
                        "{name} beside {} or {}: a backward is one B, or one I and one W",
                        twin(ActionKind::I),
                        twin(ActionKind::W)
                    ),
                ),
                ActionKind::I | ActionKind::W if st.b.is_some() => err(
                    Some(idx),
                    a,
                    format!(
                        "{name} beside {}: a backward is one B, or one I and one W",
                        twin(ActionKind::B)
                    ),
                ),
                ActionKind::B | ActionKind::I if st.f.is_none() => err(
                    Some(idx),
                    a,
                    format!("{name} comes before its {}", twin(ActionKind::F)),
                ),
                ActionKind::W if st.i.is_none() => err(
                    Some(idx),
                    a,
                    format!("{name} comes before its {}", twin(ActionKind::I)),
                ),
                _ => {}
            }
        }
        for chunk in 0..v {
            for micro in 0..m {
                let a = |kind| act(kind, micro, chunk);
                let st = seen.remove(&(micro, chunk)).unwrap_or_default();
                if st.f.is_none() {
                    let f = a(ActionKind::F);
                    err(None, f, format!("{} is missing", action_text(f, v)));
                }
                match (st.b, st.i, st.w) {
                    (None, None, None) => {
                        let b = a(ActionKind::B);
                        err(
                            None,
                            b,
                            format!(
                                "{} is missing (or {} and {})",
                                action_text(b, v),
                                action_text(a(ActionKind::I), v),
                                action_text(a(ActionKind::W), v)
                            ),
                        );
                    }
                    (None, Some(_), None) => {
                        let w = a(ActionKind::W);
                        err(
                            None,
                            w,
                            format!(
                                "{} is missing (after {})",
                                action_text(w, v),
                                action_text(a(ActionKind::I), v)
                            ),
                        );
                    }
                    // A W without an I was reported at the W.
                    _ => {}
                }
            }
        }
    }
    errors
}

#[cfg(test)]
#[path = "../tests/unit/orders.rs"]
mod tests;
