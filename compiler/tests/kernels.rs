//! The generated kernels of every example schedule: PTX for sm_80 and sm_90 that `ptxas`
//! assembles, one `.entry` per kernel, and each kernel's registers and spills pinned in a
//! snapshot (`ptxas -v`), so a change in generated code shows in review.
//!
//! `ptxas` comes from the `nvidia-cuda-nvcc-cu12` wheel (`.ci/run` installs it) or `$PTXAS`.
//! Without it the assembly test says it skipped (`schedc::testing::skip`), unless `SCHED_REQUIRE`
//! lists `ptxas`, as CI's does, which makes a missing assembler a failure.
#![cfg(feature = "llvm")]

use sched_ir::job::Dtype;
use sched_kernels::codegen::{ptx, SMS};
use sched_kernels::{for_job, Kernel, Op};
use schedc::{analyze, FsLoader};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Every kernel any example schedule needs, and the kernels of options no example uses
/// ([`unused_options`]), each once, in a stable order.
fn example_kernels() -> Vec<Kernel> {
    let mut files: Vec<_> = std::fs::read_dir(repo().join("schedules"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "sched"))
        .collect();
    files.sort();
    let mut all: BTreeMap<String, Kernel> = BTreeMap::new();
    for f in files {
        let a = analyze(&f, &FsLoader).unwrap();
        assert!(!a.has_errors(), "{}", a.render());
        for job in &a.jobs {
            for k in for_job(job) {
                all.insert(k.name(), k);
            }
        }
    }
    for k in unused_options() {
        all.insert(k.name(), k);
    }
    all.into_values().collect()
}

/// Kernels no example schedule's `for_job` lists: the catalogue's kernels the CUDA backend does
/// not launch today (strided block copies; fp32 statistics moved to and from 2-byte halves,
/// which it copies as bytes).
fn unused_options() -> Vec<Kernel> {
    let a = Dtype::Bf16;
    vec![
        Kernel::new(Op::Gather2d, &[a, a]),
        Kernel::new(Op::LoadHalves, &[]),
        Kernel::new(Op::StoreHalves, &[]),
    ]
}

fn ptxas() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("PTXAS") {
        return Some(PathBuf::from(p));
    }
    let out = Command::new("python3")
        .args([
            "-c",
            "import nvidia.cuda_nvcc, os; print(os.path.join(nvidia.cuda_nvcc.__path__[0], 'bin', 'ptxas'))",
        ])
        .output()
        .ok()?;
    let p = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    p.is_file().then_some(p)
}

#[test]
fn every_kernel_has_an_entry_for_each_sm() {
    let kernels = example_kernels();
    assert!(kernels.len() > 20, "{} kernels", kernels.len());
    for sm in SMS {
        let text = ptx(&kernels, sm).unwrap();
        assert!(text.contains(".version 7.8"), "PTX ISA 7.8");
        assert!(text.contains(&format!(".target sm_{sm}")));
        for k in &kernels {
            assert!(
                text.contains(&format!(".entry {}(", k.name())),
                "no entry for {k} on sm_{sm}"
            );
        }
        // Every call is resolved inside the module (an unknown intrinsic would be an
        // `.extern .func` that only ptxas rejects).
        assert!(
            !text.contains(".extern .func"),
            "unresolved call on sm_{sm}"
        );
    }
}

/// `ptxas -v` lines of one module, as (kernel, "registers N, spill stores S, spill loads L").
fn resources(ptxas: &Path, text: &str, sm: u32) -> BTreeMap<String, String> {
    let dir = std::env::temp_dir().join(format!("sched-ptx-{}-{sm}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("kernels.ptx");
    std::fs::write(&src, text).unwrap();
    let out = Command::new(ptxas)
        .arg(format!("-arch=sm_{sm}"))
        .arg("-v")
        .arg("-o")
        .arg(dir.join("kernels.cubin"))
        .arg(&src)
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stderr).to_string();
    std::fs::remove_dir_all(&dir).ok();
    assert!(out.status.success(), "ptxas sm_{sm} failed:\n{log}");
    let mut by_kernel = BTreeMap::new();
    let mut current = None;
    let mut spills = String::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            current = rest.split('\'').next().map(str::to_string);
        } else if line.contains("spill stores") {
            let f: Vec<&str> = line.split_whitespace().collect();
            spills = format!("spill stores {}, spill loads {}", f[4], f[8]);
        } else if let Some(rest) = line.split("Used ").nth(1) {
            let regs = rest.split_whitespace().next().unwrap_or("?");
            if let Some(k) = current.take() {
                by_kernel.insert(k, format!("registers {regs}, {spills}"));
            }
        }
    }
    by_kernel
}

#[test]
fn ptxas_assembles_every_kernel_and_pins_its_resources() {
    let Some(ptxas) = ptxas() else {
        return schedc::testing::skip(
            "ptxas",
            "no ptxas (pip install nvidia-cuda-nvcc-cu12, or set PTXAS)",
        );
    };
    let kernels = example_kernels();
    let mut report = String::new();
    for sm in SMS {
        let text = ptx(&kernels, sm).unwrap();
        let res = resources(&ptxas, &text, sm);
        for k in &kernels {
            let r = res
                .get(&k.name())
                .unwrap_or_else(|| panic!("ptxas -v reported nothing for {k} on sm_{sm}"));
            report.push_str(&format!("sm_{sm} {k}: {r}\n"));
        }
    }
    insta::assert_snapshot!("ptxas_resources", report);
}
