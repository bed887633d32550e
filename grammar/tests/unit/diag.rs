//! Unit tests of `diag` (a child module of it: they reach its private items).

use super::*;

#[test]
fn suggestions() {
    assert_eq!(
        did_you_mean("micro_step", ["micro_steps", "micro_batch"]),
        Some("micro_steps")
    );
    assert_eq!(did_you_mean("gib", ["GiB", "GB"]), Some("GiB"));
    assert_eq!(
        did_you_mean("trasnformer", ["transformer", "mlp"]),
        Some("transformer")
    );
    assert_eq!(did_you_mean("zzz", ["transformer", "mlp"]), None);
    assert_eq!(did_you_mean("bf61", ["bf16", "fp16", "fp32"]), Some("bf16"));
    assert_eq!(did_you_mean("flsh", ["flash", "naive"]), Some("flash"));
    assert_eq!(did_you_mean("ndoes", ["nodes"]), Some("nodes"));
    assert_eq!(did_you_mean("onde", ["node"]), Some("node"));
    // One changed letter in a short word is another word, not a typo.
    assert_eq!(did_you_mean("relu", ["gelu", "swiglu"]), None);
    assert_eq!(did_you_mean("lion", ["adam", "adamw", "sgd"]), None);
}

#[test]
fn long_lines_are_shown_around_the_labels() {
    let mut m = SourceMap::new();
    let line = format!("a = 1; {}b = 2", "x = 1; ".repeat(10_000));
    let id = m.add("a.sched", "a.sched", format!("first\n{line}\nlast\n"));
    let b = 6 + line.len() - 5;
    let d = Diagnostic::error("boom")
        .at(Span::new(id, b, b + 1), "here")
        .also(Span::new(id, 6, 7), "there");
    let out = m.render(&[d]);
    let expected = format!("a.sched:2:{}", line.len() - 4);
    assert!(out.len() < 1000 && out.contains(&expected), "{out}");
    assert!(
        out.contains("2 │ a = 1; x = 1;") && out.contains(" … ") && out.contains("x = 1; b = 2\n"),
        "{out}"
    );
    // A label over several lines, one of them long, keeps its line numbers and `·` breaks.
    let mut text = "x\n".repeat(10);
    text.push_str(&line);
    text.push('\n');
    let id = m.add("b.sched", "b.sched", text);
    let d = Diagnostic::error("wide").at(Span::new(id, 2, 20 + line.len()), "all of it");
    let out = m.render(&[d]);
    assert!(
        out.len() < 2000
            && out.contains("b.sched:2:1")
            && out.contains("11 │")
            && out.contains('·'),
        "{out}"
    );
}

#[test]
fn line_columns() {
    let mut m = SourceMap::new();
    let id = m.add("a.sched", "a.sched", "ab\ncdé\nf".to_string());
    assert_eq!(m.location(Span::new(id, 4, 5)), "a.sched:2:2");
    assert_eq!(m.location(Span::new(id, 8, 9)), "a.sched:3:1");
}
