//! Unit tests of `parser` (a child module of it: they reach its private items).

use super::*;

fn ok(src: &str) -> File {
    let p = parse(FileId(0), src);
    assert!(p.errors.is_empty(), "{:?}", p.errors);
    p.file
}

#[test]
fn spec_example_shapes() {
    let f = ok(r#"
import "clusters/a800.sched"   # comment
model m {
    dtype = bf16; seq_len = 4096
    layer block[32] = transformer(hidden = 4096, heads = 32,
                                  ffn = 11008,
    )
}
schedule s { shard { params = 8 x 1  grads = 8x2 } prefetch { forward = 1  backward = 1  max_live = 4 GiB }
  preset = mics(partition = 8) }
cluster c { measured all_gather 8 x 2 { 1 MiB = 20 GB/s; 64MiB = 95 GB/s } }
"#);
    assert_eq!(f.items.len(), 4);
    let Item::Block(s) = &f.items[2] else {
        panic!()
    };
    let Entry::Nested(shard) = &s.body.entries[0] else {
        panic!()
    };
    assert!(matches!(shard.entries[1].value.kind, ValueKind::Mesh(_)));
    let Entry::Nested(pf) = &s.body.entries[1] else {
        panic!()
    };
    assert_eq!(pf.entries.len(), 3);
    let ValueKind::Quantity(q) = &pf.entries[2].value.kind else {
        panic!()
    };
    assert_eq!((q.number.text.as_str(), q.unit.name.as_str()), ("4", "GiB"));
}

#[test]
fn several_errors_are_reported() {
    let p = parse(
        FileId(0),
        "model a {\n  x = = 1\n}\nmodel b { ok = 1 }\nschedule c {\n  y = \n}\n",
    );
    assert_eq!(p.errors.len(), 2, "{:?}", p.errors);
    assert_eq!(p.file.items.len(), 1);
}

fn errors(src: &str) -> Vec<(String, Vec<(u32, u32)>)> {
    let p = parse(FileId(0), src);
    p.errors
        .iter()
        .map(|d| {
            (
                d.message.clone(),
                d.labels
                    .iter()
                    .map(|l| (l.span.start, l.span.end))
                    .collect(),
            )
        })
        .collect()
}

#[test]
fn valid_strings_are_not_touched_by_recovery() {
    let f = ok(r#"import "a\"b\\c.sched"
s x { train { data = "q\"\\" } }"#);
    let Item::Import(i) = &f.items[0] else {
        panic!()
    };
    assert_eq!(i.path.value, r#"a"b\c.sched"#);
}

#[test]
fn bad_strings_are_reported_where_they_are_wrong() {
    let e = errors("import \"lib\\models.sched\"\n");
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(e[0].0.starts_with("invalid escape `\\m`"), "{e:?}");
    assert_eq!(e[0].1, [(11, 13)]);
    let p = parse(FileId(0), "import \"lib\\models.sched\"\nmodel m {}\n");
    assert_eq!(
        p.file.items.len(),
        1,
        "the broken import is dropped, the model kept"
    );

    let e = errors("import \"a.sched\nmodel m {}\n");
    assert_eq!(e.len(), 1, "{e:?}");
    assert_eq!(e[0].0, "unclosed string");
    assert_eq!(e[0].1, [(7, 8), (15, 15)]);
    // An escaped quote at the end of the line does not close the string.
    assert_eq!(errors("import \"a\\\"\n")[0].0, "unclosed string");
    assert_eq!(
        errors("s x { a = \"\\\n}\n")[0].0,
        "invalid escape `\\` in a string (only `\\\"` and `\\\\` are allowed)"
    );
}

#[test]
fn a_missing_comma_between_arguments_is_named() {
    let src = "model m {\n layer e = embedding(vocab = 256 hidden = 64)\n}\n";
    let e = errors(src);
    assert_eq!(e.len(), 1, "{e:?}");
    assert_eq!(e[0].0, "expected `,` before the argument `hidden`");
    let at = src.find("hidden").unwrap() as u32;
    assert_eq!(e[0].1, [(at, at + 6)]);
    // Across lines too, and with a quantity before it.
    let e = errors("model m {\n layer e = k(a = 1 GiB\n b = 2)\n}\n");
    assert_eq!(e.len(), 1, "{e:?}");
    // A trailing comma is still fine.
    ok("model m {\n layer e = k(a = 1,\n b = 2,\n)\n}\n");
}

#[test]
fn unclosed_brackets_show_where_they_opened() {
    let e = errors("model m {\n  a = 1\n");
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(e[0].1.contains(&(8, 9)), "{e:?}");
    let e = errors("model m {\n  a = 1\n\nschedule s {\n}\n");
    assert_eq!(e[0].0, "expected `}` before the next item");
    assert_eq!(e[0].1, [(19, 27), (8, 9)]);
    // A block closed later is not reported as unclosed.
    let e = errors("model m {\n  a = = 1\n}\n");
    assert_eq!(e[0].1.len(), 1, "{e:?}");
    let e = errors("model m {\n layer l = k(a = 1\n}\n");
    let paren = "model m {\n layer l = k".len() as u32;
    assert!(e[0].1.contains(&(paren, paren + 1)), "{e:?}");
}

#[test]
fn quantity_needs_the_end_of_the_entry() {
    let f = ok("model m { a = 80 GBps\n b = 1  c = 2 }");
    let Item::Block(m) = &f.items[0] else {
        panic!()
    };
    assert_eq!(m.body.entries.len(), 3);
}

#[test]
fn pipeline_block_with_list_rows_and_inner_order() {
    let src = "schedule s {\n    pipeline {\n        stages = 2;  virtual = 1\n        layers = [3,\n            1, ]\n        order {\n            stage 0 = \"F0 B0\"\n            stage 1 = \"F0  I0 W0\"  # split\n        }\n    }\n}\n";
    let f = ok(src);
    let Item::Block(s) = &f.items[0] else {
        panic!()
    };
    let Entry::Nested(pl) = &s.body.entries[0] else {
        panic!()
    };
    assert_eq!(pl.entries.len(), 3);
    let ValueKind::List(items) = &pl.entries[2].value.kind else {
        panic!("{:?}", pl.entries[2])
    };
    assert_eq!(items.len(), 2);
    assert!(matches!(&items[1].kind, ValueKind::Number(n) if n.text == "1"));
    let [order] = pl.blocks.as_slice() else {
        panic!()
    };
    assert_eq!(order.key.name, "order");
    assert_eq!(order.rows.len(), 2);
    assert_eq!(order.rows[1].index.text, "1");
    let ValueKind::String(text) = &order.rows[1].value.kind else {
        panic!()
    };
    // Every action has its own span in the file.
    let words: Vec<(&str, &str)> = text
        .words()
        .into_iter()
        .map(|(w, span)| (w, &src[span.range()]))
        .collect();
    assert_eq!(words, [("F0", "F0"), ("I0", "I0"), ("W0", "W0")]);
    // Spans stay exact after escapes.
    let f = ok("s x { p { q { r 0 = \"\\\\ F1 \\\" B2\" } } }\n");
    let Item::Block(b) = &f.items[0] else {
        panic!()
    };
    let Entry::Nested(p) = &b.body.entries[0] else {
        panic!()
    };
    let ValueKind::String(t) = &p.blocks[0].rows[0].value.kind else {
        panic!()
    };
    let src = "s x { p { q { r 0 = \"\\\\ F1 \\\" B2\" } } }\n";
    let spans: Vec<&str> = t.words().iter().map(|(_, s)| &src[s.range()]).collect();
    assert_eq!(spans, ["\\\\", "F1", "\\\"", "B2"]);
}

#[test]
fn a_value_before_a_row_on_one_line_stays_a_value() {
    let f = ok("s x { order { a = 4 GiB stage 0 = \"F0\" } }\ns y { p { stages = 4  stage 1 = \"F0\" } }\n");
    let Item::Block(b) = &f.items[0] else {
        panic!()
    };
    let Entry::Nested(o) = &b.body.entries[0] else {
        panic!()
    };
    assert!(matches!(o.entries[0].value.kind, ValueKind::Quantity(_)));
    assert_eq!(o.rows.len(), 1);
    let Item::Block(b) = &f.items[1] else {
        panic!()
    };
    let Entry::Nested(p) = &b.body.entries[0] else {
        panic!()
    };
    assert!(matches!(p.entries[0].value.kind, ValueKind::Number(_)));
    assert_eq!(p.rows[0].key.name, "stage");
}
