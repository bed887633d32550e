//! The `.sched` language front end: grammar, syntax tree, parser, diagnostics and formatter.
//!
//! This crate owns everything about the text of a `.sched` file and nothing about its meaning:
//! [`parser::parse`] turns text into an [`ast::File`] with byte spans on every node, [`diag`] holds
//! the diagnostics type and its one rendering path, and [`fmt`] prints a file in canonical layout
//! keeping its comments. Semantic analysis (names, imports, presets, units, rules) lives in the
//! compiler's `sema`. Nothing outside this crate sees pest.

pub mod ast;
pub mod diag;
pub mod fmt;
pub mod parser;

pub use diag::{Diagnostic, FileId, Severity, SourceMap, Span};
pub use parser::{parse, Parsed};
