//! Helpers shared by the runtime's tests: models from sched text or the repository's schedules,
//! and seeded random buffers.
#![allow(dead_code)]

use schedc::job::{Job, Model};
use schedc::{analyze, FsLoader, MemLoader};
use schedrun::math::Rng;
use std::path::{Path, PathBuf};

/// The models of a sched source held in memory (every model it defines).
pub fn models(text: &str) -> Vec<Model> {
    let loader = MemLoader::default()
        .in_dir("/mem")
        .with("/mem/m.sched", text);
    let a = analyze(Path::new("/mem/m.sched"), &loader).expect("readable");
    assert!(!a.has_errors(), "{}", a.render());
    a.models.iter().map(|m| (**m).clone()).collect()
}

pub fn model(text: &str, name: &str) -> Model {
    models(text)
        .into_iter()
        .find(|m| m.name == name)
        .unwrap_or_else(|| panic!("no model {name}"))
}

pub fn schedules_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../schedules")
}

/// The job of `schedules/tiny_cpu.sched` (tiny_gpt under ZeRO-3 on 4 ranks).
pub fn tiny_job() -> Job {
    let a = analyze(&schedules_dir().join("tiny_cpu.sched"), &FsLoader).expect("readable");
    assert!(!a.has_errors(), "{}", a.render());
    a.select(None).expect("one schedule").clone()
}

/// `tiny_gpt` or `tiny_llama` from `schedules/models/tiny.sched`.
pub fn tiny(name: &str) -> Model {
    let a = analyze(&schedules_dir().join("models/tiny.sched"), &FsLoader).expect("readable");
    assert!(!a.has_errors(), "{}", a.render());
    a.models
        .iter()
        .find(|m| m.name == name)
        .map(|m| (**m).clone())
        .unwrap_or_else(|| panic!("no model {name}"))
}

pub fn normal(rng: &mut Rng, n: usize, std: f64) -> Vec<f32> {
    (0..n).map(|_| (rng.normal() * std) as f32).collect()
}
