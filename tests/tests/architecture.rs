//! The architecture's layering, checked: within each crate, the modules under one parent form a
//! graph without cycles.
//!
//! An edge `a → b` is a path in `a`'s source (`use` trees and inline paths, through `crate::`,
//! `super::` and `self::`) that names an item of `b`. Edges between a module and its own ancestors
//! or descendants are containment, not layering, and are left out; every other edge is lifted to
//! the two children of the modules' nearest common ancestor, so `kernels/mod.rs → lower/workspace`
//! counts as `kernels → lower`. A cycle among siblings (`lower → kernels → lower`) means neither
//! can be understood, tested or moved without the other: the test names each edge of the cycle
//! with the file and line that makes it.
//!
//! Between crates, Cargo already refuses cycles; [`the_runtime_reads_plans_without_the_compiler`]
//! checks the one arrow the architecture makes optional.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The library crates whose modules are checked, by source root.
const CRATES: [&str; 6] = [
    "grammar/src",
    "ir/src",
    "verify/src",
    "kernels/src",
    "compiler/src",
    "runtime/src",
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .into()
}

/// A module path inside one crate: `[]` is the crate root, `["lower", "workspace"]` a module.
type ModPath = Vec<String>;

/// Every module file of the crate under `src` (`lib.rs`, `a.rs`, `a/mod.rs`, `a/b.rs`; not
/// `bin/`), by module path.
fn modules(src: &Path) -> BTreeMap<ModPath, PathBuf> {
    let mut out = BTreeMap::new();
    let mut stack = vec![(src.to_path_buf(), vec![])];
    while let Some((dir, prefix)) = stack.pop() {
        let mut entries: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        for path in entries {
            let name = path.file_name().unwrap().to_str().unwrap().to_string();
            if path.is_dir() {
                if prefix.is_empty() && name == "bin" {
                    continue;
                }
                let mut p: ModPath = prefix.clone();
                p.push(name);
                stack.push((path, p));
            } else if let Some(stem) = name.strip_suffix(".rs") {
                let mut p: ModPath = prefix.clone();
                if !(stem == "mod" || (prefix.is_empty() && stem == "lib")) {
                    p.push(stem.to_string());
                }
                out.insert(p, path);
            }
        }
    }
    out
}

/// The source with comments and the contents of string and char literals blanked (line
/// structure kept), so that only code is searched for paths.
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            i += 2;
            while i < b.len() && !(b[i] == b'*' && b.get(i + 1) == Some(&b'/')) {
                if b[i] == b'\n' {
                    out.push('\n');
                }
                i += 1;
            }
            i += 2;
        } else if c == b'r' && matches!(b.get(i + 1), Some(b'"') | Some(b'#')) && is_raw_start(b, i)
        {
            let hashes = b[i + 1..].iter().take_while(|&&h| h == b'#').count();
            i += 2 + hashes;
            let close: Vec<u8> = std::iter::once(b'"')
                .chain(std::iter::repeat_n(b'#', hashes))
                .collect();
            while i < b.len() && !b[i..].starts_with(&close) {
                if b[i] == b'\n' {
                    out.push('\n');
                }
                i += 1;
            }
            i += close.len();
            out.push_str("\"\"");
        } else if c == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                }
                if b.get(i) == Some(&b'\n') {
                    out.push('\n');
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == b'\'' && is_char_literal(b, i) {
            i += 1;
            while i < b.len() && b[i] != b'\'' {
                if b[i] == b'\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push_str("' '");
        } else {
            // Multi-byte UTF-8 sequences are copied whole.
            let len = utf8_len(c);
            out.push_str(&text[i..i + len]);
            i += len;
        }
    }
    out
}

fn utf8_len(first: u8) -> usize {
    match first {
        0..=0x7f => 1,
        0xc0..=0xdf => 2,
        0xe0..=0xef => 3,
        _ => 4,
    }
}

/// `r"…"` or `r#"…"#` at `i`, not an identifier ending in `r`.
fn is_raw_start(b: &[u8], i: usize) -> bool {
    let before = i.checked_sub(1).map(|j| b[j]);
    let ident_before = before.is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_');
    let hashes = b[i + 1..].iter().take_while(|&&h| h == b'#').count();
    !ident_before && b.get(i + 1 + hashes) == Some(&b'"')
}

/// A char literal at `i` (`'a'`, `'\n'`, `'\u{1F600}'`), not a lifetime (`'a`).
fn is_char_literal(b: &[u8], i: usize) -> bool {
    match b.get(i + 1) {
        Some(b'\\') => true,
        Some(&c) => {
            let len = utf8_len(c);
            b.get(i + 1 + len) == Some(&b'\'')
        }
        None => false,
    }
}

/// Every path a `use` tree names: `a::{b, c::{d, e}}` → `a::b`, `a::c::d`, `a::c::e`.
fn expand_use(tree: &str) -> Vec<String> {
    let tree: String = tree.chars().filter(|c| !c.is_whitespace()).collect();
    let mut out = vec![];
    expand_into(&tree, "", &mut out);
    out
}

fn expand_into(tree: &str, prefix: &str, out: &mut Vec<String>) {
    for part in split_top(tree) {
        match part.find('{') {
            Some(open) => {
                let head = &part[..open];
                let inner = &part[open + 1..part.len() - 1];
                expand_into(inner, &format!("{prefix}{head}"), out);
            }
            None if !part.is_empty() => {
                let part = part.split(" as ").next().unwrap_or(part);
                out.push(format!("{prefix}{part}"));
            }
            None => {}
        }
    }
}

/// `tree` split at its top-level commas.
fn split_top(tree: &str) -> Vec<&str> {
    let (mut depth, mut start, mut parts) = (0, 0, vec![]);
    for (i, c) in tree.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&tree[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&tree[start..]);
    parts
}

/// One reference from a module's source to a path, with where it is.
struct Reference {
    line: usize,
    path: String,
}

/// The paths the code of one file names through `crate::`, `super::` or `self::`, each with its
/// line; and for each, the module it is written in (a `#[cfg(test)] mod name {` block's contents
/// are one level deeper than the file).
fn references(code: &str) -> Vec<(Reference, bool)> {
    let mut out = vec![];
    let mut in_test_mod = false;
    let mut pending_cfg_test = false;
    let lines: Vec<&str> = code.lines().collect();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i].trim();
        if line.starts_with("#[cfg(test)]") {
            pending_cfg_test = true;
        } else if pending_cfg_test && line.starts_with("mod ") && line.ends_with('{') {
            in_test_mod = true;
            pending_cfg_test = false;
        } else if !line.is_empty() && !line.starts_with("#[") {
            pending_cfg_test = false;
        }
        if let Some(rest) = use_tree_start(line) {
            // A `use` may span lines up to its `;`.
            let mut tree = rest.to_string();
            let first = i;
            while !tree.contains(';') && i + 1 < lines.len() {
                i += 1;
                tree.push_str(lines[i].trim());
            }
            let tree = tree.split(';').next().unwrap_or("");
            for path in expand_use(tree) {
                out.push((
                    Reference {
                        line: first + 1,
                        path,
                    },
                    in_test_mod,
                ));
            }
        } else {
            for path in inline_paths(lines[i]) {
                out.push((Reference { line: i + 1, path }, in_test_mod));
            }
        }
        i += 1;
    }
    out
}

/// The tree of a `use` declaration on this line (`pub use`, `pub(crate) use` too).
fn use_tree_start(line: &str) -> Option<&str> {
    let line = line
        .strip_prefix("pub(crate) ")
        .or_else(|| line.strip_prefix("pub(super) "))
        .or_else(|| line.strip_prefix("pub "))
        .unwrap_or(line);
    line.strip_prefix("use ")
}

/// Paths written inline (`crate::a::b`, `super::c`, `self::d`) on one line of code.
fn inline_paths(line: &str) -> Vec<String> {
    let mut out = vec![];
    for start in ["crate::", "super::", "self::"] {
        let mut from = 0;
        while let Some(at) = line[from..].find(start) {
            let at = from + at;
            let before = line[..at].chars().last();
            let boundary = !before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':');
            let end = line[at..]
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .map_or(line.len(), |e| at + e);
            if boundary {
                out.push(line[at..end].trim_end_matches(':').to_string());
            }
            from = end.max(at + start.len());
        }
    }
    out
}

/// The module a path written in module `here` names: the longest module prefix it resolves to.
fn resolve(path: &str, here: &ModPath, known: &BTreeSet<ModPath>) -> Option<ModPath> {
    let mut segments = path.split("::").peekable();
    let mut base: ModPath = match *segments.peek()? {
        "crate" => {
            segments.next();
            vec![]
        }
        "self" => {
            segments.next();
            here.clone()
        }
        "super" => {
            let mut b = here.clone();
            while segments.peek() == Some(&"super") {
                segments.next();
                b.pop()?;
            }
            b
        }
        _ => return None,
    };
    for s in segments {
        let mut next = base.clone();
        next.push(s.to_string());
        if known.contains(&next) {
            base = next;
        } else {
            break;
        }
    }
    Some(base)
}

fn is_prefix(a: &[String], b: &[String]) -> bool {
    a.len() <= b.len() && a == &b[..a.len()]
}

/// An edge of the sibling graph under one parent, with the references that make it.
type Edges = BTreeMap<(ModPath, ModPath), Vec<String>>;

/// The sibling edges of one crate.
fn sibling_edges(src: &Path) -> Edges {
    let mods = modules(src);
    let known: BTreeSet<ModPath> = mods.keys().cloned().collect();
    let mut edges = Edges::new();
    for (here, file) in &mods {
        let code = code_only(&std::fs::read_to_string(file).unwrap());
        for (r, in_test_mod) in references(&code) {
            let mut from = here.clone();
            if in_test_mod {
                // `super::` in a test module names the file's module.
                from.push("tests".into());
            }
            let Some(to) = resolve(&r.path, &from, &known) else {
                continue;
            };
            let from = here;
            if is_prefix(from, &to) || is_prefix(&to, from) {
                continue;
            }
            let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
            let a = from[..=common].to_vec();
            let b = to[..=common].to_vec();
            let rel = file.strip_prefix(root()).unwrap_or(file).display();
            edges
                .entry((a, b))
                .or_default()
                .push(format!("{rel}:{} names {}", r.line, r.path));
        }
    }
    edges
}

/// The strongly connected components of `edges` with more than one module: each is a set of
/// modules that all reach each other, the cycles to break (Tarjan's algorithm).
fn tangles(edges: &Edges) -> Vec<BTreeSet<ModPath>> {
    let mut next: BTreeMap<&ModPath, Vec<&ModPath>> = BTreeMap::new();
    for (a, b) in edges.keys() {
        next.entry(a).or_default().push(b);
        next.entry(b).or_default();
    }
    struct Tarjan<'a> {
        next: BTreeMap<&'a ModPath, Vec<&'a ModPath>>,
        index: BTreeMap<&'a ModPath, usize>,
        low: BTreeMap<&'a ModPath, usize>,
        stack: Vec<&'a ModPath>,
        on_stack: BTreeSet<&'a ModPath>,
        out: Vec<BTreeSet<ModPath>>,
    }
    impl<'a> Tarjan<'a> {
        fn visit(&mut self, n: &'a ModPath) {
            let i = self.index.len();
            self.index.insert(n, i);
            self.low.insert(n, i);
            self.stack.push(n);
            self.on_stack.insert(n);
            for m in self.next[n].clone() {
                if !self.index.contains_key(m) {
                    self.visit(m);
                    let low = self.low[n].min(self.low[m]);
                    self.low.insert(n, low);
                } else if self.on_stack.contains(m) {
                    let low = self.low[n].min(self.index[m]);
                    self.low.insert(n, low);
                }
            }
            if self.low[n] == self.index[n] {
                let mut component = BTreeSet::new();
                loop {
                    let m = self.stack.pop().unwrap();
                    self.on_stack.remove(m);
                    component.insert(m.clone());
                    if m == n {
                        break;
                    }
                }
                if component.len() > 1 {
                    self.out.push(component);
                }
            }
        }
    }
    let nodes: Vec<&ModPath> = next.keys().copied().collect();
    let mut t = Tarjan {
        next,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: vec![],
        on_stack: BTreeSet::new(),
        out: vec![],
    };
    for n in nodes {
        if !t.index.contains_key(n) {
            t.visit(n);
        }
    }
    t.out
}

fn name(m: &ModPath) -> String {
    if m.is_empty() {
        "crate".into()
    } else {
        m.join("::")
    }
}

#[test]
fn no_module_imports_its_way_around_a_cycle() {
    let mut report = String::new();
    for krate in CRATES {
        let edges = sibling_edges(&root().join(krate));
        for tangle in tangles(&edges) {
            let names: Vec<String> = tangle.iter().map(name).collect();
            report += &format!("{krate}: modules in a cycle: {}\n", names.join(", "));
            for ((a, b), why) in &edges {
                if tangle.contains(a) && tangle.contains(b) {
                    report += &format!("  {} -> {}: {}\n", name(a), name(b), why.join("; "));
                }
            }
        }
    }
    assert!(report.is_empty(), "{report}");
}

#[test]
fn the_cycle_finder_finds_cycles() {
    // The checker itself: a planted cycle through a use tree and an inline path is found.
    let known: BTreeSet<ModPath> = [vec![], vec!["a".into()], vec!["b".into()]]
        .into_iter()
        .collect();
    let code = code_only(
        "use crate::{a::X, b};\n// crate::a::not_code\nfn f() { let s = \"crate::b\"; crate::b::g() }\n",
    );
    let refs = references(&code);
    let paths: Vec<&str> = refs.iter().map(|(r, _)| r.path.as_str()).collect();
    assert_eq!(paths, ["crate::a::X", "crate::b", "crate::b::g"]);
    let here: ModPath = vec!["a".into()];
    assert_eq!(
        resolve("super::b::Y", &here, &known),
        Some(vec!["b".to_string()])
    );
    let mut edges = Edges::new();
    let m = |s: &str| vec![s.to_string()];
    edges.insert((m("a"), m("b")), vec![]);
    edges.insert((m("b"), m("c")), vec![]);
    assert!(tangles(&edges).is_empty());
    edges.insert((m("c"), m("a")), vec![]);
    edges.insert((m("c"), m("d")), vec![]);
    assert_eq!(
        tangles(&edges),
        [[m("a"), m("b"), m("c")].into_iter().collect()],
        "a -> b -> c -> a is a cycle; d is outside it"
    );
}

#[test]
fn the_runtime_reads_plans_without_the_compiler() {
    // `schedc` is an optional dependency of schedrun, behind its `compile` feature: a build with
    // `--no-default-features` links nothing of the compiler (CI also asks `cargo tree`).
    let manifest = std::fs::read_to_string(root().join("runtime/Cargo.toml")).unwrap();
    let line = manifest
        .lines()
        .find(|l| l.starts_with("schedc"))
        .expect("schedrun names schedc");
    assert!(line.contains("optional = true"), "{line}");
    assert!(manifest.contains("compile = [\"dep:schedc\"]"));
}
