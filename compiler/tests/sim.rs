//! The simulator checked against the formulas it implements and the papers' analyses:
//! α–β time of a lone collective, link sharing between overlapping ones, a single stream as the sum
//! of its ops, lower bounds over every example, MiCS §3.4's 2-hop bound, MiCS §3.3's hierarchical
//! all-gather gain, seed 003's IDEFICS-80B worked example, Megatron-LM's MFU formula, `measured`
//! tables, one representative rank against every rank, the Chrome trace's structure, and
//! `schedc simulate` on the command line.

use cranelift_entity::EntityRef;
use sched_ir::ir::*;
use sched_ir::job::{Collective, Dtype};
use schedc::sim::cost::{COLLECTIVE_START_S, LINK_EFFICIENCY};
use schedc::sim::{self, CostModel};
use schedc::{analyze, FsLoader, Job, MemLoader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Jobs of an inline source.
fn jobs(src: &str) -> Vec<Job> {
    let a = analyze(
        Path::new("sim.sched"),
        &MemLoader::default().with("sim.sched", src),
    )
    .unwrap();
    assert!(!a.has_errors(), "{}\n---\n{src}", a.render());
    a.jobs
}

fn cluster(nodes: u32, gpus: u32, intra: &str, inter: &str, extra: &str) -> String {
    format!(
        "cluster c {{\n nodes = {nodes}\n gpus_per_node = {gpus}\n gpu_memory = 80 GiB\n peak_flops = 312 TFLOPS\n \
         intra_node {{ {intra} }}\n inter_node {{ {inter} }}\n {extra}\n}}\n"
    )
}

const LLAMA_SMALL: &str = "model m {\n dtype = bf16\n seq_len = 1024\n \
    layer embed = embedding(vocab = 32000, hidden = 2048, positions = rope)\n \
    layer block[4] = transformer(hidden = 2048, heads = 16, ffn = 5504, norm = rmsnorm, act = swiglu, bias = false)\n \
    layer head = lm_head(hidden = 2048, vocab = 32000, norm = rmsnorm)\n}\n";

fn compile(job: &Job) -> sched_verify::Verified {
    schedc::compile(job).unwrap_or_else(|e| panic!("{}: {e}", job.schedule.name))
}

/// Most test clusters' links within a node...
const INTRA: &str = "bandwidth = 200 GB/s  latency = 3 us";
/// ... and between nodes.
const INTER: &str = "bandwidth = 400 Gbps  latency = 10 us";

/// Each job of `LLAMA_SMALL` on `cluster` (a `cluster c` block) under `schedules` (blocks naming
/// `model = m` and `cluster = c`), with its compiled program, ready to simulate.
fn llama_small_programs(cluster: &str, schedules: &str) -> Vec<(Job, sched_verify::Verified)> {
    jobs(&format!("{cluster}{LLAMA_SMALL}{schedules}"))
        .into_iter()
        .map(|job| {
            let p = compile(&job);
            (job, p)
        })
        .collect()
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * a.abs().max(b.abs())
}

// -------------------------------------------------------------------------------------------------
// Hand-built programs: collectives alone and together
// -------------------------------------------------------------------------------------------------

/// The groups of mesh `a x b` on `nodes` nodes of `g` GPUs (lowering §1), in member order.
fn mesh_groups(a: u32, b: u32, g: u32, nodes: u32) -> Vec<Vec<u32>> {
    let mut groups = vec![];
    for nb in 0..nodes / b {
        for lb in 0..g / a {
            let mut members = vec![];
            for n in nb * b..(nb + 1) * b {
                for l in lb * a..(lb + 1) * a {
                    members.push(n * g + l);
                }
            }
            groups.push(members);
        }
    }
    groups
}

/// A program of one all-gather per entry of `calls` (stream index, mesh, payload bytes), each
/// alone on its stream, no waits.
fn collectives_program(g: u32, nodes: u32, calls: &[(usize, (u32, u32), u64)]) -> Program {
    let mut p = Program {
        schedule: "hand".into(),
        layout: sched_ir::Layout {
            gpus_per_node: g,
            nodes,
            ..Default::default()
        },
        micro_steps: 1,
        ..Program::default()
    };
    let streams = calls.iter().map(|c| c.0).max().unwrap() + 1;
    for s in 0..streams {
        p.streams.push(Stream::new(
            [StreamRole::Gather, StreamRole::Reduce, StreamRole::Sync][s % 3],
        ));
    }
    for &(s, (a, b), bytes) in calls {
        let comm = p.comms.push(Communicator {
            name: format!("{a} x {b}"),
            groups: mesh_groups(a, b, g, nodes),
            scope: if b == 1 {
                Scope::Intra
            } else if a == 1 {
                Scope::Inter
            } else {
                Scope::Mixed
            },
        });
        let buf = p.buffers.push(Buffer {
            name: format!("buf{}", p.buffers.len()),
            kind: BufferKind::Gathered,
            dtype: Dtype::Bf16,
            bytes,
            layer: None,
            offset: 0,
            stage: 0,
        });
        let region = Region::whole(buf, bytes);
        p.ops.push(Op {
            kind: OpKind::Collective(CollectiveOp {
                kind: Collective::AllGather,
                comm,
                dtype: Dtype::Bf16,
                count: bytes / 2,
                input: region,
                output: region,
            }),
            role: OpRole::Gather,
            stream: StreamId::new(s),
            layer: None,
            micro_step: None,
            reads: vec![],
            writes: vec![region],
            wait: vec![],
            record: None,
        });
    }
    p
}

fn hand_job(nodes: u32, g: u32) -> Job {
    let src = format!(
        "{}{LLAMA_SMALL}schedule s {{ model = m\n cluster = c }}\n",
        cluster(
            nodes,
            g,
            "bandwidth = 200 GB/s  latency = 3 us",
            "bandwidth = 800 Gbps  latency = 10 us",
            ""
        )
    );
    jobs(&src).remove(0)
}

#[test]
fn a_single_collective_takes_its_alpha_beta_time() {
    let job = hand_job(4, 8);
    let m = 256u64 << 20;
    // The links at what NCCL's rings sustain of them; every call starts its kernel once.
    let (intra, inter) = (200e9 * LINK_EFFICIENCY, 100e9 * LINK_EFFICIENCY);
    // Intra-node 8 x 1: (p-1)(α + M/(p·w)), AMSP §IV-A.
    let p = collectives_program(8, 4, &[(0, (8, 1), m)]);
    let want = COLLECTIVE_START_S + 7.0 * (3e-6 + m as f64 / (8.0 * intra));
    let r = sim::step_time(&p, &job);
    assert!(close(r, want, 1e-9), "{} vs {want}", r);
    // Across 4 nodes, 1 GPU per node from each of the 8 groups: the node's network carries 8 rings.
    let p = collectives_program(8, 4, &[(0, (1, 4), m)]);
    let want = COLLECTIVE_START_S + 3.0 * (10e-6 + 8.0 * m as f64 / (4.0 * inter));
    let r = sim::step_time(&p, &job);
    assert!(close(r, want, 1e-9), "{} vs {want}", r);
    // Mixed 8 x 4: one ring leaves each node; a step waits for the slower link.
    let p = collectives_program(8, 4, &[(0, (8, 4), m)]);
    let chunk = m as f64 / 32.0;
    let want = COLLECTIVE_START_S + 31.0 * (10e-6 + (chunk / intra).max(chunk / inter));
    let r = sim::step_time(&p, &job);
    assert!(close(r, want, 1e-9), "{} vs {want}", r);
    // And the planner's entry point agrees.
    let cm = CostModel::new(&job);
    assert!(close(
        cm.collective_seconds(Collective::AllGather, 8, 4, m),
        want,
        1e-12
    ));
}

#[test]
fn collectives_that_overlap_share_the_node_network() {
    let job = hand_job(4, 8);
    let m = 512u64 << 20;
    let alone = CostModel::new(&job).collective_seconds(Collective::AllGather, 8, 4, m);
    let latency = COLLECTIVE_START_S + 31.0 * 10e-6;
    let p = collectives_program(8, 4, &[(0, (8, 4), m), (1, (8, 4), m)]);
    let r = sim::step_time(&p, &job);
    // Both move at half speed: the pair takes the latency plus twice the transfer.
    let want = latency + 2.0 * (alone - latency);
    assert!(close(r, want, 1e-6), "{} vs {want}", r);
    // An intra-node call beside an inter-node-bound one takes only the intra link's spare share.
    let p = collectives_program(8, 4, &[(0, (8, 4), m), (1, (8, 1), m)]);
    let r = sim::step_time(&p, &job);
    let a = CostModel::new(&job).collective_seconds(Collective::AllGather, 8, 1, m);
    assert!(r >= alone.max(a) - 1e-12);
    assert!(r < alone + a, "no overlap at all: {}", r);
}

#[test]
fn a_coalesced_group_pays_one_latency_per_ring_step() {
    let job = hand_job(4, 8);
    let cm = CostModel::new(&job);
    let shape = sim::cost::GroupShape::mesh(8, 1, 8);
    let one = cm.transfer(&[(Collective::AllGather, 64 << 20)], shape);
    let two = cm.transfer(
        &[
            (Collective::AllGather, 64 << 20),
            (Collective::AllGather, 64 << 20),
        ],
        shape,
    );
    assert_eq!(one.latency_s, two.latency_s);
    assert!(close(two.transfer_s, 2.0 * one.transfer_s, 1e-12));
}

// -------------------------------------------------------------------------------------------------
// Compiled schedules
// -------------------------------------------------------------------------------------------------

#[test]
fn a_single_stream_takes_the_sum_of_its_ops() {
    let (job, p) = llama_small_programs(
        &cluster(4, 8, INTRA, INTER, ""),
        "schedule s { model = m\n cluster = c\n micro_steps = 2\n preset = mics(partition = 8 x 2)\n streams = single }\n",
    )
    .remove(0);
    assert_eq!(p.streams.len(), 1);
    let classes = sim::classes::rank_classes(&p);
    let cm = CostModel::new(&job);
    let mut sum = 0.0;
    for op in p.ops.values() {
        sum += match &op.kind {
            OpKind::Compute(_) => sim::engine::compute_op_seconds(&cm, &p, &job, op),
            _ => {
                let c = op.collectives();
                let shape = sim::engine::group_shape(&p, &classes, c[0].comm, 0);
                let parts: Vec<_> = c
                    .iter()
                    .map(|c| (c.kind, c.count * c.dtype.bytes()))
                    .collect();
                cm.transfer(&parts, shape).seconds()
            }
        };
    }
    let r = sim::simulate(&p, &job);
    assert!(
        close(r.step_time_s, sum, 1e-9),
        "{} vs {sum}",
        r.step_time_s
    );
    assert!(close(r.streams[0].busy_s, sum, 1e-9));
}

/// Every schedule of every example: overlap never beats the busiest resource.
#[test]
fn overlap_never_beats_compute_or_any_link() {
    std::env::set_current_dir(repo()).unwrap();
    let mut checked = 0;
    for e in std::fs::read_dir(repo().join("schedules")).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_none_or(|x| x != "sched") {
            continue;
        }
        let a = analyze(&path, &FsLoader).unwrap();
        for job in &a.jobs {
            let p = compile(job);
            let r = sim::simulate(&p, job);
            let name = &job.schedule.name;
            let eps = 1e-9 * r.step_time_s;
            assert!(r.step_time_s + eps >= r.compute_s, "{name}");
            for s in &r.streams {
                assert!(r.step_time_s + eps >= s.busy_s, "{name}: {}", s.name);
            }
            // Bytes over each link class, at its full rate, bound the step from below, stage by
            // stage (a rank runs only its stage's ops).
            let classes = sim::classes::rank_classes(&p);
            let cm = CostModel::new(job);
            let stages = p.layout.stages;
            let mut compute_mean = 0.0;
            for stage in 0..stages {
                let rank = p.layout.rank_of(stage, 0, 0);
                let (mut intra, mut inter, mut compute) = (0.0, 0.0, 0.0);
                for op in p.ops.values() {
                    let stream = &p.streams[op.stream];
                    if stream.stage != stage {
                        continue;
                    }
                    if let OpKind::Compute(_) = op.kind {
                        compute += sim::engine::compute_op_seconds(&cm, &p, job, op);
                        continue;
                    }
                    let c = op.collectives();
                    let t = if stream.role == StreamRole::P2p {
                        let parts: Vec<_> = c
                            .iter()
                            .map(|c| {
                                let shape = sim::engine::group_shape(&p, &classes, c.comm, rank);
                                (c.kind, c.count * c.dtype.bytes(), shape)
                            })
                            .collect();
                        cm.p2p_transfer(&parts)
                    } else {
                        let shape = sim::engine::group_shape(&p, &classes, c[0].comm, rank);
                        let parts: Vec<_> = c
                            .iter()
                            .map(|c| (c.kind, c.count * c.dtype.bytes()))
                            .collect();
                        cm.transfer(&parts, shape)
                    };
                    intra += t.intra_bytes / (job.cluster.intra_node.bandwidth * LINK_EFFICIENCY);
                    inter += t.inter_bytes / (job.cluster.inter_node.bandwidth * LINK_EFFICIENCY);
                }
                let bound = intra.max(inter);
                assert!(
                    r.step_time_s + eps >= bound,
                    "{name}: stage {stage}: {} < {bound}",
                    r.step_time_s
                );
                // Compute ops may overlap each other (an update on the sync stream), never exceed
                // their sum stretched by the most collectives that can run beside them (one per
                // other stream of the stage).
                let streams = p.streams.values().filter(|s| s.stage == stage).count();
                let stretch = 1.0 + cm.contention() * (streams - 1) as f64;
                compute_mean += compute * stretch / f64::from(stages);
            }
            assert!(r.compute_s <= compute_mean + eps, "{name}");
            assert!(r.mfu > 0.0 && r.mfu < 1.0, "{name}: mfu {}", r.mfu);
            assert_eq!(
                r.simulated_ranks, stages,
                "{name}: compiled schedules are symmetric within a stage"
            );
            checked += 1;
        }
    }
    assert!(checked >= 20, "only {checked} example schedules");
}

/// Sum of the simulated durations of the collectives with one of `roles`.
fn collective_seconds(p: &Program, job: &Job, roles: &[OpRole]) -> f64 {
    let t = sim::run(p, job);
    p.ops
        .iter()
        .filter(|(_, op)| !matches!(op.kind, OpKind::Compute(_)) && roles.contains(&op.role))
        .map(|(id, _)| t.ranks[0].end[id.index()] - t.ranks[0].start[id.index()])
        .sum()
}

#[test]
fn two_hop_sync_meets_the_mics_bound() {
    // One node of 8 GPUs: every group has the same bandwidth (B_all = B_part = B_repl), s = 4.
    let sched = |name: &str, sync: &str| {
        format!(
            "schedule {name} {{ model = m\n cluster = c\n micro_steps = 4\n shard {{ params = 2\n grads = 2\n optimizer = 2 }}\n grad_sync = {sync}\n streams = single }}\n"
        )
    };
    let links = "bandwidth = 100 GB/s  latency = 1 us";
    let js = llama_small_programs(
        &cluster(1, 8, links, links, ""),
        &(sched("two_hop", "two_hop") + &sched("flat", "flat")),
    );
    let cost = |(j, p): &(Job, sched_verify::Verified)| {
        collective_seconds(p, j, &[OpRole::Reduce, OpRole::Sync])
    };
    let (two_hop, flat) = (cost(&js[0]), cost(&js[1]));
    let ratio = flat / two_hop;
    let (s, n, p) = (4.0, 8.0, 2.0);
    assert!(ratio >= 2.0 * s / (s + 2.0), "flat/two_hop = {ratio}");
    // The lowering's collectives: per micro-step a reduce-scatter over p (two-hop) or an all-reduce
    // over n (flat); at the boundary an all-reduce of M/p over the n/p replicas.
    let r = n / p;
    let want = (s * 2.0 * (n - 1.0) / n) / (s * (p - 1.0) / p + 2.0 * (r - 1.0) / r / p);
    assert!(
        close(ratio, want, 0.01),
        "flat/two_hop = {ratio}, formulas give {want}"
    );
}

#[test]
fn hierarchical_all_gather_gains_the_traffic_ratio() {
    // The network is the bottleneck: intra-node links 100 x faster, latencies negligible.
    let sched = |name: &str, ag: &str| {
        format!(
            "schedule {name} {{ model = m\n cluster = c\n shard {{ params = 8 x 2\n grads = 8 x 2\n optimizer = 8 x 2 }}\n all_gather = {ag}\n streams = single }}\n"
        )
    };
    let js = llama_small_programs(
        &cluster(
            2,
            8,
            "bandwidth = 2000 GB/s  latency = 1 ns",
            "bandwidth = 160 Gbps  latency = 1 ns",
            "",
        ),
        &(sched("flat", "flat") + &sched("hier", "hierarchical")),
    );
    // Less the fixed kernel start each call pays: the hierarchical algorithm makes more calls.
    let cost = |(j, p): &(Job, sched_verify::Verified)| {
        let calls = p
            .ops
            .values()
            .filter(|op| !matches!(op.kind, OpKind::Compute(_)) && op.role == OpRole::Gather)
            .count();
        collective_seconds(p, j, &[OpRole::Gather]) - calls as f64 * COLLECTIVE_START_S
    };
    let ratio = cost(&js[0]) / cost(&js[1]);
    let (p, a) = (16.0, 8.0);
    let want = (p - 1.0) / (p - a);
    assert!(
        close(ratio, want, 0.02),
        "flat/hierarchical = {ratio}, want {want}"
    );
}

#[test]
fn seed_003_idefics_80b_worked_example() {
    let path = repo().join("tests/inputs/sim/idefics80b.sched");
    let a = analyze(&path, &FsLoader).unwrap();
    assert!(!a.has_errors(), "{}", a.render());
    let job = &a.jobs[0];
    assert_eq!(job.ranks(), 512);
    let cm = CostModel::new(job);
    // comms = 3 transmissions x 2 bytes x 80B parameters / 42.5 GB/s.
    let model_bytes = 2 * job.model.parameters();
    let comms = 2.0 * cm.collective_seconds(Collective::AllGather, 8, 64, model_bytes)
        + cm.collective_seconds(Collective::ReduceScatter, 8, 64, model_bytes);
    assert!(close(comms, 3.0 * 2.0 * 80.0 / 42.5, 0.01), "comms {comms}");
    assert_eq!(comms.round(), 11.0);
    // compute = 4 passes x 2 x 80B x 1024 x 3584 / (512 x 250 TFLOPS).
    let compute: f64 = job
        .model
        .layers
        .iter()
        .map(|l| {
            cm.compute_seconds(l, ComputeKind::Forward)
                + cm.compute_seconds(l, ComputeKind::Recompute)
                + cm.compute_seconds(l, ComputeKind::Backward)
        })
        .sum();
    let seed = 4.0 * 2.0 * 80.0 * 1024.0 * 3584.0 / (512.0 * 1e3 * 250.0);
    assert!(close(compute, seed, 0.001), "compute {compute} vs {seed}");
    assert_eq!(compute.round(), 18.0);
    // The whole step, simulated: computing takes the seed's 18 s, stretched by the collectives that
    // run beside it (each second of compute beside n of them takes 1 + n·contention; at most a
    // gather and a reduction at once), and overlapped communication adds little.
    let r = sim::simulate(&compile(job), job);
    assert!(r.compute_s >= seed * 0.999, "{}", r.compute_s);
    assert!(
        r.compute_s <= seed + 2.0 * cm.contention() * comms,
        "{}",
        r.compute_s
    );
    assert!(r.compute_s > seed * 1.01, "no contention: {}", r.compute_s);
    assert!(r.step_time_s >= r.compute_s.max(comms));
    assert!(r.step_time_s < r.compute_s + comms);
}

#[test]
fn mfu_is_megatrons_formula() {
    let (h, l, s, v, heads) = (1024u64, 6u64, 2048u64, 50257u64, 16u64);
    let src = format!(
        "{}model gpt {{\n dtype = bf16\n seq_len = {s}\n micro_batch = 2\n \
         layer embed = embedding(vocab = {v}, hidden = {h}, positions = learned)\n \
         layer block[{l}] = transformer(hidden = {h}, heads = {heads}, ffn = {})\n \
         layer head = lm_head(hidden = {h}, vocab = {v}, tied = true)\n}}\n\
         schedule s {{ model = gpt\n cluster = c\n micro_steps = 3\n preset = zero2 }}\n",
        cluster(2, 4, INTRA, INTER, ""),
        4 * h
    );
    let job = jobs(&src).remove(0);
    let b = (2 * 3 * job.ranks()) as f64; // sequences per step
    let (h, l, s, v) = (h as f64, l as f64, s as f64, v as f64);
    let megatron = 72.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h));
    let ours = sim::model_flops_per_step(&job);
    assert!(close(ours, megatron, 1e-12), "{ours} vs {megatron}");
    let r = sim::simulate(&compile(&job), &job);
    let mfu = megatron / (r.step_time_s * job.ranks() as f64 * job.cluster.peak_flops);
    assert!(close(r.mfu, mfu, 1e-12));
    assert!(close(r.tflops_per_gpu, mfu * 312.0, 1e-12));
}

#[test]
fn measured_tables_override_the_model_interpolated_in_log_size() {
    let table = "measured all_gather 8 x 1 { 1 MiB = 20 GB/s; 64 MiB = 80 GB/s }";
    let src = format!(
        "{}{LLAMA_SMALL}schedule s {{ model = m\n cluster = c }}\n",
        cluster(2, 8, INTRA, INTER, table)
    );
    let job = jobs(&src).remove(0);
    let cm = CostModel::new(&job);
    let t = |bytes: u64| cm.collective_seconds(Collective::AllGather, 8, 1, bytes);
    // 8 MiB lies half-way in log size between 1 MiB and 64 MiB: 50 GB/s.
    assert!(close(t(8 << 20), (8u64 << 20) as f64 / 50e9, 1e-12));
    // Clamped outside the points.
    assert!(close(t(1 << 10), 1024.0 / 20e9, 1e-12));
    assert!(close(t(1 << 30), (1u64 << 30) as f64 / 80e9, 1e-12));
    // Other collectives and meshes keep the α–β model.
    let rs = cm.collective_seconds(Collective::ReduceScatter, 8, 1, 8 << 20);
    let want = COLLECTIVE_START_S + 7.0 * (3e-6 + (1u64 << 20) as f64 / (200e9 * LINK_EFFICIENCY));
    assert!(close(rs, want, 1e-12));
}

#[test]
fn the_trace_has_a_process_per_rank_a_thread_per_stream_and_a_slice_per_op() {
    let (job, p) = llama_small_programs(
        &cluster(4, 8, INTRA, INTER, ""),
        "schedule s { model = m\n cluster = c\n micro_steps = 2\n preset = mics(partition = 8 x 2) }\n",
    )
    .remove(0);
    let (r, trace) = sim::simulate_traced(&p, &job);
    let v: serde_json::Value =
        serde_json::from_str(&serde_json::to_string(&trace).unwrap()).unwrap();
    let events = v["traceEvents"].as_array().unwrap();
    let of = |ph: &str| events.iter().filter(|e| e["ph"] == ph).collect::<Vec<_>>();
    let meta = of("M");
    assert_eq!(
        meta.iter().filter(|e| e["name"] == "process_name").count(),
        1
    );
    let threads: Vec<&str> = meta
        .iter()
        .filter(|e| e["name"] == "thread_name")
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(threads, ["compute", "gather", "reduce", "sync"]);
    let slices = of("X");
    assert_eq!(slices.len(), p.ops.len());
    let mut end = 0.0f64;
    for (s, (_, op)) in slices.iter().zip(p.ops.iter()) {
        assert_eq!(s["tid"].as_u64().unwrap() as usize, op.stream.index());
        assert!(s["dur"].as_f64().unwrap() >= 0.0);
        assert!(s["args"]["bytes"].as_u64().unwrap() > 0, "{s}");
        assert!(s["args"].get("layer").is_some() && s["args"].get("micro_step").is_some());
        end = end.max(s["ts"].as_f64().unwrap() + s["dur"].as_f64().unwrap());
    }
    assert!(close(end, r.step_time_s * 1e6, 1e-9));
    // One flow arrow per event wait, start and finish paired by id, finish not before start.
    let waits: usize = p.ops.values().map(|o| o.wait.len()).sum();
    let (starts, finishes) = (of("s"), of("f"));
    assert_eq!(starts.len(), waits);
    assert_eq!(finishes.len(), waits);
    for (s, f) in starts.iter().zip(&finishes) {
        assert_eq!(s["id"], f["id"]);
        assert!(s["ts"].as_f64().unwrap() <= f["ts"].as_f64().unwrap() + 1e-6);
    }
}

#[test]
fn the_planners_scale_simulates_in_one_representative() {
    // The benchmark times the planner's scale (1,024 ranks); here a 256-rank AMSP mesh checks that
    // one class stands for every rank of a compiled schedule.
    let (job, p) = llama_small_programs(
        &cluster(32, 8, INTRA, INTER, ""),
        "schedule s { model = m\n cluster = c\n shard { params = 8 x 1\n grads = 8 x 4\n optimizer = 8 x 16 } }\n",
    )
    .remove(0);
    let c = sim::classes::rank_classes(&p);
    assert_eq!(c.representatives, [0]);
    assert_eq!(c.sizes, [256]);
    assert_eq!(sim::simulate(&p, &job).simulated_ranks, 1);
}

#[test]
fn one_representative_gives_the_same_step_as_every_rank() {
    // Simulate every rank as its own class (rendezvous across all of them) and compare.
    let programs = llama_small_programs(
        &cluster(4, 8, INTRA, INTER, ""),
        "schedule s { model = m\n cluster = c\n micro_steps = 2\n preset = mics(partition = 8 x 2)\n buckets { gather = 64 MiB  reduce = 64 MiB } }\n\
         schedule t { model = m\n cluster = c\n shard { params = 4 x 1\n grads = 8 x 1\n optimizer = 8 x 4 } }\n",
    );
    for (job, p) in programs {
        let one = sim::run(&p, &job);
        let mut each = sim::classes::rank_classes(&p);
        each.class_of = (0..p.ranks()).collect();
        each.representatives = (0..p.ranks()).collect();
        each.sizes = vec![1; p.ranks() as usize];
        let all = sim::engine::run(&p, &job, &each, &CostModel::new(&job));
        assert_eq!(all.ranks.len(), 32);
        assert!(
            close(all.step_time_s, one.step_time_s, 1e-12),
            "{}: {} vs {}",
            job.schedule.name,
            all.step_time_s,
            one.step_time_s
        );
        for r in &all.ranks {
            assert_eq!(
                r.end, one.ranks[0].end,
                "{}: rank {}",
                job.schedule.name, r.rank
            );
        }
    }
}

#[test]
fn ragged_groups_split_ranks_into_classes_that_rendezvous() {
    // Ranks 0-3 all-gather among themselves, ranks 4-7 in pairs: two classes, each its own time.
    let job = hand_job(1, 8);
    let mut p = collectives_program(8, 1, &[(0, (8, 1), 64 << 20)]);
    p.comms[CommId::new(0)].groups = vec![vec![0, 1, 2, 3], vec![4, 5], vec![6, 7]];
    let c = sim::classes::rank_classes(&p);
    assert_eq!(c.representatives, [0, 4]);
    let t = sim::run(&p, &job);
    assert_eq!(t.ranks.len(), 2);
    let bw = 200e9 * LINK_EFFICIENCY;
    let four = COLLECTIVE_START_S + 3.0 * (3e-6 + (16u64 << 20) as f64 / bw);
    let two = COLLECTIVE_START_S + 3e-6 + (32u64 << 20) as f64 / bw;
    assert!(close(t.ranks[0].end[0], four, 1e-9));
    assert!(close(t.ranks[1].end[0], two, 1e-9));
}

// -------------------------------------------------------------------------------------------------
// The command line
// -------------------------------------------------------------------------------------------------

fn schedc(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_schedc"))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap()
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn simulate_prints_the_cli_json_and_writes_a_trace() {
    let dir = scratch("simulate_json");
    let tiny = repo().join("schedules/tiny_cpu.sched");
    let out = schedc(
        &[
            "simulate",
            tiny.to_str().unwrap(),
            "--json",
            "--trace",
            "t.json",
        ],
        &dir,
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for key in [
        "schedule",
        "step_time_s",
        "compute_s",
        "exposed_comm_s",
        "mfu",
        "tflops_per_gpu",
        "tokens_per_gpu_per_s",
        "peak_memory_bytes",
        "fits",
        "streams",
    ] {
        assert!(v.get(key).is_some(), "missing {key}: {v}");
    }
    assert_eq!(v["schedule"], "tiny_zero3");
    assert_eq!(v["streams"][0]["name"], "compute");
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("t.json")).unwrap()).unwrap();
    assert!(!trace["traceEvents"].as_array().unwrap().is_empty());
    // The table, and a plan file gives the same figures as its source.
    let out = schedc(
        &["compile", tiny.to_str().unwrap(), "-o", "tiny.plan.json"],
        &dir,
    );
    assert_eq!(out.status.code(), Some(0));
    let out2 = schedc(&["simulate", "tiny.plan.json", "--json"], &dir);
    assert_eq!(out2.status.code(), Some(0));
    let v2: serde_json::Value = serde_json::from_slice(&out2.stdout).unwrap();
    assert_eq!(v, v2);
    let table = schedc(&["simulate", "tiny.plan.json"], &dir);
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(
        text.contains("step time") && text.contains("MFU") && text.contains("fits"),
        "{text}"
    );
}

#[test]
fn simulate_exit_codes_and_no_partial_trace() {
    let dir = scratch("simulate_errors");
    std::fs::write(dir.join("bad.sched"), "schedule s { model = nope }\n").unwrap();
    assert_eq!(
        schedc(&["simulate", "bad.sched"], &dir).status.code(),
        Some(1)
    );
    assert_eq!(
        schedc(&["simulate", "missing.sched"], &dir).status.code(),
        Some(2)
    );
    std::fs::write(
        dir.join("bad.plan.json"),
        "{\"format\": \"sched-plan\", \"version\": 1}",
    )
    .unwrap();
    assert_eq!(
        schedc(&["simulate", "bad.plan.json"], &dir).status.code(),
        Some(1)
    );
    let several = repo().join("schedules/tiny_cpu_schedules.sched");
    assert_eq!(
        schedc(&["simulate", several.to_str().unwrap()], &dir)
            .status
            .code(),
        Some(1)
    );
    // A trace that cannot be written: exit 2, nothing left behind.
    let tiny = repo().join("schedules/tiny_cpu.sched");
    let out = schedc(
        &[
            "simulate",
            tiny.to_str().unwrap(),
            "--trace",
            "no/such/dir/t.json",
        ],
        &dir,
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(!dir.join("no").exists());
}

// -------------------------------------------------------------------------------------------------
// Cost model terms: memory bandwidth, shapes, launches, contention
// -------------------------------------------------------------------------------------------------

#[test]
fn memory_bandwidth_key_sets_the_memory_roof() {
    let src = |extra: &str| {
        format!(
            "{}{LLAMA_SMALL}schedule s {{ model = m\n cluster = c }}\n",
            cluster(1, 8, INTRA, INTER, extra)
        )
    };
    let derived = CostModel::new(&jobs(&src("")).remove(0));
    assert_eq!(
        derived.memory_bandwidth(),
        312e12 / sim::cost::FLOPS_PER_HBM_BYTE
    );
    let job = jobs(&src("memory_bandwidth = 2039 GB/s")).remove(0);
    assert_eq!(job.cluster.memory_bandwidth, Some(2039e9));
    let given = CostModel::new(&job);
    assert_eq!(given.memory_bandwidth(), 2039e9);
    // A memory-bound kernel: its bytes at the bandwidth, plus one launch.
    let bytes = 1e9;
    assert!(close(
        given.memory_seconds(bytes),
        bytes / 2039e9 + sim::cost::KERNEL_LAUNCH_S,
        1e-12
    ));
    // The optimizer update is memory-bound: a faster memory makes it faster by the ratio.
    let block = &job.model.layers[1];
    let (a, b) = (
        derived.compute_seconds(block, ComputeKind::Update),
        given.compute_seconds(block, ComputeKind::Update),
    );
    assert!(close(
        a - sim::cost::KERNEL_LAUNCH_S,
        (b - sim::cost::KERNEL_LAUNCH_S) * 2039e9 / derived.memory_bandwidth(),
        1e-9
    ));
}

#[test]
fn small_and_skinny_products_run_below_the_large_product_efficiency() {
    let f = |m, n, k| sim::cost::gemm_shape_factor(m, n, k, sim::cost::WAVE_ELEMENTS);
    // Large products tend to `efficiency`; fewer output tiles or a short inner loop fall below it.
    assert!(f(16384.0, 16384.0, 16384.0) > 0.99);
    assert!((f(4096.0, 4096.0, 4096.0) - 0.934).abs() < 0.001);
    assert!(f(512.0, 4096.0, 4096.0) < 0.7);
    assert!(f(4096.0, 4096.0, 128.0) < 0.82 * f(4096.0, 4096.0, 4096.0));
    let job = hand_job(1, 8);
    let cm = CostModel::new(&job);
    let per_flop = |m: f64, n: f64, k: f64| cm.gemm_seconds(m, n, k) / (2.0 * m * n * k);
    let peak = 312e12 * job.cluster.efficiency;
    // A large product runs near `peak × efficiency`.
    assert!(per_flop(8192.0, 8192.0, 8192.0) * peak < 1.02);
    // 16 tokens through an LM head's 4096 x 32768 weights: their bytes, not the FLOPs, set the
    // time (the roofline).
    let (m, n, k) = (16.0, 32768.0, 4096.0);
    let bytes = (m * k + k * n + m * n) * 2.0 / cm.memory_bandwidth();
    assert!(close(cm.gemm_seconds(m, n, k), bytes, 1e-12));
    assert!(per_flop(m, n, k) * peak > 2.0);
    // 64 tokens through a 4096 x 4096 product: too few output tiles to fill the GPU, far below
    // peak though not memory-bound.
    let (m, n, k) = (64.0, 4096.0, 4096.0);
    let bytes = (m * k + k * n + m * n) * 2.0 / cm.memory_bandwidth();
    assert!(cm.gemm_seconds(m, n, k) > bytes);
    assert!(per_flop(m, n, k) * peak > 4.0);
}

#[test]
fn compute_beside_collectives_is_slowed_by_the_contention_factor() {
    let (job, p) = llama_small_programs(
        &cluster(2, 8, INTRA, INTER, ""),
        "schedule s { model = m\n cluster = c\n nodes = 2\n preset = zero3\n micro_steps = 2 }\n",
    )
    .remove(0);
    let classes = sim::classes::rank_classes(&p);
    let at = |k: f64| {
        let t = sim::engine::run(&p, &job, &classes, &CostModel::new(&job).with_contention(k));
        let r = &t.ranks[0];
        let (mut compute, mut comm) = (0.0, 0.0);
        for (id, op) in p.ops.iter() {
            let d = r.end[id.index()] - r.start[id.index()];
            match op.kind {
                OpKind::Compute(_) => compute += d,
                _ => comm += d,
            }
        }
        (t.step_time_s, compute, comm)
    };
    let (step0, compute0, _) = at(0.0);
    let k = sim::cost::CONTENTION;
    let (step, compute, comm) = at(k);
    // Without contention every compute op takes its cost-model time.
    let alone: f64 = p
        .ops
        .values()
        .map(|op| sim::engine::compute_op_seconds(&CostModel::new(&job), &p, &job, op))
        .sum();
    assert!(close(compute0, alone, 1e-9), "{compute0} vs {alone}");
    // With it, compute stretches by at most the factor times what runs beside it (two collectives
    // at most: a gather and a reduction), and the step cannot get shorter.
    assert!(compute > compute0, "{compute} vs {compute0}");
    assert!(compute - compute0 <= 2.0 * k * comm + 1e-9);
    assert!(step >= step0 - 1e-12);
}
