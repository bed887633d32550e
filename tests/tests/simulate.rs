//! `schedc simulate --json` of every schedule of every top-level example (`schedules/*.sched`), pinned
//! per file (`simulate@FILE.snap`). Figures are rounded to six significant digits so that the last
//! bits of floating-point arithmetic never decide a snapshot; a change to the cost model or the
//! engine shows up here as a reviewable diff of predicted step times and MFU.

use schedc::{analyze, FsLoader};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn round(v: Value) -> Value {
    match v {
        Value::Number(n) if n.is_f64() => {
            let x: f64 = format!("{:.5e}", n.as_f64().unwrap()).parse().unwrap();
            serde_json::json!(x)
        }
        Value::Array(a) => Value::Array(a.into_iter().map(round).collect()),
        Value::Object(o) => Value::Object(o.into_iter().map(|(k, v)| (k, round(v))).collect()),
        v => v,
    }
}

#[test]
fn simulations_of_every_example_are_pinned() {
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo().join("schedules"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "sched"))
        .collect();
    files.sort();
    assert!(files.len() >= 10, "expected the example schedules");
    for path in files {
        let a = analyze(&path, &FsLoader).unwrap();
        assert!(!a.has_errors(), "{}:\n{}", path.display(), a.render());
        let reports: Vec<Value> = a
            .jobs
            .iter()
            .map(|job| {
                let program =
                    schedc::compile(job).unwrap_or_else(|e| panic!("{}: {e}", job.schedule.name));
                round(serde_json::to_value(schedc::sim::simulate(&program, job)).unwrap())
            })
            .collect();
        let json = serde_json::to_string_pretty(&reports).unwrap();
        let suffix = path
            .file_name()
            .unwrap()
            .to_string_lossy()
            .replace('.', "_");
        insta::with_settings!({ snapshot_suffix => suffix, prepend_module_to_snapshot => false, omit_expression => true }, {
            insta::assert_snapshot!("simulate", json);
        });
    }
}
