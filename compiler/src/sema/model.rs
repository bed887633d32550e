//! Resolving `model` blocks: dtypes, optimizer, layers with their tensors and exact parameter counts.
//!
//! Layers are expanded (`block[32]` becomes `block[0]` … `block[31]`) and each gets the tensors the
//! runtime names, in flattening order; a layer's parameter count is the sum of its tensors, which a
//! test checks against the closed formulas of `dsl.md`. Rules checked here: `heads` divides `hidden`,
//! `kv_heads` divides `heads`, even head size with rotary positions, positive sizes, an embedding
//! only first and an lm_head only last, consistent hidden widths between neighbouring layers, and a
//! tied lm_head matching the embedding it shares.
//!
//! Beyond the spec: the `mlp` kind also takes `norm = layernorm | rmsnorm` (default `layernorm`),
//! since it carries its own norm; `optimizer` defaults to `adam` and `micro_batch` to 1.
//!
//! `norm_eps` (every norm's ε, default 1e-5) and `rope_base` (the rotary θ, default 10,000) are
//! model-wide numbers; unset, the resolved model leaves them unset, so plans are unchanged.

use super::values::*;
use super::Ctx;
use sched_grammar::ast::{BlockItem, LayerDecl, Value};
use sched_grammar::diag::Diagnostic;
use sched_ir::job::*;

const KEYS: &[(&str, Shape)] = &[
    ("dtype", Shape::Value),
    ("grad_dtype", Shape::Value),
    ("optimizer", Shape::Value),
    ("seq_len", Shape::Value),
    ("micro_batch", Shape::Value),
    ("norm_eps", Shape::Value),
    ("rope_base", Shape::Value),
];

const KINDS: [&str; 5] = ["embedding", "transformer", "mlp", "lm_head", "dense"];

/// Most parameters a model may have (10^15: far beyond any model, far below u64 overflow).
pub(crate) const MAX_PARAMETERS: u64 = 1_000_000_000_000_000;

/// Most layers a model may expand to.
pub(crate) const MAX_LAYERS: u64 = 100_000;
/// Most layers all the models of one analysis may expand to together: every expanded layer holds
/// its tensor list, so a file of many large models would otherwise take gigabytes.
pub(crate) const MAX_TOTAL_LAYERS: u64 = 4 * MAX_LAYERS;
/// Largest width (hidden, ffn, vocab, seq_len…) a layer may have.
const MAX_DIM: u64 = 1 << 32;

pub(crate) fn resolve(ctx: &mut Ctx, item: &BlockItem) -> Option<Model> {
    let what = format!("model `{}`", item.name.name);
    let r = BlockReader::new(
        ctx,
        &what,
        &item.body.entries,
        KEYS,
        Extras {
            layers: true,
            ..Extras::default()
        },
    );
    r.require(
        ctx,
        &item.name,
        &what,
        &[("dtype", "dtype = bf16"), ("seq_len", "seq_len = 2048")],
    );
    let dtype = r
        .value("dtype")
        .and_then(|v| expect_choice(ctx, v, &Dtype::NAMES, "dtype"))
        .map(dtype_of);
    let grad_dtype = match r.value("grad_dtype") {
        Some(v) => expect_choice(ctx, v, &Dtype::NAMES, "dtype").map(dtype_of),
        None => dtype,
    };
    let optimizer = match r.value("optimizer") {
        Some(v) => expect_choice(ctx, v, &Optimizer::NAMES, "optimizer")
            .map(|i| [Optimizer::Adam, Optimizer::AdamW, Optimizer::Sgd][i]),
        None => Some(Optimizer::Adam),
    };
    let seq_len = r
        .value("seq_len")
        .and_then(|v| expect_int(ctx, v, 1, MAX_DIM, "`seq_len`"));
    let micro_batch = match r.value("micro_batch") {
        Some(v) => expect_int(ctx, v, 1, MAX_DIM, "`micro_batch`"),
        None => Some(1),
    };
    // `Some(None)`: not set; `None`: set wrongly (reported).
    let norm_eps = match r.value("norm_eps") {
        Some(v) => norm_eps(ctx, v).map(Some),
        None => Some(None),
    };
    let rope_base = match r.value("rope_base") {
        Some(v) => rope_base(ctx, v).map(Some),
        None => Some(None),
    };
    if r.layers.is_empty() {
        ctx.error(
            Diagnostic::error(format!("{what} has no layers"))
                .at(item.name.span, "no `layer` entries")
                .note("add layers such as `layer block[12] = transformer(hidden = 768, heads = 12, ffn = 3072)`"),
        );
        return None;
    }
    let layers = layers(ctx, &what, &r.layers, seq_len)?;
    let total = layers
        .iter()
        .try_fold(0u64, |acc, l| acc.checked_add(l.params));
    if total.is_none_or(|t| t > MAX_PARAMETERS) {
        ctx.error(
            Diagnostic::error(format!("{what} has more than {MAX_PARAMETERS} parameters"))
                .at(item.name.span, "model too large")
                .note("the largest models trained today have about 10^12"),
        );
        return None;
    }
    if let Some(v) = r.value("rope_base") {
        let rotary = layers.iter().any(|l| {
            matches!(
                l.kind,
                LayerKind::Embedding {
                    positions: Positions::Rope,
                    ..
                }
            )
        });
        if !rotary {
            ctx.warn(
                Diagnostic::warning(format!(
                    "{what} sets `rope_base` but has no rotary positions: it changes nothing"
                ))
                .at(v.span, "unused")
                .note("rotary positions are the embedding's `positions = rope`"),
            );
        }
    }
    Some(Model {
        name: item.name.name.clone(),
        dtype: dtype?,
        grad_dtype: grad_dtype?,
        optimizer: optimizer?,
        seq_len: seq_len?,
        micro_batch: micro_batch?,
        layers,
        norm_eps: norm_eps?,
        rope_base: rope_base?,
    })
}

/// `norm_eps`: positive, at most 1, and not zero once rounded to the fp32 the norms add it in.
fn norm_eps(ctx: &mut Ctx, v: &Value) -> Option<f64> {
    let x = expect_number(ctx, v)?;
    if x > 0.0 && x <= 1.0 && (x as f32) > 0.0 {
        return Some(x);
    }
    ctx.error(
        Diagnostic::error(format!(
            "`norm_eps` must be positive and at most 1 (as an fp32, not 0), found {x:e}"
        ))
        .at(v.span, "out of range")
        .note("GPT-2 and LLaMA use 1e-5 (the default), LLaMA 2 and later 1e-6"),
    );
    None
}

/// `rope_base`: greater than 1, so that the rotation frequencies fall along a head.
fn rope_base(ctx: &mut Ctx, v: &Value) -> Option<f64> {
    let x = expect_number(ctx, v)?;
    if x > 1.0 {
        return Some(x);
    }
    ctx.error(
        Diagnostic::error(format!("`rope_base` must be greater than 1, found {x}"))
            .at(v.span, "out of range")
            .note("LLaMA uses 10000 (the default), LLaMA 3 500000"),
    );
    None
}

fn dtype_of(i: usize) -> Dtype {
    [Dtype::Bf16, Dtype::Fp16, Dtype::Fp32][i]
}

/// Expands and checks every layer declaration, then the rules between layers.
fn layers(
    ctx: &mut Ctx,
    what: &str,
    decls: &[&LayerDecl],
    seq_len: Option<u64>,
) -> Option<Vec<Layer>> {
    let mut kinds = Vec::with_capacity(decls.len());
    let mut total: u64 = 0;
    for d in decls {
        let count = match &d.repeat {
            None => Some(1),
            Some(n) => match n.value() {
                Some(c) if (1..=MAX_LAYERS).contains(&c) => Some(c),
                _ => {
                    ctx.error(
                        Diagnostic::error(format!(
                            "a layer count must be between 1 and {MAX_LAYERS}, found {}",
                            n.text
                        ))
                        .at(n.span, "invalid count"),
                    );
                    None
                }
            },
        };
        total = total.saturating_add(count.unwrap_or(1));
        kinds.push((d, layer_kind(ctx, d, seq_len), count));
    }
    if total > MAX_LAYERS {
        ctx.error(
            Diagnostic::error(format!(
                "the model has {total} layers; at most {MAX_LAYERS} are allowed"
            ))
            .at(decls[0].span, "model declared from here"),
        );
        return None;
    }
    if ctx.layers_expanded + total > MAX_TOTAL_LAYERS {
        ctx.error(
            Diagnostic::error(format!(
                "{what} would bring the layers of all models in scope to {}; at most {MAX_TOTAL_LAYERS} are allowed",
                ctx.layers_expanded + total
            ))
            .at(decls[0].span, format!("{total} layers from here"))
            .note("split the models over several files, each checked on its own"),
        );
        return None;
    }
    ctx.layers_expanded += total;
    check_sequence(ctx, &kinds);
    let mut out = Vec::with_capacity(total as usize);
    let mut names = std::collections::HashMap::new();
    for (d, kind, count) in kinds {
        if let Some(first) = names.insert(d.name.name.as_str(), d.name.span) {
            ctx.error(
                Diagnostic::error(format!("layer `{}` is declared twice", d.name.name))
                    .at(d.name.span, "declared again here")
                    .also(first, "first declared here"),
            );
        }
        let (Some(kind), Some(count), Some(seq_len)) = (kind, count, seq_len) else {
            continue;
        };
        let Some((tensors, params)) = tensors(&kind, seq_len) else {
            ctx.error(
                Diagnostic::error("the layer's parameter count overflows 64 bits")
                    .at(d.call.span, "too large"),
            );
            continue;
        };
        for i in 0..count {
            let name = match d.repeat {
                Some(_) => format!("{}[{i}]", d.name.name),
                None => d.name.name.clone(),
            };
            out.push(Layer {
                name,
                kind,
                tensors: tensors.clone(),
                params,
            });
        }
    }
    (out.len() as u64 == total).then_some(out)
}

const EMBEDDING: &[(&str, Shape)] = &[
    ("vocab", Shape::Value),
    ("hidden", Shape::Value),
    ("positions", Shape::Value),
];
const TRANSFORMER: &[(&str, Shape)] = &[
    ("hidden", Shape::Value),
    ("heads", Shape::Value),
    ("ffn", Shape::Value),
    ("kv_heads", Shape::Value),
    ("norm", Shape::Value),
    ("act", Shape::Value),
    ("bias", Shape::Value),
    ("attention", Shape::Value),
];
const MLP: &[(&str, Shape)] = &[
    ("hidden", Shape::Value),
    ("ffn", Shape::Value),
    ("act", Shape::Value),
    ("bias", Shape::Value),
    ("norm", Shape::Value),
];
const LM_HEAD: &[(&str, Shape)] = &[
    ("hidden", Shape::Value),
    ("vocab", Shape::Value),
    ("norm", Shape::Value),
    ("tied", Shape::Value),
];
const DENSE: &[(&str, Shape)] = &[
    ("params", Shape::Value),
    ("flops_per_token", Shape::Value),
    ("activation_bytes_per_token", Shape::Value),
];

/// The required arguments of each kind, and what to write for each when it is missing.
const REQUIRED: [&[(&str, &str)]; 5] = [
    &[("vocab", "vocab = 32000"), ("hidden", "hidden = 4096")],
    &[
        ("hidden", "hidden = 4096"),
        ("heads", "heads = 32"),
        ("ffn", "ffn = 11008"),
    ],
    &[("hidden", "hidden = 4096"), ("ffn", "ffn = 16384")],
    &[("hidden", "hidden = 4096"), ("vocab", "vocab = 32000")],
    &[
        ("params", "params = 1e9"),
        ("flops_per_token", "flops_per_token = 2e9"),
        (
            "activation_bytes_per_token",
            "activation_bytes_per_token = 16 KiB",
        ),
    ],
];

/// Reads the arguments of one layer declaration.
fn layer_kind(ctx: &mut Ctx, d: &LayerDecl, seq_len: Option<u64>) -> Option<LayerKind> {
    let k = choice(ctx, &d.call.callee, &KINDS, "layer kind")?;
    let what = format!("layer `{}` ({})", d.name.name, KINDS[k]);
    let keys = [EMBEDDING, TRANSFORMER, MLP, LM_HEAD, DENSE][k];
    let a = Args {
        r: BlockReader::for_args(ctx, &what, &d.call.args, keys),
        d,
        what,
    };
    a.r.require(ctx, &d.call.callee, &a.what, REQUIRED[k]);
    let kind = match k {
        0 => LayerKind::Embedding {
            vocab: a.dim(ctx, "vocab")?,
            hidden: a.dim(ctx, "hidden")?,
            positions: [Positions::Learned, Positions::Rope, Positions::None][a.choice(
                ctx,
                "positions",
                &["learned", "rope", "none"],
                "position kind",
            )?],
        },
        1 => transformer(ctx, &a)?,
        2 => LayerKind::Mlp(MlpSpec {
            hidden: a.dim(ctx, "hidden")?,
            ffn: a.dim(ctx, "ffn")?,
            act: activation(a.choice(ctx, "act", &["gelu", "swiglu"], "activation")?),
            bias: a.flag(ctx, "bias", true)?,
            norm: norm(a.choice(ctx, "norm", &["layernorm", "rmsnorm"], "norm")?),
        }),
        3 => LayerKind::LmHead {
            hidden: a.dim(ctx, "hidden")?,
            vocab: a.dim(ctx, "vocab")?,
            norm: norm(a.choice(ctx, "norm", &["layernorm", "rmsnorm"], "norm")?),
            tied: a.flag(ctx, "tied", false)?,
        },
        _ => dense(ctx, &a)?,
    };
    if let (
        LayerKind::Embedding {
            positions: Positions::Learned,
            ..
        },
        None,
    ) = (kind, seq_len)
    {
        return None; // the model's seq_len error is already reported
    }
    Some(kind)
}

fn transformer(ctx: &mut Ctx, a: &Args) -> Option<LayerKind> {
    let hidden = a.dim(ctx, "hidden");
    let heads = a.dim(ctx, "heads");
    let ffn = a.dim(ctx, "ffn");
    let kv_heads = match a.r.value("kv_heads") {
        Some(v) => expect_int(ctx, v, 1, MAX_DIM, "`kv_heads`"),
        None => heads,
    };
    let norm = a
        .choice(ctx, "norm", &["layernorm", "rmsnorm"], "norm")
        .map(norm);
    let act = a
        .choice(ctx, "act", &["gelu", "swiglu"], "activation")
        .map(activation);
    let bias = a.flag(ctx, "bias", true);
    let attention = a.choice(ctx, "attention", &["flash", "naive"], "attention kind");
    let (hidden, heads, kv_heads) = (hidden?, heads?, kv_heads?);
    if hidden % heads != 0 {
        ctx.error(
            Diagnostic::error(format!(
                "`heads` must divide `hidden`: {hidden} is not a multiple of {heads}"
            ))
            .at(a.span("heads"), format!("{heads} heads"))
            .also(a.span("hidden"), format!("hidden {hidden}")),
        );
        return None;
    }
    if heads % kv_heads != 0 {
        ctx.error(
            Diagnostic::error(format!(
                "`kv_heads` must divide `heads`: {heads} is not a multiple of {kv_heads}"
            ))
            .at(a.span("kv_heads"), format!("{kv_heads} kv heads"))
            .also(a.span("heads"), format!("{heads} heads")),
        );
        return None;
    }
    Some(LayerKind::Transformer(TransformerSpec {
        hidden,
        heads,
        kv_heads,
        ffn: ffn?,
        norm: norm?,
        act: act?,
        bias: bias?,
        attention: [Attention::Flash, Attention::Naive][attention?],
    }))
}

fn dense(ctx: &mut Ctx, a: &Args) -> Option<LayerKind> {
    let params =
        a.r.value("params")
            .and_then(|v| expect_int(ctx, v, 0, 1 << 50, "`params`"));
    let flops =
        a.r.value("flops_per_token")
            .and_then(|v| expect_number(ctx, v));
    let act =
        a.r.value("activation_bytes_per_token")
            .and_then(|v| match &v.kind {
                sched_grammar::ast::ValueKind::Quantity(_) => expect_bytes(ctx, v),
                _ => expect_int(ctx, v, 0, 1 << 50, "`activation_bytes_per_token`"),
            });
    if let Some(f) = flops.filter(|f| *f < 0.0) {
        ctx.error(
            Diagnostic::error(format!("`flops_per_token` cannot be negative, found {f}"))
                .at(a.span("flops_per_token"), "here"),
        );
        return None;
    }
    Some(LayerKind::Dense {
        params: params?,
        flops_per_token: flops?,
        activation_bytes_per_token: act?,
    })
}

fn norm(i: usize) -> Norm {
    [Norm::LayerNorm, Norm::RmsNorm][i]
}

fn activation(i: usize) -> Activation {
    [Activation::Gelu, Activation::SwiGlu][i]
}

/// The arguments of one layer call, with typed getters that apply the defaults of `dsl.md`.
struct Args<'a> {
    r: BlockReader<'a>,
    d: &'a LayerDecl,
    what: String,
}

impl Args<'_> {
    /// A required positive size (its absence is reported with the others, by [`REQUIRED`]).
    fn dim(&self, ctx: &mut Ctx, key: &str) -> Option<u64> {
        self.r
            .value(key)
            .and_then(|v| expect_int(ctx, v, 1, MAX_DIM, &format!("`{key}`")))
    }

    /// An optional choice whose default is the first name.
    fn choice(&self, ctx: &mut Ctx, key: &str, names: &[&str], what: &str) -> Option<usize> {
        match self.r.value(key) {
            Some(v) => expect_choice(ctx, v, names, what),
            None => Some(0),
        }
    }

    fn flag(&self, ctx: &mut Ctx, key: &str, default: bool) -> Option<bool> {
        match self.r.value(key) {
            Some(v) => expect_bool(ctx, v, &format!("`{key}`")),
            None => Some(default),
        }
    }

    /// Where `key` is written, or the layer kind when it is defaulted.
    fn span(&self, key: &str) -> sched_grammar::diag::Span {
        self.r.key_span(key).unwrap_or(self.d.call.callee.span)
    }
}

type Decl<'a> = (&'a &'a LayerDecl, Option<LayerKind>, Option<u64>);

/// Rules between layers: placement of embedding and lm_head, hidden widths, tying, rotary head size.
fn check_sequence(ctx: &mut Ctx, decls: &[Decl]) {
    let last = decls.len() - 1;
    let mut embedding: Option<(&LayerDecl, u64, u64, Positions)> = None;
    let mut prev: Option<(&LayerDecl, u64)> = None;
    for (i, (d, kind, count)) in decls.iter().enumerate() {
        let Some(kind) = kind else {
            prev = None;
            continue;
        };
        let repeated = count.is_some_and(|c| c > 1);
        match *kind {
            LayerKind::Embedding {
                vocab,
                hidden,
                positions,
            } => {
                if i != 0 || repeated {
                    ctx.error(
                        Diagnostic::error(
                            "an embedding layer must be the model's first layer, and only one",
                        )
                        .at(d.name.span, "embedding here"),
                    );
                }
                embedding = Some((d, vocab, hidden, positions));
            }
            LayerKind::LmHead {
                hidden,
                vocab,
                tied,
                ..
            } => {
                if i != last || repeated {
                    ctx.error(
                        Diagnostic::error(
                            "an lm_head layer must be the model's last layer, and only one",
                        )
                        .at(d.name.span, "lm_head here"),
                    );
                }
                if tied {
                    check_tied(ctx, d, embedding, vocab, hidden);
                }
            }
            LayerKind::Transformer(t) => {
                if let Some((e, .., Positions::Rope)) = embedding.filter(|_| t.head_dim() % 2 != 0)
                {
                    ctx.error(
                        Diagnostic::error(format!(
                            "rotary positions need an even head size; {} / {} heads = {}",
                            t.hidden,
                            t.heads,
                            t.head_dim()
                        ))
                        .at(d.name.span, "odd head size")
                        .also(e.name.span, "rotary positions set here"),
                    );
                }
            }
            _ => {}
        }
        if let (Some((p, ph)), Some(h)) = (prev, kind.hidden()) {
            if ph != h {
                ctx.error(
                    Diagnostic::error(format!(
                        "layer `{}` has hidden {h} but the layer before it has hidden {ph}",
                        d.name.name
                    ))
                    .at(d.call.span, format!("hidden {h}"))
                    .also(p.call.span, format!("hidden {ph}")),
                );
            }
        }
        prev = kind.hidden().map(|h| (**d, h));
    }
}

fn check_tied(
    ctx: &mut Ctx,
    d: &LayerDecl,
    embedding: Option<(&LayerDecl, u64, u64, Positions)>,
    vocab: u64,
    hidden: u64,
) {
    match embedding {
        None => ctx.error(
            Diagnostic::error("a tied lm_head needs an embedding layer to share its weights with")
                .at(d.name.span, "tied = true here"),
        ),
        Some((e, ev, eh, _)) if (ev, eh) != (vocab, hidden) => ctx.error(
            Diagnostic::error(format!(
                "a tied lm_head must match its embedding: {vocab} x {hidden} here, {ev} x {eh} in the embedding"
            ))
            .at(d.call.span, "lm_head shape")
            .also(e.call.span, "embedding shape"),
        ),
        Some(_) => {}
    }
}

/// The tensors of one layer, in flattening order, and their total, with overflow checked.
pub(crate) fn tensors(kind: &LayerKind, seq_len: u64) -> Option<(Vec<TensorSpec>, u64)> {
    let mut ts = Tensors(vec![]);
    match *kind {
        LayerKind::Embedding {
            vocab,
            hidden,
            positions,
        } => {
            ts.push("wte", &[vocab, hidden]);
            if positions == Positions::Learned {
                ts.push("wpe", &[seq_len, hidden]);
            }
        }
        LayerKind::Transformer(t) => {
            let qkv = t.hidden + 2 * t.kv_dim();
            ts.norm("ln1", t.norm, t.hidden);
            ts.linear("attn.qkv", qkv, t.hidden, t.bias);
            ts.linear("attn.proj", t.hidden, t.hidden, t.bias);
            ts.norm("ln2", t.norm, t.hidden);
            ts.mlp(&t.mlp());
        }
        LayerKind::Mlp(m) => {
            ts.norm("ln", m.norm, m.hidden);
            ts.mlp(&m);
        }
        LayerKind::LmHead {
            hidden,
            vocab,
            norm,
            tied,
        } => {
            ts.norm("norm", norm, hidden);
            if !tied {
                ts.push("weight", &[vocab, hidden]);
            }
        }
        LayerKind::Dense { params, .. } => return Some((vec![], params)),
    }
    let total = ts.0.iter().try_fold(0u64, |acc, t| {
        t.shape
            .iter()
            .try_fold(1u64, |p, &d| p.checked_mul(d))
            .and_then(|n| acc.checked_add(n))
    })?;
    Some((ts.0, total))
}

struct Tensors(Vec<TensorSpec>);

impl Tensors {
    fn push(&mut self, name: &str, shape: &[u64]) {
        self.0.push(TensorSpec {
            name: name.to_string(),
            shape: shape.to_vec(),
        });
    }

    fn norm(&mut self, prefix: &str, norm: Norm, hidden: u64) {
        self.push(&format!("{prefix}.weight"), &[hidden]);
        if norm == Norm::LayerNorm {
            self.push(&format!("{prefix}.bias"), &[hidden]);
        }
    }

    fn linear(&mut self, prefix: &str, out: u64, inp: u64, bias: bool) {
        self.push(&format!("{prefix}.weight"), &[out, inp]);
        if bias {
            self.push(&format!("{prefix}.bias"), &[out]);
        }
    }

    fn mlp(&mut self, m: &MlpSpec) {
        match m.act {
            Activation::Gelu => self.linear("mlp.fc", m.ffn, m.hidden, m.bias),
            Activation::SwiGlu => {
                self.linear("mlp.gate", m.ffn, m.hidden, m.bias);
                self.linear("mlp.up", m.ffn, m.hidden, m.bias);
            }
        }
        self.linear("mlp.proj", m.hidden, m.ffn, m.bias);
    }
}

#[cfg(test)]
#[path = "../../tests/unit/sema_model.rs"]
mod tests;
