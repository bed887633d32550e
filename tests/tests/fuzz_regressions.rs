//! Inputs that once crashed, hung or overflowed the stack, kept so they never do again.
//!
//! Every file under `tests/inputs/fuzz/` (reproducers minimised from `cargo fuzz`, see `fuzz/`) goes
//! through what the fuzz targets do: parse, the whole analysis with an in-memory loader that also
//! holds a small valid `lib.sched`, rendering of every diagnostic, and the resolved-job listing of
//! every job; a file that parses cleanly must also format to text that parses cleanly and formats
//! to itself. A few adversarial inputs are built here rather than stored (they are megabytes).
//!
//! "Passing" means returning at all: no panic, no stack overflow (each case runs on a thread with
//! the default 2 MiB test stack), no hang (a time limit per case, generous as debug builds are slow:
//! the stored reproducers of hangs run for minutes when the bug is present and for a few seconds
//! once it is fixed), and, on Linux, no case that drives the process's peak memory past
//! [`MAX_PEAK_BYTES`] (a few-kilobyte file once expanded into gigabytes of layers).

use sched_grammar::{fmt::format, parse, FileId};
use schedc::{analyze, MemLoader};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

/// The fuzz target's fixed second file (fuzz/fuzz_targets/check.rs), so `import "lib.sched"` resolves.
const LIB: &str = r#"# fixed library for the fuzzer
cluster c {
    nodes         = 4
    gpus_per_node = 8
    gpu_memory    = 80 GiB
    peak_flops    = 312 TFLOPS
    intra_node { bandwidth = 300 GB/s   latency = 3 us }
    inter_node { bandwidth = 400 Gbps   latency = 10 us }
    measured all_gather 8 x 2 { 1 MiB = 20 GB/s; 64 MiB = 95 GB/s; 512 MiB = 110 GB/s }
}

model m {
    dtype       = bf16
    optimizer   = adam
    seq_len     = 1024
    micro_batch = 1
    layer embed    = embedding(vocab = 50257, hidden = 768, positions = learned)
    layer block[4] = transformer(hidden = 768, heads = 12, ffn = 3072)
    layer head     = lm_head(hidden = 768, vocab = 50257, tied = true)
}
"#;

/// How long a stored reproducer may take before it counts as a hang.
const STORED_LIMIT: Duration = Duration::from_secs(20);
/// How long a built-in (multi-megabyte) case may take.
const BUILT_IN_LIMIT: Duration = Duration::from_secs(120);
/// The most memory the test process may have used at its peak after a stored reproducer.
const MAX_PEAK_BYTES: u64 = 2 << 30;

/// What a case produced, for the built-in cases' own assertions.
struct Outcome {
    has_errors: bool,
    rendered: String,
}

/// Everything the fuzz targets do to one input.
fn exercise(text: &str) -> Outcome {
    let loader = MemLoader::default()
        .with("main.sched", text)
        .with("lib.sched", LIB);
    let analysis = analyze(Path::new("main.sched"), &loader).expect("main.sched is in memory");
    let rendered = analysis.render();
    for job in &analysis.jobs {
        let _ = schedc::emit::job::emit_job(job);
    }

    let parsed = parse(FileId(0), text);
    if parsed.errors.is_empty() {
        let once = format(text, &parsed.file);
        let again = parse(FileId(0), &once);
        assert!(
            again.errors.is_empty(),
            "formatted output does not parse: {:?}\n{once}",
            again.errors
        );
        assert_eq!(
            format(&once, &again.file),
            once,
            "formatting is not idempotent"
        );
    }
    Outcome {
        has_errors: analysis.has_errors(),
        rendered,
    }
}

/// Runs `exercise` on its own thread (default test stack size) and fails on a panic, a stack
/// overflow (which aborts the process) or a run past `limit` (the thread is then left running).
fn run_case(name: &str, text: String, limit: Duration) -> Outcome {
    let (tx, rx) = mpsc::channel();
    let handle = std::thread::Builder::new()
        .name(name.to_string())
        .stack_size(2 << 20)
        .spawn(move || {
            let outcome = exercise(&text);
            let _ = tx.send(());
            outcome
        })
        .expect("spawn");
    match rx.recv_timeout(limit) {
        Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => match handle.join() {
            Ok(o) => o,
            Err(e) => panic!("{name}: panicked: {}", message(&*e)),
        },
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("{name}: still running after {limit:?} (a hang)")
        }
    }
}

/// The text of a panic payload.
fn message(e: &(dyn std::any::Any + Send)) -> String {
    e.downcast_ref::<String>()
        .cloned()
        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// The process's peak resident memory so far (`VmHWM`), where the platform says.
fn peak_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line
        .trim_start_matches("VmHWM:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

fn fuzz_inputs() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("inputs/fuzz");
    let mut files: Vec<PathBuf> = match std::fs::read_dir(&dir) {
        Ok(entries) => entries
            .map(|e| e.unwrap().path())
            .filter(|p| p.is_file())
            .collect(),
        Err(_) => vec![],
    };
    files.sort();
    files
}

#[test]
fn stored_fuzz_reproducers_do_not_crash() {
    let mut failures = vec![];
    let mut over_memory = false;
    for path in fuzz_inputs() {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let bytes = std::fs::read(&path).unwrap();
        // The fuzz targets skip input that is not UTF-8; a `.bin` reproducer is run lossily so it
        // still exercises the front end.
        let text = String::from_utf8(bytes)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned());
        let result = std::panic::catch_unwind(|| run_case(&name, text, STORED_LIMIT));
        // The high-water mark only rises, so only the first case past the limit is named (a hung
        // case left running can also be what raised it).
        if let Some(peak) = peak_bytes().filter(|&p| p > MAX_PEAK_BYTES && !over_memory) {
            failures.push(format!(
                "{name}: peak memory reached {} MiB (limit {} MiB)",
                peak >> 20,
                MAX_PEAK_BYTES >> 20
            ));
            over_memory = true;
        }
        if let Err(e) = result {
            failures.push(message(&*e));
        }
    }
    assert!(
        failures.is_empty(),
        "{} reproducer(s) still fail:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

fn assert_error(name: &str, text: String) -> Outcome {
    let o = run_case(name, text, BUILT_IN_LIMIT);
    assert!(o.has_errors, "{name}: expected an error diagnostic");
    assert!(
        o.rendered.contains("error"),
        "{name}: the error was not rendered:\n{}",
        &o.rendered[..o.rendered.len().min(2000)]
    );
    o
}

#[test]
fn a_megabyte_of_open_braces() {
    assert_error("braces", "{".repeat(1 << 20));
}

#[test]
fn braces_nested_100k_deep_inside_an_item() {
    let text = format!(
        "schedule s {}{}\n",
        "{".repeat(100_000),
        "}".repeat(100_000)
    );
    assert_error("nested braces", text);
}

#[test]
fn parens_nested_100k_deep_in_a_call() {
    let text = format!(
        "model m {{\n    layer a = transformer{}{}\n}}\n",
        "(".repeat(100_000),
        ")".repeat(100_000)
    );
    assert_error("nested parens", text);
    assert_error("bare parens", "(".repeat(100_000));
}

#[test]
fn a_nine_megabyte_file_is_refused_with_a_diagnostic() {
    let item = "cluster c {\n    nodes = 4  # padding padding padding padding padding padding\n}\n";
    let text = item.repeat((9 << 20) / item.len() + 1);
    assert!(text.len() > 9 << 20);
    assert_error("9 MB", text);
    // The same size on a single line, which the rendered snippet shows in full.
    assert_error("9 MB line", format!("# {}\n", "x".repeat(9 << 20)));
}

#[test]
fn very_long_lines_names_and_numbers() {
    let long = "a".repeat(1 << 20);
    assert_error("long key", format!("model m {{ {long} = 1 }}\n"));
    assert_error("long value", format!("model m {{ dtype = {long} }}\n"));
    assert_error(
        "long unit",
        format!("cluster c {{ gpu_memory = 1 {long} }}\n"),
    );
    assert_error("long string", format!("import \"{long}\"\n"));
    let digits = "9".repeat(1 << 16);
    assert_error(
        "long integer",
        format!(
            "import \"lib.sched\"\nschedule s {{ model = m  cluster = c  nodes = {digits} }}\n"
        ),
    );
    assert_error(
        "long decimal",
        format!("cluster c {{ gpu_memory = 0.{digits} GiB }}\n"),
    );
    assert_error(
        "long entry line",
        format!("model m {{ {} }}\n", "dtype = bf16; ".repeat(50_000)),
    );
}

#[test]
fn huge_and_odd_numbers() {
    let cases = [
        "model m { dtype = bf16  seq_len = 1024\n layer x[99999999999] = transformer(hidden = 8, heads = 1, ffn = 8) }",
        "model m { dtype = bf16  seq_len = 1024\n layer x[99999999999999999999999999999] = dense(params = 1, flops_per_token = 1, activation_bytes_per_token = 1) }",
        "model m { dtype = bf16  seq_len = 1e999999999999\n layer x = mlp(hidden = 1e9, ffn = 1e-9) }",
        "model m { dtype = bf16  seq_len = 4096\n layer x = transformer(hidden = 4294967296, heads = 1, ffn = 4294967296) }",
        "cluster c { nodes = 18446744073709551616  gpus_per_node = -0  gpu_memory = 1e2147483647 GiB  peak_flops = 1e-2147483648 TFLOPS }",
        "cluster c { gpu_memory = 99999999999999999999999999999999999999999 TiB  peak_flops = 1e308 PFLOPS }",
        "import \"lib.sched\"\nschedule s { model = m  cluster = c  shard { params = 4294967296 x 4294967297  grads = 0 x 0  optimizer = 99999999999999999999 } }",
        "import \"lib.sched\"\nschedule s { model = m  cluster = c  preset = hpz(secondary = 0)  micro_steps = 0 }",
        "import \"lib.sched\"\nschedule s { model = m  cluster = c  preset = mics(partition = 0 x 0)  train { steps = 1e99  lr = 1e999  clip = -1e999 } }",
    ];
    for (i, text) in cases.iter().enumerate() {
        assert_error(&format!("number case {i}"), text.to_string());
    }
}

#[test]
fn odd_bytes_and_line_endings() {
    let cases = [
        "model m {\r    dtype = bf16\r    seq_len = 8\r}\r".to_string(),
        "model m {\r\n    dtype = bf16\r\n}\r\n\r".to_string(),
        "\r".repeat(10_000),
        "model m { dtype = bf16\0 }\n".to_string(),
        "\0".repeat(10_000),
        "model m { dtype = \u{feff}bf16 }\n".to_string(),
        "model m { dtype = bf16 } \u{2028}\u{85} é\u{301}\n\u{1F600} = 1\n".to_string(),
        "cluster c { gpu_memory = 80 GiB\u{0}\r\n".to_string(),
        "import \"\\\"\"\nimport \"\\\\\"\nimport \"\"\nimport \".\"\nimport \"/\"\nimport \"main.sched\"\n".to_string(),
    ];
    for (i, text) in cases.into_iter().enumerate() {
        run_case(&format!("bytes case {i}"), text, BUILT_IN_LIMIT);
    }
}
