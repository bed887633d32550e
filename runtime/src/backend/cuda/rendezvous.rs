//! The start-up rendezvous of a multi-process run: a small TCP exchange on the master (rank 0).
//!
//! Every rank connects to `MASTER_ADDR:MASTER_PORT` (retrying until the timeout, since the master
//! may start later) and sends one line, `hello RANK WORLD PLAN_HASH`. The master waits for every
//! other rank, then checks that all world sizes agree, that each rank came exactly once, and that
//! every rank holds the same plan (by hash). On success it sends each rank `ok N` followed by N
//! lines `COMM GROUP STREAM HEX_ID`: the NCCL unique id of every communicator the plan needs
//! (one per communicator group and stream, [`CommKey`]), so the members of a group build their
//! communicator from the same id. On failure it sends `error MESSAGE` to every rank that came,
//! and every rank reports the same one line, naming the ranks at fault. Nothing here blocks
//! longer than the timeout: a missing rank makes the master (and through it everyone else) fail
//! with its number.
//!
//! Plain `std::net`, no async runtime; the ids are opaque bytes produced by the caller (NCCL's
//! `ncclGetUniqueId` in the CUDA backend, anything in tests).

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// One NCCL communicator a rank needs: the plan's communicator `comm`, its group `group`, used on
/// the streams of role `stream` ([`super::comm_stream`]). cudarc binds a communicator to one
/// stream, so a communicator group used on two streams needs two NCCL communicators, each with
/// its own unique id. The role, not the stream's id, names it: a pipeline's stages have streams
/// of their own, and a transfer's two ends issue it on their stages' streams of one role, which
/// must share the communicator (a rank has one stream of each role).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CommKey {
    pub comm: u32,
    pub group: u32,
    pub stream: u32,
}

/// Bytes of an NCCL unique id (`ncclUniqueId`).
pub const ID_BYTES: usize = 128;

/// What one rank brings to the rendezvous.
#[derive(Clone, Debug)]
pub struct Hello {
    pub rank: u32,
    pub world: u32,
    pub plan_hash: u64,
}

/// Why the rendezvous failed; the message is one line naming the ranks at fault (the same line
/// every rank that came hears).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RendezvousError(pub String);

fn err(m: impl Into<String>) -> RendezvousError {
    RendezvousError(m.into())
}

/// The ids every rank receives, in [`CommKey`] order.
pub type Ids = Vec<(CommKey, [u8; ID_BYTES])>;

/// FNV-1a over `bytes`: the plan hash (stable across builds and machines, unlike `DefaultHasher`).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The master's side: `me` is rank 0's hello; waits on `listener` for the other `world − 1`
/// ranks, checks them, makes one id per key with `make_id`, and sends the table to everyone.
pub fn serve<E: std::fmt::Display>(
    listener: TcpListener,
    me: &Hello,
    keys: &[CommKey],
    timeout: Duration,
    mut make_id: impl FnMut(&CommKey) -> Result<[u8; ID_BYTES], E>,
) -> Result<Ids, RendezvousError> {
    let start = Instant::now();
    listener
        .set_nonblocking(true)
        .map_err(|e| err(format!("rendezvous: cannot poll the listener: {e}")))?;
    let mut peers: Vec<(Hello, TcpStream)> = vec![];
    let mut bad: Vec<String> = vec![];
    while peers.len() + 1 < me.world as usize && start.elapsed() <= timeout {
        match listener.accept() {
            Ok((s, _)) => match read_hello(s, timeout.saturating_sub(start.elapsed())) {
                Ok(p) => peers.push(p),
                Err(m) => bad.push(m.0),
            },
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(err(format!("rendezvous: accept failed: {e}"))),
        }
    }
    // Disagreements first (they explain a missing rank better than the absence does), then
    // absences; everyone who came hears the same line.
    let problem = check(me, &peers, &bad).or_else(|| {
        let mut seen = vec![false; me.world as usize];
        seen[0] = true;
        for (h, _) in &peers {
            seen[h.rank as usize] = true;
        }
        let missing: Vec<String> = (0..me.world)
            .filter(|r| !seen[*r as usize])
            .map(|r| r.to_string())
            .collect();
        (!missing.is_empty()).then(|| {
            format!(
                "rendezvous: rank(s) {} of {} never joined within {timeout:?}",
                missing.join(", "),
                me.world
            )
        })
    });
    if let Some(m) = problem {
        tell(&mut peers, &format!("error {m}"));
        return Err(err(m));
    }
    let mut ids = vec![];
    for k in keys {
        match make_id(k) {
            Ok(id) => ids.push((*k, id)),
            Err(e) => {
                let m = format!("rendezvous: rank 0 cannot make the NCCL id of {k:?}: {e}");
                tell(&mut peers, &format!("error {m}"));
                return Err(err(m));
            }
        }
    }
    let mut table = format!("ok {}\n", ids.len());
    for (k, id) in &ids {
        table += &format!("{} {} {} {}\n", k.comm, k.group, k.stream, hex(id));
    }
    for (h, s) in &mut peers {
        s.write_all(table.as_bytes())
            .and_then(|()| s.flush())
            .map_err(|e| {
                err(format!(
                    "rendezvous: cannot send the ids to rank {}: {e}",
                    h.rank
                ))
            })?;
    }
    Ok(ids)
}

/// The first problem among the hellos that came, if any (ranks that did not come are the
/// caller's to name).
fn check(me: &Hello, peers: &[(Hello, TcpStream)], bad: &[String]) -> Option<String> {
    if let Some(b) = bad.first() {
        return Some(b.clone());
    }
    let wrong_world: Vec<String> = peers
        .iter()
        .filter(|(h, _)| h.world != me.world)
        .map(|(h, _)| format!("rank {} says {}", h.rank, h.world))
        .collect();
    if !wrong_world.is_empty() {
        return Some(format!(
            "rendezvous: world sizes disagree: rank 0 says {}, {}",
            me.world,
            wrong_world.join(", ")
        ));
    }
    let mut seen = vec![0u32; me.world as usize];
    seen[0] = 1;
    for (h, _) in peers {
        match seen.get_mut(h.rank as usize) {
            Some(n) => *n += 1,
            None => {
                return Some(format!(
                    "rendezvous: rank {} is outside a world of {}",
                    h.rank, me.world
                ))
            }
        }
    }
    if let Some(r) = seen.iter().position(|&n| n > 1) {
        return Some(format!("rendezvous: rank {r} joined more than once"));
    }
    let differ: Vec<String> = peers
        .iter()
        .filter(|(h, _)| h.plan_hash != me.plan_hash)
        .map(|(h, _)| format!("{} ({:016x})", h.rank, h.plan_hash))
        .collect();
    if !differ.is_empty() {
        return Some(format!(
            "rendezvous: rank(s) {} hold a different plan from rank 0 ({:016x}); every rank must run the same plan",
            differ.join(", "),
            me.plan_hash
        ));
    }
    None
}

fn tell(peers: &mut [(Hello, TcpStream)], line: &str) {
    for (_, s) in peers {
        let _ = s.write_all(format!("{line}\n").as_bytes());
        let _ = s.flush();
    }
}

fn read_hello(s: TcpStream, timeout: Duration) -> Result<(Hello, TcpStream), RendezvousError> {
    let _ = s.set_nonblocking(false);
    let _ = s.set_read_timeout(Some(timeout.max(Duration::from_millis(100))));
    let mut line = String::new();
    let mut r = BufReader::new(
        s.try_clone()
            .map_err(|e| err(format!("rendezvous: a peer's socket: {e}")))?,
    );
    r.read_line(&mut line).map_err(|e| {
        err(format!(
            "rendezvous: a rank connected but sent no hello: {e}"
        ))
    })?;
    let f: Vec<&str> = line.split_whitespace().collect();
    let parsed = match f.as_slice() {
        ["hello", rank, world, hash] => (|| {
            Some(Hello {
                rank: rank.parse().ok()?,
                world: world.parse().ok()?,
                plan_hash: u64::from_str_radix(hash, 16).ok()?,
            })
        })(),
        _ => None,
    };
    let h = parsed.ok_or_else(|| {
        err(format!(
            "rendezvous: a peer sent a malformed hello: {line:?}"
        ))
    })?;
    Ok((h, s))
}

/// A worker's side: connects to `addr` (retrying until `timeout`), says hello, and waits for the
/// master's answer (at most `timeout` again, since the master waits that long for the others).
pub fn join(addr: &str, me: &Hello, timeout: Duration) -> Result<Ids, RendezvousError> {
    let start = Instant::now();
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| {
            err(format!(
                "rendezvous: cannot resolve master address {addr}: {e}"
            ))
        })?
        .collect();
    let mut s = loop {
        let attempt = addrs
            .iter()
            .find_map(|a| TcpStream::connect_timeout(a, Duration::from_millis(500)).ok());
        if let Some(s) = attempt {
            break s;
        }
        if start.elapsed() > timeout {
            return Err(err(format!(
                "rendezvous: rank {} could not reach the master at {addr} within {timeout:?}",
                me.rank
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let hello = format!("hello {} {} {:016x}\n", me.rank, me.world, me.plan_hash);
    s.write_all(hello.as_bytes()).map_err(|e| {
        err(format!(
            "rendezvous: rank {} cannot talk to the master: {e}",
            me.rank
        ))
    })?;
    let _ = s.set_read_timeout(Some(timeout + Duration::from_secs(1)));
    let mut r = BufReader::new(s);
    let mut line = String::new();
    let lost = |e: &dyn std::fmt::Display| {
        err(format!(
            "rendezvous: rank {} got no answer from the master at {addr}: {e}",
            me.rank
        ))
    };
    r.read_line(&mut line).map_err(|e| lost(&e))?;
    if line.is_empty() {
        return Err(lost(&"it closed the connection"));
    }
    if let Some(m) = line.strip_prefix("error ") {
        return Err(err(m.trim_end()));
    }
    let n: usize = line
        .strip_prefix("ok ")
        .and_then(|n| n.trim().parse().ok())
        .ok_or_else(|| lost(&format!("malformed answer {line:?}")))?;
    let mut ids = Vec::with_capacity(n);
    for _ in 0..n {
        let mut l = String::new();
        r.read_line(&mut l).map_err(|e| lost(&e))?;
        let f: Vec<&str> = l.split_whitespace().collect();
        let entry = match f.as_slice() {
            [c, g, st, id] => (|| {
                Some((
                    CommKey {
                        comm: c.parse().ok()?,
                        group: g.parse().ok()?,
                        stream: st.parse().ok()?,
                    },
                    unhex(id)?,
                ))
            })(),
            _ => None,
        };
        ids.push(entry.ok_or_else(|| lost(&format!("malformed id line {l:?}")))?);
    }
    Ok(ids)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<[u8; ID_BYTES]> {
    if s.len() != 2 * ID_BYTES {
        return None;
    }
    let mut out = [0u8; ID_BYTES];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
#[path = "../../../tests/unit/backend_cuda_rendezvous.rs"]
mod tests;
