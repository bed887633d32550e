//! Weights in Hugging Face layout (issue 28, item 2): `--init` from a `transformers` checkpoint,
//! `--save-hf` back into one.
//!
//! Two families are read and written, each in its own tensor names and layouts (`runtime.md`,
//! "Hugging Face checkpoints"). GPT-2 (`[transformer.]wte`, `wpe`, `h.N.ln_1`,
//! `h.N.attn.c_attn` holding q, k and v fused, `h.N.attn.c_proj`, `h.N.ln_2`, `h.N.mlp.c_fc`,
//! `h.N.mlp.c_proj`, `ln_f`, `lm_head` unless tied) stores its products as `Conv1D`s, [in, out]:
//! they are transposed into the project's [out, in]. LLaMA (`model.embed_tokens`,
//! `model.layers.N.self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`, `input_layernorm`,
//! `post_attention_layernorm`, `model.norm`, `lm_head` unless tied) keeps [out, in], and its
//! separate q, k and v are stacked into the project's fused `attn.qkv` (rows q, k, v).
//!
//! Rotary positions need no permutation: `transformers`' LLaMA rotates with `rotate_half`, pairing
//! element i of a head with element i + d/2, and so does the project's rope (`math::ops::Rope`);
//! a unit test checks the attention scores of the two formulas agree. (Meta's original LLaMA
//! files pair neighbours, 2i with 2i + 1; `transformers`' conversion script permutes q and k rows
//! into the rotate-half order, so a Hugging Face checkpoint is already in the project's order.)
//!
//! A checkpoint is one `.safetensors` file, a sharded `model.safetensors.index.json` with the
//! shards it names, or a folder holding either. The family comes from the tensor names and, when
//! a `config.json` lies beside the checkpoint, from its `model_type` too (they must agree); the
//! model must have the family's shape (an embedding, transformer blocks and an lm_head with the
//! family's norms, activation, biases and positions). F32, BF16 and F16 tensors load. Every
//! problem is an error naming the file and what is wrong, and nothing is loaded half.

use crate::train::{LayerState, State};
use safetensors::tensor::{Dtype as StDtype, TensorView};
use safetensors::SafeTensors;
use sched_ir::job::{Activation, Dtype, LayerKind, Model, Norm, Positions, TransformerSpec};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The file name of a single-file checkpoint in a folder.
pub const SINGLE: &str = "model.safetensors";
/// The file name of a sharded checkpoint's index in a folder.
pub const INDEX: &str = "model.safetensors.index.json";
/// The config `transformers` saves beside a checkpoint.
pub const CONFIG: &str = "config.json";

/// A model family whose checkpoints schedrun reads and writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Gpt2,
    Llama,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::Gpt2 => "GPT-2",
            Family::Llama => "LLaMA",
        }
    }
}

/// Why a Hugging Face checkpoint could not be read or written.
#[derive(Clone, Debug, thiserror::Error)]
pub enum HfError {
    #[error("cannot {} {}: {error}", if *writing { "write" } else { "read" }, path.display())]
    Io {
        path: PathBuf,
        writing: bool,
        error: Arc<std::io::Error>,
    },
    /// Not a safetensors file (truncated, say), not an index, not a JSON config.
    #[error("{}: {problem}", path.display())]
    Format { path: PathBuf, problem: String },
    /// The index names a shard that is not there.
    #[error("{}: shard `{shard}` (of tensor `{tensor}`) does not exist", index.display())]
    MissingShard {
        index: PathBuf,
        shard: String,
        tensor: String,
    },
    /// A tensor the model needs is not in the checkpoint.
    #[error("{} has no tensor `{tensor}` (model `{model}`'s `{needed_for}`)", path.display())]
    Missing {
        path: PathBuf,
        tensor: String,
        model: String,
        needed_for: String,
    },
    #[error("{}: tensor `{tensor}` has shape {file:?}; model `{model}` needs {want:?}", path.display())]
    Shape {
        path: PathBuf,
        tensor: String,
        file: Vec<usize>,
        want: Vec<usize>,
        model: String,
    },
    #[error("{}: tensor `{tensor}` is {dtype}; F32, BF16 or F16 expected", path.display())]
    Dtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    /// `config.json` names an architecture schedrun does not read.
    #[error("{}: `model_type` is `{found}`, not a family schedrun reads (gpt2, llama, mistral)", path.display())]
    Architecture { path: PathBuf, found: String },
    /// The checkpoint's family and the model's (or the config's) differ.
    #[error("{}: {problem}", path.display())]
    Family { path: PathBuf, problem: String },
    /// The checkpoint holds tensors the model does not have.
    #[error("{}: {count} tensor(s) model `{model}` does not have: {}", path.display(), first.join(", "))]
    Extra {
        path: PathBuf,
        model: String,
        count: usize,
        first: Vec<String>,
    },
    /// The model has no Hugging Face layout.
    #[error("model `{model}` has no Hugging Face layout: {problem}")]
    Model { model: String, problem: String },
}

fn io(path: &Path, writing: bool) -> impl FnOnce(std::io::Error) -> HfError + '_ {
    move |e| HfError::Io {
        path: path.to_path_buf(),
        writing,
        error: e.into(),
    }
}

/// Where one of the project's tensors lives in a Hugging Face checkpoint.
#[derive(Clone, Debug, PartialEq)]
enum Source {
    /// One tensor of the same elements, or of the transposed matrix (GPT-2's `Conv1D`s).
    Tensor { name: String, transposed: bool },
    /// Rows stacked from several tensors, each of `rows` rows (LLaMA's q, k, v).
    Rows(Vec<(String, usize)>),
}

/// The family whose shape `model` has: an embedding, transformer blocks and an lm_head with
/// GPT-2's learned positions, layer norms, GELU and biases, or LLaMA's rotary positions, RMS
/// norms, SwiGLU and no biases.
pub fn family_of_model(model: &Model) -> Result<Family, HfError> {
    let refuse = |problem: String| HfError::Model {
        model: model.name.clone(),
        problem,
    };
    let n = model.layers.len();
    let (Some(first), Some(last)) = (model.layers.first(), model.layers.last()) else {
        return Err(refuse("it has no layers".into()));
    };
    let LayerKind::Embedding { positions, .. } = first.kind else {
        return Err(refuse(format!(
            "its first layer `{}` is not an embedding",
            first.name
        )));
    };
    let LayerKind::LmHead {
        norm: head_norm, ..
    } = last.kind
    else {
        return Err(refuse(format!(
            "its last layer `{}` is not an lm_head",
            last.name
        )));
    };
    let family = match positions {
        Positions::Learned => Family::Gpt2,
        Positions::Rope => Family::Llama,
        Positions::None => {
            return Err(refuse(
                "its embedding has no positions (GPT-2's are learned, LLaMA's rotary)".into(),
            ))
        }
    };
    let (norm, act, bias) = match family {
        Family::Gpt2 => (Norm::LayerNorm, Activation::Gelu, true),
        Family::Llama => (Norm::RmsNorm, Activation::SwiGlu, false),
    };
    let fam = family.name();
    if head_norm != norm {
        return Err(refuse(format!(
            "{fam}'s final norm is {norm:?}, `{}` has {head_norm:?}",
            last.name
        )));
    }
    for l in &model.layers[1..n - 1] {
        let LayerKind::Transformer(t) = l.kind else {
            return Err(refuse(format!(
                "layer `{}` is a {}, not a transformer block",
                l.name,
                l.kind.name()
            )));
        };
        let what = if t.norm != norm {
            format!("{:?} norms", t.norm)
        } else if t.act != act {
            format!("a {:?} MLP", t.act)
        } else if t.bias != bias {
            format!("bias = {}", t.bias)
        } else if family == Family::Gpt2 && t.kv_heads != t.heads {
            "grouped-query attention".into()
        } else {
            continue;
        };
        return Err(refuse(format!(
            "{fam}-shaped by its positions, but `{}` has {what}",
            l.name
        )));
    }
    Ok(family)
}

/// Where each tensor of each of `model`'s layers lives, for `family`; `prefix` starts GPT-2's
/// names of the base model (`transformer.` or nothing).
fn sources(model: &Model, family: Family, prefix: &str) -> Vec<Vec<(String, Source)>> {
    let one = |name: String, transposed: bool| Source::Tensor { name, transposed };
    let mut block = 0usize;
    model
        .layers
        .iter()
        .map(|layer| {
            let (n, spec) = match layer.kind {
                LayerKind::Transformer(t) => {
                    block += 1;
                    (block - 1, Some(t))
                }
                _ => (0, None),
            };
            layer
                .tensors
                .iter()
                .filter_map(|t| {
                    let s = source(family, prefix, &layer.kind, spec, n, &t.name, &one)?;
                    Some((t.name.clone(), s))
                })
                .collect()
        })
        .collect()
}

/// The source of tensor `tensor` of a layer of `kind` (block number `n`, spec `spec` for a
/// transformer); `None` for a tensor the family does not have (not for the shapes
/// [`family_of_model`] accepts).
fn source(
    family: Family,
    prefix: &str,
    kind: &LayerKind,
    spec: Option<TransformerSpec>,
    n: usize,
    tensor: &str,
    one: &dyn Fn(String, bool) -> Source,
) -> Option<Source> {
    let (part, end) = tensor.rsplit_once('.').unwrap_or(("", tensor));
    match (family, kind) {
        (Family::Gpt2, LayerKind::Embedding { .. }) => match tensor {
            "wte" | "wpe" => Some(one(format!("{prefix}{tensor}.weight"), false)),
            _ => None,
        },
        (Family::Llama, LayerKind::Embedding { .. }) => {
            (tensor == "wte").then(|| one("model.embed_tokens.weight".into(), false))
        }
        (Family::Gpt2, LayerKind::LmHead { .. }) => match (part, end) {
            ("norm", _) => Some(one(format!("{prefix}ln_f.{end}"), false)),
            ("", "weight") => Some(one("lm_head.weight".into(), false)),
            _ => None,
        },
        (Family::Llama, LayerKind::LmHead { .. }) => match (part, end) {
            ("norm", "weight") => Some(one("model.norm.weight".into(), false)),
            ("", "weight") => Some(one("lm_head.weight".into(), false)),
            _ => None,
        },
        (Family::Gpt2, LayerKind::Transformer(_)) => {
            let (hf, transposed) = match part {
                "ln1" => ("ln_1", false),
                "ln2" => ("ln_2", false),
                "attn.qkv" => ("attn.c_attn", true),
                "attn.proj" => ("attn.c_proj", true),
                "mlp.fc" => ("mlp.c_fc", true),
                "mlp.proj" => ("mlp.c_proj", true),
                _ => return None,
            };
            Some(one(
                format!("{prefix}h.{n}.{hf}.{end}"),
                transposed && end == "weight",
            ))
        }
        (Family::Llama, LayerKind::Transformer(_)) => {
            let at = |hf: &str| format!("model.layers.{n}.{hf}.{end}");
            match part {
                "attn.qkv" => {
                    let t = spec?;
                    let (h, kv) = (t.hidden as usize, t.kv_dim() as usize);
                    Some(Source::Rows(vec![
                        (at("self_attn.q_proj"), h),
                        (at("self_attn.k_proj"), kv),
                        (at("self_attn.v_proj"), kv),
                    ]))
                }
                "ln1" => Some(one(at("input_layernorm"), false)),
                "ln2" => Some(one(at("post_attention_layernorm"), false)),
                "attn.proj" => Some(one(at("self_attn.o_proj"), false)),
                "mlp.gate" => Some(one(at("mlp.gate_proj"), false)),
                "mlp.up" => Some(one(at("mlp.up_proj"), false)),
                "mlp.proj" => Some(one(at("mlp.down_proj"), false)),
                _ => None,
            }
        }
        _ => None,
    }
}

/// Buffers `transformers` saves beside the weights in some checkpoints (GPT-2's causal mask,
/// LLaMA's rotary frequencies): recomputed, not read.
fn is_buffer(name: &str) -> bool {
    name.ends_with(".attn.bias")
        || name.ends_with(".attn.masked_bias")
        || name.ends_with(".rotary_emb.inv_freq")
}

/// The files of a checkpoint as read: each shard's path and bytes, which shard holds each
/// tensor, and the file to name for a tensor that is missing (the index, or the one file).
struct Files {
    shards: Vec<(PathBuf, Vec<u8>)>,
    named: PathBuf,
    weight_map: Option<HashMap<String, usize>>,
}

/// Reads `path`: a `.safetensors` file, an index (`….index.json`) with its shards, or a folder
/// holding [`INDEX`] or [`SINGLE`].
fn read_files(path: &Path) -> Result<Files, HfError> {
    let path = if path.is_dir() {
        if path.join(INDEX).exists() {
            path.join(INDEX)
        } else {
            path.join(SINGLE)
        }
    } else {
        path.to_path_buf()
    };
    let read = |p: &Path| std::fs::read(p).map_err(io(p, false));
    if !path.to_string_lossy().ends_with(".json") {
        let bytes = read(&path)?;
        return Ok(Files {
            shards: vec![(path.clone(), bytes)],
            named: path,
            weight_map: None,
        });
    }
    let text = std::fs::read_to_string(&path).map_err(io(&path, false))?;
    let format = |problem: String| HfError::Format {
        path: path.clone(),
        problem,
    };
    let index: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| format(format!("not a safetensors index (JSON): {e}")))?;
    let map = index
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| format("not a safetensors index: no `weight_map` object".into()))?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut shards: Vec<(PathBuf, Vec<u8>)> = vec![];
    let mut by_name: BTreeMap<String, usize> = BTreeMap::new();
    let mut weight_map = HashMap::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| format(format!("`weight_map` entry `{tensor}` is not a file name")))?;
        if file.contains('/') || file.contains('\\') || file == ".." {
            return Err(format(format!(
                "shard `{file}` is not a file name beside the index"
            )));
        }
        let i = match by_name.get(file) {
            Some(&i) => i,
            None => {
                let at = dir.join(file);
                if !at.is_file() {
                    return Err(HfError::MissingShard {
                        index: path.clone(),
                        shard: file.to_string(),
                        tensor: tensor.clone(),
                    });
                }
                shards.push((at.clone(), read(&at)?));
                by_name.insert(file.to_string(), shards.len() - 1);
                shards.len() - 1
            }
        };
        weight_map.insert(tensor.clone(), i);
    }
    Ok(Files {
        shards,
        named: path,
        weight_map: Some(weight_map),
    })
}

/// The family `config.json` beside `path` names, if there is one.
fn config_family(path: &Path) -> Result<Option<(PathBuf, Family)>, HfError> {
    let dir = if path.is_dir() {
        path
    } else {
        path.parent().unwrap_or(Path::new("."))
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let at = dir.join(CONFIG);
    if !at.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&at).map_err(io(&at, false))?;
    let config: serde_json::Value = serde_json::from_str(&text).map_err(|e| HfError::Format {
        path: at.clone(),
        problem: format!("not a JSON config: {e}"),
    })?;
    let kind = config
        .get("model_type")
        .and_then(|v| v.as_str())
        .ok_or_else(|| HfError::Format {
            path: at.clone(),
            problem: "no `model_type`".into(),
        })?;
    let family = match kind {
        "gpt2" => Family::Gpt2,
        "llama" | "mistral" => Family::Llama,
        other => {
            return Err(HfError::Architecture {
                path: at,
                found: other.to_string(),
            })
        }
    };
    Ok(Some((at, family)))
}

/// Reads the initial weights of `model` from the Hugging Face checkpoint at `path` (a file, an
/// index or a folder), whole tensors in the project's layout, as `--init` does.
pub fn load(path: &Path, model: &Model) -> Result<State, HfError> {
    let config = config_family(path)?;
    let files = read_files(path)?;
    let parsed = files
        .shards
        .iter()
        .map(|(p, bytes)| {
            SafeTensors::deserialize(bytes).map_err(|e| HfError::Format {
                path: p.clone(),
                problem: format!("not a safetensors file (truncated or damaged?): {e}"),
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    // Every tensor of the checkpoint, and which shard holds it.
    let mut holder: HashMap<String, usize> = HashMap::new();
    for (i, st) in parsed.iter().enumerate() {
        for name in st.names() {
            holder.entry(name.clone()).or_insert(i);
        }
    }
    if let Some(map) = &files.weight_map {
        for (tensor, &i) in map {
            if parsed[i].tensor(tensor).is_err() {
                return Err(HfError::Format {
                    path: files.shards[i].0.clone(),
                    problem: format!(
                        "has no tensor `{tensor}`, which {} says it holds",
                        files.named.display()
                    ),
                });
            }
            holder.insert(tensor.clone(), i);
        }
    }
    let found = if holder.contains_key("transformer.wte.weight") {
        (Family::Gpt2, "transformer.")
    } else if holder.contains_key("wte.weight") {
        (Family::Gpt2, "")
    } else if holder.contains_key("model.embed_tokens.weight") {
        (Family::Llama, "")
    } else {
        return Err(HfError::Family {
            path: files.named.clone(),
            problem: "neither GPT-2 tensor names (`transformer.wte.weight`, `wte.weight`) nor \
                      LLaMA's (`model.embed_tokens.weight`)"
                .into(),
        });
    };
    let (family, prefix) = found;
    if let Some((at, named)) = &config {
        if *named != family {
            return Err(HfError::Family {
                path: at.clone(),
                problem: format!(
                    "says {}, but {} has {} tensor names",
                    named.name(),
                    files.named.display(),
                    family.name()
                ),
            });
        }
    }
    let want = family_of_model(model)?;
    if want != family {
        return Err(HfError::Family {
            path: files.named.clone(),
            problem: format!(
                "a {} checkpoint, but model `{}` is {}-shaped",
                family.name(),
                model.name,
                want.name()
            ),
        });
    }
    let mut used: HashSet<&str> = HashSet::new();
    let mut layers = vec![];
    for (layer, srcs) in model.layers.iter().zip(sources(model, family, prefix)) {
        let mut st = LayerState::default();
        for t in &layer.tensors {
            let shape: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
            let Some((_, src)) = srcs.iter().find(|(n, _)| *n == t.name) else {
                return Err(HfError::Model {
                    model: model.name.clone(),
                    problem: format!("`{}.{}` has no Hugging Face name", layer.name, t.name),
                });
            };
            let mut read = |name: &str, want: Vec<usize>| -> Result<Vec<f32>, HfError> {
                let Some((key, &i)) = holder.get_key_value(name) else {
                    return Err(HfError::Missing {
                        path: files.named.clone(),
                        tensor: name.to_string(),
                        model: model.name.clone(),
                        needed_for: format!("{}.{}", layer.name, t.name),
                    });
                };
                used.insert(key.as_str());
                let file = &files.shards[i].0;
                let view = parsed[i].tensor(name).map_err(|e| HfError::Format {
                    path: file.clone(),
                    problem: format!("tensor `{name}`: {e}"),
                })?;
                if view.shape() != want.as_slice() {
                    return Err(HfError::Shape {
                        path: file.clone(),
                        tensor: name.to_string(),
                        file: view.shape().to_vec(),
                        want,
                        model: model.name.clone(),
                    });
                }
                values(file, name, &view)
            };
            match src {
                Source::Tensor {
                    name,
                    transposed: false,
                } => st.params.extend(read(name, shape)?),
                Source::Tensor {
                    name,
                    transposed: true,
                } => {
                    let (rows, cols) = (shape[0], shape[1]);
                    let v = read(name, vec![cols, rows])?;
                    st.params.extend(transpose(&v, cols, rows));
                }
                Source::Rows(parts) => {
                    for (name, rows) in parts {
                        let mut part = shape.clone();
                        part[0] = *rows;
                        st.params.extend(read(name, part)?);
                    }
                }
            }
        }
        layers.push(st);
    }
    let tied = matches!(
        model.layers.last().map(|l| &l.kind),
        Some(LayerKind::LmHead { tied: true, .. })
    );
    let mut extra: Vec<String> = holder
        .keys()
        .filter(|n| !used.contains(n.as_str()) && !is_buffer(n))
        // A tied head's copy of the embedding, which some checkpoints keep.
        .filter(|n| !(tied && *n == "lm_head.weight"))
        .cloned()
        .collect();
    if !extra.is_empty() {
        extra.sort();
        return Err(HfError::Extra {
            path: files.named.clone(),
            model: model.name.clone(),
            count: extra.len(),
            first: extra.into_iter().take(5).collect(),
        });
    }
    Ok(State { layers, step: 0 })
}

/// A tensor's values as f32, from F32, BF16 or F16.
fn values(file: &Path, name: &str, view: &TensorView<'_>) -> Result<Vec<f32>, HfError> {
    let data = view.data();
    Ok(match view.dtype() {
        StDtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        StDtype::BF16 => data
            .chunks_exact(2)
            .map(|b| crate::math::bf16_bits_to_f32(u16::from_le_bytes([b[0], b[1]])))
            .collect(),
        StDtype::F16 => data
            .chunks_exact(2)
            .map(|b| f16_bits_to_f32(u16::from_le_bytes([b[0], b[1]])))
            .collect(),
        d => {
            return Err(HfError::Dtype {
                path: file.to_path_buf(),
                tensor: name.to_string(),
                dtype: format!("{d:?}"),
            })
        }
    })
}

/// The value of IEEE half bits `h` (exact: every half is an f32).
fn f16_bits_to_f32(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0f32 } else { 1.0 };
    let exp = i32::from((h >> 10) & 0x1f);
    let frac = f32::from(h & 0x3ff);
    sign * match exp {
        0 => frac * 2f32.powi(-24),
        31 if frac == 0.0 => f32::INFINITY,
        31 => f32::NAN,
        e => (1.0 + frac / 1024.0) * 2f32.powi(e - 15),
    }
}

/// `v` ([rows, cols], row-major) transposed into [cols, rows].
fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; v.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = v[r * cols + c];
        }
    }
    out
}

/// Named tensors: name, shape and fp32 values.
pub type NamedTensors = Vec<(String, Vec<usize>, Vec<f32>)>;

/// The tensors of `state` (whole, in `model`'s layers) in `model`'s family's Hugging Face names
/// and layouts, as `transformers`' `save_pretrained` names them (GPT-2 under `transformer.`, no
/// `lm_head.weight` when tied), in fp32.
pub fn tensors(model: &Model, state: &State) -> Result<NamedTensors, HfError> {
    let family = family_of_model(model)?;
    let prefix = match family {
        Family::Gpt2 => "transformer.",
        Family::Llama => "",
    };
    let mut out = vec![];
    for ((layer, st), srcs) in model
        .layers
        .iter()
        .zip(&state.layers)
        .zip(sources(model, family, prefix))
    {
        let mut at = 0usize;
        for t in &layer.tensors {
            let n = t.elements() as usize;
            let shape: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
            let v = st.params.get(at..at + n).ok_or_else(|| HfError::Model {
                model: model.name.clone(),
                problem: format!("the state of `{}` is shorter than its tensors", layer.name),
            })?;
            at += n;
            let src = srcs.iter().find(|(name, _)| *name == t.name).map(|s| &s.1);
            match src {
                Some(Source::Tensor {
                    name,
                    transposed: false,
                }) => out.push((name.clone(), shape, v.to_vec())),
                Some(Source::Tensor {
                    name,
                    transposed: true,
                }) => out.push((
                    name.clone(),
                    vec![shape[1], shape[0]],
                    transpose(v, shape[0], shape[1]),
                )),
                Some(Source::Rows(parts)) => {
                    let width: usize = shape[1..].iter().product();
                    let mut row = 0;
                    for (name, rows) in parts {
                        let mut s = shape.clone();
                        s[0] = *rows;
                        out.push((
                            name.clone(),
                            s,
                            v[row * width..(row + rows) * width].to_vec(),
                        ));
                        row += rows;
                    }
                }
                None => {
                    return Err(HfError::Model {
                        model: model.name.clone(),
                        problem: format!("`{}.{}` has no Hugging Face name", layer.name, t.name),
                    })
                }
            }
        }
    }
    Ok(out)
}

/// Where `--save-hf PATH` writes: the weights file and the `config.json` beside it. A `PATH`
/// ending in `.safetensors` is the weights file itself (the config goes into its folder); any
/// other `PATH` is a folder (made when missing) that receives [`SINGLE`] and [`CONFIG`], as
/// `save_pretrained` writes them.
pub fn save_paths(path: &Path) -> (PathBuf, PathBuf) {
    if path.extension().is_some_and(|e| e == "safetensors") {
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        (path.to_path_buf(), dir.join(CONFIG))
    } else {
        (path.join(SINGLE), path.join(CONFIG))
    }
}

/// The safetensors dtype `--save-hf` writes `model`'s weights in: BF16 for a bf16 model (its
/// parameters are bf16 values, so nothing is lost), F32 otherwise (an fp16 model's values are
/// all exact in fp32).
pub fn save_dtype(model: &Model) -> StDtype {
    match model.dtype {
        Dtype::Bf16 => StDtype::BF16,
        Dtype::Fp16 | Dtype::Fp32 => StDtype::F32,
    }
}

/// Writes the weights of `state` as a Hugging Face checkpoint (`--save-hf`): the weights file
/// and its `config.json` ([`save_paths`]), in [`save_dtype`]. Both are built before either is
/// written, and each is written atomically. Returns the two paths.
pub fn save(path: &Path, model: &Model, state: &State) -> Result<(PathBuf, PathBuf), HfError> {
    let (weights, config) = save_paths(path);
    let bytes = to_bytes(&weights, &tensors(model, state)?, save_dtype(model))?;
    let text =
        serde_json::to_string_pretty(&config_json(model)?).expect("configs serialise") + "\n";
    if let Some(dir) = weights.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io(dir, true))?;
    }
    sched_ir::files::write_atomically(&weights, &bytes).map_err(io(&weights, true))?;
    sched_ir::files::write_atomically(&config, text.as_bytes()).map_err(io(&config, true))?;
    Ok((weights, config))
}

/// The `config.json` of `model` in its family's own keys, as `transformers` reads them
/// (`from_pretrained` on the folder builds the same model, and `schedc import hf` on it gives
/// `model` back): GPT-2's `n_embd`, `n_layer`, … or LLaMA's `hidden_size`,
/// `num_key_value_heads`, `rope_theta`, …, the norms' epsilon, tying, the dtype the weights are
/// written in, and dropout 0 (schedrun trains without it). `transformers` 4 and 5 both read the
/// keys written (`torch_dtype`, a top-level `rope_theta`).
pub fn config_json(model: &Model) -> Result<serde_json::Value, HfError> {
    use serde_json::json;
    let family = family_of_model(model)?;
    let refuse = |problem: String| HfError::Model {
        model: model.name.clone(),
        problem,
    };
    let blocks: Vec<TransformerSpec> = model
        .layers
        .iter()
        .filter_map(|l| match l.kind {
            LayerKind::Transformer(t) => Some(t),
            _ => None,
        })
        .collect();
    let Some(&t) = blocks.first() else {
        return Err(refuse("it has no transformer blocks".into()));
    };
    let same = |a: &TransformerSpec| {
        (a.hidden, a.heads, a.kv_heads, a.ffn) == (t.hidden, t.heads, t.kv_heads, t.ffn)
    };
    if let Some(l) = model
        .layers
        .iter()
        .find(|l| matches!(l.kind, LayerKind::Transformer(ref b) if !same(b)))
    {
        return Err(refuse(format!(
            "block `{}` differs from the first in hidden size, heads or ffn: a config.json \
             describes blocks all alike",
            l.name
        )));
    }
    let (vocab, head_vocab, tied) = match (
        &model.layers[0].kind,
        &model.layers[model.layers.len() - 1].kind,
    ) {
        (
            LayerKind::Embedding { vocab, .. },
            LayerKind::LmHead {
                vocab: hv, tied, ..
            },
        ) => (*vocab, *hv, *tied),
        _ => unreachable!("family_of_model checked the first and last layers"),
    };
    if vocab != head_vocab {
        return Err(refuse(format!(
            "its embedding's vocabulary ({vocab}) and its lm_head's ({head_vocab}) differ"
        )));
    }
    let dtype = match save_dtype(model) {
        StDtype::BF16 => "bfloat16",
        _ => "float32",
    };
    let eps = model.norm_eps.unwrap_or(Model::DEFAULT_NORM_EPS);
    Ok(match family {
        Family::Gpt2 => json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": vocab,
            "n_positions": model.seq_len,
            "n_embd": t.hidden,
            "n_layer": blocks.len(),
            "n_head": t.heads,
            "n_inner": t.ffn,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": eps,
            "tie_word_embeddings": tied,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "torch_dtype": dtype,
        }),
        Family::Llama => json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab,
            "max_position_embeddings": model.seq_len,
            "hidden_size": t.hidden,
            "intermediate_size": t.ffn,
            "num_hidden_layers": blocks.len(),
            "num_attention_heads": t.heads,
            "num_key_value_heads": t.kv_heads,
            "head_dim": t.head_dim(),
            "hidden_act": "silu",
            "rms_norm_eps": eps,
            "rope_theta": model.rope_base(),
            "attention_bias": false,
            "mlp_bias": false,
            "attention_dropout": 0.0,
            "tie_word_embeddings": tied,
            "torch_dtype": dtype,
        }),
    })
}

/// `tensors` serialised as a safetensors file in `dtype` (F32 or BF16, rounded to nearest even)
/// with `transformers`' metadata (`path` only names the file in errors).
pub fn to_bytes(
    path: &Path,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    dtype: StDtype,
) -> Result<Vec<u8>, HfError> {
    let data: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| match dtype {
            StDtype::BF16 => v
                .iter()
                .flat_map(|&x| crate::math::f32_to_bf16_bits(x).to_le_bytes())
                .collect(),
            _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        })
        .collect();
    let dtype = if dtype == StDtype::BF16 {
        StDtype::BF16
    } else {
        StDtype::F32
    };
    let views = tensors
        .iter()
        .zip(&data)
        .map(|((name, shape, _), d)| {
            TensorView::new(dtype, shape.clone(), d)
                .map(|v| (name.clone(), v))
                .map_err(|e| HfError::Format {
                    path: path.to_path_buf(),
                    problem: format!("tensor `{name}`: {e}"),
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize(views, &Some(meta)).map_err(|e| HfError::Format {
        path: path.to_path_buf(),
        problem: format!("cannot serialise: {e}"),
    })
}

/// Whether `--init PATH` names a Hugging Face checkpoint rather than the project's own weights
/// file: a folder, an index, or a safetensors file without the project's `format` metadata whose
/// tensor names are GPT-2's or LLaMA's. Reads only the file's header; any doubt (an unreadable
/// file) answers no, and the project's loader reports the problem.
pub fn is_hf_checkpoint(path: &Path) -> bool {
    if path.is_dir() || path.to_string_lossy().ends_with(".json") {
        return true;
    }
    let Some(header) = header(path) else {
        return false;
    };
    let ours = header
        .get("__metadata__")
        .and_then(|m| m.get("format"))
        .and_then(|f| f.as_str())
        == Some("sched-checkpoint");
    !ours
        && header.keys().any(|k| {
            k == "transformer.wte.weight" || k == "wte.weight" || k == "model.embed_tokens.weight"
        })
}

/// A safetensors file's JSON header (its first 8 bytes give the header's length).
fn header(path: &Path) -> Option<serde_json::Map<String, serde_json::Value>> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).ok()?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len).ok()?;
    let len = u64::from_le_bytes(len);
    if len > 100 << 20 {
        return None;
    }
    let mut text = vec![0u8; len as usize];
    f.read_exact(&mut text).ok()?;
    serde_json::from_slice(&text).ok()
}

#[cfg(test)]
#[path = "../tests/unit/hf_rope.rs"]
mod tests;
