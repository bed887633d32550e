//! Long runs (`runtime.md`, "Long runs"): outputs checked before the first step, periodic
//! checkpoint folders that survive SIGKILL and resume bit for bit (under the same schedule and
//! another), SIGTERM's stop after a step with a checkpoint and exit 143, damaged entries refused
//! by name, and a NaN loss stopping the run at its step.

use schedc::{analyze, FsLoader};
use schedrun::checkpoint::{self, folder, Contents};
use schedrun::train::State;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};

#[path = "common/cli.rs"]
mod cli;

use cli::{command, root, s, schedrun, stderr};

/// A fresh folder for one test.
fn temp(test: &str) -> PathBuf {
    cli::fresh_dir("long", test)
}

fn tiny_gpt() -> std::sync::Arc<sched_ir::job::Model> {
    analyze(&root().join("schedules/tiny_cpu.sched"), &FsLoader)
        .unwrap()
        .jobs
        .remove(0)
        .model
}

fn load(f: &Path) -> State {
    checkpoint::load(f, &tiny_gpt(), Contents::Checkpoint).unwrap()
}

/// The steps of the complete entries under `dir`, oldest first.
fn entries(dir: &Path) -> Vec<u64> {
    let mut v: Vec<u64> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.path().join(folder::MANIFEST).exists())
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("step-")?.parse().ok())
        .collect();
    v.sort();
    v
}

/// Starts `args` with `--json` and reads its step lines until step `until` has been printed; the
/// rest of its stdout is drained by a thread, so the run never writes into a closed pipe.
fn start_until(args: &[&str], until: u64) -> (Child, u64) {
    let mut child = command(args)
        .arg("--json")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = 0;
    for line in lines.by_ref() {
        let v: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap();
        if let Some(step) = v["step"].as_u64() {
            seen = step;
            if step >= until {
                break;
            }
        }
    }
    assert_eq!(seen, until, "the run ended before step {until}");
    std::thread::spawn(move || lines.for_each(drop));
    (child, seen)
}

/// A step in 2..=4 that differs from run to run (no random crate needed).
fn some_step() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    2 + u64::from(t ^ std::process::id()) % 3
}

const TINY: [&str; 5] = ["schedules/tiny_cpu.sched", "--lr", "1e-3", "--seed", "0"];

fn with<'a>(base: &[&'a str], more: &[&'a str]) -> Vec<&'a str> {
    base.iter().chain(more).copied().collect()
}

#[test]
fn an_unwritable_output_is_refused_before_the_first_step_and_nothing_is_written() {
    let dir = temp("unwritable");
    let a_file = dir.join("a file");
    std::fs::write(&a_file, b"x").unwrap();
    let init = dir.join("init.safetensors");
    let missing = dir.join("no such folder").join("x.safetensors");
    let under_file = a_file.join("x.json");
    let cases: Vec<(&str, PathBuf)> = vec![
        ("--save", missing.clone()),
        ("--trace", under_file.clone()),
        ("--save-init", missing.clone()),
        ("--checkpoints", a_file.join("ckpt")),
        ("--save", dir.clone()),
    ];
    for (flag, path) in &cases {
        let mut args = with(&TINY, &["--steps", "2", "--save-init", s(&init)]);
        if *flag == "--save-init" {
            args.truncate(args.len() - 2);
        }
        args.extend([*flag, s(path)]);
        let out = schedrun(&args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{flag}: {err}");
        assert!(err.contains(s(path)) && err.contains(flag), "{flag}: {err}");
        assert!(out.stdout.is_empty(), "{flag}: a step ran");
        assert!(!init.exists(), "{flag}: --save-init was written");
        assert!(!err.contains("step "), "{flag}: {err}");
    }
    // Nothing but the file this test made: no probe left behind.
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
    assert_eq!(left.len(), 1, "{left:?}");
}

/// SIGKILL at a step that changes from run to run, then `--resume DIR`: the weights and optimizer
/// state at the end are bit-identical to an uninterrupted run of the same length, resumed under
/// the same schedule (ZeRO-3) and under ZeRO-1 (the same global batch and reduction order); under
/// MiCS, whose hierarchical all-reduce sums in another order, within 1e-5 (`runtime.md`,
/// "Parity").
#[test]
fn a_run_killed_at_any_step_resumes_from_its_folder_bit_for_bit() {
    let dir = temp("killed");
    let ckpt = dir.join("ckpt");
    let kill_at = some_step();
    let (mut child, _) = start_until(
        &with(
            &TINY,
            &[
                "--steps",
                "100",
                "--checkpoints",
                s(&ckpt),
                "--save-every",
                "1",
            ],
        ),
        kill_at,
    );
    child.kill().unwrap();
    child.wait().unwrap();
    let have = entries(&ckpt);
    // The entry of the step last printed may be cut short by the kill; on a loaded machine the run
    // may have gone on a step or two before the kill landed.
    let from = *have.last().expect("a complete entry");
    assert!(
        from + 1 >= kill_at,
        "killed after step {kill_at}, newest entry {from}"
    );
    assert!(have.len() <= 3, "--keep defaults to 3: {have:?}");

    let steps = (from + 2).max(6);
    let straight = dir.join("straight.safetensors");
    let out = schedrun(&with(
        &TINY,
        &["--steps", &steps.to_string(), "--save", s(&straight)],
    ));
    assert!(out.status.success(), "{}", stderr(&out));
    let want = load(&straight);
    assert_eq!(want.step, steps);

    let others = [
        (vec![], true),
        (
            vec![
                "schedules/tiny_cpu_schedules.sched",
                "--schedule",
                "tiny_zero1",
            ],
            true,
        ),
        (
            vec![
                "schedules/tiny_cpu_schedules.sched",
                "--schedule",
                "tiny_mics2",
            ],
            false,
        ),
    ];
    for (other, exact) in &others {
        let mut args: Vec<&str> = if other.is_empty() {
            TINY.to_vec()
        } else {
            let mut a = other.clone();
            a.extend(&TINY[1..]);
            a
        };
        let end = dir.join("resumed.safetensors");
        let until = steps.to_string();
        args.extend([
            "--resume",
            s(&ckpt),
            "--until-step",
            &until,
            "--save",
            s(&end),
        ]);
        let out = schedrun(&args);
        assert!(out.status.success(), "{other:?}: {}", stderr(&out));
        let got = load(&end);
        assert_eq!(got.step, steps);
        let within = |a: &[f32], b: &[f32]| {
            a.len() == b.len()
                && a.iter()
                    .zip(b)
                    .all(|(x, y)| (x - y).abs() <= 1e-5 * (1.0 + y.abs()))
        };
        let same = if *exact {
            got == want
        } else {
            got.layers.iter().zip(&want.layers).all(|(g, w)| {
                within(&g.params, &w.params)
                    && within(&g.master, &w.master)
                    && within(&g.m, &w.m)
                    && within(&g.v, &w.v)
            })
        };
        assert!(
            same,
            "{other:?}: resumed from step {from} (killed after step {kill_at}), the final state \
             differs from the uninterrupted run's"
        );
    }
}

#[cfg(unix)]
fn signal(child: &Child, signal: i32) {
    // SAFETY: kill(2) on a child this test started and has not reaped.
    let r = unsafe { libc::kill(child.id() as libc::pid_t, signal) };
    assert_eq!(r, 0);
}

#[cfg(unix)]
#[test]
fn sigterm_stops_after_the_step_with_a_complete_checkpoint_and_exit_143() {
    let dir = temp("sigterm");
    let ckpt = dir.join("ckpt");
    let save = dir.join("last.safetensors");
    let (child, seen) = start_until(
        &with(
            &TINY,
            &[
                "--steps",
                "200",
                "--checkpoints",
                s(&ckpt),
                "--save",
                s(&save),
            ],
        ),
        2,
    );
    signal(&child, libc::SIGTERM);
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(143), "{err}");
    assert!(
        err.contains("SIGTERM") && err.contains("stopped after step"),
        "{err}"
    );
    let have = entries(&ckpt);
    assert_eq!(have.len(), 1, "{have:?}");
    let step = have[0];
    assert!(step >= seen && step < 200, "stopped at step {step}");
    let resolved = folder::resolve(&ckpt).unwrap();
    assert_eq!(load(&resolved.file), load(&save));
    assert_eq!(load(&save).step, step);

    // A second signal ends the run at once, mid-step: exit 130 for SIGINT, no checkpoint. The
    // stress mode's sleeps before every op make a step last long enough to send it in; signals
    // sent back to back could merge into one.
    let ckpt2 = dir.join("ckpt2");
    let (child, _) = start_until(
        &with(
            &TINY,
            &[
                "--steps",
                "200",
                "--checkpoints",
                s(&ckpt2),
                "--jitter",
                "100000",
            ],
        ),
        1,
    );
    // Step 2 takes about 0.8 s: both signals land in it.
    std::thread::sleep(std::time::Duration::from_millis(200));
    signal(&child, libc::SIGINT);
    std::thread::sleep(std::time::Duration::from_millis(50));
    signal(&child, libc::SIGINT);
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", stderr(&out));
    assert!(
        !ckpt2.exists() || entries(&ckpt2).is_empty(),
        "{:?}",
        entries(&ckpt2)
    );
}

#[test]
fn a_damaged_checkpoint_folder_is_refused_naming_what_is_missing() {
    let dir = temp("damaged");
    let ckpt = dir.join("ckpt");
    let out = schedrun(&with(
        &TINY,
        &[
            "--steps",
            "4",
            "--checkpoints",
            s(&ckpt),
            "--save-every",
            "1",
            "--keep",
            "2",
        ],
    ));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(entries(&ckpt), [3, 4], "--keep 2 keeps the newest two");
    let newest = ckpt.join("step-00000004");
    let state = newest.join(folder::STATE);
    let bytes = std::fs::read(&state).unwrap();
    let resume = |what: &Path| schedrun(&with(&TINY, &["--steps", "1", "--resume", s(what)]));

    // Truncated: refused, naming the entry and the file.
    std::fs::write(&state, &bytes[..bytes.len() / 2]).unwrap();
    let out = resume(&ckpt);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("step-00000004")
            && err.contains("state.safetensors")
            && err.contains("truncated"),
        "{err}"
    );
    assert!(out.stdout.is_empty());

    // Altered in place (same size): refused by the hash.
    let mut flipped = bytes.clone();
    let at = flipped.len() - 7;
    flipped[at] ^= 1;
    std::fs::write(&state, &flipped).unwrap();
    let err = stderr(&resume(&ckpt));
    assert!(
        err.contains("state.safetensors") && err.contains("damaged"),
        "{err}"
    );

    // Missing.
    std::fs::remove_file(&state).unwrap();
    let out = resume(&newest);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("`state.safetensors` is missing"), "{err}");

    // No manifest (a write cut short): resuming the folder skips the entry for the previous one;
    // naming the entry itself is refused.
    std::fs::write(&state, &bytes).unwrap();
    std::fs::remove_file(newest.join(folder::MANIFEST)).unwrap();
    let out = resume(&newest);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("manifest.json is missing"), "{err}");
    let out = resume(&ckpt);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("skipping") && err.contains("step-00000004"),
        "{err}"
    );
    assert!(err.contains("step-00000003"), "{err}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("step     4"));

    // Resumed from entry 3 into the same folder, step 4 is written again: the cut-short entry is
    // replaced by a complete one and no hidden leftover stays.
    let out = schedrun(&with(
        &TINY,
        &[
            "--steps",
            "1",
            "--resume",
            s(&ckpt.join("step-00000003")),
            "--checkpoints",
            s(&ckpt),
        ],
    ));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(entries(&ckpt), [3, 4]);
    assert_eq!(std::fs::read_dir(&ckpt).unwrap().count(), 2);
    assert_eq!(load(&folder::resolve(&ckpt).unwrap().file).step, 4);
}

#[test]
fn a_nan_loss_stops_the_run_at_its_step_and_keeps_the_last_good_checkpoint() {
    let dir = temp("nan");
    let ckpt = dir.join("ckpt");
    let save = dir.join("final.safetensors");
    let out = schedrun(&with(
        &TINY,
        &[
            "--steps",
            "5",
            "--checkpoints",
            s(&ckpt),
            "--save-every",
            "1",
            "--save",
            s(&save),
            "--inject-nan",
            "3",
            "--json",
        ],
    ));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("step 3: the loss is NaN"), "{err}");
    // The poisoned weight (block[0]'s) spoils every gradient; the head's shows it first.
    assert!(
        err.contains("non-finite gradients in head, block[1], block[0], embed (backward order)"),
        "names the layers: {err}"
    );
    assert!(
        err.contains("step-00000002"),
        "names the last good checkpoint: {err}"
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 2);
    assert_eq!(entries(&ckpt), [1, 2]);
    assert!(!save.exists());
    let last = load(&folder::resolve(&ckpt).unwrap().file);
    assert!(last
        .layers
        .iter()
        .all(|l| l.params.iter().all(|x| x.is_finite())));
}

/// `train { checkpoints, save_every, keep }` in the schedule: the folder relative to the file,
/// the flags overriding the keys.
#[test]
fn the_schedule_s_train_keys_set_the_checkpoints() {
    let dir = temp("keys");
    let file = dir.join("job.sched");
    let schedules = root().join("schedules");
    std::fs::write(
        &file,
        format!(
            "import \"{}/models/tiny.sched\"\nimport \"{}/clusters/cpu.sched\"\n\n\
             schedule tiny_keys {{\n    model   = tiny_gpt\n    cluster = cpu4\n    \
             preset  = zero3\n    train {{ steps = 5  lr = 1e-3  seed = 0  checkpoints = \"ck\"  \
             save_every = 2  keep = 2 }}\n}}\n",
            schedules.display(),
            schedules.display()
        ),
    )
    .unwrap();
    let out = schedrun(&[s(&file)]);
    assert!(out.status.success(), "{}", stderr(&out));
    // Steps 2 and 4 by the cadence, 5 at the end; the newest two kept.
    assert_eq!(entries(&dir.join("ck")), [4, 5]);

    let out = schedrun(&[
        s(&file),
        "--save-every",
        "1",
        "--keep",
        "4",
        "--resume",
        s(&dir.join("ck")),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(entries(&dir.join("ck")), [7, 8, 9, 10]);

    // --save-every without a folder anywhere is refused.
    let out = schedrun(&with(&TINY, &["--steps", "1", "--save-every", "2"]));
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("--checkpoints"), "{}", stderr(&out));
}

/// With clipping, a gradient that goes non-finite while the loss stays finite (`--inject-nan
/// STEP:grad` puts a NaN into block[0]'s gradient during the step) stops the run at that very
/// step through the gradient norm, naming the step and the layer; no entry or `--save` file holds
/// the spoilt update.
#[test]
fn a_non_finite_gradient_norm_with_a_finite_loss_stops_the_run_at_its_step() {
    let dir = temp("norm");
    let ckpt = dir.join("ckpt");
    let save = dir.join("final.safetensors");
    let out = schedrun(&[
        "schedules/tiny_cpu_schedules.sched",
        "--schedule",
        "tiny_zero3_clip",
        "--steps",
        "5",
        "--checkpoints",
        s(&ckpt),
        "--save-every",
        "1",
        "--save",
        s(&save),
        "--inject-nan",
        "3:grad",
        "--json",
    ]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("step 3: the gradient norm is NaN with a finite loss ("),
        "{err}"
    );
    assert!(
        err.contains("non-finite gradients in block[0] (backward order)"),
        "names the one layer: {err}"
    );
    assert!(err.contains("step-00000002"), "the last good entry: {err}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 2);
    assert_eq!(entries(&ckpt), [1, 2]);
    assert!(!save.exists());
    let last = load(&folder::resolve(&ckpt).unwrap().file);
    assert_eq!(last.step, 2);
    assert!(last.non_finite_layers().is_empty());

    // The hook's argument is checked.
    let out = schedrun(&with(&TINY, &["--steps", "1", "--inject-nan", "3:loss"]));
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}

/// Without clipping no norm is computed: a non-finite gradient with a finite loss spoils the
/// update unseen, and the checkpoint due after that step is refused instead of written (exit 1,
/// naming the step and the layer), so no entry ever holds non-finite state.
#[test]
fn a_non_finite_state_is_never_checkpointed() {
    let dir = temp("state");
    let ckpt = dir.join("ckpt");
    let out = schedrun(&with(
        &TINY,
        &[
            "--steps",
            "5",
            "--checkpoints",
            s(&ckpt),
            "--save-every",
            "1",
            "--inject-nan",
            "3:grad",
            "--json",
        ],
    ));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(
            "step 3: the weights or optimizer state after this step hold non-finite values in \
             block[0]"
        ),
        "{err}"
    );
    assert!(err.contains("step-00000002"), "the last good entry: {err}");
    assert_eq!(entries(&ckpt), [1, 2]);
}

/// A small state of `model` whose every value differs: what the shard tests write.
fn numbered_state(model: &sched_ir::job::Model, step: u64) -> State {
    let mut k = 0.0f32;
    let mut next = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                k += 1.0;
                k * 1e-3
            })
            .collect()
    };
    State {
        layers: model
            .layers
            .iter()
            .map(|l| {
                let n = l.params as usize;
                let master = next(n);
                schedrun::train::LayerState {
                    params: master.clone(),
                    master,
                    m: next(n),
                    v: next(n),
                }
            })
            .collect(),
        step,
    }
}

/// `state` cut into `world` equal shards of each layer (padded to a multiple of `world`), rank
/// `r` holding the `r`-th, as ZeRO's optimizer sharding does.
fn shards_of(state: &State, world: u32) -> Vec<checkpoint::shards::RankShard> {
    (0..world)
        .map(|rank| checkpoint::shards::RankShard {
            rank,
            layers: state
                .layers
                .iter()
                .enumerate()
                .map(|(layer, l)| {
                    let n = l.master.len();
                    let padded = n.div_ceil(world as usize) * world as usize;
                    let os = padded / world as usize;
                    let first = rank as usize * os;
                    let slice = |v: &[f32]| -> Vec<f32> {
                        (first..first + os)
                            .map(|i| v.get(i).copied().unwrap_or(0.0))
                            .collect()
                    };
                    checkpoint::shards::LayerShard {
                        layer,
                        first,
                        padded,
                        master: slice(&l.master),
                        m: slice(&l.m),
                        v: slice(&l.v),
                    }
                })
                .collect(),
        })
        .collect()
}

/// The sharded entry format on its own: four ranks (threads) write their shards at once, one
/// places the entry after all have; until then no entry is visible. The entry loads back to the
/// state; a rank that did not write is refused by name at placing; a missing or truncated shard
/// and a missing manifest are refused at resuming, naming the file.
#[test]
fn sharded_entries_written_by_several_ranks_load_whole_and_refuse_damage() {
    let dir = temp("shards");
    let ckpt = dir.join("ckpt");
    let model = tiny_gpt();
    let state = numbered_state(&model, 7);
    let shards = shards_of(&state, 4);
    let barrier = std::sync::Barrier::new(4);
    std::thread::scope(|scope| {
        for shard in &shards {
            let (ckpt, model, barrier) = (&ckpt, &model, &barrier);
            scope.spawn(move || {
                checkpoint::shards::write_rank(ckpt, model, 7, 4, shard).unwrap();
                barrier.wait();
            });
        }
    });
    // Written but not placed: the hidden pending folder is no entry.
    let err = folder::resolve(&ckpt)
        .err()
        .expect("no entry yet")
        .to_string();
    assert!(err.contains("no complete checkpoint entry"), "{err}");
    let entry = checkpoint::shards::finish(&ckpt, &model, 7, 4, 3).unwrap();
    assert_eq!(entry, ckpt.join("step-00000007"));
    let mut names: Vec<String> = std::fs::read_dir(&entry)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "manifest.json",
            "rank-00000.safetensors",
            "rank-00001.safetensors",
            "rank-00002.safetensors",
            "rank-00003.safetensors"
        ]
    );
    let resolved = folder::resolve(&ckpt).unwrap();
    assert_eq!(resolved.file, entry);
    assert_eq!(folder::load(&resolved.file, &model).unwrap(), state);

    // A rank that never wrote: placing is refused naming it, and nothing is placed.
    for shard in &shards[..3] {
        checkpoint::shards::write_rank(&ckpt, &model, 8, 4, shard).unwrap();
    }
    let err = checkpoint::shards::finish(&ckpt, &model, 8, 4, 3)
        .unwrap_err()
        .to_string();
    assert!(err.contains("rank 3 has not written its shard"), "{err}");
    assert_eq!(entries(&ckpt), [7]);

    let refused = |what: &Path| folder::resolve(what).err().map(|e| e.to_string());
    let shard1 = entry.join("rank-00001.safetensors");
    let bytes = std::fs::read(&shard1).unwrap();
    std::fs::write(&shard1, &bytes[..bytes.len() - 100]).unwrap();
    let err = refused(&ckpt).expect("a truncated shard is refused");
    assert!(
        err.contains("step-00000007")
            && err.contains("rank-00001.safetensors")
            && err.contains("truncated"),
        "{err}"
    );
    std::fs::write(&shard1, &bytes).unwrap();
    std::fs::remove_file(entry.join("rank-00002.safetensors")).unwrap();
    let err = refused(&ckpt).expect("a missing shard is refused");
    assert!(err.contains("`rank-00002.safetensors` is missing"), "{err}");
    std::fs::remove_file(entry.join(folder::MANIFEST)).unwrap();
    let err = refused(&entry).expect("an entry without its manifest is refused");
    assert!(
        err.contains("manifest.json is missing")
            && err
                .contains("rank-00000.safetensors, rank-00001.safetensors, rank-00003.safetensors"),
        "{err}"
    );
}

/// The sharded entries end to end (`--shard-checkpoints` makes the CPU backend write them as
/// several CUDA processes do, each rank its shard): resumed from its folder under another
/// schedule with another sharding, a run ends bit-identical to an uninterrupted one; a removed
/// shard is refused by `--resume` naming it.
#[test]
fn sharded_checkpoints_resume_under_another_schedule_bit_for_bit() {
    let dir = temp("sharded-run");
    let ckpt = dir.join("ckpt");
    let out = schedrun(&with(
        &TINY,
        &[
            "--steps",
            "3",
            "--checkpoints",
            s(&ckpt),
            "--save-every",
            "2",
            "--shard-checkpoints",
        ],
    ));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(entries(&ckpt), [2, 3]);
    assert!(ckpt.join("step-00000003/rank-00003.safetensors").exists());
    assert!(!ckpt.join("step-00000003").join(folder::STATE).exists());

    let straight = dir.join("straight.safetensors");
    let out = schedrun(&with(&TINY, &["--steps", "5", "--save", s(&straight)]));
    assert!(out.status.success(), "{}", stderr(&out));
    let end = dir.join("end.safetensors");
    let mut args = vec![
        "schedules/tiny_cpu_schedules.sched",
        "--schedule",
        "tiny_zero1",
    ];
    args.extend(&TINY[1..]);
    args.extend(["--resume", s(&ckpt), "--until-step", "5", "--save", s(&end)]);
    let out = schedrun(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("step-00000003"), "{}", stderr(&out));
    assert_eq!(load(&end), load(&straight));

    std::fs::remove_file(ckpt.join("step-00000003/rank-00002.safetensors")).unwrap();
    let out = schedrun(&with(&TINY, &["--steps", "1", "--resume", s(&ckpt)]));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("step-00000003") && err.contains("`rank-00002.safetensors` is missing"),
        "{err}"
    );
}

/// Whatever the sharding, a sharded entry holds exactly the state a whole one does: under
/// replicas (DDP, HSDP, MiCS, AMSP: each slice written once), pipeline stages and a tied head's
/// replica of the embedding on another stage, the entry written by `--shard-checkpoints` loads
/// to the `--save` file of the same step, bit for bit.
#[test]
fn sharded_entries_hold_the_whole_state_under_every_sharding() {
    let dir = temp("every-sharding");
    let cases = [
        ("schedules/tiny_cpu_schedules.sched", "tiny_ddp"),
        ("schedules/tiny_cpu_schedules.sched", "tiny_hsdp"),
        ("schedules/tiny_cpu_schedules.sched", "tiny_mics2"),
        ("schedules/tiny_cpu_schedules.sched", "tiny_amsp"),
        ("schedules/tiny_pipeline.sched", "tiny_1f1b"),
        (
            "schedules/tiny_pipeline_schedules.sched",
            "tiny_gpt_tied_interleaved_zero3",
        ),
    ];
    for (file, schedule) in cases {
        let ckpt = dir.join(schedule);
        let save = dir.join(format!("{schedule}.safetensors"));
        let out = schedrun(&[
            file,
            "--schedule",
            schedule,
            "--steps",
            "2",
            "--checkpoints",
            s(&ckpt),
            "--shard-checkpoints",
            "--save",
            s(&save),
        ]);
        assert!(out.status.success(), "{schedule}: {}", stderr(&out));
        let model = analyze(&root().join(file), &FsLoader)
            .unwrap()
            .jobs
            .into_iter()
            .find(|j| j.schedule.name == schedule)
            .unwrap()
            .model;
        let entry = folder::resolve(&ckpt).unwrap().file;
        assert!(entry.is_dir(), "{schedule}: a sharded entry");
        let whole = checkpoint::load(&save, &model, Contents::Checkpoint).unwrap();
        assert_eq!(whole.step, 2);
        assert!(
            folder::load(&entry, &model).unwrap() == whole,
            "{schedule}: the sharded entry differs from the whole state"
        );
    }
}
