//! Where the CUDA backend's kernels come from: the PTX modules `schedc compile --emit ptx`
//! writes beside a plan file, one per GPU architecture (`x.plan.json` gives `x.sm_80.ptx` and
//! `x.sm_90.ptx`, `schedc::kernels::ptx_path`), or one module named on the command line
//! (`schedrun --ptx`). The backend picks the architecture from its device's compute capability
//! ([`sm_for`]), then reads and checks the module ([`read_module`]) before loading anything:
//! written for that architecture, and holding every kernel the job needs
//! (`schedc::kernels::for_job`, the variants the device code may launch). A missing, unreadable
//! or mismatched module is one error naming the file and the command that writes it. No NVRTC:
//! the driver loads the PTX text as it is (`kernels.rs`).
//!
//! Built everywhere, so these checks are tested without a GPU or the `cuda` feature.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use super::enqueue::CudaError;
use schedc::kernels::{ptx_path, Kernel};
use std::path::PathBuf;

/// Where the CUDA backend finds its PTX.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PtxFiles {
    /// Beside this plan file, named after it, one module per architecture.
    BesidePlan(PathBuf),
    /// This module (it must still be for the device's architecture).
    File(PathBuf),
}

impl PtxFiles {
    /// Where `schedrun FILE [--ptx F]` finds the kernels: `F`, else beside `file` when it is a
    /// plan file. A `.sched` file compiled on the spot has no PTX (schedrun generates no code):
    /// refused, saying what to run (`schedule` is the `--schedule` given, if any).
    pub fn for_input(
        file: &std::path::Path,
        ptx: Option<&std::path::Path>,
        schedule: Option<&str>,
    ) -> Result<PtxFiles, String> {
        if let Some(f) = ptx {
            return Ok(PtxFiles::File(f.to_path_buf()));
        }
        let text = std::fs::read_to_string(file)
            .map_err(|e| format!("cannot read {}: {e}", file.display()))?;
        if schedc::load::is_plan_text(&text) {
            return Ok(PtxFiles::BesidePlan(file.to_path_buf()));
        }
        let schedule = schedule.map_or(String::new(), |s| format!(" --schedule {s}"));
        Err(format!(
            "--backend cuda runs the kernels `schedc compile --emit ptx` writes beside a plan, and \
             {f} is a schedule: compile it first (`schedc compile {f}{schedule} --emit ptx -o \
             NAME.plan.json`, schedc built with `--features llvm`) and run NAME.plan.json, or pass \
             --ptx",
            f = file.display()
        ))
    }

    /// The module for `sm_{sm}`.
    pub fn path(&self, sm: u32) -> PathBuf {
        match self {
            PtxFiles::BesidePlan(plan) => ptx_path(plan, sm),
            PtxFiles::File(f) => f.clone(),
        }
    }

    /// What writes the module, for messages.
    fn remedy(&self, schedule: &str) -> String {
        match self {
            PtxFiles::BesidePlan(plan) => format!(
                "write it with `schedc compile <file.sched> --schedule {schedule} --emit ptx -o {}` \
                 (schedc built with `--features llvm`)",
                plan.display()
            ),
            PtxFiles::File(_) => format!(
                "pass the module `schedc compile <file.sched> --schedule {schedule} --emit ptx` \
                 wrote for this plan and this GPU"
            ),
        }
    }
}

/// The PTX architecture for a device of compute capability `major.minor`: sm_90 from 9.0 on
/// (the driver compiles sm_90 PTX for later architectures), sm_80 for 8.x. Older devices are
/// refused: the generated kernels are written for sm_80 and sm_90 (PTX ISA 7.8).
pub fn sm_for(major: i32, minor: i32) -> Result<u32, CudaError> {
    match major {
        9.. => Ok(90),
        8 => Ok(80),
        _ => Err(CudaError::backend(format!(
            "this GPU has compute capability {major}.{minor}; the cuda backend's kernels need \
             8.0 or later (they are built for sm_80 and sm_90)"
        ))),
    }
}

/// The architecture a module's `.target` directive names (`sm_90` gives 90).
fn target(text: &str) -> Option<u32> {
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with(".target"))?;
    let arch = line.trim_start()[".target".len()..]
        .split(|c: char| c == ',' || c.is_whitespace())
        .find(|w| !w.is_empty())?;
    arch.strip_prefix("sm_")?.parse().ok()
}

/// The module of `files` for `sm_{sm}` (its path and text), checked: readable, written for
/// that architecture, and holding an entry for each of `kernels`. `schedule` names the plan's
/// schedule in the messages.
pub fn read_module(
    files: &PtxFiles,
    sm: u32,
    schedule: &str,
    kernels: &[Kernel],
) -> Result<(PathBuf, String), CudaError> {
    let path = files.path(sm);
    let fail = |what: String| {
        CudaError::backend(format!(
            "the cuda backend's kernels: {}: {what}; {}",
            path.display(),
            files.remedy(schedule)
        ))
    };
    let text = std::fs::read_to_string(&path).map_err(|e| fail(format!("cannot read it ({e})")))?;
    match target(&text) {
        Some(t) if t == sm => {}
        Some(t) => {
            return Err(fail(format!(
                "it is PTX for sm_{t}; this GPU needs sm_{sm}"
            )))
        }
        None => return Err(fail("it is not a PTX module (no `.target sm_NN`)".into())),
    }
    let missing: Vec<String> = kernels
        .iter()
        .map(Kernel::name)
        .filter(|n| !text.contains(&format!(".entry {n}(")))
        .collect();
    if !missing.is_empty() {
        let shown = missing
            .iter()
            .take(3)
            .cloned()
            .collect::<Vec<_>>()
            .join(", ");
        let more = missing.len().saturating_sub(3);
        let more = if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        };
        return Err(fail(format!(
            "it lacks {} of the {} kernels this plan needs ({shown}{more}): it was written for \
             another plan or by another schedc",
            missing.len(),
            kernels.len()
        )));
    }
    Ok((path, text))
}

#[cfg(test)]
mod tests {
    use super::*;
    use schedc::job::Dtype;
    use schedc::kernels::Op;

    #[test]
    fn the_architecture_follows_the_compute_capability() {
        assert_eq!(sm_for(9, 0).unwrap(), 90);
        assert_eq!(sm_for(10, 0).unwrap(), 90);
        assert_eq!(sm_for(8, 0).unwrap(), 80);
        assert_eq!(sm_for(8, 9).unwrap(), 80);
        let e = sm_for(7, 5).unwrap_err().to_string();
        assert!(e.contains("7.5") && e.contains("8.0"), "{e}");
    }

    /// A plan file's modules are beside it, `--ptx` names one; a `.sched` file is refused with
    /// the command that writes a plan and its PTX.
    #[test]
    fn the_command_line_finds_the_modules_of_a_plan_file() {
        let dir = std::env::temp_dir().join(format!("schedrun-ptx-cli-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (plan, source) = (dir.join("x.plan.json"), dir.join("x.sched"));
        std::fs::write(&plan, "\n  {\"version\": 1}").unwrap();
        std::fs::write(&source, "model m { }").unwrap();
        assert_eq!(
            PtxFiles::for_input(&plan, None, None),
            Ok(PtxFiles::BesidePlan(plan.clone()))
        );
        let k = std::path::Path::new("k.ptx");
        assert_eq!(
            PtxFiles::for_input(&source, Some(k), None),
            Ok(PtxFiles::File(k.to_path_buf()))
        );
        let e = PtxFiles::for_input(&source, None, Some("big")).unwrap_err();
        assert!(
            e.contains("is a schedule") && e.contains("x.sched --schedule big --emit ptx -o"),
            "{e}"
        );
        let e = PtxFiles::for_input(&dir.join("none.json"), None, None).unwrap_err();
        assert!(e.contains("cannot read") && e.contains("none.json"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    /// What `schedc compile --emit ptx` writes passes the check: the generator's `.target` and
    /// `.entry` lines are the ones it reads.
    #[cfg(feature = "llvm")]
    #[test]
    fn a_generated_module_is_accepted() {
        use schedc::kernels::codegen::{ptx, SMS};
        let dir = std::env::temp_dir().join(format!("schedrun-ptx-gen-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let plan = dir.join("g.plan.json");
        let (f, a) = (Dtype::Fp32, Dtype::Bf16);
        let kernels = [
            Kernel::new(Op::Round { to: a }, &[f]),
            Kernel::new(Op::Adam { decayed: true }, &[a]),
            Kernel::new(Op::AddLoss, &[]),
        ];
        for sm in SMS {
            std::fs::write(
                schedc::kernels::ptx_path(&plan, sm),
                ptx(&kernels, sm).unwrap(),
            )
            .unwrap();
            let files = PtxFiles::BesidePlan(plan.clone());
            read_module(&files, sm, "g", &kernels).unwrap();
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn modules_are_found_beside_the_plan() {
        let f = PtxFiles::BesidePlan(PathBuf::from("/runs/gpt.plan.json"));
        assert_eq!(f.path(90), PathBuf::from("/runs/gpt.sm_90.ptx"));
        assert_eq!(f.path(80), PathBuf::from("/runs/gpt.sm_80.ptx"));
        let f = PtxFiles::File(PathBuf::from("k.ptx"));
        assert_eq!(f.path(90), PathBuf::from("k.ptx"));
    }

    /// A missing file, a module for another architecture, and one without the plan's kernels
    /// are each refused in one message naming the file and what to run; a good one is read.
    #[test]
    fn a_missing_or_mismatched_module_is_refused_with_its_path() {
        let dir = std::env::temp_dir().join(format!("schedrun-ptx-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let plan = dir.join("run.plan.json");
        let files = PtxFiles::BesidePlan(plan.clone());
        let f = Dtype::Fp32;
        let kernels = [
            Kernel::new(Op::Convert, &[f, Dtype::Bf16]),
            Kernel::new(Op::Fill, &[f]),
        ];
        let module = |target: &str, entries: &[&Kernel]| {
            let mut t = format!("//\n.version 7.8\n.target {target}\n.address_size 64\n");
            for k in entries {
                t += &format!(
                    "\n.visible .entry {}(\n\t.param .u64 p0\n)\n{{\n\tret;\n}}\n",
                    k.name()
                );
            }
            t
        };

        let e = read_module(&files, 90, "gpt", &kernels)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("run.sm_90.ptx") && e.contains("cannot read"),
            "{e}"
        );
        assert!(
            e.contains("--schedule gpt --emit ptx -o") && e.contains("run.plan.json"),
            "{e}"
        );

        std::fs::write(
            dir.join("run.sm_90.ptx"),
            module("sm_80", &[&kernels[0], &kernels[1]]),
        )
        .unwrap();
        let e = read_module(&files, 90, "gpt", &kernels)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("PTX for sm_80") && e.contains("needs sm_90"),
            "{e}"
        );

        std::fs::write(dir.join("run.sm_90.ptx"), module("sm_90", &[&kernels[1]])).unwrap();
        let e = read_module(&files, 90, "gpt", &kernels)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("lacks 1 of the 2") && e.contains("convert_fp32_bf16"),
            "{e}"
        );

        std::fs::write(
            dir.join("run.sm_90.ptx"),
            module("sm_90", &[&kernels[0], &kernels[1]]),
        )
        .unwrap();
        let (path, text) = read_module(&files, 90, "gpt", &kernels).unwrap();
        assert_eq!(path, dir.join("run.sm_90.ptx"));
        assert!(text.contains(".entry fill_fp32("));

        std::fs::write(dir.join("other.ptx"), "not ptx").unwrap();
        let files = PtxFiles::File(dir.join("other.ptx"));
        let e = read_module(&files, 80, "gpt", &kernels)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("other.ptx") && e.contains("not a PTX module"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
