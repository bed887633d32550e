//! Unit tests of `device::action` (a child module of it: they reach its private items).

use crate::backend::cpu::CpuBackend;
use crate::backend::RunOptions;
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
