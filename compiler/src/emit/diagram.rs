//! `schedc compile --emit diagram`: the simulated step drawn as the pipeline papers draw their
//! schedules, as an SVG.
//!
//! One row per pipeline stage (its first rank's timeline: every rank of a stage runs alike), one
//! row for a schedule without a pipeline; time runs across, from 0 to the simulated step. Each
//! box is one action of the stage ([`sched_ir::timeline::actions`]): its fill's hue is the
//! micro-batch's (the same hue on every stage, as in the papers' figures), `F` is light and
//! solid, `B` dark and hatched, `I` and `W` (split backward) dark with their own hatching and
//! light with dots; recomputed forwards inside a `B` are marked by a light strip along the box's
//! top. The micro-batch's number and `.chunk` with several chunks per stage (or the number alone)
//! is written in a box when it fits. The optimizer's work and other non-action compute
//! (accumulation, copies) sit in a thin grey lane under each row; what is left of a row's
//! background is the stage's idle time, its bubble. A time axis in milliseconds, a legend and a title (schedule, stages, chunks,
//! micro-batches, step time and bubble, with the uniform-stage closed form where the schedule has
//! one) complete it.
//!
//! The output is a pure function of the program and the job: coordinates are written with one
//! decimal and figures rounded, so it is stable across runs and snapshot-tested.

use crate::sim::{self, SimReport};
use sched_ir::ir::Program;
use sched_ir::job::{ActionKind, Job, PipelineSchedule};
use sched_ir::timeline::{actions, ActionSpan, Timeline, Work};
use sched_verify::Verified;
use std::collections::BTreeSet;
use std::fmt::Write;

/// Left margin (row labels), right margin, and the width of the time axis, in pixels.
const LEFT: f64 = 88.0;
const RIGHT: f64 = 24.0;
const PLOT_W: f64 = 1080.0;
/// Height of the title block.
const TOP: f64 = 60.0;
/// Height of a row's action lane, of its lane of other work, and the gap between rows.
const ROW_H: f64 = 30.0;
const LANE_H: f64 = 6.0;
const GAP: f64 = 10.0;
/// Height of the time axis and of the legend below it.
const AXIS_H: f64 = 34.0;
const LEGEND_H: f64 = 40.0;
/// Width of a character of the 11 px labels, generously: a label is written only where it fits.
const CHAR_W: f64 = 7.0;

/// The diagram of `program`'s simulated step (simulated here, at the default contention).
pub fn emit_diagram(program: &Verified, job: &Job) -> String {
    let (report, timeline) = sim::simulate_timeline(program, job);
    render(program, job, &report, &timeline)
}

/// The SVG of a simulated step.
pub fn render(program: &Program, job: &Job, report: &SimReport, timeline: &Timeline) -> String {
    let stages = program.layout.stages.max(1);
    let step = timeline.step_time_s.max(f64::MIN_POSITIVE);
    let rows: Vec<Row> = (0..stages)
        .map(|stage| {
            let rank = sim::report::stage_timeline(program, timeline, stage);
            Row {
                stage,
                rank: rank.rank,
                alike: rank.ranks,
                spans: actions(program, rank, stage),
            }
        })
        .collect();
    let micro_batches = program.micro_steps.max(1);
    let width = LEFT + PLOT_W + RIGHT;
    let rows_h = f64::from(stages) * (ROW_H + LANE_H + GAP);
    let height = TOP + rows_h + AXIS_H + LEGEND_H;
    let x = |t: f64| LEFT + t / step * PLOT_W;

    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" viewBox="0 0 {} {}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">"#,
        px(width),
        px(height),
        px(width),
        px(height)
    );
    out += &defs();
    let _ = writeln!(
        out,
        r#"<rect x="0" y="0" width="{}" height="{}" fill="white"/>"#,
        px(width),
        px(height)
    );
    let (title, subtitle) = titles(program, job, report);
    let _ = writeln!(
        out,
        r#"<text x="{}" y="24" font-size="16" font-weight="bold">{}</text>"#,
        px(LEFT),
        escape(&title)
    );
    let _ = writeln!(
        out,
        r##"<text x="{}" y="44" font-size="12" fill="#333">{}</text>"##,
        px(LEFT),
        escape(&subtitle)
    );

    for (i, row) in rows.iter().enumerate() {
        let y = TOP + i as f64 * (ROW_H + LANE_H + GAP);
        let label = if stages > 1 {
            format!("stage {}", row.stage)
        } else {
            "step".to_string()
        };
        let rank = match row.alike {
            1 => format!("rank {}", row.rank),
            n => format!("rank {} (×{n})", row.rank),
        };
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" font-size="12" font-weight="bold" text-anchor="end">{label}</text>"#,
            px(LEFT - 8.0),
            px(y + 13.0)
        );
        let _ = writeln!(
            out,
            r##"<text x="{}" y="{}" font-size="10" fill="#555" text-anchor="end">{}</text>"##,
            px(LEFT - 8.0),
            px(y + 26.0),
            escape(&rank)
        );
        // The row's background: what shows through is idle time.
        let _ = writeln!(
            out,
            r##"<rect x="{}" y="{}" width="{}" height="{}" fill="#f2f2f2"/>"##,
            px(LEFT),
            px(y),
            px(PLOT_W),
            px(ROW_H + LANE_H)
        );
        for span in &row.spans {
            let (x0, x1) = (x(span.start), x(span.end));
            let w = (x1 - x0).max(0.5);
            match span.work {
                Work::Action(kind) => {
                    let micro = span.micro.unwrap_or(0);
                    out += &action_box(kind, micro, micro_batches, x0, y, w, ROW_H);
                    for &(s, e) in &span.recompute {
                        let _ = writeln!(
                            out,
                            r#"<rect x="{}" y="{}" width="{}" height="4" fill="white" fill-opacity="0.75"/>"#,
                            px(x(s)),
                            px(y + 1.0),
                            px((x(e) - x(s)).max(0.5))
                        );
                    }
                    // The micro-batch and chunk, or the micro-batch alone, whichever fits.
                    let fits = |t: &String| w >= t.len() as f64 * CHAR_W + 4.0;
                    let micro_only = span.micro.map_or(String::new(), |m| m.to_string());
                    let text = Some(box_label(span))
                        .filter(fits)
                        .or(Some(micro_only).filter(fits));
                    if let Some(text) = text {
                        let fill = match kind {
                            ActionKind::F | ActionKind::W => "#111",
                            ActionKind::B | ActionKind::I => "white",
                        };
                        let _ = writeln!(
                            out,
                            r#"<text x="{}" y="{}" font-size="11" text-anchor="middle" fill="{fill}">{text}</text>"#,
                            px(x0 + w / 2.0),
                            px(y + ROW_H / 2.0 + 4.0)
                        );
                    }
                }
                Work::Optimizer | Work::Other => {
                    let fill = if span.work == Work::Optimizer {
                        "#666"
                    } else {
                        "#aaa"
                    };
                    let _ = writeln!(
                        out,
                        r#"<rect x="{}" y="{}" width="{}" height="{}" fill="{fill}"/>"#,
                        px(x0),
                        px(y + ROW_H),
                        px(w),
                        px(LANE_H)
                    );
                }
            }
        }
    }

    // The time axis.
    let axis_y = TOP + rows_h;
    let _ = writeln!(
        out,
        r##"<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="#333"/>"##,
        px(LEFT),
        px(axis_y),
        px(LEFT + PLOT_W),
        px(axis_y)
    );
    let (tick, decimals) = tick_step(step * 1e3);
    let mut k = 0u32;
    loop {
        let ms = f64::from(k) * tick;
        if ms > step * 1e3 * (1.0 + 1e-9) {
            break;
        }
        let tx = x(ms / 1e3);
        let _ = writeln!(
            out,
            r##"<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="#333"/>"##,
            px(tx),
            px(axis_y),
            px(tx),
            px(axis_y + 5.0)
        );
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" font-size="10" text-anchor="middle">{ms:.decimals$}</text>"#,
            px(tx),
            px(axis_y + 17.0)
        );
        k += 1;
    }
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" font-size="10" text-anchor="end">ms</text>"#,
        px(LEFT - 8.0),
        px(axis_y + 17.0)
    );

    out += &legend(TOP + rows_h + AXIS_H, micro_batches, &Present::of(&rows));
    out += "</svg>\n";
    out
}

/// One row of the diagram: a stage's first rank and its compute.
struct Row {
    stage: u32,
    rank: u32,
    alike: u32,
    spans: Vec<ActionSpan>,
}

/// The title (schedule, pipeline shape) and the subtitle (step, bubble).
fn titles(program: &Program, job: &Job, report: &SimReport) -> (String, String) {
    let pipeline = &job.schedule.pipeline;
    let m = program.micro_steps;
    let step = format!("simulated step {}", ms(report.step_time_s));
    match report.bubble {
        Some(bubble) => {
            let (p, v) = (pipeline.stages, pipeline.virtual_stages);
            let chunks = if v > 1 {
                format!(" × {v} chunks")
            } else {
                String::new()
            };
            let title = format!(
                "{}: {}, {p} stages{chunks}, {}",
                program.schedule,
                pipeline.schedule.name(),
                plural(m, "micro-batch", "micro-batches")
            );
            let ideal = match pipeline.schedule {
                PipelineSchedule::Gpipe | PipelineSchedule::OneFOneB => {
                    Some(("(p−1)/(m+p−1)", f64::from(p - 1) / f64::from(m + p - 1)))
                }
                PipelineSchedule::Interleaved1F1B => Some((
                    "(p−1)/(v·m+p−1)",
                    f64::from(p - 1) / f64::from(v * m + p - 1),
                )),
                _ => None,
            };
            let mut sub = format!("{step} · bubble {}", percent(bubble));
            if let Some((formula, b)) = ideal {
                let _ = write!(sub, " (uniform stages: {formula} = {})", percent(b));
            }
            (title, sub)
        }
        None => {
            let title = format!(
                "{}: no pipeline, {}, {}",
                program.schedule,
                plural(program.ranks(), "rank", "ranks"),
                plural(m, "micro-step", "micro-steps")
            );
            let busy = report.compute_s / report.step_time_s.max(f64::MIN_POSITIVE);
            (title, format!("{step} · compute busy {}", percent(busy)))
        }
    }
}

/// An action's box text: the micro-batch, and its chunk with several per stage (`3.1`).
fn box_label(span: &ActionSpan) -> String {
    let micro = span.micro.map_or(String::new(), |m| m.to_string());
    if span.chunked {
        format!("{micro}.{}", span.chunk)
    } else {
        micro
    }
}

/// The box (at `x`, `y`, `w` by `h`) of one action of micro-batch `micro`.
fn action_box(
    kind: ActionKind,
    micro: u32,
    micro_batches: u32,
    x: f64,
    y: f64,
    w: f64,
    h: f64,
) -> String {
    let (fill, pattern) = match kind {
        ActionKind::F => (colour(micro, micro_batches, false), None),
        ActionKind::B => (colour(micro, micro_batches, true), Some("hatch-b")),
        ActionKind::I => (colour(micro, micro_batches, true), Some("hatch-i")),
        ActionKind::W => (colour(micro, micro_batches, false), Some("dots-w")),
    };
    let mut s = format!(
        r#"<rect x="{}" y="{}" width="{}" height="{}" fill="{fill}" stroke="white" stroke-width="0.5"/>"#,
        px(x),
        px(y),
        px(w),
        px(h)
    );
    if let Some(p) = pattern {
        let _ = write!(
            s,
            r#"<rect x="{}" y="{}" width="{}" height="{}" fill="url(#{p})"/>"#,
            px(x),
            px(y),
            px(w),
            px(h)
        );
    }
    s.push('\n');
    s
}

/// Micro-batch `i`'s colour: hues spread evenly over the micro-batches, light for forward
/// (and `W`), dark for backward (and `I`).
fn colour(i: u32, micro_batches: u32, dark: bool) -> String {
    let hue = (f64::from(i % micro_batches) * 360.0 / f64::from(micro_batches)).round();
    if dark {
        format!("hsl({hue}, 55%, 38%)")
    } else {
        format!("hsl({hue}, 75%, 75%)")
    }
}

/// The hatchings of `B` and `I` and the dots of `W`.
fn defs() -> String {
    r##"<defs>
<pattern id="hatch-b" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><line x1="0" y1="0" x2="0" y2="6" stroke="white" stroke-opacity="0.35" stroke-width="2"/></pattern>
<pattern id="hatch-i" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(-45)"><line x1="0" y1="0" x2="0" y2="6" stroke="white" stroke-opacity="0.35" stroke-width="2"/></pattern>
<pattern id="dots-w" width="5" height="5" patternUnits="userSpaceOnUse"><circle cx="2.5" cy="2.5" r="1" fill="black" fill-opacity="0.35"/></pattern>
</defs>
"##
    .to_string()
}

/// What a diagram holds, for its legend.
#[derive(Default)]
struct Present {
    kinds: BTreeSet<ActionKind>,
    recompute: bool,
    optimizer: bool,
    other: bool,
}

impl Present {
    fn of(rows: &[Row]) -> Self {
        let mut p = Present::default();
        for span in rows.iter().flat_map(|r| &r.spans) {
            match span.work {
                Work::Action(k) => {
                    p.kinds.insert(k);
                    p.recompute |= !span.recompute.is_empty();
                }
                Work::Optimizer => p.optimizer = true,
                Work::Other => p.other = true,
            }
        }
        p
    }
}

/// The legend: what the styles of the boxes that the diagram holds mean, and the micro-batches'
/// hues.
fn legend(y: f64, micro_batches: u32, present: &Present) -> String {
    let mut out = String::new();
    let y = y + 6.0;
    let mut x = LEFT;
    let entry = |out: &mut String, x: &mut f64, text: &str| {
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" font-size="11">{text}</text>"#,
            px(*x + 31.0),
            px(y + 11.0)
        );
        *x += 31.0 + text.len() as f64 * 6.5 + 14.0;
    };
    for kind in &present.kinds {
        out += &action_box(*kind, 0, micro_batches, x, y, 26.0, 14.0);
        let text = match kind {
            ActionKind::F => "forward (F)",
            ActionKind::B => "backward (B)",
            ActionKind::I => "input gradient (I)",
            ActionKind::W => "weight gradient (W)",
        };
        entry(&mut out, &mut x, text);
    }
    if present.recompute {
        out += &action_box(ActionKind::B, 0, micro_batches, x, y, 26.0, 14.0);
        let _ = writeln!(
            out,
            r#"<rect x="{}" y="{}" width="26" height="4" fill="white" fill-opacity="0.75"/>"#,
            px(x),
            px(y + 1.0)
        );
        entry(&mut out, &mut x, "recomputed forward");
    }
    for (shown, fill, text) in [
        (present.optimizer, "#666", "optimizer"),
        (present.other, "#aaa", "accumulate, copy"),
    ] {
        if shown {
            let _ = writeln!(
                out,
                r#"<rect x="{}" y="{}" width="26" height="{}" fill="{fill}"/>"#,
                px(x),
                px(y + 8.0),
                px(LANE_H)
            );
            entry(&mut out, &mut x, text);
        }
    }
    let _ = writeln!(
        out,
        r##"<rect x="{}" y="{}" width="26" height="14" fill="#f2f2f2" stroke="#ccc" stroke-width="0.5"/>"##,
        px(x),
        px(y)
    );
    entry(&mut out, &mut x, "idle");
    // The micro-batches' hues, the first 32.
    let y = y + 20.0;
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" font-size="11">colour = micro-batch:</text>"#,
        px(LEFT),
        px(y + 11.0)
    );
    let shown = micro_batches.min(32);
    for i in 0..shown {
        let bx = LEFT + 130.0 + f64::from(i) * 24.0;
        let _ = writeln!(
            out,
            r#"<rect x="{}" y="{}" width="22" height="14" fill="{}"/>"#,
            px(bx),
            px(y),
            colour(i, micro_batches, false)
        );
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" font-size="10" text-anchor="middle">{i}</text>"#,
            px(bx + 11.0),
            px(y + 11.0)
        );
    }
    if micro_batches > shown {
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" font-size="11">…</text>"#,
            px(LEFT + 130.0 + f64::from(shown) * 24.0),
            px(y + 11.0)
        );
    }
    out
}

/// A tick spacing of 1, 2 or 5 × 10^k ms giving at most about ten ticks over `span_ms`, and the
/// decimals its labels need.
fn tick_step(span_ms: f64) -> (f64, usize) {
    let raw = (span_ms / 10.0).max(1e-9);
    let exp = raw.log10().floor();
    let base = 10f64.powf(exp);
    let tick = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * base)
        .find(|t| *t >= raw)
        .unwrap_or(10.0 * base);
    let decimals = if tick >= 1.0 {
        0
    } else {
        (-tick.log10().floor()) as usize
    };
    (tick, decimals)
}

/// A coordinate with one decimal (`-0.0` written `0`).
fn px(v: f64) -> String {
    let r = (v * 10.0).round() / 10.0;
    if r == r.trunc() {
        format!("{}", r as i64)
    } else {
        format!("{r:.1}")
    }
}

/// Seconds as milliseconds, to four significant digits at most.
fn ms(s: f64) -> String {
    let v = s * 1e3;
    let decimals = match v.abs() {
        a if a >= 100.0 => 1,
        a if a >= 1.0 => 2,
        _ => 4,
    };
    format!("{v:.decimals$} ms")
}

fn percent(f: f64) -> String {
    format!("{:.1}%", f * 100.0)
}

fn plural(n: u32, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
