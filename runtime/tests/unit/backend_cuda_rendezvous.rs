//! Unit tests of `backend::cuda::rendezvous` (a child module of it: they reach its private items).

use super::*;

fn keys() -> Vec<CommKey> {
    vec![
        CommKey {
            comm: 0,
            group: 0,
            stream: 1,
        },
        CommKey {
            comm: 1,
            group: 0,
            stream: 2,
        },
        CommKey {
            comm: 1,
            group: 1,
            stream: 2,
        },
    ]
}

fn fake_id(k: &CommKey) -> Result<[u8; ID_BYTES], std::convert::Infallible> {
    let mut id = [0u8; ID_BYTES];
    id[0] = k.comm as u8;
    id[1] = k.group as u8;
    id[2] = k.stream as u8;
    id[127] = 0xab;
    Ok(id)
}

/// Runs a rendezvous of `hellos` (rank 0 first) over loopback; each rank's result.
fn run(hellos: Vec<Hello>, timeout: Duration) -> Vec<Result<Ids, RendezvousError>> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let mut it = hellos.into_iter();
    let master = it.next().unwrap();
    std::thread::scope(|s| {
        let workers: Vec<_> = it
            .map(|h| {
                let addr = addr.clone();
                s.spawn(move || join(&addr, &h, timeout))
            })
            .collect();
        let mine = serve(listener, &master, &keys(), timeout, fake_id);
        let mut out = vec![mine];
        out.extend(workers.into_iter().map(|w| w.join().unwrap()));
        out
    })
}

fn hello(rank: u32, world: u32, plan_hash: u64) -> Hello {
    Hello {
        rank,
        world,
        plan_hash,
    }
}

#[test]
fn every_rank_gets_the_same_ids() {
    let out = run(
        (0..4).map(|r| hello(r, 4, 0xfeed)).collect(),
        Duration::from_secs(10),
    );
    let first = out[0].clone().unwrap();
    assert_eq!(first.len(), 3);
    assert_eq!(first[2].0, keys()[2]);
    assert_eq!(first[2].1, fake_id(&keys()[2]).unwrap());
    for r in &out {
        assert_eq!(r.as_ref().unwrap(), &first);
    }
}

#[test]
fn a_plan_hash_mismatch_names_the_rank() {
    let out = run(
        vec![hello(0, 3, 1), hello(1, 3, 1), hello(2, 3, 7)],
        Duration::from_secs(10),
    );
    for r in &out {
        let e = r.as_ref().unwrap_err().0.clone();
        assert!(
            e.contains("rank(s) 2 ") && e.contains("different plan"),
            "{e}"
        );
    }
}

#[test]
fn a_missing_rank_times_out_naming_it() {
    let t = Instant::now();
    let out = run(
        vec![hello(0, 3, 5), hello(2, 3, 5)],
        Duration::from_millis(600),
    );
    assert!(t.elapsed() < Duration::from_secs(5), "no hang");
    for r in &out {
        let e = r.as_ref().unwrap_err().0.clone();
        assert!(e.contains("rank(s) 1 of 3 never joined"), "{e}");
    }
}

#[test]
fn a_wrong_world_size_is_refused() {
    let out = run(
        vec![hello(0, 2, 5), hello(1, 3, 5)],
        Duration::from_secs(10),
    );
    for r in &out {
        let e = r.as_ref().unwrap_err().0.clone();
        assert!(
            e.contains("world sizes disagree") && e.contains("rank 1 says 3"),
            "{e}"
        );
    }
}

#[test]
fn a_worker_without_a_master_gives_up() {
    // A port nobody listens on: bind, note it, close.
    let addr = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let t = Instant::now();
    let e = join(&addr, &hello(1, 2, 0), Duration::from_millis(300)).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(e.0.contains("rank 1 could not reach the master"), "{}", e.0);
}

#[test]
fn ids_survive_hex() {
    let id = fake_id(&keys()[1]).unwrap();
    assert_eq!(unhex(&hex(&id)), Some(id));
    assert_eq!(unhex("zz"), None);
}
