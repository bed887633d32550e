//! Tensor parallelism's numerics (`schedrun::math::tensor`) against the single-rank layer math:
//! for t ∈ {1, 2, 4}, the sum over the tensor group of each slice's partial products (what the
//! all-reduce computes) gives the full layer's output and input gradient, the gathered slice
//! gradients its parameter gradients, and the vocabulary-parallel cross-entropy the loss and
//! logits gradient of `cross_entropy`, within 1e-5 relative in fp32. Each check also shows that
//! a missing reduction or a wrong slice is caught.

mod common;

use sched_ir::job::{Layer, LayerKind, Model};
use schedrun::math::tensor::{
    gather, vocab_cross_entropy, vocab_loss, vocab_max, vocab_sums, BlockSlice, EmbeddingSlice,
    HeadSlice, Reduce, SliceError, SliceLayout, Split, TensorRank, VocabShard,
};
use schedrun::math::{cross_entropy, Input, LayerMath, Rng, SliceGrads};
use std::sync::{Barrier, Mutex};

const TOL: f32 = 1e-5;

/// GPT- and LLaMA-style layers over a vocabulary that 2 and 4 do not divide; the LLaMA block has
/// grouped-query attention that still has a kv head per rank at t = 4, the GPT block naive
/// attention (the probabilities saved) over sequences of two row blocks.
const MODELS: &str = r#"
model gpt_259 {
    dtype = fp32  optimizer = adamw  seq_len = 70  micro_batch = 1
    layer embed    = embedding(vocab = 259, hidden = 32, positions = learned)
    layer block[1] = transformer(hidden = 32, heads = 4, ffn = 64, attention = naive)
    layer m        = mlp(hidden = 32, ffn = 64)
    layer head     = lm_head(hidden = 32, vocab = 259)
}
model llama_259 {
    dtype = fp32  optimizer = adamw  seq_len = 12  micro_batch = 2
    layer embed    = embedding(vocab = 259, hidden = 32, positions = rope)
    layer block[1] = transformer(hidden = 32, heads = 8, kv_heads = 4, ffn = 48,
                                 norm = rmsnorm, act = swiglu, bias = false)
    layer m        = mlp(hidden = 32, ffn = 48, act = swiglu, norm = rmsnorm, bias = false)
    layer head     = lm_head(hidden = 32, vocab = 259, norm = rmsnorm, tied = true)
}
model dense_one {
    dtype = fp32  optimizer = adamw  seq_len = 4  micro_batch = 1
    layer embed = embedding(vocab = 16, hidden = 8)
    layer d     = dense(params = 100, flops_per_token = 10, activation_bytes_per_token = 4)
    layer head  = lm_head(hidden = 8, vocab = 16, tied = true)
}
"#;

fn model(name: &str) -> Model {
    match name {
        "tiny_gpt" | "tiny_llama" => common::tiny(name),
        _ => common::model(MODELS, name),
    }
}

fn layer<'m>(m: &'m Model, name: &str) -> &'m Layer {
    m.layers.iter().find(|l| l.name == name).unwrap()
}

fn rank(size: usize, index: usize) -> TensorRank {
    TensorRank { size, index }
}

/// max |a − b| / max |b|: `b` is the reference.
fn rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    let scale = b.iter().fold(0f32, |m, &x| m.max(x.abs())).max(1e-30);
    let diff = a.iter().zip(b).fold(0f32, |m, (&x, &y)| {
        m.max(if x.is_nan() || y.is_nan() {
            f32::INFINITY
        } else {
            (x - y).abs()
        })
    });
    diff / scale
}

/// [`rel`] of each tensor of `l`'s flat vectors on its own, the largest: a small tensor (a bias)
/// is not hidden by a large one.
fn rel_tensors(l: &Layer, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    let mut at = 0;
    let mut worst = 0f32;
    for ts in &l.tensors {
        let n = ts.elements() as usize;
        worst = worst.max(rel(&a[at..at + n], &b[at..at + n]));
        at += n;
    }
    worst
}

/// Parameters larger than the real init (norm gains near 1, biases non-zero) so every tensor
/// matters, and a bias added t times or not at all shows.
fn params_of(l: &Layer, rng: &mut Rng) -> Vec<f32> {
    let mut out = vec![];
    for ts in &l.tensors {
        let n = ts.elements() as usize;
        if ts.shape.len() == 1 && ts.name.ends_with("weight") {
            out.extend(rng.normals(n, 0.2).iter().map(|v| 1.0 + v));
        } else {
            out.extend(rng.normals(n, 0.3));
        }
    }
    out
}

fn tokens(m: &Model) -> usize {
    (m.micro_batch * m.seq_len) as usize
}

fn vocab(m: &Model) -> usize {
    m.layers
        .iter()
        .find_map(|l| match l.kind {
            LayerKind::Embedding { vocab, .. } => Some(vocab as usize),
            _ => None,
        })
        .unwrap()
}

// ---- slicing ----

#[test]
fn slices_gather_back_to_the_layer() {
    for name in ["gpt_259", "llama_259", "tiny_gpt"] {
        let m = model(name);
        let mut rng = Rng::new(7);
        for l in &m.layers {
            let full = params_of(l, &mut rng);
            for t in [1, 2, 4] {
                let layouts: Vec<SliceLayout> = (0..t)
                    .map(|k| SliceLayout::new(l, rank(t, k)).unwrap())
                    .collect();
                let slices: Vec<Vec<f32>> = layouts.iter().map(|s| s.slice(&full)).collect();
                if t == 1 {
                    assert_eq!(slices[0], full, "{name} {}: t = 1 slices nothing", l.name);
                }
                let refs: Vec<&[f32]> = slices.iter().map(Vec::as_slice).collect();
                assert_eq!(
                    gather(l, t, &refs).unwrap(),
                    full,
                    "{name} {} t={t}",
                    l.name
                );
                // Each rank holds the same shapes; the split tensors' elements add up to the
                // whole (plus padding rows), the replicated ones are whole on every rank.
                for ts in &l.tensors {
                    let per: Vec<_> = layouts
                        .iter()
                        .map(|s| s.tensors().iter().find(|x| x.name == ts.name).unwrap())
                        .collect();
                    assert!(per.iter().all(|p| p.shape == per[0].shape));
                    let n: u64 = per.iter().map(|p| p.shape.iter().product::<u64>()).sum();
                    match per[0].split {
                        Split::Replicated => assert_eq!(per[0].shape, ts.shape),
                        Split::Vocab => assert!(n >= ts.elements() && n - ts.elements() < 4 * 32),
                        _ => assert_eq!(n, ts.elements(), "{} {}", l.name, ts.name),
                    }
                }
                if t > 1
                    && l.tensors
                        .iter()
                        .any(|ts| ts.name != "wpe" && ts.shape.len() == 2)
                {
                    let reversed: Vec<&[f32]> = refs.iter().rev().copied().collect();
                    assert_ne!(gather(l, t, &reversed).unwrap(), full, "order matters");
                }
            }
        }
    }
}

#[test]
fn qkv_slices_hold_each_ranks_heads_with_their_kv_heads() {
    // 8 heads of width 4, 4 kv heads: rank 1 of 2 holds q heads 4..8 (q rows 16..32), kv heads
    // 2..4 (k rows 32 + 8..16, v rows 48 + 8..16) of the packed [q | k | v] rows.
    let m = model("llama_259");
    let l = layer(&m, "block[0]");
    let s = SliceLayout::new(l, rank(2, 1)).unwrap();
    let qkv = s.range("attn.qkv.weight").unwrap();
    let full_qkv = schedrun::math::tensor_range(l, "attn.qkv.weight").unwrap();
    let rows: Vec<(usize, usize)> = s
        .runs()
        .iter()
        .filter(|r| qkv.contains(&r.slice))
        .map(|r| ((r.full - full_qkv.start) / 32, r.len / 32))
        .collect();
    assert_eq!(rows, [(16, 16), (40, 8), (56, 8)]);
    let t = s.tensors().iter().find(|t| t.name == "attn.proj.weight");
    assert_eq!(t.unwrap().shape, [32, 16]);
}

#[test]
fn layers_that_cannot_be_split_are_refused() {
    let llama = model("tiny_llama");
    let block = layer(&llama, "block[0]");
    // kv_heads = 2: four ranks would split a kv head.
    let e = SliceLayout::new(block, rank(4, 0)).unwrap_err();
    assert!(matches!(e, SliceError::Split { .. }), "{e}");
    assert!(e.to_string().contains("kv_heads = 2"), "{e}");
    assert!(BlockSlice::new(block, &llama, rank(4, 1)).is_err());
    assert!(BlockSlice::new(block, &llama, rank(2, 1)).is_ok());
    let e = SliceLayout::new(block, rank(2, 2)).unwrap_err();
    assert_eq!(e, SliceError::Rank { size: 2, index: 2 });
    let dense = model("dense_one");
    assert!(SliceLayout::new(layer(&dense, "d"), rank(2, 0)).is_err());
    let head = layer(&llama, "head");
    assert!(BlockSlice::new(head, &llama, rank(2, 0)).is_err());
    assert!(gather(block, 2, &[&[]]).is_err());
}

// ---- transformer and mlp layers ----

/// How the test combines the ranks' partials.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// The all-reduce: the sum over the group.
    Sum,
    /// No reduction: rank 0's partial alone.
    RankZero,
    /// Every rank handed rank 0's slice (a wrong slice).
    SameSlice,
}

struct Outcome {
    output: f32,
    grad_input: f32,
    grads: f32,
}

/// The full layer against its t slices run phase by phase, partials combined by `mode`.
fn block_parity(m: &Model, name: &str, t: usize, mode: Mode) -> Outcome {
    let l = layer(m, name);
    let full = LayerMath::new(l, m).unwrap();
    let mut rng = Rng::new(11 + t as u64);
    let params = params_of(l, &mut rng);
    let x = rng.normals(full.input_elements(), 1.0);
    let dy = rng.normals(full.output_elements(), 1.0);
    let mut out = vec![0.0; full.output_elements()];
    let mut saved = vec![f32::NAN; full.saved_elements()];
    full.forward(&params, None, Input::Hidden(&x), &mut out, &mut saved);
    let (mut gi, mut gp) = (vec![0.0; x.len()], vec![0.0; full.params()]);
    full.backward(
        &params,
        None,
        &saved,
        Input::Hidden(&x),
        SliceGrads {
            output: &dy,
            input: Some(&mut gi),
            params: &mut gp,
            tied: None,
        },
    );

    let slices: Vec<BlockSlice> = (0..t)
        .map(|k| BlockSlice::new(l, m, rank(t, k)).unwrap())
        .collect();
    let p: Vec<Vec<f32>> = slices
        .iter()
        .map(|s| {
            let k = if mode == Mode::SameSlice {
                0
            } else {
                s.layout().rank().index
            };
            SliceLayout::new(l, rank(t, k)).unwrap().slice(&params)
        })
        .collect();
    let n = slices[0].stream_elements();
    let combine = |parts: &[Vec<f32>]| -> Vec<f32> {
        match mode {
            Mode::RankZero => parts[0].clone(),
            _ => (0..n).map(|i| parts.iter().map(|q| q[i]).sum()).collect(),
        }
    };
    let mut saved: Vec<Vec<f32>> = slices
        .iter()
        .map(|s| vec![f32::NAN; s.saved_elements()])
        .collect();
    let mut partial = vec![vec![0.0; n]; t];
    let mut stream = vec![x.clone(); t];
    for j in 0..slices[0].sublayers() {
        for k in 0..t {
            slices[k].forward_open(j, &p[k], &stream[k], &mut saved[k], &mut partial[k]);
        }
        let sum = combine(&partial);
        for k in 0..t {
            slices[k].forward_close(j, &p[k], &sum, &mut stream[k]);
        }
    }
    for (k, s) in saved.iter().enumerate() {
        assert!(
            s.iter().all(|v| v.is_finite()),
            "rank {k} left saved unwritten"
        );
    }
    let mut grads: Vec<Vec<f32>> = slices.iter().map(|s| vec![f32::NAN; s.params()]).collect();
    let mut sg = vec![dy.clone(); t];
    for j in (0..slices[0].sublayers()).rev() {
        for k in 0..t {
            slices[k].backward_open(j, &p[k], &saved[k], &sg[k], &mut grads[k], &mut partial[k]);
        }
        let sum = combine(&partial);
        for k in 0..t {
            slices[k].backward_close(j, &p[k], &x, &saved[k], &sum, &mut sg[k], &mut grads[k]);
        }
    }
    if mode == Mode::Sum {
        // Every rank ends with the same stream and, for the replicated tensors, the same
        // gradients: no reduction of them is needed without sequence parallelism.
        for k in 1..t {
            assert_eq!(stream[k], stream[0]);
            assert_eq!(sg[k], sg[0]);
            for ts in slices[k].layout().tensors() {
                if ts.split == Split::Replicated {
                    let r = ts.range.clone();
                    assert_eq!(grads[k][r.clone()], grads[0][r], "{}", ts.name);
                }
            }
        }
    }
    let refs: Vec<&[f32]> = grads.iter().map(Vec::as_slice).collect();
    let gathered = gather(l, t, &refs).unwrap();
    Outcome {
        output: rel(&stream[0], &out),
        grad_input: rel(&sg[0], &gi),
        grads: rel_tensors(l, &gathered, &gp),
    }
}

fn check_blocks(name: &str, sizes: &[usize]) {
    let m = model(name);
    for l in m
        .layers
        .iter()
        .filter(|l| matches!(l.kind, LayerKind::Transformer(_) | LayerKind::Mlp(_)))
    {
        for &t in sizes {
            let o = block_parity(&m, &l.name, t, Mode::Sum);
            let what = format!("{name} {} t={t}", l.name);
            assert!(o.output < TOL, "{what}: output off by {}", o.output);
            assert!(
                o.grad_input < TOL,
                "{what}: input gradient off by {}",
                o.grad_input
            );
            assert!(
                o.grads < TOL,
                "{what}: parameter gradients off by {}",
                o.grads
            );
            if t == 1 {
                // One rank: the slice is the layer, and the same operations give the same bits.
                assert_eq!((o.output, o.grad_input, o.grads), (0.0, 0.0, 0.0), "{what}");
            } else {
                for mode in [Mode::RankZero, Mode::SameSlice] {
                    let o = block_parity(&m, &l.name, t, mode);
                    assert!(o.output > 1e-3, "{what}: a wrong reduction went unnoticed");
                    assert!(o.grads > 1e-3, "{what}: a wrong reduction went unnoticed");
                }
            }
        }
    }
}

#[test]
fn gpt_blocks_sum_to_the_full_layer() {
    check_blocks("gpt_259", &[1, 2, 4]);
    check_blocks("tiny_gpt", &[1, 2, 4]);
}

#[test]
fn llama_blocks_sum_to_the_full_layer() {
    check_blocks("llama_259", &[1, 2, 4]);
    check_blocks("tiny_llama", &[1, 2]);
}

/// An all-reduce between threads: each rank puts its buffer in its slot and every rank sums
/// the slots in rank order, so all get the same bits.
struct Group {
    barrier: Barrier,
    slots: Mutex<Vec<Vec<f32>>>,
}

impl Group {
    fn new(t: usize) -> Self {
        Group {
            barrier: Barrier::new(t),
            slots: Mutex::new(vec![vec![]; t]),
        }
    }

    fn all_reduce(&self, k: usize, op: Reduce, buf: &mut [f32]) {
        self.slots.lock().unwrap()[k] = buf.to_vec();
        self.barrier.wait();
        {
            let slots = self.slots.lock().unwrap();
            for (i, v) in buf.iter_mut().enumerate() {
                let mut it = slots.iter().map(|s| s[i]);
                let first = it.next().unwrap();
                *v = match op {
                    Reduce::Sum => it.fold(first, |a, b| a + b),
                    Reduce::Max => it.fold(first, f32::max),
                };
            }
        }
        self.barrier.wait();
    }
}

#[test]
fn ranks_on_threads_with_a_real_all_reduce() {
    let m = model("llama_259");
    let l = layer(&m, "block[0]");
    let full = LayerMath::new(l, &m).unwrap();
    let mut rng = Rng::new(5);
    let params = params_of(l, &mut rng);
    let x = rng.normals(full.input_elements(), 1.0);
    let dy = rng.normals(full.output_elements(), 1.0);
    let mut out = vec![0.0; full.output_elements()];
    let mut saved = vec![0.0; full.saved_elements()];
    full.forward(&params, None, Input::Hidden(&x), &mut out, &mut saved);
    let (mut gi, mut gp) = (vec![0.0; x.len()], vec![0.0; full.params()]);
    let grads = SliceGrads {
        output: &dy,
        input: Some(&mut gi),
        params: &mut gp,
        tied: None,
    };
    full.backward(&params, None, &saved, Input::Hidden(&x), grads);
    for t in [2, 4] {
        let group = Group::new(t);
        let results: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = std::thread::scope(|sc| {
            let handles: Vec<_> = (0..t)
                .map(|k| {
                    let (group, params, x, dy, m) = (&group, &params, &x, &dy, &m);
                    sc.spawn(move || {
                        let s = BlockSlice::new(l, m, rank(t, k)).unwrap();
                        let p = s.layout().slice(params);
                        let mut reduce = |b: &mut [f32]| group.all_reduce(k, Reduce::Sum, b);
                        let mut out = vec![0.0; s.stream_elements()];
                        let mut saved = vec![0.0; s.saved_elements()];
                        s.forward(&p, x, &mut out, &mut saved, &mut reduce);
                        let (mut gi, mut g) = (vec![0.0; x.len()], vec![0.0; s.params()]);
                        s.backward(&p, x, &saved, dy, &mut gi, &mut g, &mut reduce);
                        (out, gi, g)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let refs: Vec<&[f32]> = results.iter().map(|r| r.2.as_slice()).collect();
        for (o, g, _) in &results {
            assert!(rel(o, &out) < TOL && rel(g, &gi) < TOL, "t={t}");
        }
        assert!(
            rel_tensors(l, &gather(l, t, &refs).unwrap(), &gp) < TOL,
            "t={t}"
        );
    }
}

// ---- vocabulary-parallel embedding, head and cross-entropy ----

/// The logits of rank `shard` ([rows, width]) cut from full ones ([rows, vocab] in rows
/// `stride` apart), the padding columns filled with `pad`.
fn cut(full: &[f32], stride: usize, shard: &VocabShard, rows: usize, pad: f32) -> Vec<f32> {
    let mut out = vec![pad; rows * shard.width];
    for i in 0..rows {
        let src = &full[i * stride + shard.start..][..shard.columns()];
        out[i * shard.width..][..shard.columns()].copy_from_slice(src);
    }
    out
}

/// The full [rows, vocab] matrix from the ranks' columns (padding dropped).
fn join(parts: &[Vec<f32>], shards: &[VocabShard], rows: usize) -> Vec<f32> {
    let vocab = shards[0].vocab;
    let mut out = vec![0.0; rows * vocab];
    for (p, s) in parts.iter().zip(shards) {
        for i in 0..rows {
            out[i * vocab + s.start..][..s.columns()]
                .copy_from_slice(&p[i * s.width..][..s.columns()]);
        }
    }
    out
}

/// Parallel cross-entropy on each rank's cut of `logits` ([rows, vocab], dense), the
/// reductions done by summing and maximising over the ranks (or, `reduce_sums` false, each
/// rank's sums left local): every rank's loss and the gathered gradient.
fn parallel_ce(
    logits: &[f32],
    targets: &[u32],
    vocab: usize,
    t: usize,
    pad: f32,
    reduce_sums: bool,
) -> (Vec<f64>, Vec<f32>, Vec<Vec<f32>>) {
    let n = targets.len();
    let shards: Vec<VocabShard> = (0..t).map(|k| VocabShard::new(vocab, rank(t, k))).collect();
    let cuts: Vec<Vec<f32>> = shards
        .iter()
        .map(|s| cut(logits, vocab, s, n, pad))
        .collect();
    let mut max = vec![vec![0.0; n]; t];
    for k in 0..t {
        vocab_max(&cuts[k], shards[k].width, &shards[k], &mut max[k]);
    }
    let max: Vec<f32> = (0..n)
        .map(|i| max.iter().fold(f32::NEG_INFINITY, |m, v| m.max(v[i])))
        .collect();
    let mut sums = vec![vec![0.0; 2 * n]; t];
    for k in 0..t {
        vocab_sums(
            &cuts[k],
            shards[k].width,
            &shards[k],
            targets,
            &max,
            &mut sums[k],
        );
    }
    let total: Vec<f32> = (0..2 * n)
        .map(|i| sums.iter().map(|v| v[i]).sum())
        .collect();
    let mut grads: Vec<Vec<f32>> = shards.iter().map(|s| vec![f32::NAN; n * s.width]).collect();
    let losses = (0..t)
        .map(|k| {
            let s = if reduce_sums { &total } else { &sums[k] };
            let w = shards[k].width;
            vocab_loss(&cuts[k], w, &shards[k], targets, &max, s, &mut grads[k])
        })
        .collect();
    (losses, join(&grads, &shards, n), grads)
}

fn ce_case(vocab: usize, rows: usize, seed: u64) -> (Vec<f32>, Vec<u32>) {
    let mut rng = Rng::new(seed);
    let logits = rng.normals(rows * vocab, 2.0);
    let targets = (0..rows).map(|_| rng.below(vocab as u64) as u32).collect();
    (logits, targets)
}

#[test]
fn parallel_cross_entropy_equals_the_gathered_one() {
    for vocab in [256, 259, 13] {
        let rows = 24;
        let (logits, targets) = ce_case(vocab, rows, vocab as u64);
        let mut grad = vec![0.0; logits.len()];
        let loss = cross_entropy(&logits, &targets, vocab, vocab, &mut grad);
        for t in [1, 2, 4] {
            // Padding columns hold values that would win the softmax (or poison it) if read.
            for pad in [1e30, f32::NAN] {
                let (losses, g, per_rank) = parallel_ce(&logits, &targets, vocab, t, pad, true);
                for l in &losses {
                    assert!(
                        (l - loss).abs() <= 1e-6 * loss.abs(),
                        "V={vocab} t={t}: {l} vs {loss}"
                    );
                }
                assert!(rel(&g, &grad) < TOL, "V={vocab} t={t}: {}", rel(&g, &grad));
                for (k, p) in per_rank.iter().enumerate() {
                    let s = VocabShard::new(vocab, rank(t, k));
                    for row in p.chunks_exact(s.width) {
                        assert!(row[s.columns()..].iter().all(|&v| v == 0.0), "padding grad");
                    }
                }
            }
            if t > 1 {
                let (losses, ..) = parallel_ce(&logits, &targets, vocab, t, 0.0, false);
                assert!(
                    losses.iter().any(|l| (l - loss).abs() > 1e-3 * loss.abs()),
                    "V={vocab} t={t}: a missing reduction went unnoticed"
                );
            }
        }
    }
}

#[test]
fn parallel_cross_entropy_on_threads() {
    let (vocab, rows, t) = (259, 16, 4);
    let (logits, targets) = ce_case(vocab, rows, 3);
    let mut grad = vec![0.0; logits.len()];
    let loss = cross_entropy(&logits, &targets, vocab, vocab, &mut grad);
    let group = Group::new(t);
    let shards: Vec<VocabShard> = (0..t).map(|k| VocabShard::new(vocab, rank(t, k))).collect();
    // Rows wider than the shard: the stride is not the width.
    let stride = shards[0].width + 3;
    let out: Vec<(f64, Vec<f32>)> = std::thread::scope(|sc| {
        let handles: Vec<_> = shards
            .iter()
            .enumerate()
            .map(|(k, s)| {
                let (group, logits, targets) = (&group, &logits, &targets);
                sc.spawn(move || {
                    let c = cut(logits, vocab, s, rows, f32::INFINITY);
                    let mut wide = vec![-1.0; rows * stride];
                    for i in 0..rows {
                        wide[i * stride..][..s.width].copy_from_slice(&c[i * s.width..][..s.width]);
                    }
                    let mut g = vec![7.0; rows * stride];
                    let mut reduce = |op: Reduce, b: &mut [f32]| group.all_reduce(k, op, b);
                    let l = vocab_cross_entropy(&wide, stride, s, targets, &mut g, &mut reduce);
                    assert!(g.chunks_exact(stride).all(|r| r[s.width..] == [7.0; 3]));
                    let g = g
                        .chunks_exact(stride)
                        .flat_map(|r| r[..s.width].to_vec())
                        .collect();
                    (l, g)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (l, _) in &out {
        assert!((l - loss).abs() <= 1e-6 * loss);
    }
    let parts: Vec<Vec<f32>> = out.into_iter().map(|o| o.1).collect();
    assert!(rel(&join(&parts, &shards, rows), &grad) < TOL);
}

/// The finite-difference gradient of the parallel loss (mean over rows, accumulated in f64)
/// against its analytic gradient, on a vocabulary of 13 over 4 ranks (the last holds one word
/// and three padding columns); `wrong` drops the target's −1/n, which must fail.
fn ce_gradcheck(wrong: bool) -> Vec<String> {
    const EPS: f32 = 1e-2;
    let (vocab, rows, t) = (13, 6, 4);
    let (mut logits, targets) = ce_case(vocab, rows, 17);
    let loss = |z: &[f32]| parallel_ce(z, &targets, vocab, t, f32::NAN, true).0[0] / rows as f64;
    let (_, mut grad, _) = parallel_ce(&logits, &targets, vocab, t, f32::NAN, true);
    if wrong {
        for (i, &tg) in targets.iter().enumerate() {
            grad[i * vocab + tg as usize] += 1.0 / rows as f32;
        }
    }
    let mut failures = vec![];
    for i in 0..logits.len() {
        let x = logits[i];
        logits[i] = x + EPS;
        let up = loss(&logits);
        logits[i] = x - EPS;
        let down = loss(&logits);
        logits[i] = x;
        let fd = (up - down) / (2.0 * f64::from(EPS));
        let an = f64::from(grad[i]);
        if (fd - an).abs() > 1e-4 + 1e-2 * fd.abs().max(an.abs()) {
            failures.push(format!(
                "logit {i}: finite difference {fd:.6}, analytic {an:.6}"
            ));
        }
    }
    failures
}

#[test]
fn parallel_cross_entropy_passes_a_finite_difference_check() {
    let failures = ce_gradcheck(false);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(!ce_gradcheck(true).is_empty(), "the check cannot fail");
}

/// The embedding, the head and the loss of `name` at t, against the full layers: the
/// embedding's output and gradients, the head's logits, the loss and its gradient, the head's
/// input and parameter (and tied) gradients.
fn vocab_parity(name: &str, t: usize) {
    let m = model(name);
    let (emb, head) = (&m.layers[0], m.layers.last().unwrap());
    let (fe, fh) = (
        LayerMath::new(emb, &m).unwrap(),
        LayerMath::new(head, &m).unwrap(),
    );
    let mut rng = Rng::new(23);
    let (pe, ph) = (params_of(emb, &mut rng), params_of(head, &mut rng));
    let n = tokens(&m);
    let v = vocab(&m);
    let toks: Vec<u32> = (0..n).map(|_| rng.below(v as u64) as u32).collect();
    let targets: Vec<u32> = (0..n).map(|_| rng.below(v as u64) as u32).collect();
    let tie = fh.is_tied();
    let wte = schedrun::math::tensor_range(emb, "wte").unwrap();
    let tied = tie.then(|| &pe[wte.clone()]);

    // The full layers and loss.
    let mut x = vec![0.0; fe.output_elements()];
    fe.forward(&pe, None, Input::Tokens(&toks), &mut x, &mut []);
    let stride = fh.output_stride();
    let mut logits = vec![0.0; fh.output_elements()];
    let mut hs = vec![0.0; fh.saved_elements()];
    fh.forward(&ph, tied, Input::Hidden(&x), &mut logits, &mut hs);
    let mut dlogits = vec![0.0; logits.len()];
    let loss = cross_entropy(&logits, &targets, v, stride, &mut dlogits);
    let (mut gx, mut gph, mut gt) = (
        vec![0.0; x.len()],
        vec![0.0; ph.len()],
        vec![0.0; wte.len()],
    );
    let grads = SliceGrads {
        output: &dlogits,
        input: Some(&mut gx),
        params: &mut gph,
        tied: tie.then_some(&mut gt[..]),
    };
    fh.backward(&ph, tied, &hs, Input::Hidden(&x), grads);
    let mut gpe = vec![0.0; pe.len()];
    let grads = SliceGrads {
        output: &gx,
        input: None,
        params: &mut gpe,
        tied: None,
    };
    fe.backward(&pe, None, &[], Input::Tokens(&toks), grads);
    if tie {
        for (a, &b) in gpe[wte.clone()].iter_mut().zip(&gt) {
            *a += b;
        }
    }

    // The slices, phase by phase.
    let es: Vec<EmbeddingSlice> = (0..t)
        .map(|k| EmbeddingSlice::new(emb, &m, rank(t, k)).unwrap())
        .collect();
    let hsl: Vec<HeadSlice> = (0..t)
        .map(|k| HeadSlice::new(head, &m, rank(t, k)).unwrap())
        .collect();
    let pes: Vec<Vec<f32>> = es.iter().map(|s| s.layout().slice(&pe)).collect();
    let phs: Vec<Vec<f32>> = hsl.iter().map(|s| s.layout().slice(&ph)).collect();
    let sum_of = |parts: &[Vec<f32>]| -> Vec<f32> {
        (0..parts[0].len())
            .map(|i| parts.iter().map(|p| p[i]).sum())
            .collect()
    };
    let mut partial = vec![vec![0.0; x.len()]; t];
    for k in 0..t {
        es[k].forward_open(&pes[k], &toks, &mut partial[k]);
    }
    let sum = sum_of(&partial);
    let mut xs = vec![vec![0.0; x.len()]; t];
    for k in 0..t {
        es[k].forward_close(&pes[k], &sum, &mut xs[k]);
        assert_eq!(
            xs[k], x,
            "{name} t={t}: the embedding's sum has one term per token"
        );
    }
    let shards: Vec<VocabShard> = hsl.iter().map(|s| s.shard()).collect();
    let tied_of = |k: usize| tie.then(|| &pes[k][es[k].wte()]);
    let mut lk: Vec<Vec<f32>> = hsl.iter().map(|s| vec![0.0; s.logits_elements()]).collect();
    let mut saved: Vec<Vec<f32>> = hsl.iter().map(|s| vec![0.0; s.saved_elements()]).collect();
    for k in 0..t {
        hsl[k].forward(&phs[k], tied_of(k), &xs[k], &mut saved[k], &mut lk[k]);
    }
    let dense: Vec<f32> = logits
        .chunks_exact(stride)
        .flat_map(|r| r[..v].to_vec())
        .collect();
    let tol = if t == 1 { 0.0 } else { TOL };
    assert!(
        rel(&join(&lk, &shards, n), &dense) <= tol,
        "{name} t={t}: logits"
    );
    // The loss from the ranks' logits alone.
    let mut max = vec![vec![0.0; n]; t];
    for k in 0..t {
        vocab_max(&lk[k], shards[k].width, &shards[k], &mut max[k]);
    }
    let max: Vec<f32> = (0..n)
        .map(|i| max.iter().fold(f32::NEG_INFINITY, |a, m| a.max(m[i])))
        .collect();
    let mut sums = vec![vec![0.0; 2 * n]; t];
    for k in 0..t {
        vocab_sums(
            &lk[k],
            shards[k].width,
            &shards[k],
            &targets,
            &max,
            &mut sums[k],
        );
    }
    let sums = sum_of(&sums);
    let mut dl: Vec<Vec<f32>> = lk.iter().map(|l| vec![0.0; l.len()]).collect();
    for k in 0..t {
        let l = vocab_loss(
            &lk[k],
            shards[k].width,
            &shards[k],
            &targets,
            &max,
            &sums,
            &mut dl[k],
        );
        assert!(
            (l - loss).abs() <= 1e-6 * loss,
            "{name} t={t}: loss {l} vs {loss}"
        );
    }
    let ddense: Vec<f32> = dlogits
        .chunks_exact(stride)
        .flat_map(|r| r[..v].to_vec())
        .collect();
    assert!(
        rel(&join(&dl, &shards, n), &ddense) <= tol,
        "{name} t={t}: dlogits"
    );
    // The head's backward, then the embedding's.
    let mut gps: Vec<Vec<f32>> = hsl.iter().map(|s| vec![f32::NAN; s.params()]).collect();
    let mut gts: Vec<Vec<f32>> = hsl
        .iter()
        .map(|s| vec![f32::NAN; s.tied_elements()])
        .collect();
    for k in 0..t {
        let gt = tie.then_some(&mut gts[k][..]);
        let (p, tw) = (&phs[k], tied_of(k));
        hsl[k].backward_open(p, tw, &saved[k], &dl[k], &mut gps[k], gt, &mut partial[k]);
    }
    let sum = sum_of(&partial);
    let mut gxs = vec![vec![0.0; x.len()]; t];
    for k in 0..t {
        hsl[k].backward_close(&phs[k], &xs[k], &saved[k], &sum, &mut gps[k], &mut gxs[k]);
        assert_eq!(gxs[k], gxs[0]);
    }
    assert!(
        rel(&gxs[0], &gx) <= tol,
        "{name} t={t}: head input gradient"
    );
    let refs: Vec<&[f32]> = gps.iter().map(Vec::as_slice).collect();
    assert!(
        rel_tensors(head, &gather(head, t, &refs).unwrap(), &gph) <= tol,
        "{name} t={t}: head grads"
    );
    let mut ges: Vec<Vec<f32>> = es.iter().map(|s| vec![f32::NAN; s.params()]).collect();
    for k in 0..t {
        es[k].backward(&toks, &gxs[0], &mut ges[k]);
        if tie {
            let r = es[k].wte();
            for (a, &b) in ges[k][r].iter_mut().zip(&gts[k]) {
                *a += b;
            }
        }
    }
    let refs: Vec<&[f32]> = ges.iter().map(Vec::as_slice).collect();
    let gathered = gather(emb, t, &refs).unwrap();
    assert!(
        rel_tensors(emb, &gathered, &gpe) <= tol,
        "{name} t={t}: embedding grads"
    );
    // Padding rows get no gradient.
    for (k, s) in es.iter().enumerate() {
        let (h, sh) = (x.len() / n, s.shard());
        let pad = &ges[k][s.wte()][sh.columns() * h..];
        assert!(
            pad.iter().all(|&g| g == 0.0),
            "{name} t={t}: padding rows' gradient"
        );
    }
}

#[test]
fn vocabulary_parallel_embedding_head_and_loss() {
    for t in [1, 2, 4] {
        vocab_parity("gpt_259", t);
        vocab_parity("llama_259", t);
        vocab_parity("tiny_gpt", t);
    }
}

/// What the lowering plans for a slice's saved activations (`abi::slice_saved_bytes`) is what
/// the device layer's sliced math saves, byte for byte: naive attention (probabilities) and
/// flash (log-sum-exps), GQA, SwiGLU, fp32 and bf16, t = 1, 2 and 4.
#[test]
fn planned_slice_activations_are_what_the_sliced_math_saves() {
    use schedrun::math::Stored;
    let mut checked = 0;
    for name in ["gpt_259", "llama_259", "tiny_gpt", "tiny_llama"] {
        for dtype in [sched_ir::job::Dtype::Fp32, sched_ir::job::Dtype::Bf16] {
            let mut m = model(name);
            m.dtype = dtype;
            for t in [1u32, 2, 4] {
                for l in m
                    .layers
                    .iter()
                    .filter(|l| !matches!(l.kind, LayerKind::Dense { .. }))
                {
                    let Ok(math) = LayerMath::sliced(l, &m, t) else {
                        continue; // kv heads that t does not divide
                    };
                    let saved: u64 = math
                        .saved_segments()
                        .iter()
                        .map(|s| {
                            s.elements as u64
                                * match s.stored {
                                    Stored::Model => dtype.bytes(),
                                    Stored::F32 => 4,
                                }
                        })
                        .sum();
                    let planned = sched_ir::abi::slice_saved_bytes(&l.kind, &m, t);
                    assert_eq!(planned, saved, "{name} {dtype:?} t = {t}: {}", l.name);
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 40, "only {checked} layers checked");
}
