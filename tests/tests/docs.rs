//! The documentation a clone of this repository has: the README stays a short front page whose
//! first commands are the two a newcomer needs (and the ones CI runs), every link in the README
//! and `docs/` leads to a file of the repository (and a heading there), and nothing points outside
//! the repository.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .into()
}

/// The README and every page under `docs/`, with the changelog.
fn pages() -> Vec<PathBuf> {
    let mut pages = vec![root().join("README.md"), root().join("CHANGELOG.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// The targets of the Markdown links `[text](target)` in `text`, outside code spans and blocks.
fn links(text: &str) -> Vec<String> {
    let mut out = vec![];
    let mut in_block = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
            continue;
        }
        if in_block {
            continue;
        }
        // Drop inline code spans.
        let code_free: String = line
            .split('`')
            .enumerate()
            .filter(|(i, _)| i % 2 == 0)
            .map(|(_, s)| s)
            .collect::<Vec<_>>()
            .join(" ");
        let mut rest = code_free.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].to_string());
            rest = &after[end..];
        }
    }
    out
}

/// GitHub's anchor for a heading: lower case, spaces to `-`, punctuation but `-` and `_` dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors(text: &str) -> BTreeSet<String> {
    let mut in_block = false;
    let mut out = BTreeSet::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
        } else if !in_block && line.starts_with('#') {
            out.insert(anchor(line.trim_start_matches('#')));
        }
    }
    out
}

#[test]
fn the_readme_is_a_front_page_that_starts_with_the_two_commands() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines <= 150,
        "README.md has {lines} lines; reference material goes to docs/"
    );
    let commands: Vec<&str> = readme
        .lines()
        .filter(|l| l.starts_with("    cargo "))
        .map(str::trim)
        .collect();
    assert_eq!(
        commands.get(..2),
        Some(
            &[
                "cargo run --release -p schedrun -- schedules/tiny_cpu.sched",
                "cargo test --workspace",
            ][..]
        ),
        "the README's first commands are the main job and the test command"
    );
    // CI runs the README's test command.
    let ci = std::fs::read_to_string(root().join(".ci/run")).unwrap();
    assert!(ci.lines().any(|l| l.trim() == "cargo test --workspace"));
}

#[test]
fn every_link_of_the_docs_leads_inside_the_repository() {
    let mut broken = vec![];
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let dir = page.parent().unwrap();
        for link in links(&text) {
            let name = page.strip_prefix(root()).unwrap().display();
            if link.starts_with("http://") || link.starts_with("https://") {
                broken.push(format!("{name}: {link} leaves the repository"));
                continue;
            }
            let (file, heading) = link.split_once('#').unwrap_or((&link, ""));
            let target = if file.is_empty() {
                page.clone()
            } else {
                dir.join(file)
            };
            if !target.exists() {
                broken.push(format!("{name}: {link} does not exist"));
                continue;
            }
            let inside = root().canonicalize().unwrap();
            if !target.canonicalize().unwrap().starts_with(&inside) {
                broken.push(format!("{name}: {link} is outside the repository"));
                continue;
            }
            if !heading.is_empty() {
                let there = std::fs::read_to_string(&target).unwrap_or_default();
                if !anchors(&there).contains(heading) {
                    broken.push(format!("{name}: {link}: no such heading"));
                }
            }
        }
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn nothing_refers_to_the_specification_outside_the_repository() {
    // The contract lives in docs/; a clone has no `../shared`.
    let mut found = vec![];
    let mut stack = vec![root()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            if path.is_dir() {
                if !matches!(name.as_str(), "target" | ".git" | "corpus" | "artifacts") {
                    stack.push(path);
                }
                continue;
            }
            let text_like = [
                "rs", "md", "toml", "sched", "pest", "dict", "sh", "py", "json",
            ]
            .iter()
            .any(|x| name.ends_with(&format!(".{x}")))
                || name == "run";
            if !text_like || path.ends_with("tests/tests/docs.rs") {
                continue;
            }
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            for (i, line) in text.lines().enumerate() {
                if line.contains("shared/spec") || line.contains("../shared") {
                    let rel = path.strip_prefix(root()).unwrap().display();
                    found.push(format!("{rel}:{}: {}", i + 1, line.trim()));
                }
            }
        }
    }
    assert!(found.is_empty(), "{}", found.join("\n"));
}

#[test]
fn the_link_checker_reads_links_and_headings() {
    assert_eq!(
        links("see [a](docs/a.md#b-c) and `[x](not.md)`\n```\n[y](no.md)\n```\n"),
        ["docs/a.md#b-c"]
    );
    assert!(anchors("# B c\n## What the verifier proves\n").contains("what-the-verifier-proves"));
    assert_eq!(
        anchor(" Planner notes (`schedc plan`)"),
        "planner-notes-schedc-plan"
    );
}
