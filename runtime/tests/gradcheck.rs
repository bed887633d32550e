//! Finite-difference gradient checks of every layer kind and variant, and of the loss.
//!
//! Each check takes L = Σ output ⊙ R for a fixed random R (so grad_output = R), perturbs single
//! coordinates of the parameters, the input and the tied `wte` by ±ε, and compares the central
//! difference of L (accumulated in f64) with the analytic gradient from `backward`. Parameters are
//! drawn larger than the real init (std 0.3, gains near 1) so ε is small against them, and every
//! tensor gets coordinates of its own.

mod common;

use sched_ir::job::{LayerKind, Model};
use schedrun::math::{cross_entropy, Input, LayerMath, Rng, SliceGrads};

const EPS: f32 = 1e-2;
const RTOL: f64 = 2e-2;
const ATOL: f64 = 2e-3;

/// Small models covering every variant; sequences of 5 (one attention block) except `*_long`
/// (70 tokens: two blocks, the second partial).
const MODELS: &str = r#"
model gpt_naive {
    dtype = fp32  optimizer = adamw  seq_len = 5  micro_batch = 2
    layer embed    = embedding(vocab = 16, hidden = 8, positions = learned)
    layer block[1] = transformer(hidden = 8, heads = 2, ffn = 12, attention = naive)
    layer m        = mlp(hidden = 8, ffn = 12)
    layer head     = lm_head(hidden = 8, vocab = 16, tied = true)
}
model gpt_flash {
    dtype = fp32  optimizer = adamw  seq_len = 5  micro_batch = 2
    layer embed    = embedding(vocab = 16, hidden = 8, positions = learned)
    layer block[1] = transformer(hidden = 8, heads = 2, ffn = 12, attention = flash)
    layer head     = lm_head(hidden = 8, vocab = 16)
}
model gpt_long {
    dtype = fp32  optimizer = adamw  seq_len = 70  micro_batch = 1
    layer embed    = embedding(vocab = 16, hidden = 8, positions = learned)
    layer block[1] = transformer(hidden = 8, heads = 2, ffn = 12, attention = flash)
    layer head     = lm_head(hidden = 8, vocab = 16, tied = true)
}
model llama_naive {
    dtype = fp32  optimizer = adamw  seq_len = 5  micro_batch = 2
    layer embed    = embedding(vocab = 16, hidden = 16, positions = rope)
    layer block[1] = transformer(hidden = 16, heads = 4, kv_heads = 2, ffn = 12,
                                 norm = rmsnorm, act = swiglu, bias = false, attention = naive)
    layer m        = mlp(hidden = 16, ffn = 12, act = swiglu, norm = rmsnorm, bias = false)
    layer head     = lm_head(hidden = 16, vocab = 16, norm = rmsnorm)
}
model llama_flash {
    dtype = fp32  optimizer = adamw  seq_len = 5  micro_batch = 2
    layer embed    = embedding(vocab = 16, hidden = 16, positions = rope)
    layer block[1] = transformer(hidden = 16, heads = 4, kv_heads = 2, ffn = 12,
                                 norm = rmsnorm, act = swiglu, bias = false, attention = flash)
    layer head     = lm_head(hidden = 16, vocab = 16, norm = rmsnorm, tied = true)
}
model llama_long {
    dtype = fp32  optimizer = adamw  seq_len = 70  micro_batch = 1
    layer embed    = embedding(vocab = 16, hidden = 8, positions = rope)
    layer block[1] = transformer(hidden = 8, heads = 2, kv_heads = 1, ffn = 12,
                                 norm = rmsnorm, act = swiglu, bias = false, attention = naive)
    layer head     = lm_head(hidden = 8, vocab = 16, norm = rmsnorm)
}
model odd_vocab {
    dtype = fp32  optimizer = adamw  seq_len = 5  micro_batch = 2
    layer embed    = embedding(vocab = 13, hidden = 8, positions = learned)
    layer block[1] = transformer(hidden = 8, heads = 2, ffn = 12, attention = naive)
    layer head     = lm_head(hidden = 8, vocab = 13, tied = true)
}
model plain {
    dtype = fp32  optimizer = adamw  seq_len = 5  micro_batch = 2
    layer embed    = embedding(vocab = 16, hidden = 8, positions = none)
    layer block[1] = transformer(hidden = 8, heads = 2, ffn = 12, norm = rmsnorm, act = gelu, attention = naive)
    layer m        = mlp(hidden = 8, ffn = 12, act = swiglu, norm = layernorm, bias = true)
    layer head     = lm_head(hidden = 8, vocab = 16, norm = layernorm)
}
"#;

fn model(name: &str) -> Model {
    common::model(MODELS, name)
}

struct Case {
    params: Vec<f32>,
    tied: Option<Vec<f32>>,
    tokens: Vec<u32>,
    hidden: Vec<f32>,
    r: Vec<f32>,
}

/// L = Σ forward(…) ⊙ R, in f64.
fn loss(m: &LayerMath, c: &Case) -> f64 {
    let mut out = vec![0.0; m.output_elements()];
    let mut saved = vec![f32::NAN; m.saved_elements()];
    let input = if m.takes_tokens() {
        Input::Tokens(&c.tokens)
    } else {
        Input::Hidden(&c.hidden)
    };
    m.forward(&c.params, c.tied.as_deref(), input, &mut out, &mut saved);
    out.iter()
        .zip(&c.r)
        .map(|(&o, &r)| f64::from(o) * f64::from(r))
        .sum()
}

fn central(m: &LayerMath, c: &mut Case, get: fn(&mut Case) -> &mut Vec<f32>, i: usize) -> f64 {
    let x = get(c)[i];
    get(c)[i] = x + EPS;
    let up = loss(m, c);
    get(c)[i] = x - EPS;
    let down = loss(m, c);
    get(c)[i] = x;
    (up - down) / (2.0 * f64::from(EPS))
}

fn compare(what: &str, fd: f64, an: f32, failures: &mut Vec<String>) {
    let an = f64::from(an);
    if (fd - an).abs() > ATOL + RTOL * fd.abs().max(an.abs()) {
        failures.push(format!(
            "{what}: finite difference {fd:.6}, backward {an:.6}"
        ));
    }
}

/// Checks layer `layer` of `model`: parameters (a few coordinates of each tensor, more of large
/// ones), the input, and the tied `wte`.
fn check(model_name: &str, layer: &str) {
    let model = model(model_name);
    let l = model
        .layers
        .iter()
        .find(|l| l.name == layer)
        .unwrap_or_else(|| panic!("no layer {layer}"));
    let m = LayerMath::new(l, &model).expect("runnable");
    let mut rng = Rng::new(0xc0ffee ^ (model_name.len() * 31 + layer.len()) as u64);
    let t = (model.micro_batch * model.seq_len) as usize;
    let mut params = vec![];
    for ts in &l.tensors {
        let n = ts.elements() as usize;
        if ts.shape.len() == 1 && ts.name.ends_with("weight") {
            params.extend(rng.normals(n, 0.2).iter().map(|v| 1.0 + v));
        } else {
            params.extend(rng.normals(n, 0.3));
        }
    }
    let vocab = model
        .layers
        .iter()
        .find_map(|l| match l.kind {
            LayerKind::Embedding { vocab, .. } => Some(vocab),
            _ => None,
        })
        .expect("an embedding");
    let mut c = Case {
        params,
        tied: m.is_tied().then(|| rng.normals(m.tied_elements(), 0.3)),
        tokens: (0..t).map(|_| rng.below(vocab) as u32).collect(),
        hidden: rng.normals(
            if m.takes_tokens() {
                0
            } else {
                m.input_elements()
            },
            1.0,
        ),
        r: rng.normals(m.output_elements(), 1.0),
    };

    let mut gi = vec![
        0.0;
        if m.takes_tokens() {
            0
        } else {
            m.input_elements()
        }
    ];
    let mut gp = vec![f32::NAN; m.params()];
    let mut gt = vec![f32::NAN; m.tied_elements()];
    let mut out = vec![0.0; m.output_elements()];
    let mut saved = vec![f32::NAN; m.saved_elements()];
    let input = if m.takes_tokens() {
        Input::Tokens(&c.tokens)
    } else {
        Input::Hidden(&c.hidden)
    };
    m.forward(&c.params, c.tied.as_deref(), input, &mut out, &mut saved);
    assert!(
        saved.iter().all(|v| v.is_finite()),
        "forward left part of `saved` unwritten"
    );
    gi.fill(f32::NAN);
    m.backward(
        &c.params,
        c.tied.as_deref(),
        &saved,
        input,
        SliceGrads {
            output: &c.r,
            input: (!m.takes_tokens()).then_some(&mut gi[..]),
            params: &mut gp,
            tied: m.is_tied().then_some(&mut gt[..]),
        },
    );
    assert!(
        gp.iter().all(|g| g.is_finite()),
        "grad_params not all written"
    );
    assert!(
        gi.iter().all(|g| g.is_finite()),
        "grad_input not all written"
    );
    assert!(
        gt.iter().all(|g| g.is_finite()),
        "grad_tied not all written"
    );

    let mut failures = vec![];
    let mut checked = 0;
    let mut at = 0;
    for ts in &l.tensors {
        let n = ts.elements() as usize;
        let mut picks: Vec<usize> = (0..6.min(n))
            .map(|_| at + rng.below(n as u64) as usize)
            .collect();
        if ts.name == "wte" {
            // Rows of tokens that occur, so most picks have a nonzero gradient.
            let h = ts.shape[1] as usize;
            picks.extend(
                (0..6).map(|k| c.tokens[k % t] as usize * h + rng.below(h as u64) as usize),
            );
        }
        for i in picks {
            let fd = central(&m, &mut c, |c| &mut c.params, i);
            compare(
                &format!("{model_name}/{layer}: {}[{}]", ts.name, i - at),
                fd,
                gp[i],
                &mut failures,
            );
            checked += 1;
        }
        at += n;
    }
    for _ in 0..if m.takes_tokens() { 0 } else { 12 } {
        let i = rng.below(gi.len() as u64) as usize;
        let fd = central(&m, &mut c, |c| &mut c.hidden, i);
        compare(
            &format!("{model_name}/{layer}: input[{i}]"),
            fd,
            gi[i],
            &mut failures,
        );
        checked += 1;
    }
    for _ in 0..if m.is_tied() { 12 } else { 0 } {
        let i = rng.below(gt.len() as u64) as usize;
        let fd = central(&m, &mut c, |c| c.tied.as_mut().expect("tied"), i);
        compare(
            &format!("{model_name}/{layer}: tied wte[{i}]"),
            fd,
            gt[i],
            &mut failures,
        );
        checked += 1;
    }
    assert!(checked >= 12, "too few coordinates checked");
    assert!(
        failures.is_empty(),
        "{} of {checked} coordinates differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn embedding_learned_positions() {
    check("gpt_naive", "embed");
}

#[test]
fn embedding_rope_has_no_table() {
    check("llama_naive", "embed");
}

#[test]
fn embedding_without_positions() {
    check("plain", "embed");
}

#[test]
fn transformer_gpt_naive() {
    check("gpt_naive", "block[0]");
}

#[test]
fn transformer_gpt_flash() {
    check("gpt_flash", "block[0]");
}

#[test]
fn transformer_gpt_flash_two_blocks_of_rows() {
    check("gpt_long", "block[0]");
}

#[test]
fn transformer_llama_naive_rope_gqa() {
    check("llama_naive", "block[0]");
}

#[test]
fn transformer_llama_flash_rope_gqa() {
    check("llama_flash", "block[0]");
}

#[test]
fn transformer_llama_one_kv_head_two_blocks_of_rows() {
    check("llama_long", "block[0]");
}

#[test]
fn transformer_rmsnorm_gelu_bias_without_rope() {
    check("plain", "block[0]");
}

#[test]
fn mlp_gelu_layernorm_bias() {
    check("gpt_naive", "m");
}

#[test]
fn mlp_swiglu_rmsnorm() {
    check("llama_naive", "m");
}

#[test]
fn mlp_swiglu_layernorm_bias() {
    check("plain", "m");
}

#[test]
fn lm_head_tied_layernorm() {
    check("gpt_naive", "head");
}

#[test]
fn lm_head_untied_layernorm() {
    check("plain", "head");
}

#[test]
fn lm_head_untied_rmsnorm() {
    check("llama_naive", "head");
}

#[test]
fn lm_head_tied_rmsnorm() {
    check("llama_flash", "head");
}

/// A head over 13 words: its logits lie in rows of 16 (`logits_stride`), whose padding the
/// backward is handed random values in (R) and must not read.
#[test]
fn lm_head_tied_over_an_odd_vocabulary() {
    check("odd_vocab", "head");
}

/// The loss over rows of 7 logits 8 apart, NaN in the padding: the value and the gradient of
/// the mean loss agree with f64 sums and central differences over the 7 columns, and the
/// padding of the gradient is not written.
#[test]
fn cross_entropy_gradient_and_value() {
    let (n, vocab, stride) = (6, 7, 8);
    let mut rng = Rng::new(7);
    let mut logits = rng.normals(n * stride, 2.0);
    logits
        .chunks_mut(stride)
        .for_each(|row| row[vocab] = f32::NAN);
    let targets: Vec<u32> = (0..n).map(|_| rng.below(vocab as u64) as u32).collect();
    let mut grad = vec![-1.0; n * stride];
    let total = cross_entropy(&logits, &targets, vocab, stride, &mut grad);
    assert!(
        grad.chunks(stride).all(|row| row[vocab] == -1.0),
        "padding written"
    );

    // The value against a direct f64 computation.
    let direct: f64 = logits
        .chunks(stride)
        .map(|row| &row[..vocab])
        .zip(&targets)
        .map(|(row, &t)| {
            let z: f64 = row.iter().map(|&x| f64::from(x).exp()).sum();
            z.ln() - f64::from(row[t as usize])
        })
        .sum();
    assert!(
        (total - direct).abs() < 1e-5 * direct.abs(),
        "{total} vs {direct}"
    );

    // The gradient of the mean loss, by central differences.
    let mut scratch = vec![0.0; n * stride];
    let mut failures = vec![];
    for i in (0..n * stride).filter(|i| i % stride < vocab) {
        let x = logits[i];
        logits[i] = x + EPS;
        let up = cross_entropy(&logits, &targets, vocab, stride, &mut scratch) / n as f64;
        logits[i] = x - EPS;
        let down = cross_entropy(&logits, &targets, vocab, stride, &mut scratch) / n as f64;
        logits[i] = x;
        compare(
            &format!("logit {i}"),
            (up - down) / (2.0 * f64::from(EPS)),
            grad[i],
            &mut failures,
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // Each row's gradient sums to zero.
    for row in grad.chunks(stride) {
        assert!(row[..vocab].iter().sum::<f32>().abs() < 1e-6);
    }
}
