//! Unit tests of `device::action` (a child module of it: they reach its private items).

use crate::backend::cpu::CpuBackend;
use crate::backend::RunOptions;
use crate::exec::Action;
use crate::plan::Plan;
use crate::train::Trainer;
use std::sync::Arc;

/// The bits of the losses and final weights of 3 steps of `plan` on the CPU backend.
fn run(plan: Plan) -> (Vec<u64>, Vec<u32>) {
    let plan = Arc::new(plan);
    let backend = CpuBackend::new(plan.clone(), RunOptions::default());
    let mut t = Trainer::new(plan.clone(), backend, crate::data::Corpus::builtin());
    let train = plan.job.schedule.train.clone();
    t.load(&t.initial_state(train.seed)).unwrap();
    let losses = (0..3)
        .map(|_| t.step(train.lr, train.clip).unwrap().loss.to_bits())
        .collect();
    let weights = t.state().unwrap().into_params();
    (losses, weights.iter().map(|w| w.to_bits()).collect())
}

/// A 16-bit model's layer gradients stored unrounded where the store rounds them (a bf16
/// part written whole) give the bits of rounding them first: one rank, with micro-steps
/// (whose second adds to the parts, and so still rounds first), and ZeRO-2 over two ranks.
#[test]
fn gradients_rounded_by_their_store_give_the_same_bits() {
    let text = "\
            model m { dtype = bf16  optimizer = adamw  seq_len = 16  micro_batch = 2
              layer embed    = embedding(vocab = 256, hidden = 32, positions = learned)
              layer block[1] = transformer(hidden = 32, heads = 4, ffn = 64)
              layer head     = lm_head(hidden = 32, vocab = 256, tied = true) }
            cluster one { nodes = 1  gpus_per_node = 1  gpu_memory = 4 GiB  peak_flops = 1 TFLOPS
              intra_node { bandwidth = 10 GB/s  latency = 1 us }
              inter_node { bandwidth = 1 Gbps  latency = 50 us } }
            cluster two { nodes = 1  gpus_per_node = 2  gpu_memory = 4 GiB  peak_flops = 1 TFLOPS
              intra_node { bandwidth = 10 GB/s  latency = 1 us }
              inter_node { bandwidth = 1 Gbps  latency = 50 us } }
            schedule a { model = m  cluster = one  preset = ddp  train { lr = 1e-2  seed = 1 } }
            schedule b { model = m  cluster = one  preset = ddp  micro_steps = 2  train { lr = 1e-2  seed = 2 } }
            schedule c { model = m  cluster = two  preset = zero2  train { lr = 1e-2  seed = 3 } }\n";
    let loader = schedc::MemLoader::default()
        .in_dir("/mem")
        .with("/mem/s.sched", text);
    let a = schedc::analyze(std::path::Path::new("/mem/s.sched"), &loader).expect("readable");
    assert!(!a.has_errors(), "{}", a.render());
    for job in &a.jobs {
        let program = schedc::compile(job).unwrap();
        let plan = || Plan::new(program.clone(), job.clone()).unwrap();
        let stored = run(plan());
        let mut first = plan();
        first.round_grads_first = true;
        let rounded_first = run(first);
        let name = &job.schedule.name;
        assert_eq!(stored.0, rounded_first.0, "{name}: the losses' bits");
        let differ = stored
            .1
            .iter()
            .zip(&rounded_first.1)
            .filter(|(a, b)| a != b);
        assert_eq!(differ.count(), 0, "{name}: weights whose bits differ");
    }
}

/// Models with every layer kind (GELU, biases and layer norms; a tied head on the embedding's
/// stage, which `zbv` gives) in fp32 and bf16 under a split-backward pipeline.
const SPLIT: &str = "\
    model gpt { dtype = fp32  optimizer = adamw  seq_len = 16  micro_batch = 2
      layer embed    = embedding(vocab = 256, hidden = 32, positions = learned)
      layer block[2] = transformer(hidden = 32, heads = 4, ffn = 64, attention = naive)
      layer mlp      = mlp(hidden = 32, ffn = 48)
      layer head     = lm_head(hidden = 32, vocab = 256, tied = true) }
    model gpt16 { dtype = bf16  optimizer = adamw  seq_len = 16  micro_batch = 2
      layer embed    = embedding(vocab = 256, hidden = 32, positions = learned)
      layer block[2] = transformer(hidden = 32, heads = 2, ffn = 64)
      layer mlp      = mlp(hidden = 32, ffn = 48)
      layer head     = lm_head(hidden = 32, vocab = 256, tied = true) }
    cluster two { nodes = 1  gpus_per_node = 2  gpu_memory = 4 GiB  peak_flops = 1 TFLOPS
      intra_node { bandwidth = 10 GB/s  latency = 1 us }
      inter_node { bandwidth = 1 Gbps  latency = 50 us } }
    schedule zbv { model = gpt  cluster = two  micro_steps = 4  preset = ddp
      pipeline { stages = 2  virtual = 2  schedule = zbv  layers = [2, 1, 1, 1] }
      train { lr = 1e-2  seed = 4 } }
    schedule zb16 { model = gpt16  cluster = two  micro_steps = 4  preset = ddp
      pipeline { stages = 2  virtual = 2  schedule = zbv  layers = [2, 1, 1, 1] }
      train { lr = 1e-2  seed = 4 } }\n";

fn split_jobs() -> Vec<sched_ir::job::Job> {
    let loader = schedc::MemLoader::default()
        .in_dir("/mem")
        .with("/mem/s.sched", SPLIT);
    let a = schedc::analyze(std::path::Path::new("/mem/s.sched"), &loader).expect("readable");
    assert!(!a.has_errors(), "{}", a.render());
    a.jobs.clone()
}

/// A split-backward plan's `backward_input` and `backward_weight` ops decode into their
/// actions: an `I` for every layer with an input gradient or a stash (the embedding has
/// neither), the stash written by its `I` and read by its `W` exactly where the layer stashes,
/// a `W` for every layer, the tied head's with the embedding's gradient.
#[test]
fn split_backward_ops_decode() {
    for job in &split_jobs() {
        let program = schedc::compile(job).unwrap_or_else(|e| panic!("{e}"));
        let plan = Plan::new(program, job.clone()).unwrap();
        let (mut inputs, mut weights) = (vec![], vec![]);
        for a in &plan.actions {
            match a {
                Action::BackwardInput {
                    layer,
                    stash,
                    grad_input,
                    tied,
                    ..
                } => {
                    let m = &plan.maths[*layer];
                    assert_eq!(stash.is_some(), m.stash_elements() > 0);
                    assert_eq!(grad_input.is_some(), *layer > 0);
                    assert_eq!(tied.is_some(), m.is_tied());
                    inputs.push(*layer);
                }
                Action::BackwardWeight {
                    layer,
                    stash,
                    tied,
                    grads,
                    tied_grads,
                    ..
                } => {
                    let m = &plan.maths[*layer];
                    assert_eq!(stash.is_some(), m.stash_elements() > 0);
                    assert_eq!(tied.is_some(), m.is_tied());
                    assert!(!grads.is_empty());
                    assert_eq!(tied_grads.is_empty(), !m.is_tied());
                    weights.push(*layer);
                }
                Action::Backward { .. } => panic!("{}: a whole backward", job.schedule.name),
                _ => {}
            }
        }
        let n = plan.maths.len();
        let per_layer = |v: &[usize], l: usize| v.iter().filter(|&&x| x == l).count();
        let m = job.schedule.micro_steps as usize;
        for l in 0..n {
            let want_i = if l == 0 { 0 } else { m };
            assert_eq!(
                per_layer(&inputs, l),
                want_i,
                "{}: I of layer {l}",
                job.schedule.name
            );
            assert_eq!(
                per_layer(&weights, l),
                m,
                "{}: W of layer {l}",
                job.schedule.name
            );
        }
    }
}

/// A stash that is not fp32, or not the layer's size, is refused with the op named.
#[test]
fn a_stash_of_another_dtype_or_size_is_refused() {
    let job = &split_jobs()[0];
    let verified = schedc::compile(job).unwrap();
    let maths: Vec<crate::math::LayerMath> = job
        .model
        .layers
        .iter()
        .map(|l| crate::math::LayerMath::new(l, &job.model).unwrap())
        .collect();
    let stash = |p: &sched_ir::ir::Program| {
        p.buffers
            .iter()
            .find(|(_, b)| b.kind == sched_ir::ir::BufferKind::Stash)
            .map(|(id, _)| id)
            .expect("a stash")
    };
    let mut p = verified.program().clone();
    let s = stash(&p);
    p.buffers[s].dtype = sched_ir::job::Dtype::Bf16;
    let err = crate::exec::decode(&p, &job.model, &maths).unwrap_err();
    assert!(err.to_string().contains("is not fp32"), "{err}");
    let mut p = verified.program().clone();
    let s = stash(&p);
    for (_, op) in p.ops.iter_mut() {
        for r in op.reads.iter_mut().chain(op.writes.iter_mut()) {
            if r.buffer == s {
                r.bytes -= 4;
            }
        }
    }
    let err = crate::exec::decode(&p, &job.model, &maths).unwrap_err();
    assert!(err.to_string().contains("its stash region holds"), "{err}");
}

/// A split-backward pipeline trains as the single-process reference on its global batch
/// (`runtime.md`, "Parity": within 1e-5 in fp32), and a bf16 one runs.
#[test]
fn a_split_backward_pipeline_trains_as_the_reference() {
    let jobs = split_jobs();
    let plan = |job: &sched_ir::job::Job| Plan::new(schedc::compile(job).unwrap(), job.clone());
    let job = &jobs[0];
    let (losses, weights) = run(plan(job).unwrap());
    // The reference on the global batch: one data-parallel rank's micro-steps.
    let model = &job.model;
    let sequences = (job.schedule.micro_steps as u64 * model.micro_batch) as usize;
    let corpus = crate::data::Corpus::builtin();
    let mut r = crate::reference::Reference::new(model, &job.schedule.train).unwrap();
    for (t, got) in losses.iter().enumerate() {
        let batch = corpus
            .global_batch(t as u64, sequences, model.seq_len as usize)
            .unwrap();
        let want = r.step(t as u64, &batch);
        let got = f64::from_bits(*got);
        assert!(
            ((got - want) / want).abs() <= 1e-5,
            "step {t}: loss {got}, reference {want}"
        );
    }
    let want: Vec<f32> = r.weights().into_iter().flat_map(|(_, w)| w).collect();
    assert_eq!(weights.len(), want.len());
    for (i, (g, w)) in weights.iter().zip(&want).enumerate() {
        let g = f32::from_bits(*g);
        assert!((g - w).abs() <= 1e-5, "weight {i}: {g}, reference {w}");
    }
    let (losses, _) = run(plan(&jobs[1]).unwrap());
    assert!(losses.iter().all(|l| f64::from_bits(*l).is_finite()));
}
