//! Deterministic initialisation (`runtime.md`: weights normal(0, 0.02), residual output projections
//! scaled by 1/sqrt(2·layers), biases zero, norm gains one).
//!
//! Each tensor draws from its own generator seeded by (seed, layer name, tensor name), so a tensor's
//! values depend on nothing else: not on the schedule, the shard layout, the other layers or any
//! crate's version. The generator is written out here (splitmix64 seeding xoshiro256**, Box–Muller
//! normals) so the numbers never change underneath the weights files.

use sched_ir::job::{Layer, LayerKind, Model};

/// xoshiro256** seeded through splitmix64.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
    spare: Option<f64>,
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut st = seed;
        Rng {
            s: [
                splitmix64(&mut st),
                splitmix64(&mut st),
                splitmix64(&mut st),
                splitmix64(&mut st),
            ],
            spare: None,
        }
    }

    /// A generator for one named stream: FNV-1a over the seed and the names, then splitmix64.
    pub fn for_names(seed: u64, names: &[&str]) -> Self {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |b: u8| {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        };
        seed.to_le_bytes().into_iter().for_each(&mut eat);
        for n in names {
            eat(0xff); // separator: ("ab","c") and ("a","bc") differ
            n.bytes().for_each(&mut eat);
        }
        Rng::new(h)
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let out = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
    }

    /// Uniform in [0, 1), 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in 0..n (n > 0), by multiply-shift.
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Standard normal, by Box–Muller (both values of each pair are used).
    pub fn normal(&mut self) -> f64 {
        if let Some(z) = self.spare.take() {
            return z;
        }
        let u1 = 1.0 - self.next_f64(); // (0, 1]
        let u2 = self.next_f64();
        let r = (-2.0 * u1.ln()).sqrt();
        let theta = std::f64::consts::TAU * u2;
        self.spare = Some(r * theta.sin());
        r * theta.cos()
    }

    /// `n` normal values of standard deviation `std`, as f32 (test data and perturbations).
    pub fn normals(&mut self, n: usize, std: f64) -> Vec<f32> {
        (0..n).map(|_| (self.normal() * std) as f32).collect()
    }
}

/// Standard deviation of every weight matrix.
pub const INIT_STD: f64 = 0.02;

/// The initial flat parameter vector (P_l values) of `layer` for `seed`. A `dense` layer, which has
/// no tensors, gets zeros.
pub fn init_layer(layer: &Layer, model: &Model, seed: u64) -> Vec<f32> {
    let blocks = model
        .layers
        .iter()
        .filter(|l| matches!(l.kind, LayerKind::Transformer(_)))
        .count()
        .max(1);
    let residual_scale = 1.0 / (2.0 * blocks as f64).sqrt();
    let mut out = Vec::with_capacity(layer.params as usize);
    for t in &layer.tensors {
        let n = t.elements() as usize;
        if t.shape.len() >= 2 {
            let scale = match t.name.as_str() {
                "attn.proj.weight" | "mlp.proj.weight" => residual_scale,
                _ => 1.0,
            };
            let mut rng = Rng::for_names(seed, &[&layer.name, &t.name]);
            out.extend((0..n).map(|_| (rng.normal() * INIT_STD * scale) as f32));
        } else if t.name.ends_with("bias") {
            out.extend(std::iter::repeat_n(0.0, n));
        } else {
            out.extend(std::iter::repeat_n(1.0, n)); // norm gains
        }
    }
    out.resize(layer.params as usize, 0.0);
    out
}
