//! Unit tests of `orders` (a child module of it): every built-in order is well formed, keeps the
//! in-flight bounds its schedule promises, runs without deadlock in a small discrete-time
//! simulation of the stages, and gives the bubbles the schedule table promises.

use super::*;
use std::collections::HashMap;

fn pipeline(schedule: PipelineSchedule, p: u32, v: u32, m: u32) -> Pipeline {
    Pipeline {
        stages: p,
        virtual_stages: v,
        schedule,
        chunks: vec![1; (p * v) as usize],
        order: generate(schedule, p, v, m),
    }
}

/// The (schedule, v) pairs the language allows, and whether m must be a multiple of p.
const BUILT_IN: [(PipelineSchedule, u32); 6] = [
    (PipelineSchedule::Gpipe, 1),
    (PipelineSchedule::OneFOneB, 1),
    (PipelineSchedule::Interleaved1F1B, 2),
    (PipelineSchedule::Interleaved1F1B, 3),
    (PipelineSchedule::ZbH1, 1),
    (PipelineSchedule::Zbv, 2),
];

/// The (p, m) grid for `schedule`: m ≥ p (any m for gpipe), m a multiple of p for interleaved.
fn grid(schedule: PipelineSchedule) -> Vec<(u32, u32)> {
    let mut out = vec![];
    for p in 1..=6 {
        for m in 1..=14 {
            let ok = match schedule {
                PipelineSchedule::Gpipe => true,
                PipelineSchedule::Interleaved1F1B => m >= p && m % p == 0,
                _ => m >= p,
            };
            if ok {
                out.push((p, m));
            }
        }
    }
    out
}

#[test]
fn every_built_in_order_is_well_formed() {
    for (schedule, v) in BUILT_IN {
        for (p, m) in grid(schedule) {
            let pl = pipeline(schedule, p, v, m);
            let errors = check(&pl, m);
            assert!(
                errors.is_empty(),
                "{} p={p} v={v} m={m}: {errors:?}\n{:?}",
                schedule.name(),
                pl.order
            );
        }
    }
}

/// The most micro-batches a stage holds in flight: F done, B (or I) not yet.
fn max_in_flight(list: &[Action]) -> usize {
    let mut live = 0usize;
    let mut max = 0;
    for a in list {
        match a.kind {
            ActionKind::F => live += 1,
            ActionKind::B | ActionKind::I => live -= 1,
            ActionKind::W => {}
        }
        max = max.max(live);
    }
    max
}

#[test]
fn in_flight_micro_batches_are_bounded_as_promised() {
    for (p, m) in grid(PipelineSchedule::OneFOneB) {
        let one = generate(PipelineSchedule::OneFOneB, p, 1, m);
        let zb = generate(PipelineSchedule::ZbH1, p, 1, m);
        let gpipe = generate(PipelineSchedule::Gpipe, p, 1, m);
        for s in 0..p as usize {
            let bound = (p as usize - s).min(m as usize);
            assert_eq!(max_in_flight(&one[s]), bound, "1f1b p={p} m={m} s={s}");
            assert_eq!(max_in_flight(&zb[s]), bound, "zb_h1 p={p} m={m} s={s}");
            assert_eq!(max_in_flight(&gpipe[s]), m as usize, "gpipe p={p} m={m}");
        }
    }
}

#[test]
fn small_orders_are_the_textbook_ones() {
    let text = |schedule, p, v, m| -> Vec<String> {
        generate(schedule, p, v, m)
            .iter()
            .map(|l| order_text(l, v))
            .collect()
    };
    assert_eq!(
        text(PipelineSchedule::Gpipe, 2, 1, 3),
        ["F0 F1 F2 B0 B1 B2", "F0 F1 F2 B0 B1 B2"]
    );
    assert_eq!(
        text(PipelineSchedule::OneFOneB, 3, 1, 4),
        [
            "F0 F1 F2 B0 F3 B1 B2 B3",
            "F0 F1 B0 F2 B1 F3 B2 B3",
            "F0 B0 F1 B1 F2 B2 F3 B3"
        ]
    );
    assert_eq!(
        text(PipelineSchedule::ZbH1, 3, 1, 4),
        [
            "F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3",
            "F0 F1 I0 F2 I1 W0 F3 I2 W1 I3 W2 W3",
            "F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3"
        ]
    );
    // Stage 0 warms up with (p−1)·2 + (v−1)·p = 4 forward passes, stage 1 with 2.
    assert_eq!(
        text(PipelineSchedule::Interleaved1F1B, 2, 2, 4),
        [
            "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0",
            "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0"
        ]
    );
}

#[test]
fn actions_read_back_as_written() {
    for word in ["F0", "B12", "I3.1", "W0.2"] {
        let a = parse_action(word).unwrap();
        let v = if word.contains('.') { 3 } else { 1 };
        assert_eq!(action_text(a, v), word);
    }
    assert_eq!(parse_action("F3.0").unwrap(), parse_action("F3").unwrap());
    for bad in [
        "", "F", "X1", "f1", "F1.", "F.1", "F-1", "F1.2.3", "F 1", "B1a",
    ] {
        assert_eq!(parse_action(bad), None, "{bad:?}");
    }
}

/// Costs of one action of one chunk in the simulation: F = 1, B = 2, I = W = 1.
fn cost(kind: ActionKind) -> u64 {
    match kind {
        ActionKind::B => 2,
        _ => 1,
    }
}

/// Runs every stage's list in order, each action as soon as its stage is free and its inputs
/// exist: F of chunk c after F of chunk c−1 (same micro-batch), B or I of chunk c after B or I of
/// chunk c+1 (of the last chunk: after its own F), W after its I. Gives the step time and the
/// idle share of the stages, or `None` when the stages deadlock.
fn simulate(pl: &Pipeline) -> Option<(u64, f64)> {
    #[derive(Clone, Copy, PartialEq, Eq, Hash)]
    enum Done {
        F,
        Input,
        W,
    }
    let p = pl.stages;
    let last = p * pl.virtual_stages - 1;
    let mut finish: HashMap<(Done, u32, u32), u64> = HashMap::new();
    let mut pos = vec![0usize; p as usize];
    let mut free = vec![0u64; p as usize];
    let mut busy = 0u64;
    loop {
        let mut progress = false;
        for s in 0..p {
            let list = &pl.order[s as usize];
            while let Some(&a) = list.get(pos[s as usize]) {
                let c = pl.chunk_of(s, a.chunk);
                let deps = match a.kind {
                    ActionKind::F if c == 0 => vec![],
                    ActionKind::F => vec![(Done::F, c - 1)],
                    ActionKind::B | ActionKind::I if c == last => vec![(Done::F, c)],
                    ActionKind::B | ActionKind::I => vec![(Done::F, c), (Done::Input, c + 1)],
                    ActionKind::W => vec![(Done::Input, c)],
                };
                let times: Option<Vec<u64>> = deps
                    .iter()
                    .map(|&(d, chunk)| finish.get(&(d, chunk, a.micro)).copied())
                    .collect();
                let Some(times) = times else { break };
                let start = times.into_iter().fold(free[s as usize], u64::max);
                let end = start + cost(a.kind);
                busy += cost(a.kind);
                free[s as usize] = end;
                let done = match a.kind {
                    ActionKind::F => Done::F,
                    ActionKind::B | ActionKind::I => Done::Input,
                    ActionKind::W => Done::W,
                };
                finish.insert((done, c, a.micro), end);
                pos[s as usize] += 1;
                progress = true;
            }
        }
        if !progress {
            break;
        }
    }
    let all = (0..p as usize).all(|s| pos[s] == pl.order[s].len());
    let makespan = free.iter().copied().max().unwrap_or(0);
    all.then(|| {
        let total = makespan * u64::from(p);
        (makespan, (total - busy) as f64 / total as f64)
    })
}

#[test]
fn every_built_in_order_runs_without_deadlock() {
    for (schedule, v) in BUILT_IN {
        for (p, m) in grid(schedule) {
            let pl = pipeline(schedule, p, v, m);
            assert!(
                simulate(&pl).is_some(),
                "{} p={p} v={v} m={m} deadlocks: {:?}",
                schedule.name(),
                pl.order
            );
        }
    }
}

#[test]
fn bubbles_match_the_schedule_table() {
    for (p, m) in grid(PipelineSchedule::OneFOneB) {
        let expect = f64::from(p - 1) / f64::from(m + p - 1);
        let gpipe = simulate(&pipeline(PipelineSchedule::Gpipe, p, 1, m)).unwrap();
        let one = simulate(&pipeline(PipelineSchedule::OneFOneB, p, 1, m)).unwrap();
        let zb = simulate(&pipeline(PipelineSchedule::ZbH1, p, 1, m)).unwrap();
        assert!((gpipe.1 - expect).abs() < 1e-12, "gpipe p={p} m={m}");
        assert!((one.1 - expect).abs() < 1e-12, "1f1b p={p} m={m}");
        // 1F1B's step is 3(m+p−1); ZB-H1's is about 3m + p − 1.
        assert_eq!(one.0, 3 * u64::from(m + p - 1));
        if p > 1 {
            assert!(zb.1 < one.1, "zb_h1 p={p} m={m}: {} vs {}", zb.1, one.1);
            assert!(
                zb.0 <= 3 * u64::from(m) + u64::from(p - 1) + 1,
                "zb_h1 p={p} m={m}"
            );
        }
    }
    for (p, m) in grid(PipelineSchedule::Interleaved1F1B) {
        for v in [2, 3] {
            let il = simulate(&pipeline(PipelineSchedule::Interleaved1F1B, p, v, m)).unwrap();
            // Chunks are 1/v of a stage: the bubble is (p−1)/(v·m+p−1) of the step.
            let expect = f64::from(p - 1) / f64::from(v * m + p - 1);
            assert!(
                il.1 <= expect + 1e-12,
                "interleaved p={p} v={v} m={m}: {} > {expect}",
                il.1
            );
            if v == 2 && p > 1 {
                let zbv = simulate(&pipeline(PipelineSchedule::Zbv, p, 2, m)).unwrap();
                assert!(
                    zbv.1 < il.1,
                    "zbv p={p} m={m}: {} not below interleaved's {}",
                    zbv.1,
                    il.1
                );
            }
        }
    }
}

fn words(list: &str) -> Vec<Action> {
    list.split_whitespace()
        .map(|w| parse_action(w).unwrap())
        .collect()
}

fn custom(lines: &[&str], v: u32) -> Pipeline {
    Pipeline {
        stages: lines.len() as u32,
        virtual_stages: v,
        schedule: PipelineSchedule::Custom,
        chunks: vec![1; lines.len() * v as usize],
        order: lines.iter().map(|l| words(l)).collect(),
    }
}

fn messages(pl: &Pipeline, m: u32) -> Vec<String> {
    check(pl, m)
        .into_iter()
        .map(|e| match e.index {
            Some(i) => format!("stage {} #{i}: {}", e.stage, e.message),
            None => format!("stage {}: {}", e.stage, e.message),
        })
        .collect()
}

#[test]
fn check_names_each_broken_rule_at_its_action() {
    // The spec's example passes.
    let ok = custom(
        &["F0 F1 F2 F3 B0 B1 B2 B3", "F0 B0 F1 B1 F2 I2 F3 I3 W2 W3"],
        1,
    );
    assert_eq!(messages(&ok, 4), Vec::<String>::new());
    let bad = custom(&["F0 F0 B1 F1 B0 W2 F2 I2", "F0 B0 I0 W0 F1 B1 F5 F1.1"], 1);
    assert_eq!(
        messages(&bad, 3),
        [
            "stage 0 #1: F0 appears twice (first at position 1)",
            "stage 0 #2: B1 comes before its F1",
            "stage 0 #5: W2 comes before its I2",
            "stage 1 #2: I0 beside B0: a backward is one B, or one I and one W",
            "stage 1 #3: W0 beside B0: a backward is one B, or one I and one W",
            "stage 1 #6: F5 names micro-batch 5, but there are 3 (0 … 2)",
            "stage 1 #7: F1.1 names local chunk 1, but each stage has 1 (0 … 0)",
            "stage 1: F2 is missing",
            "stage 1: B2 is missing (or I2 and W2)",
        ]
    );
    let half = custom(&["F0 I0"], 1);
    assert_eq!(messages(&half, 1), ["stage 0: W0 is missing (after I0)"]);
    let two = custom(&["F0.0 F0.1 B0.1"], 2);
    assert_eq!(
        messages(&two, 1),
        ["stage 0: B0.0 is missing (or I0.0 and W0.0)"]
    );
}
