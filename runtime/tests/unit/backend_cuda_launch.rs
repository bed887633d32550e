//! Unit tests of `backend::cuda::launch` (a child module of it: they reach its private items).

use super::*;
use std::collections::HashMap;

fn env(pairs: &[(&str, &str)]) -> Result<Option<DistEnv>, String> {
    let m: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    DistEnv::from_vars(|k| m.get(k).cloned()).map_err(|e| e.to_string())
}

#[test]
fn torchrun_variables() {
    let e = env(&[
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "1234"),
    ])
    .unwrap()
    .unwrap();
    assert_eq!(
        e,
        DistEnv {
            rank: 3,
            world: 8,
            local_rank: 1,
            master_addr: "node0".into(),
            master_port: 1234
        }
    );
    assert_eq!(e.master(), "node0:1234");
}

#[test]
fn slurm_fallbacks_and_defaults() {
    let e = env(&[
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "16"),
        ("SLURM_LOCALID", "5"),
        ("MASTER_ADDR", "10.0.0.1"),
    ])
    .unwrap()
    .unwrap();
    assert_eq!((e.rank, e.world, e.local_rank), (5, 16, 5));
    assert_eq!(e.master_port, DEFAULT_MASTER_PORT);
    let single = env(&[("RANK", "0"), ("WORLD_SIZE", "1")]).unwrap().unwrap();
    assert_eq!(single.master(), "127.0.0.1:29500");
    assert_eq!(single.local_rank, 0);
}

#[test]
fn no_rank_means_launcher() {
    assert_eq!(env(&[("MASTER_PORT", "1")]).unwrap(), None);
}

#[test]
fn malformed_variables_are_named() {
    let e = env(&[("RANK", "x"), ("WORLD_SIZE", "2")]).unwrap_err();
    assert!(e.contains("RANK=\"x\""), "{e}");
    let e = env(&[("RANK", "1")]).unwrap_err();
    assert!(e.contains("WORLD_SIZE is not"), "{e}");
    let e = env(&[("RANK", "2"), ("WORLD_SIZE", "2")]).unwrap_err();
    assert!(e.contains("not below"), "{e}");
    let e = env(&[("RANK", "1"), ("WORLD_SIZE", "2")]).unwrap_err();
    assert!(e.contains("MASTER_ADDR"), "{e}");
    let e = env(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "a"),
        ("MASTER_PORT", "99999"),
    ])
    .unwrap_err();
    assert!(e.contains("port"), "{e}");
}

#[test]
fn child_variables_round_trip() {
    let envs = local_envs(3, 4000);
    let back = DistEnv::from_vars(|k| {
        envs[2]
            .vars()
            .into_iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v)
    })
    .unwrap()
    .unwrap();
    assert_eq!(back, envs[2]);
}

fn sh(script: &str) -> Command {
    let mut c = Command::new("sh");
    c.args(["-c", script]);
    c
}

#[test]
fn all_ranks_succeeding_is_success() {
    assert_eq!(run_ranks(vec![sh("exit 0"), sh("exit 0")]), Ok(()));
}

#[test]
fn a_failing_rank_stops_the_others_and_is_named() {
    let t = std::time::Instant::now();
    let e = run_ranks(vec![sh("sleep 30"), sh("exit 3"), sh("sleep 30")]).unwrap_err();
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "the sleepers were stopped"
    );
    assert_eq!(e.rank, Some(1));
    assert!(
        e.message.contains("rank 1 failed (exit status 3)"),
        "{}",
        e.message
    );
}

#[test]
fn a_missing_program_is_named() {
    let e = run_ranks(vec![Command::new("/nonexistent/schedrun-x")]).unwrap_err();
    assert_eq!(e.rank, Some(0));
}
