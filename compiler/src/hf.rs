//! `schedc import hf`: a Hugging Face `config.json` becomes a `model` block (issue 28, item 1).
//!
//! Two families are read: GPT-2 (`model_type = "gpt2"`: learned positions, LayerNorm, the tanh
//! GELU, biases, a head tied to the embedding unless said otherwise) and LLaMA with its
//! look-alike `mistral` (rotary positions, RMSNorm, SwiGLU, grouped-query
//! attention, no biases; Qwen2, whose q, k and v projections have biases, is refused). Every field
//! is either mapped to the language (the norms' epsilon to `norm_eps`, with `transformers`'
//! default where the config leaves it out: 1e-5 for GPT-2, 1e-6 for LLaMA and Mistral; the
//! rotary base to `rope_base`, default 10,000, from `rope_theta` or `transformers` 5's
//! `rope_parameters` of the `default` type), checked to hold the one value the language and
//! the runtime implement (no rotary scaling, no sliding window, no biases on LLaMA's projections,
//! head size hidden/heads), or one of the bookkeeping fields that do not change the model (token
//! ids, initialisation range, `transformers_version`, …). Anything else is refused with an error
//! naming the field: a config is never imported as a different model. The context length
//! (`n_positions`, `max_position_embeddings`) becomes `seq_len`, which for GPT-2 is also the size
//! of the learned position table, so the parameter count `schedc check` prints equals the
//! checkpoint's.

use serde_json::{Map, Value};
use std::fmt::Write;

/// Why a config cannot be imported: the field (empty for the file as a whole) and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{message}", if field.is_empty() { String::new() } else { format!("`{field}`: ") })]
pub struct ImportError {
    pub field: String,
    pub message: String,
}

fn error(field: &str, message: impl Into<String>) -> ImportError {
    ImportError {
        field: field.to_string(),
        message: message.into(),
    }
}

/// Fields of every family that do not change the model's architecture or parameters.
const BOOKKEEPING: &[&str] = &[
    "_name_or_path",
    "architectures",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
    "pretraining_tp",
    "task_specific_params",
    "summary_type",
    "summary_use_proj",
    "summary_activation",
    "summary_proj_to_labels",
    "summary_first_dropout",
    "attn_pdrop",
    "embd_pdrop",
    "resid_pdrop",
    "attention_dropout",
    "hidden_dropout",
    "n_ctx",
    "max_window_layers",
    "tie_word_embeddings",
];

/// A model block for `config` (a `config.json`'s text), named `name`.
pub fn model_from_config(config: &str, name: &str) -> Result<String, ImportError> {
    let value: Value =
        serde_json::from_str(config).map_err(|e| error("", format!("not a JSON config: {e}")))?;
    let Value::Object(c) = value else {
        return Err(error("", "not a JSON object"));
    };
    let mut read = Fields {
        c: &c,
        used: vec![],
    };
    let kind = read.str("model_type")?;
    let body = match kind.as_str() {
        "gpt2" => gpt2(&mut read)?,
        "llama" | "mistral" => llama(&mut read)?,
        "qwen2" => {
            return Err(error(
                "model_type",
                "`qwen2` has biases on its q, k and v projections (not a config field: the \
                 architecture's), which cannot be expressed yet",
            ))
        }
        other => {
            return Err(error(
                "model_type",
                format!("`{other}` is not a family schedc imports (gpt2, llama, mistral)"),
            ))
        }
    };
    if let Some(field) = c
        .keys()
        .find(|k| !read.used.contains(&k.as_str()) && !BOOKKEEPING.contains(&k.as_str()))
    {
        return Err(error(
            field,
            "schedc does not know what this field does to the model, so it will not import it as a \
             model without it",
        ));
    }
    // `transformers` 5 writes `dtype`, earlier versions `torch_dtype`.
    let dtype_key = if c.contains_key("dtype") {
        "dtype"
    } else {
        "torch_dtype"
    };
    let dtype = match c.get(dtype_key).and_then(Value::as_str) {
        None | Some("float32") => "fp32",
        Some("bfloat16") => "bf16",
        Some("float16") => "fp16",
        Some(other) => {
            return Err(error(
                dtype_key,
                format!("`{other}` is not a dtype schedc trains in"),
            ))
        }
    };
    let source = c
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str)
        .unwrap_or(kind.as_str())
        .to_string();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# Imported from a Hugging Face config ({source}) by `schedc import hf`."
    );
    let _ = writeln!(out, "model {name} {{");
    let _ = writeln!(out, "    dtype       = {dtype}");
    let _ = writeln!(out, "    optimizer   = adamw");
    out.push_str(&body);
    out.push_str("}\n");
    Ok(formatted(out))
}

/// `text` in `schedc fmt`'s canonical layout.
fn formatted(text: String) -> String {
    let mut sources = sched_grammar::SourceMap::new();
    let id = sources.add(
        "import.sched".to_string(),
        std::path::Path::new("import.sched"),
        text,
    );
    let source = &sources.get(id).text;
    let parsed = sched_grammar::parse(id, source);
    debug_assert!(parsed.errors.is_empty(), "an imported block parses");
    if !parsed.errors.is_empty() {
        return source.clone();
    }
    sched_grammar::fmt::format(source, &parsed.file)
}

/// The config's fields, with the names read so far (everything read is accounted for).
struct Fields<'a> {
    c: &'a Map<String, Value>,
    used: Vec<&'static str>,
}

impl Fields<'_> {
    fn get(&mut self, key: &'static str) -> Option<&Value> {
        self.used.push(key);
        self.c.get(key).filter(|v| !v.is_null())
    }

    fn str(&mut self, key: &'static str) -> Result<String, ImportError> {
        match self.get(key) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(_) => Err(error(key, "must be a string")),
            None => Err(error(key, "missing")),
        }
    }

    fn int(&mut self, key: &'static str) -> Result<u64, ImportError> {
        self.int_or(key, None)
    }

    /// A positive integer, `default` when absent or null.
    fn int_or(&mut self, key: &'static str, default: Option<u64>) -> Result<u64, ImportError> {
        match self.get(key) {
            Some(v) => v
                .as_u64()
                .filter(|&n| n > 0)
                .ok_or_else(|| error(key, format!("must be a positive integer, not {v}"))),
            None => default.ok_or_else(|| error(key, "missing")),
        }
    }

    /// A number that `valid` accepts (`rule` says which), `default` when absent or null.
    fn number(
        &mut self,
        key: &'static str,
        default: f64,
        valid: fn(f64) -> bool,
        rule: &str,
    ) -> Result<f64, ImportError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => match v.as_f64() {
                Some(x) if valid(x) => Ok(x),
                Some(x) => Err(error(key, format!("{x} here: it must be {rule}"))),
                None => Err(error(key, format!("must be a number, not {v}"))),
            },
        }
    }

    /// The norms' epsilon from `key` (`default` when absent), as the language takes it.
    fn norm_eps(&mut self, key: &'static str, default: f64) -> Result<f64, ImportError> {
        self.number(
            key,
            default,
            |x| x > 0.0 && x <= 1.0 && (x as f32) > 0.0,
            "positive and at most 1 (schedc's `norm_eps`)",
        )
    }

    /// A boolean that must be false (or absent).
    fn off(&mut self, key: &'static str, what: &str) -> Result<(), ImportError> {
        match self.get(key) {
            None | Some(Value::Bool(false)) => Ok(()),
            Some(v) => Err(error(
                key,
                format!("{v} here: {what} cannot be expressed yet"),
            )),
        }
    }

    /// A field that must be absent or null.
    fn absent(&mut self, key: &'static str, what: &str) -> Result<(), ImportError> {
        match self.get(key) {
            None => Ok(()),
            Some(v) => Err(error(
                key,
                format!("{v} here: {what} cannot be expressed yet"),
            )),
        }
    }

    /// The rotary base from `rope_parameters` (`transformers` 5's form of `rope_theta` and
    /// `rope_scaling`: `{"rope_type": "default", "rope_theta": …}`), `theta` (the top-level
    /// `rope_theta`'s or its default) when absent. Only the `default` rotary type is read; any
    /// other type, or any other key in the object, is a scaling the language cannot express.
    fn rope_parameters(&mut self, theta: f64) -> Result<f64, ImportError> {
        const KEY: &str = "rope_parameters";
        let Some(v) = self.get(KEY) else {
            return Ok(theta);
        };
        let Value::Object(p) = v else {
            return Err(error(KEY, format!("must be an object, not {v}")));
        };
        let p = p.clone();
        let top = self.c.get("rope_theta").filter(|v| !v.is_null()).is_some();
        match p.get("rope_type").or_else(|| p.get("type")) {
            None => {}
            Some(Value::String(t)) if t == "default" => {}
            Some(t) => {
                return Err(error(
                    KEY,
                    format!("rope_type {t} here: a rotary scaling cannot be expressed yet"),
                ))
            }
        }
        if let Some(k) = p
            .keys()
            .find(|k| !matches!(k.as_str(), "rope_type" | "type" | "rope_theta"))
        {
            return Err(error(
                KEY,
                format!("`{k}` here: a rotary scaling cannot be expressed yet"),
            ));
        }
        match p.get("rope_theta") {
            None => Ok(theta),
            Some(v) => match v.as_f64() {
                Some(x) if x > 1.0 && x.is_finite() => {
                    if top && x != theta {
                        return Err(error(
                            KEY,
                            format!("rope_theta {x} here, but `rope_theta` says {theta}"),
                        ));
                    }
                    Ok(x)
                }
                _ => Err(error(
                    KEY,
                    format!("rope_theta {v} here: it must be a number greater than 1 (schedc's `rope_base`)"),
                )),
            },
        }
    }

    /// `tie_word_embeddings`, `default` when absent.
    fn tied(&mut self, default: bool) -> Result<bool, ImportError> {
        match self.get("tie_word_embeddings") {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(error(
                "tie_word_embeddings",
                format!("must be true or false, not {v}"),
            )),
        }
    }
}

/// GPT-2: `n_embd`, `n_layer`, `n_head`, `n_inner` (4·n_embd when null), `n_positions`,
/// `vocab_size`, `layer_norm_epsilon` (1e-5 when absent); the tanh GELU, biases, a tied head
/// unless untied.
fn gpt2(f: &mut Fields) -> Result<String, ImportError> {
    let hidden = f.int("n_embd")?;
    let layers = f.int("n_layer")?;
    let heads = f.int("n_head")?;
    let ffn = f.int_or("n_inner", Some(4 * hidden))?;
    let positions = f.int("n_positions")?;
    let vocab = f.int("vocab_size")?;
    match f.get("activation_function").and_then(Value::as_str) {
        None | Some("gelu_new") | Some("gelu_pytorch_tanh") => {}
        Some(other) => {
            return Err(error(
                "activation_function",
                format!("`{other}`: schedc's GELU is the tanh approximation (gelu_new)"),
            ))
        }
    }
    let eps = f.norm_eps("layer_norm_epsilon", 1e-5)?;
    f.off(
        "scale_attn_by_inverse_layer_idx",
        "scaling attention by the layer index",
    )?;
    f.off("reorder_and_upcast_attn", "reordered, upcast attention")?;
    match f.get("scale_attn_weights") {
        None | Some(Value::Bool(true)) => {}
        Some(v) => {
            return Err(error(
                "scale_attn_weights",
                format!("{v} here: attention is always scaled"),
            ))
        }
    }
    f.off("add_cross_attention", "cross-attention")?;
    let tied = f.tied(true)?;
    Ok(format!(
        "    seq_len     = {positions}    # n_positions: also the size of the learned position table\n\
         \x20   micro_batch = 1\n\
         \x20   norm_eps    = {eps:e}    # layer_norm_epsilon\n\
         \n\
         \x20   layer embed     = embedding(vocab = {vocab}, hidden = {hidden}, positions = learned)\n\
         \x20   layer block[{layers}] = transformer(hidden = {hidden}, heads = {heads}, ffn = {ffn}, norm = layernorm, act = gelu, bias = true)\n\
         \x20   layer head      = lm_head(hidden = {hidden}, vocab = {vocab}, norm = layernorm, tied = {tied})\n"
    ))
}

/// LLaMA and its look-alikes: `hidden_size`, `intermediate_size`, `num_hidden_layers`,
/// `num_attention_heads`, `num_key_value_heads` (the heads when absent), `vocab_size`,
/// `max_position_embeddings`, `rms_norm_eps` (1e-6 when absent, as in `transformers`),
/// `rope_theta` (10,000 when absent); SiLU-gated MLP, no biases, an untied head unless tied.
fn llama(f: &mut Fields) -> Result<String, ImportError> {
    let hidden = f.int("hidden_size")?;
    let ffn = f.int("intermediate_size")?;
    let layers = f.int("num_hidden_layers")?;
    let heads = f.int("num_attention_heads")?;
    let kv_heads = f.int_or("num_key_value_heads", Some(heads))?;
    let vocab = f.int("vocab_size")?;
    let positions = f.int("max_position_embeddings")?;
    if hidden % heads != 0 {
        return Err(error(
            "num_attention_heads",
            format!("{heads} heads do not divide hidden_size {hidden}"),
        ));
    }
    if let Some(d) = f.get("head_dim").cloned() {
        if d.as_u64() != Some(hidden / heads) {
            return Err(error(
                "head_dim",
                format!("{d} here: heads of another size than hidden_size / num_attention_heads = {} cannot be expressed yet", hidden / heads),
            ));
        }
    }
    match f.get("hidden_act").and_then(Value::as_str) {
        None | Some("silu") => {}
        Some(other) => {
            return Err(error(
                "hidden_act",
                format!("`{other}`: schedc's gated MLP is SwiGLU (silu)"),
            ))
        }
    }
    let eps = f.norm_eps("rms_norm_eps", 1e-6)?;
    let theta = f.number(
        "rope_theta",
        10_000.0,
        |x| x > 1.0 && x.is_finite(),
        "greater than 1 (schedc's `rope_base`)",
    )?;
    let theta = f.rope_parameters(theta)?;
    f.absent("rope_scaling", "a rotary scaling")?;
    f.off("attention_bias", "biases on the attention projections")?;
    f.off("mlp_bias", "biases on the MLP projections")?;
    // A window listed but not used (`use_sliding_window = false`) changes nothing.
    let window_used = !matches!(f.get("use_sliding_window"), Some(Value::Bool(false)));
    if window_used {
        f.absent("sliding_window", "sliding-window attention")?;
    } else {
        f.get("sliding_window");
    }
    let tied = f.tied(false)?;
    Ok(format!(
        "    seq_len     = {positions}    # max_position_embeddings\n\
         \x20   micro_batch = 1\n\
         \x20   norm_eps    = {eps:e}    # rms_norm_eps\n\
         \x20   rope_base   = {theta}    # rope_theta\n\
         \n\
         \x20   layer embed     = embedding(vocab = {vocab}, hidden = {hidden}, positions = rope)\n\
         \x20   layer block[{layers}] = transformer(hidden = {hidden}, heads = {heads}, kv_heads = {kv_heads}, ffn = {ffn}, norm = rmsnorm, act = swiglu, bias = false)\n\
         \x20   layer head      = lm_head(hidden = {hidden}, vocab = {vocab}, norm = rmsnorm, tied = {tied})\n"
    ))
}
