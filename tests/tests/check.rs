//! The checker's diagnostics, pinned by snapshots.
//!
//! `diagnostics`: every `tests/inputs/check/err/*.sched` yields at least one diagnostic (only warnings
//! for `warn_*` files); the snapshot is the rendered report, as `schedc check` prints it, and the exit
//! status the CLI would return. `resolved_ok`: every `tests/inputs/check/ok/*.sched` checks without
//! errors; the snapshot is its warnings, if any, and the resolved listing of each of its jobs.
//! Shared valid items and the other halves of import cycles live in `tests/inputs/check/lib/`.

use schedc::{analyze, Analysis, FsLoader, MemLoader};
use std::path::Path;

/// Analyses `path`, returning the analysis and its rendered report with the machine-specific
/// prefix of every path removed (`inputs/check/err/x.sched:3:5`).
fn check(path: &Path) -> (Analysis, String) {
    let analysis = analyze(path, &FsLoader).unwrap();
    let rendered = analysis
        .render()
        .replace(concat!(env!("CARGO_MANIFEST_DIR"), "/"), "");
    (analysis, rendered)
}

#[test]
fn diagnostics() {
    insta::glob!("../inputs/check/err", "*.sched", |path| {
        let (analysis, rendered) = check(path);
        let name = path.file_name().unwrap().to_string_lossy();
        assert!(
            !analysis.diagnostics.is_empty(),
            "{name} yields no diagnostic"
        );
        if name.starts_with("warn_") {
            assert!(
                !analysis.has_errors(),
                "{name} should yield only warnings:\n{rendered}"
            );
        }
        let exit = u8::from(analysis.has_errors());
        insta::assert_snapshot!(format!("{rendered}exit: {exit}"));
    });
}

#[test]
fn resolved_ok() {
    insta::glob!("../inputs/check/ok", "*.sched", |path| {
        let (analysis, rendered) = check(path);
        assert!(!analysis.has_errors(), "{}:\n{rendered}", path.display());
        assert!(
            !analysis.jobs.is_empty(),
            "{} defines no schedule",
            path.display()
        );
        let jobs: Vec<String> = analysis
            .jobs
            .iter()
            .map(schedc::emit::job::emit_job)
            .collect();
        let listing = jobs
            .join("\n")
            .replace(concat!(env!("CARGO_MANIFEST_DIR"), "/"), "");
        insta::assert_snapshot!(format!("{rendered}{listing}"));
    });
}

const TINY_MODEL: &str = "model m {\n    dtype   = bf16\n    seq_len = 64\n    layer block = mlp(hidden = 64, ffn = 256)\n}\n";

/// `cd sub && schedc check a.sched`, where `a.sched` imports `../lib/b.sched` and that imports
/// `../sub/a.sched`: the root reached again through `..` is the same file (files are identified
/// by their absolute, normalised path), so this is an import cycle, not a second copy of the root
/// whose items would be defined twice. Names are shown as written.
#[test]
fn a_relative_root_reached_again_through_dotdot_is_one_file() {
    let loader = MemLoader::default()
        .in_dir("/work/sub")
        .with(
            "a.sched",
            &format!("import \"../lib/b.sched\"\n{TINY_MODEL}"),
        )
        .with("../lib/b.sched", "import \"../sub/a.sched\"\n");
    let a = analyze(Path::new("a.sched"), &loader).unwrap();
    let rendered = a.render();
    assert_eq!(a.diagnostics.len(), 1, "{rendered}");
    assert!(
        rendered.contains("import cycle: a.sched → ../lib/b.sched → a.sched"),
        "{rendered}"
    );

    // Without a cycle: one file imported under two spellings is loaded once.
    let loader = MemLoader::default()
        .in_dir("/work/sub")
        .with(
            "a.sched",
            "import \"lib.sched\"\nimport \"../sub/lib.sched\"\nimport \"./x/../lib.sched\"\n",
        )
        .with("lib.sched", TINY_MODEL);
    let a = analyze(Path::new("a.sched"), &loader).unwrap();
    assert!(a.diagnostics.is_empty(), "{}", a.render());
    assert_eq!(a.sources.ids().count(), 2);
    assert_eq!(a.models.len(), 1);
}
