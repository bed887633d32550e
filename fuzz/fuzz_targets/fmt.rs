//! The formatter on arbitrary text that parses: its output must parse without errors, and
//! formatting that output again must change nothing (idempotence).
#![no_main]

use libfuzzer_sys::fuzz_target;
use sched_grammar::{fmt::format, parse, FileId};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let parsed = parse(FileId(0), text);
    if !parsed.errors.is_empty() {
        return;
    }
    let once = format(text, &parsed.file);
    let reparsed = parse(FileId(0), &once);
    assert!(
        reparsed.errors.is_empty(),
        "formatted output does not parse: {:?}\n--- input ---\n{text}\n--- output ---\n{once}",
        reparsed.errors
    );
    let twice = format(&once, &reparsed.file);
    assert_eq!(once, twice, "formatting is not idempotent\n--- input ---\n{text}");
});
