//! Processes of a CUDA run: which rank this process is, and the local launcher.
//!
//! Under an external launcher (torchrun, Slurm, mpirun wrappers) the environment says who this
//! process is: `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (the GPU to use), `MASTER_ADDR`,
//! `MASTER_PORT`, with Slurm's `SLURM_PROCID`, `SLURM_NTASKS` and `SLURM_LOCALID` as fallbacks.
//! Without them `schedrun --backend cuda` is the launcher: it starts `--nproc-per-node` copies of
//! itself with that environment set (master on loopback, a free port), waits for them, and when
//! one fails stops the others and exits naming the rank.

use std::process::{Child, Command, ExitStatus};
use std::time::Duration;

/// torchrun's default master port.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Who this process is in a multi-process run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistEnv {
    pub rank: u32,
    pub world: u32,
    /// The GPU ordinal this process drives.
    pub local_rank: u32,
    pub master_addr: String,
    pub master_port: u16,
}

impl DistEnv {
    /// The `host:port` the rendezvous listens on.
    pub fn master(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }

    /// Reads the environment of this process.
    pub fn from_env() -> Result<Option<DistEnv>, EnvError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Reads a launcher's variables through `var`: `None` when no rank is set (this process is
    /// then the launcher), an error naming the variable when one is malformed or half set.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<DistEnv>, EnvError> {
        let pick = |names: &[&str]| -> Option<(String, String)> {
            names
                .iter()
                .find_map(|n| var(n).filter(|v| !v.is_empty()).map(|v| (n.to_string(), v)))
        };
        let number = |(name, value): (String, String)| -> Result<u32, EnvError> {
            value
                .trim()
                .parse::<u32>()
                .map_err(|_| EnvError::NotANumber { name, value })
        };
        let rank = pick(&["RANK", "SLURM_PROCID"]);
        let world = pick(&["WORLD_SIZE", "SLURM_NTASKS"]);
        let (rank, world) = match (rank, world) {
            (None, None) => return Ok(None),
            (Some(r), Some(w)) => (number(r)?, number(w)?),
            (Some((set, _)), None) => {
                return Err(EnvError::HalfSet {
                    set,
                    unset: "WORLD_SIZE",
                })
            }
            (None, Some((set, _))) => return Err(EnvError::HalfSet { set, unset: "RANK" }),
        };
        if world == 0 || rank >= world {
            return Err(EnvError::RankPastWorld { rank, world });
        }
        let local_rank = match pick(&["LOCAL_RANK", "SLURM_LOCALID"]) {
            Some(v) => number(v)?,
            None => rank,
        };
        let master_addr = match pick(&["MASTER_ADDR"]) {
            Some((_, v)) => v,
            None if world == 1 => "127.0.0.1".to_string(),
            None => return Err(EnvError::NoMasterAddr { world }),
        };
        let master_port = match pick(&["MASTER_PORT"]) {
            Some((n, v)) => v
                .trim()
                .parse::<u16>()
                .map_err(|_| EnvError::NotAPort { name: n, value: v })?,
            None => DEFAULT_MASTER_PORT,
        };
        Ok(Some(DistEnv {
            rank,
            world,
            local_rank,
            master_addr,
            master_port,
        }))
    }

    /// The variables a launched child gets.
    pub fn vars(&self) -> Vec<(&'static str, String)> {
        vec![
            ("RANK", self.rank.to_string()),
            ("WORLD_SIZE", self.world.to_string()),
            ("LOCAL_RANK", self.local_rank.to_string()),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
        ]
    }
}

/// What is wrong with a launcher's variables (the user's to fix: exit 1).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    #[error("{name}={value:?} is not a whole number")]
    NotANumber { name: String, value: String },
    #[error("{name}={value:?} is not a port number")]
    NotAPort { name: String, value: String },
    #[error("{set} is set but {unset} is not")]
    HalfSet { set: String, unset: &'static str },
    #[error("RANK={rank} is not below WORLD_SIZE={world}")]
    RankPastWorld { rank: u32, world: u32 },
    #[error("MASTER_ADDR is not set (WORLD_SIZE={world})")]
    NoMasterAddr { world: u32 },
}

/// No free loopback port for a local run's rendezvous.
#[derive(Debug, thiserror::Error)]
#[error("cannot find a free port for the rendezvous: {0}")]
pub struct NoFreePort(#[source] std::io::Error);

/// A free loopback port for a local run's rendezvous (bound, read, released).
pub fn free_port() -> Result<u16, NoFreePort> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(NoFreePort)
}

/// The environments of `nproc` ranks on this machine.
pub fn local_envs(nproc: u32, port: u16) -> Vec<DistEnv> {
    (0..nproc)
        .map(|r| DistEnv {
            rank: r,
            world: nproc,
            local_rank: r,
            master_addr: "127.0.0.1".into(),
            master_port: port,
        })
        .collect()
}

/// Why a launched run failed.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct LaunchError {
    /// The first rank that failed, when one did.
    pub rank: Option<u32>,
    pub message: String,
}

fn describe(s: ExitStatus) -> String {
    match s.code() {
        Some(c) => format!("exit status {c}"),
        None => format!("{s}"),
    }
}

/// Starts one process per command (command `i` is rank `i`) and waits for all of them. When one
/// exits unsuccessfully, the others are killed (they would wait for it until their timeouts) and
/// the error names the first rank that failed.
pub fn run_ranks(commands: Vec<Command>) -> Result<(), LaunchError> {
    let mut children: Vec<Option<Child>> = vec![];
    for (rank, mut c) in commands.into_iter().enumerate() {
        match c.spawn() {
            Ok(ch) => children.push(Some(ch)),
            Err(e) => {
                stop(&mut children);
                return Err(LaunchError {
                    rank: Some(rank as u32),
                    message: format!("cannot start rank {rank}: {e}"),
                });
            }
        }
    }
    loop {
        let mut running = 0;
        for rank in 0..children.len() {
            let Some(ch) = children[rank].as_mut() else {
                continue;
            };
            match ch.try_wait() {
                Ok(Some(s)) if s.success() => children[rank] = None,
                Ok(Some(s)) => {
                    children[rank] = None;
                    stop(&mut children);
                    return Err(LaunchError {
                        rank: Some(rank as u32),
                        message: format!(
                            "rank {rank} failed ({}); stopped the other ranks",
                            describe(s)
                        ),
                    });
                }
                Ok(None) => running += 1,
                Err(e) => {
                    stop(&mut children);
                    return Err(LaunchError {
                        rank: Some(rank as u32),
                        message: format!("cannot wait for rank {rank}: {e}"),
                    });
                }
            }
        }
        if running == 0 {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Kills and reaps the children still running (only the processes this launcher started).
fn stop(children: &mut [Option<Child>]) {
    for ch in children.iter_mut().flatten() {
        let _ = ch.kill();
        let _ = ch.wait();
    }
}

#[cfg(test)]
#[path = "../../../tests/unit/backend_cuda_launch.rs"]
mod tests;
