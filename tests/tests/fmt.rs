//! The canonical formatter (`sched_grammar::fmt`): its output for every input under
//! `tests/inputs/fmt/` is pinned by a snapshot, and for those inputs and every example under
//! `schedules/` it is idempotent, parses back to the same syntax tree (spans aside), and keeps
//! every comment exactly once.

use sched_grammar::ast::{
    Assign, Call, Entry, File, Item, Nested, Point, Quantity, Value, ValueKind,
};
use sched_grammar::{fmt::format, parse, FileId};
use serde_json::{json, Value as Json};
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Every `.sched` file under `dir`, recursively, sorted; none when `dir` does not exist.
fn sched_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![];
    for entry in std::fs::read_dir(dir).into_iter().flatten() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(sched_files(&path));
        } else if path.extension().is_some_and(|x| x == "sched") {
            out.push(path);
        }
    }
    out.sort();
    out
}

fn parse_clean(name: &str, source: &str) -> File {
    let parsed = parse(FileId(0), source);
    assert!(
        parsed.errors.is_empty(),
        "{name} does not parse: {:?}\n{source}",
        parsed.errors
    );
    parsed.file
}

#[test]
fn formats_inputs() {
    insta::glob!("../inputs/fmt", "*.sched", |path| {
        let source = std::fs::read_to_string(path).unwrap();
        let file = parse_clean(&path.display().to_string(), &source);
        insta::assert_snapshot!(format(&source, &file));
    });
}

#[test]
fn properties_hold_for_inputs() {
    let files = sched_files(&repo().join("tests/inputs/fmt"));
    assert!(
        files.len() >= 8,
        "expected the formatter inputs, found {files:?}"
    );
    for path in files {
        check_properties(
            &path.display().to_string(),
            &std::fs::read_to_string(&path).unwrap(),
        );
    }
}

/// The examples are written by hand elsewhere; a file that does not parse is not the formatter's
/// to judge, so it is skipped (with a note) rather than failed.
#[test]
fn properties_hold_for_example_schedules() {
    for path in sched_files(&repo().join("schedules")) {
        let name = path.display().to_string();
        let source = std::fs::read_to_string(&path).unwrap();
        if parse(FileId(0), &source).errors.is_empty() {
            check_properties(&name, &source);
        } else {
            eprintln!("skipping {name}: it does not parse");
        }
    }
}

fn check_properties(name: &str, source: &str) {
    let file = parse_clean(name, source);
    let once = format(source, &file);
    let reparsed = parse_clean(&format!("{name}, formatted"), &once);
    assert_eq!(
        strip_file(&reparsed),
        strip_file(&file),
        "{name}: formatting changed the syntax tree\n{once}"
    );
    assert_eq!(
        format(&once, &reparsed),
        once,
        "{name}: formatting is not idempotent"
    );
    assert_eq!(
        comment_texts(&once),
        comment_texts(source),
        "{name}: comments changed\n{once}"
    );
    for line in once.lines() {
        assert_eq!(line, line.trim_end(), "{name}: trailing whitespace\n{once}");
        assert!(
            !line.trim_start_matches(' ').starts_with('\t'),
            "{name}: tab indentation\n{once}"
        );
    }
    assert!(
        once.is_empty() || (once.ends_with('\n') && !once.ends_with("\n\n")),
        "{name}: bad file end"
    );
}

/// The texts of all comments, sorted, found independently of the formatter: per line, the first
/// `#` outside a string literal (strings cannot span lines) to the end of the line. Lines end at
/// `\n`, `\r\n` or a lone `\r`, as in the grammar.
fn comment_texts(source: &str) -> Vec<String> {
    let mut texts = vec![];
    for line in source.split(['\n', '\r']) {
        let (mut in_string, mut escaped) = (false, false);
        for (i, c) in line.char_indices() {
            match c {
                _ if escaped => escaped = false,
                '\\' if in_string => escaped = true,
                '"' => in_string = !in_string,
                '#' if !in_string => {
                    texts.push(line[i..].trim_end().to_string());
                    break;
                }
                _ => {}
            }
        }
    }
    texts.sort();
    texts
}

// The syntax tree without spans, as JSON, so that trees from different texts can be compared.

fn strip_file(file: &File) -> Json {
    Json::Array(file.items.iter().map(strip_item).collect())
}

fn strip_item(item: &Item) -> Json {
    match item {
        Item::Import(i) => json!({ "import": i.path.value }),
        Item::Block(b) => json!({
            "kind": b.kind.name,
            "name": b.name.name,
            "entries": b.body.entries.iter().map(strip_entry).collect::<Json>(),
        }),
    }
}

fn strip_entry(entry: &Entry) -> Json {
    match entry {
        Entry::Assign(a) => json!({ "assign": strip_assign(a) }),
        Entry::Nested(n) => strip_nested(n),
        Entry::Layer(l) => json!({
            "layer": l.name.name,
            "repeat": l.repeat.as_ref().map(|r| &r.text),
            "call": strip_call(&l.call),
        }),
        Entry::Measured(m) => json!({
            "measured": m.collective.name,
            "mesh": strip_value(&m.mesh),
            "points": m.points.iter().map(strip_point).collect::<Json>(),
        }),
    }
}

fn strip_nested(n: &Nested) -> Json {
    json!({
        "nested": n.key.name,
        "entries": n.entries.iter().map(strip_assign).collect::<Json>(),
        "rows": n.rows.iter().map(|r| json!([r.key.name, r.index.text, strip_value(&r.value)])).collect::<Json>(),
        "blocks": n.blocks.iter().map(strip_nested).collect::<Json>(),
    })
}

fn strip_value(value: &Value) -> Json {
    match &value.kind {
        ValueKind::Number(n) => json!({ "number": n.text }),
        ValueKind::Quantity(q) => strip_quantity(q),
        ValueKind::Mesh(m) => json!({ "mesh": [m.a.text, m.b.text] }),
        ValueKind::String(s) => json!({ "string": s.value }),
        ValueKind::Ident(i) => json!({ "ident": i.name }),
        ValueKind::Call(c) => strip_call(c),
        ValueKind::List(items) => {
            json!({ "list": items.iter().map(strip_value).collect::<Json>() })
        }
    }
}

fn strip_assign(assign: &Assign) -> Json {
    strip_pair(&assign.key.name, &assign.value)
}

fn strip_pair(key: &str, value: &Value) -> Json {
    json!([key, strip_value(value)])
}

fn strip_point(point: &Point) -> Json {
    json!([
        strip_quantity(&point.size),
        strip_quantity(&point.bandwidth)
    ])
}

fn strip_quantity(q: &Quantity) -> Json {
    json!({ "quantity": [q.number.text, q.unit.name] })
}

fn strip_call(call: &Call) -> Json {
    json!({
        "call": call.callee.name,
        "args": call.args.iter().map(|a| strip_pair(&a.name.name, &a.value)).collect::<Json>(),
    })
}
