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
//! Folders of periodic checkpoints are [`folder`]'s; entries written as per-rank shards by
//! several processes, [`shards`]'.

use crate::train::{LayerState, State};
use safetensors::tensor::{Dtype as StDtype, TensorView};
use safetensors::SafeTensors;
use sched_ir::job::Model;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};

pub mod shards;

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
    /// A checkpoint folder or entry (`--checkpoints`) that is not complete: what is missing.
    Incomplete { path: PathBuf, problem: String },
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
            CheckpointError::Incomplete { path, problem } => {
                write!(f, "checkpoint {} is incomplete: {problem}", path.display())
            }
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
    let bytes = save_bytes(path, model, state, contents)?;
    sched_ir::files::write_atomically(path, &bytes).map_err(|e| CheckpointError::Io {
        path: path.to_path_buf(),
        writing: true,
        error: e.into(),
    })
}

/// The bytes [`save`] writes (`path` only names the file in errors).
fn save_bytes(
    path: &Path,
    model: &Model,
    state: &State,
    contents: Contents,
) -> Result<Vec<u8>, CheckpointError> {
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
    safetensors::serialize(views, &Some(meta)).map_err(|e| format(format!("cannot serialise: {e}")))
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

/// Checkpoints of a long run, one entry per saved step under a folder (`--checkpoints DIR`):
/// `DIR/step-00000120/` holds `state.safetensors` (a checkpoint as [`save`] writes it) and
/// `manifest.json`, written last, which lists every file of the entry with its size and FNV-1a
/// hash. An entry is complete exactly when its manifest is there and every file it lists has the
/// listed size and hash.
///
/// An entry is written under a hidden temporary name (`DIR/.step-00000120.PID.tmp/`), each file
/// and then the folder synced to disk, and renamed into place, so a run killed at any moment leaves
/// either the whole entry or none of it (only a hidden leftover, removed by the next save).
///
/// Processes that each hold only some ranks' shards (several CUDA processes) write a sharded
/// entry instead ([`shards`]): one `rank-NNNNN.safetensors` per rank in place of
/// `state.safetensors`, and a manifest that says how many ranks wrote (`shards`) and lists every
/// shard. [`folder::resolve`] verifies both kinds alike, and [`folder::load`] reads either.
pub mod folder {
    use super::{save_bytes, CheckpointError, Contents};
    use crate::train::State;
    use sched_ir::job::Model;
    use serde::{Deserialize, Serialize};
    use std::fs;
    use std::io::Write;
    use std::path::{Path, PathBuf};

    /// The entry's file listing every other file; written last.
    pub const MANIFEST: &str = "manifest.json";
    /// The whole state of the CPU backend (and of a single CUDA process).
    pub const STATE: &str = "state.safetensors";
    pub(super) const FORMAT: &str = "sched-checkpoint-folder";

    #[derive(Serialize, Deserialize)]
    pub(super) struct Manifest {
        pub format: String,
        pub step: u64,
        pub model: String,
        /// A sharded entry ([`super::shards`]): the number of ranks, each of which wrote one
        /// `rank-NNNNN.safetensors`. Absent for an entry of one `state.safetensors`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub shards: Option<u32>,
        pub files: Vec<FileEntry>,
    }

    #[derive(Serialize, Deserialize)]
    pub(super) struct FileEntry {
        pub name: String,
        pub bytes: u64,
        pub fnv1a64: String,
    }

    /// 64-bit FNV-1a: enough to tell a damaged file from the one written (not an authenticity
    /// check).
    pub(super) fn fnv1a64(bytes: &[u8]) -> String {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        format!("{h:016x}")
    }

    /// The folder name of step `step`'s entry.
    pub fn entry_name(step: u64) -> String {
        format!("step-{step:08}")
    }

    fn step_of(name: &str) -> Option<u64> {
        let digits = name.strip_prefix("step-")?;
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        digits.parse().ok()
    }

    pub(super) fn io(
        path: &Path,
        writing: bool,
    ) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
        move |e| CheckpointError::Io {
            path: path.to_path_buf(),
            writing,
            error: e.into(),
        }
    }

    pub(super) fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
        let mut f = fs::File::create(path).map_err(io(path, true))?;
        f.write_all(bytes).map_err(io(path, true))?;
        f.sync_all().map_err(io(path, true))
    }

    pub(super) fn sync_dir(path: &Path) -> Result<(), CheckpointError> {
        fs::File::open(path)
            .and_then(|d| d.sync_all())
            .map_err(io(path, true))
    }

    /// Writes `state` as the entry of its step under `dir` (created if missing), then removes all
    /// but the newest `keep` entries. Returns the entry's path.
    pub fn write(
        dir: &Path,
        model: &Model,
        state: &State,
        keep: usize,
    ) -> Result<PathBuf, CheckpointError> {
        fs::create_dir_all(dir).map_err(io(dir, true))?;
        let name = entry_name(state.step);
        let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
        let _ = fs::remove_dir_all(&tmp);
        fs::create_dir(&tmp).map_err(io(&tmp, true))?;
        let result = (|| {
            let file = tmp.join(STATE);
            let bytes = save_bytes(&file, model, state, Contents::Checkpoint)?;
            write_synced(&file, &bytes)?;
            let manifest = Manifest {
                format: FORMAT.to_string(),
                step: state.step,
                model: model.name.clone(),
                shards: None,
                files: vec![FileEntry {
                    name: STATE.to_string(),
                    bytes: bytes.len() as u64,
                    fnv1a64: fnv1a64(&bytes),
                }],
            };
            let text = serde_json::to_string_pretty(&manifest).expect("manifests serialise") + "\n";
            write_synced(&tmp.join(MANIFEST), text.as_bytes())?;
            sync_dir(&tmp)?;
            place(dir, &tmp, state.step)
        })();
        if result.is_err() {
            let _ = fs::remove_dir_all(&tmp);
        }
        let at = result?;
        prune(dir, keep.max(1));
        Ok(at)
    }

    /// Renames the written entry folder `tmp` to step `step`'s entry under `dir` and syncs
    /// `dir`. The same step written again (a run resumed from an older entry): the old entry is
    /// moved aside, under a hidden name the next save removes, before the new one takes its
    /// place, so that a crash in between leaves one of the two.
    pub(super) fn place(dir: &Path, tmp: &Path, step: u64) -> Result<PathBuf, CheckpointError> {
        let name = entry_name(step);
        let at = dir.join(&name);
        let old = dir.join(format!(".{name}.{}.old.tmp", std::process::id()));
        let replacing = at.exists();
        if replacing {
            fs::rename(&at, &old).map_err(io(&at, true))?;
        }
        fs::rename(tmp, &at).map_err(io(&at, true))?;
        sync_dir(dir)?;
        if replacing {
            let _ = fs::remove_dir_all(&old);
        }
        Ok(at)
    }

    /// Removes all but the newest `keep` entries, and leftovers of interrupted writes by other
    /// processes. Best effort: a failure to remove leaves an old entry, never loses a new one.
    pub(super) fn prune(dir: &Path, keep: usize) {
        let Ok(read) = fs::read_dir(dir) else {
            return;
        };
        let mut entries = vec![];
        for e in read.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(step) = step_of(&name) {
                entries.push((step, e.path()));
            } else if name.starts_with(".step-") && name.ends_with(".tmp") {
                let _ = fs::remove_dir_all(e.path());
            }
        }
        entries.sort();
        let extra = entries.len().saturating_sub(keep);
        for (_, path) in entries.into_iter().take(extra) {
            let _ = fs::remove_dir_all(path);
        }
    }

    /// What `--resume PATH` resolved to: the checkpoint to load ([`load`]), and entries passed
    /// over.
    pub struct Resolved {
        /// A checkpoint file (a `--save` file, an entry's `state.safetensors`) or a sharded
        /// entry's folder.
        pub file: PathBuf,
        /// Entries newer than the one chosen that have no manifest (writes cut short).
        pub skipped: Vec<PathBuf>,
    }

    /// `--resume PATH`: a checkpoint file as it is; an entry folder (one holding a manifest),
    /// verified; a folder of entries, its newest entry that has a manifest, verified. Entries
    /// without a manifest are skipped (reported in [`Resolved::skipped`]); an entry whose manifest
    /// is there but one of whose files is missing, truncated or altered is refused, naming the
    /// file: damage is never passed over silently.
    pub fn resolve(path: &Path) -> Result<Resolved, CheckpointError> {
        if !path.is_dir() {
            return Ok(Resolved {
                file: path.to_path_buf(),
                skipped: vec![],
            });
        }
        if path.join(MANIFEST).exists() || step_of(&file_name(path)).is_some() {
            return Ok(Resolved {
                file: verify(path)?,
                skipped: vec![],
            });
        }
        let mut entries = vec![];
        for e in fs::read_dir(path).map_err(io(path, false))? {
            let e = e.map_err(io(path, false))?;
            if let Some(step) = step_of(&e.file_name().to_string_lossy()) {
                entries.push((step, e.path()));
            }
        }
        entries.sort();
        let mut skipped = vec![];
        while let Some((_, entry)) = entries.pop() {
            if entry.join(MANIFEST).exists() {
                return Ok(Resolved {
                    file: verify(&entry)?,
                    skipped,
                });
            }
            skipped.push(entry);
        }
        Err(CheckpointError::Incomplete {
            path: path.to_path_buf(),
            problem: format!(
                "no complete checkpoint entry (a `step-N` folder with a {MANIFEST}) in this folder"
            ),
        })
    }

    fn file_name(path: &Path) -> String {
        path.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    /// The checkpoint [`resolve`] found, whole: a checkpoint file as [`super::load`] reads it
    /// (with its optimizer state), a sharded entry's folder as [`super::shards::load`] puts it
    /// together.
    pub fn load(resolved: &Path, model: &Model) -> Result<State, CheckpointError> {
        if resolved.is_dir() {
            super::shards::load(resolved, model)
        } else {
            super::load(resolved, model, Contents::Checkpoint)
        }
    }

    /// The entry's manifest, read and checked to be one.
    pub(super) fn read_manifest(entry: &Path) -> Result<Manifest, CheckpointError> {
        let incomplete = |problem: String| CheckpointError::Incomplete {
            path: entry.to_path_buf(),
            problem,
        };
        let mpath = entry.join(MANIFEST);
        let text = match fs::read_to_string(&mpath) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(incomplete(format!(
                    "{MANIFEST} is missing: the entry was not completely written{}",
                    shards_present(entry)
                )))
            }
            Err(e) => return Err(io(&mpath, false)(e)),
        };
        serde_json::from_str(&text)
            .ok()
            .filter(|m: &Manifest| m.format == FORMAT)
            .ok_or_else(|| incomplete(format!("{MANIFEST} is not a checkpoint manifest")))
    }

    /// For the message of an entry without a manifest: the rank shards it holds, if any.
    fn shards_present(entry: &Path) -> String {
        let mut names: Vec<String> = fs::read_dir(entry)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("rank-") && n.ends_with(".safetensors"))
            .collect();
        names.sort();
        match names.len() {
            0 => String::new(),
            _ => format!(" (it holds the shards {})", names.join(", ")),
        }
    }

    /// Checks every file the entry's manifest lists; returns the state file's path, or the
    /// entry's for a sharded one.
    fn verify(entry: &Path) -> Result<PathBuf, CheckpointError> {
        let incomplete = |problem: String| CheckpointError::Incomplete {
            path: entry.to_path_buf(),
            problem,
        };
        let manifest = read_manifest(entry)?;
        if let Some(world) = manifest.shards {
            for rank in 0..world {
                let name = super::shards::shard_name(rank);
                if !manifest.files.iter().any(|f| f.name == name) {
                    return Err(incomplete(format!(
                        "{MANIFEST} lists no `{name}` (rank {rank} of {world})"
                    )));
                }
            }
        }
        for f in &manifest.files {
            let at = entry.join(&f.name);
            let bytes = match fs::read(&at) {
                Ok(b) => b,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(incomplete(format!(
                        "`{}` is missing ({MANIFEST} lists it)",
                        f.name
                    )))
                }
                Err(e) => return Err(io(&at, false)(e)),
            };
            if bytes.len() as u64 != f.bytes {
                return Err(incomplete(format!(
                    "`{}` has {} bytes, {MANIFEST} says {} ({})",
                    f.name,
                    bytes.len(),
                    f.bytes,
                    if (bytes.len() as u64) < f.bytes {
                        "truncated"
                    } else {
                        "altered"
                    }
                )));
            }
            if fnv1a64(&bytes) != f.fnv1a64 {
                return Err(incomplete(format!(
                    "`{}` does not match the hash in {MANIFEST} (damaged)",
                    f.name
                )));
            }
        }
        if manifest.shards.is_some() {
            return Ok(entry.to_path_buf());
        }
        if !manifest.files.iter().any(|f| f.name == STATE) {
            return Err(incomplete(format!("{MANIFEST} lists no `{STATE}`")));
        }
        Ok(entry.join(STATE))
    }
}
