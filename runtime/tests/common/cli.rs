//! Running the `schedrun` binary from tests: its command in the workspace root, fresh folders,
//! and reading what it printed. Included with `#[path = "common/cli.rs"] mod cli;` by the
//! tests that run the binary.

#![allow(dead_code)]

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The workspace root, where `schedules/` lies.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// `schedrun ARGS` in the workspace root, not started yet.
pub fn command(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_schedrun"));
    c.args(args).current_dir(root());
    c
}

/// `schedrun ARGS` run to its end.
pub fn schedrun(args: &[&str]) -> Output {
    command(args).output().unwrap()
}

/// The `schedc` binary beside `schedrun`, built through cargo when missing (it is another
/// package's binary, which `cargo test -p schedrun` does not build).
pub fn schedc_binary() -> PathBuf {
    let schedc = Path::new(env!("CARGO_BIN_EXE_schedrun")).with_file_name("schedc");
    if !schedc.exists() {
        let st = Command::new(env!("CARGO"))
            .args(["build", "-q", "-p", "schedc"])
            .current_dir(root())
            .status()
            .unwrap();
        assert!(st.success(), "cargo build -p schedc failed");
    }
    schedc
}

/// A fresh, empty folder for test `test` of suite `suite`.
pub fn fresh_dir(suite: &str, test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("schedrun-{suite}-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The JSON objects of `--json`, one a line.
pub fn json_lines(out: &Output) -> Vec<Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}
