//! Unit tests of `fmt` (a child module of it: they reach its private items).

use super::*;

fn fmt(source: &str) -> String {
    let parsed = crate::parse(FileId(0), source);
    assert!(parsed.errors.is_empty(), "{:?}", parsed.errors);
    format(source, &parsed.file)
}

/// The expected output, one line per element.
fn lines(lines: &[&str]) -> String {
    lines.iter().map(|line| format!("{line}\n")).collect()
}

#[test]
fn comments_are_found_outside_strings_only() {
    let found: Vec<(String, bool)> =
        scan_comments("a = \"x # \\\" # y\"  # one \n  # two\t\nb = 1")
            .into_iter()
            .map(|c| (c.text, c.own_line))
            .collect();
    assert_eq!(
        found,
        [("# one".to_string(), false), ("# two".to_string(), true)]
    );
}

#[test]
fn blank_lines_are_lines_with_nothing_on_them() {
    assert!(has_blank_line("  # c\n\n  "));
    assert!(has_blank_line("\n \t\n"));
    assert!(!has_blank_line(";\n;\n"));
    assert!(!has_blank_line("\n"));
}

#[test]
fn keys_align_within_runs() {
    let out = fmt("model m {\n a = 1\n long_key = 2\n\n b = 3\n shard { x = 1 }\n cc = 4 }");
    let expected = [
        "model m {",
        "    a        = 1",
        "    long_key = 2",
        "",
        "    b = 3",
        "    shard { x = 1 }",
        "    cc = 4",
        "}",
    ];
    assert_eq!(out, lines(&expected));
}

#[test]
fn values_are_normalised() {
    let out = fmt(r#"c x { m = 80GiB; s = 8x2; n = 1_000_000; f = 7.5e9; q = "a\"b\\" }"#);
    let expected = [
        "c x {",
        "    m = 80 GiB",
        "    s = 8 x 2",
        "    n = 1_000_000",
        "    f = 7.5e9",
        r#"    q = "a\"b\\""#,
        "}",
    ];
    assert_eq!(out, lines(&expected));
}

#[test]
fn long_calls_fill_lines_after_the_parenthesis() {
    let args: Vec<String> = (0..12).map(|i| format!("argument_{i} = {i}")).collect();
    let out = fmt(&format!(
        "model m {{ layer l[2] = k({}) }}",
        args.join(", ")
    ));
    let printed: Vec<&str> = out.lines().collect();
    assert!(
        printed.len() > 3 && printed.iter().all(|l| l.len() <= MAX_WIDTH),
        "{out}"
    );
    let column = "    layer l[2] = k(".len();
    assert!(printed[2].starts_with(&" ".repeat(column)) && printed[2].as_bytes()[column] != b' ');
}

#[test]
fn nested_blocks_go_on_one_line_only_when_they_read_back() {
    let out = fmt("s x { p {\n a = 1\n b = 4 GiB\n} }");
    assert_eq!(out, lines(&["s x {", "    p { a = 1  b = 4 GiB }", "}"]));
    // `8  x1 = 2` reads back as two entries (the mesh needs the end of the entry after it).
    let out = fmt("s x { p {\n a = 8\n x1 = 2\n} }");
    assert_eq!(out, lines(&["s x {", "    p { a = 8  x1 = 2 }", "}"]));
}

#[test]
fn comments_in_calls_stay_after_their_argument() {
    let out =
        fmt("model m {\n layer l = k(  # before\n a = 1,  # after a\n b = 2  # after b\n )\n}");
    let expected = [
        "model m {",
        "    # before",
        "    layer l = k(a = 1,  # after a",
        "                b = 2)  # after b",
        "}",
    ];
    assert_eq!(out, lines(&expected));
}

#[test]
fn carriage_returns_are_dropped() {
    let out = fmt("model m {\r\n  a = 1  # c\r\n\r\n\r\n  b = 2\r\n}\r\n");
    assert_eq!(
        out,
        lines(&["model m {", "    a = 1  # c", "", "    b = 2", "}"])
    );
}

#[test]
fn keys_longer_than_a_format_width_are_padded() {
    // `format!("{key:<w$}")` panics when `w` exceeds `u16::MAX`.
    let long = "k".repeat(70_000);
    let out = fmt(&format!("model m {{\n {long} = 1\n b = 2\n}}"));
    let printed: Vec<&str> = out.lines().collect();
    assert_eq!(printed[1], format!("    {long} = 1"));
    assert_eq!(printed[2], format!("    b{} = 2", " ".repeat(69_999)));
    assert_eq!(fmt(&out), out);
}

#[test]
fn a_lone_carriage_return_ends_a_comment_as_the_grammar_says() {
    // `#n` is a comment and `l m { … }` an item: the parser reads a lone `\r` as a line break.
    let out = fmt("#n\rl m {\n  k = m}\n");
    assert_eq!(out, lines(&["#n", "l m {", "    k = m", "}"]));
    assert_eq!(
        fmt("a b { k = 1 }  # x\ry c {}\r\r"),
        lines(&["a b {", "    k = 1", "}  # x", "", "y c {}"])
    );
    assert!(has_blank_line("\r\r\r") && !has_blank_line("\r\n") && has_blank_line("\r\n\r\n"));
}

#[test]
fn empty_input_stays_empty() {
    assert_eq!(fmt(""), "");
    assert_eq!(fmt("\n\n# only\n\n"), "# only\n");
}

#[test]
fn pipeline_blocks_keep_rows_and_inner_blocks_on_their_own_lines() {
    let out = fmt("schedule s { pipeline { stages = 2  layers = [1,2]  order { stage 0 = \"F0 B0\"  stage 10=\"F0 B0\" } } }");
    let expected = [
        "schedule s {",
        "    pipeline {",
        "        stages = 2",
        "        layers = [1, 2]",
        "        order {",
        "            stage 0  = \"F0 B0\"",
        "            stage 10 = \"F0 B0\"",
        "        }",
        "    }",
        "}",
    ];
    assert_eq!(out, lines(&expected));
    // Without rows or inner blocks a pipeline block is like any nested block.
    let out = fmt("schedule s {\n pipeline {\n stages = 2\n layers = balanced\n }\n}");
    assert_eq!(
        out,
        lines(&[
            "schedule s {",
            "    pipeline { stages = 2  layers = balanced }",
            "}"
        ])
    );
}
