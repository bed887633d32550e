//! Weights and checkpoints as safetensors files of whole tensors (`runtime.md`, "Tensor names").
//!
//! A weights file holds one tensor per model weight, named `LAYER.TENSOR` (`block[3].attn.qkv.weight`)
//! with its [out, in] shape, in F32. A checkpoint adds the optimizer's state of every weight as
//! `LAYER.TENSOR.master` (the fp32 master copy), `.exp_avg` and `.exp_avg_sq` (Adam's moments),
//! and the number of steps taken in the metadata (`step`). Tensors are whole, never sharded, so a
//! file written under one schedule loads under any other of the same model.
//!
//! Loading checks every tensor's presence, dtype and shape, and refuses files with tensors the model
//! does not have. Saving writes a temporary file and renames it, so a failed save leaves nothing.

use crate::train::{LayerState, State};
use safetensors::tensor::{Dtype as StDtype, TensorView};
use safetensors::SafeTensors;
use sched_ir::job::Model;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};

const FORMAT: &str = "sched-checkpoint";

/// Why a weights file or checkpoint could not be written or loaded.
#[derive(Clone, Debug)]
pub enum CheckpointError {
    /// The file could not be read or written (the operating system's reason, also the source).
    Io {
        path: PathBuf,
        writing: bool,
        error: std::sync::Arc<std::io::Error>,
    },
    /// Not a safetensors file, or its `step` metadata is not a step count.
    Format { path: PathBuf, problem: String },
    /// A weights file where a checkpoint (with optimizer state) was asked for.
    NotACheckpoint { path: PathBuf },
    /// A tensor the model has is missing from the file.
    Missing { path: PathBuf, tensor: String },
    /// A tensor's shape differs from the model's.
    Shape {
        path: PathBuf,
        tensor: String,
        file: Vec<usize>,
        model: Vec<usize>,
    },
    /// A tensor is stored in a dtype other than F32 or BF16.
    Dtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    /// The file holds tensors the model does not have (the first few named).
    Extra {
        path: PathBuf,
        model: String,
        count: usize,
        first: Vec<String>,
    },
}

impl fmt::Display for CheckpointError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CheckpointError::Io {
                path,
                writing,
                error,
            } => {
                let verb = if *writing { "write" } else { "read" };
                write!(f, "cannot {verb} {}: {error}", path.display())
            }
            CheckpointError::Format { path, problem } => {
                write!(f, "{}: {problem}", path.display())
            }
            CheckpointError::NotACheckpoint { path } => write!(
                f,
                "{} is a weights file, not a checkpoint (no `step` in its metadata): use --init",
                path.display()
            ),
            CheckpointError::Missing { path, tensor } => {
                write!(f, "{} has no tensor `{tensor}`", path.display())
            }
            CheckpointError::Shape {
                path,
                tensor,
                file,
                model,
            } => write!(
                f,
                "{}: tensor `{tensor}` has shape {file:?}, the model's is {model:?}",
                path.display()
            ),
            CheckpointError::Dtype {
                path,
                tensor,
                dtype,
            } => write!(
                f,
                "{}: tensor `{tensor}` is {dtype}; F32 or BF16 expected",
                path.display()
            ),
            CheckpointError::Extra {
                path,
                model,
                count,
                first,
            } => write!(
                f,
                "{} holds {count} tensor(s) model `{model}` does not have: {}",
                path.display(),
                first.join(", ")
            ),
        }
    }
}

impl std::error::Error for CheckpointError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CheckpointError::Io { error, .. } => Some(error.as_ref()),
            _ => None,
        }
    }
}

/// What to write: weights only (`--save-init`) or weights and optimizer state (`--save`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Contents {
    Weights,
    Checkpoint,
}

const SUFFIXES: [&str; 3] = ["master", "exp_avg", "exp_avg_sq"];

fn part(s: &LayerState, k: usize) -> &Vec<f32> {
    match k {
        0 => &s.master,
        1 => &s.m,
        _ => &s.v,
    }
}

/// Writes `state` of `model` to `path`.
pub fn save(
    path: &Path,
    model: &Model,
    state: &State,
    contents: Contents,
) -> Result<(), CheckpointError> {
    let format = |problem: String| CheckpointError::Format {
        path: path.to_path_buf(),
        problem,
    };
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = vec![];
    for (layer, st) in model.layers.iter().zip(&state.layers) {
        let mut at = 0usize;
        for t in &layer.tensors {
            let n = t.elements() as usize;
            let shape: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
            let name = format!("{}.{}", layer.name, t.name);
            let bytes = |v: &[f32]| v[at..at + n].iter().flat_map(|x| x.to_le_bytes()).collect();
            tensors.push((name.clone(), shape.clone(), bytes(&st.params)));
            if contents == Contents::Checkpoint {
                for (k, suffix) in SUFFIXES.iter().enumerate() {
                    let v = part(st, k);
                    if !v.is_empty() {
                        tensors.push((format!("{name}.{suffix}"), shape.clone(), bytes(v)));
                    }
                }
            }
            at += n;
        }
    }
    let views = tensors
        .iter()
        .map(|(name, shape, data)| {
            TensorView::new(StDtype::F32, shape.clone(), data)
                .map(|v| (name.clone(), v))
                .map_err(|e| format(format!("tensor `{name}`: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), FORMAT.to_string());
    meta.insert("model".to_string(), model.name.clone());
    if contents == Contents::Checkpoint {
        meta.insert("step".to_string(), state.step.to_string());
    }
    let bytes = safetensors::serialize(views, &Some(meta))
        .map_err(|e| format(format!("cannot serialise: {e}")))?;
    sched_ir::files::write_atomically(path, &bytes).map_err(|e| CheckpointError::Io {
        path: path.to_path_buf(),
        writing: true,
        error: e.into(),
    })
}

/// Reads a weights file or checkpoint of `model` from `path`. With `Contents::Checkpoint` the
/// optimizer state must be there too.
pub fn load(path: &Path, model: &Model, contents: Contents) -> Result<State, CheckpointError> {
    let at = || path.to_path_buf();
    let format = |problem: String| CheckpointError::Format {
        path: at(),
        problem,
    };
    let bytes = std::fs::read(path).map_err(|e| CheckpointError::Io {
        path: at(),
        writing: false,
        error: e.into(),
    })?;
    let file = SafeTensors::deserialize(&bytes)
        .map_err(|e| format(format!("not a safetensors file: {e}")))?;
    let (_, meta) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| format(format!("not a safetensors file: {e}")))?;
    let meta = meta.metadata().clone().unwrap_or_default();
    let step = match (contents, meta.get("step")) {
        (Contents::Weights, _) => 0,
        (Contents::Checkpoint, Some(s)) => s
            .parse()
            .map_err(|_| format(format!("metadata `step` = `{s}` is not a step count")))?,
        (Contents::Checkpoint, None) => return Err(CheckpointError::NotACheckpoint { path: at() }),
    };
    let mut known = HashSet::new();
    let mut layers = vec![];
    let read = |name: &str,
                shape: &[u64],
                known: &mut HashSet<String>|
     -> Result<Vec<f32>, CheckpointError> {
        known.insert(name.to_string());
        let t = file.tensor(name).map_err(|_| CheckpointError::Missing {
            path: at(),
            tensor: name.to_string(),
        })?;
        let want: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
        if t.shape() != want.as_slice() {
            return Err(CheckpointError::Shape {
                path: at(),
                tensor: name.to_string(),
                file: t.shape().to_vec(),
                model: want,
            });
        }
        match t.dtype() {
            StDtype::F32 => Ok(t
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()),
            StDtype::BF16 => Ok(t
                .data()
                .chunks_exact(2)
                .map(|b| crate::math::bf16_bits_to_f32(u16::from_le_bytes([b[0], b[1]])))
                .collect()),
            d => Err(CheckpointError::Dtype {
                path: at(),
                tensor: name.to_string(),
                dtype: format!("{d:?}"),
            }),
        }
    };
    let moments = model.optimizer != sched_ir::job::Optimizer::Sgd;
    for layer in &model.layers {
        let mut st = LayerState::default();
        for t in &layer.tensors {
            let name = format!("{}.{}", layer.name, t.name);
            st.params.extend(read(&name, &t.shape, &mut known)?);
            if contents == Contents::Checkpoint {
                st.master
                    .extend(read(&format!("{name}.master"), &t.shape, &mut known)?);
                if moments {
                    st.m.extend(read(&format!("{name}.exp_avg"), &t.shape, &mut known)?);
                    st.v.extend(read(&format!("{name}.exp_avg_sq"), &t.shape, &mut known)?);
                }
            }
        }
        layers.push(st);
    }
    let mut extra: Vec<String> = file
        .names()
        .into_iter()
        .filter(|n| !known.contains(*n))
        .filter(|n| contents == Contents::Checkpoint || !SUFFIXES.iter().any(|s| n.ends_with(s)))
        .cloned()
        .collect();
    if !extra.is_empty() {
        extra.sort();
        return Err(CheckpointError::Extra {
            path: at(),
            model: model.name.clone(),
            count: extra.len(),
            first: extra.into_iter().take(5).collect(),
        });
    }
    Ok(State { layers, step })
}
