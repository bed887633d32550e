//! Checkpoint entries written by several processes, each holding only some ranks' shards (the
//! CUDA backend, one process per GPU; `runtime.md`, "Long runs").
//!
//! A process cannot gather whole tensors from shards other processes hold, so each rank writes
//! its own part of the optimizer state and the entry is complete only when all have: under
//! `DIR/step-00000120/`, one `rank-00003.safetensors` per rank of the plan and `manifest.json`
//! listing every one of them with its size and FNV-1a hash, as a whole-state entry's manifest
//! lists `state.safetensors` ([`super::folder`]).
//!
//! Writing takes two phases, with a point every process reaches between them (the backend's
//! [`crate::backend::Backend::all_agree`]):
//! 1. every rank, [`write_rank`]: its shard file written and synced under a temporary name and
//!    renamed into the entry's pending folder `DIR/.step-00000120.shards.tmp/` (the same name in
//!    every process), then a receipt beside it giving the file's size and hash;
//! 2. one rank, once every rank's phase 1 has returned, [`finish`]: every receipt read and every
//!    shard's size checked, the manifest written and synced last, the pending folder renamed to
//!    `step-00000120` and older entries pruned.
//!
//! So an entry named `step-N` exists only complete: a run killed at any moment leaves at most a
//! hidden pending folder, which a later save of the same step writes over (each file is replaced
//! by rename) or a later prune removes. What a rank writes is, for each layer whose optimizer
//! shard it holds and no lower rank holds too (replicas write once), its slice of the layer's
//! padded flat state: `LAYER.master`, and Adam's `LAYER.exp_avg` and `LAYER.exp_avg_sq`, 1-D
//! F32, with the slice's first element and the padded length in the file's metadata. Loading
//! ([`load`]) puts the slices of every rank back into whole layers (parameters being the master
//! copy rounded to the model's dtype, as [`crate::train::Trainer::state`] gives them), so a
//! sharded entry resumes under any schedule of the model, any number of ranks included.

use super::folder::{self, FileEntry, Manifest, MANIFEST};
use super::CheckpointError;
use crate::math::Precision;
pub use crate::train::{LayerShard, RankShard};
use crate::train::{LayerState, State};
use safetensors::tensor::{Dtype as StDtype, TensorView};
use safetensors::SafeTensors;
use sched_ir::job::{Model, Optimizer};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

const FORMAT: &str = "sched-checkpoint-shard";

/// The shard file of `rank` in an entry.
pub fn shard_name(rank: u32) -> String {
    format!("rank-{rank:05}.safetensors")
}

fn receipt_name(rank: u32) -> String {
    format!("rank-{rank:05}.receipt.json")
}

/// The pending folder every rank writes step `step`'s shards into, before [`finish`] renames it.
pub fn pending(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!(".{}.shards.tmp", folder::entry_name(step)))
}

/// What a rank leaves beside its shard once the shard is in place: what the manifest will say.
#[derive(Serialize, Deserialize)]
struct Receipt {
    step: u64,
    world: u32,
    file: FileEntry,
}

/// Where each layer's slice lies, in a shard file's metadata (`shards`): layer name to
/// (first element, padded length).
type Slices = BTreeMap<String, (usize, usize)>;

/// Phase 1, every rank: writes `shard` (rank `shard.rank` of `world`, the state after step
/// `step`) into the pending entry under `dir` (created if missing), the shard file and then its
/// receipt, each atomically and synced.
pub fn write_rank(
    dir: &Path,
    model: &Model,
    step: u64,
    world: u32,
    shard: &RankShard,
) -> Result<(), CheckpointError> {
    let at = pending(dir, step);
    fs::create_dir_all(&at).map_err(folder::io(&at, true))?;
    let name = shard_name(shard.rank);
    let file = at.join(&name);
    let bytes = shard_bytes(&file, model, step, world, shard)?;
    write_renamed(&file, &bytes)?;
    let receipt = Receipt {
        step,
        world,
        file: FileEntry {
            name,
            bytes: bytes.len() as u64,
            fnv1a64: folder::fnv1a64(&bytes),
        },
    };
    let text = serde_json::to_string(&receipt).expect("receipts serialise");
    write_renamed(&at.join(receipt_name(shard.rank)), text.as_bytes())?;
    folder::sync_dir(&at)
}

/// Writes `bytes` synced under a hidden name beside `path` and renames it to `path`.
fn write_renamed(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let result = folder::write_synced(&tmp, bytes)
        .and_then(|()| fs::rename(&tmp, path).map_err(folder::io(path, true)));
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

fn shard_bytes(
    path: &Path,
    model: &Model,
    step: u64,
    world: u32,
    shard: &RankShard,
) -> Result<Vec<u8>, CheckpointError> {
    let format = |problem: String| CheckpointError::Format {
        path: path.to_path_buf(),
        problem,
    };
    let mut tensors: Vec<(String, Vec<u8>, usize)> = vec![];
    let mut slices = Slices::new();
    for s in &shard.layers {
        let layer = model
            .layers
            .get(s.layer)
            .ok_or_else(|| format(format!("model `{}` has no layer {}", model.name, s.layer)))?;
        let n = s.master.len();
        if s.first + n > s.padded || [&s.m, &s.v].iter().any(|x| !x.is_empty() && x.len() != n) {
            return Err(format(format!(
                "layer `{}`: a slice of {n} from {} does not fit its padded length {}",
                layer.name, s.first, s.padded
            )));
        }
        slices.insert(layer.name.clone(), (s.first, s.padded));
        let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect();
        for (suffix, v) in [
            ("master", &s.master),
            ("exp_avg", &s.m),
            ("exp_avg_sq", &s.v),
        ] {
            if suffix == "master" || !v.is_empty() {
                tensors.push((format!("{}.{suffix}", layer.name), bytes(v), n));
            }
        }
    }
    let views = tensors
        .iter()
        .map(|(name, data, n)| {
            TensorView::new(StDtype::F32, vec![*n], data)
                .map(|v| (name.clone(), v))
                .map_err(|e| format(format!("tensor `{name}`: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let meta = HashMap::from([
        ("format".to_string(), FORMAT.to_string()),
        ("model".to_string(), model.name.clone()),
        ("step".to_string(), step.to_string()),
        ("rank".to_string(), shard.rank.to_string()),
        ("world".to_string(), world.to_string()),
        (
            "shards".to_string(),
            serde_json::to_string(&slices).expect("slices serialise"),
        ),
    ]);
    safetensors::serialize(views, &Some(meta)).map_err(|e| format(format!("cannot serialise: {e}")))
}

/// Phase 2, one rank, after every rank's [`write_rank`] of step `step` returned: checks that
/// each of the `world` ranks' shard is in the pending entry with the size its receipt gives,
/// writes the manifest last, renames the entry into place (an entry of the same step already
/// there is replaced) and keeps the newest `keep` entries. Returns the entry's path. A missing
/// shard or receipt is refused naming the rank, and nothing is renamed.
pub fn finish(
    dir: &Path,
    model: &Model,
    step: u64,
    world: u32,
    keep: usize,
) -> Result<PathBuf, CheckpointError> {
    let at = pending(dir, step);
    let incomplete = |problem: String| CheckpointError::Incomplete {
        path: at.clone(),
        problem,
    };
    let mut files = vec![];
    for rank in 0..world {
        let rpath = at.join(receipt_name(rank));
        let text = fs::read_to_string(&rpath).map_err(|e| {
            incomplete(format!(
                "rank {rank} has not written its shard ({}: {e})",
                receipt_name(rank)
            ))
        })?;
        let receipt: Receipt = serde_json::from_str(&text)
            .ok()
            .filter(|r: &Receipt| {
                r.step == step && r.world == world && r.file.name == shard_name(rank)
            })
            .ok_or_else(|| {
                incomplete(format!(
                    "{} is not rank {rank}'s receipt of step {step} of {world} ranks",
                    receipt_name(rank)
                ))
            })?;
        let shard = at.join(&receipt.file.name);
        let size = fs::metadata(&shard)
            .map(|m| m.len())
            .map_err(|e| incomplete(format!("`{}` of rank {rank}: {e}", receipt.file.name)))?;
        if size != receipt.file.bytes {
            return Err(incomplete(format!(
                "`{}` has {size} bytes, rank {rank} wrote {}",
                receipt.file.name, receipt.file.bytes
            )));
        }
        files.push(receipt.file);
    }
    // Receipts and anything else (a stale shard of a run with more ranks) are not the entry's.
    let listed: Vec<&str> = files.iter().map(|f| f.name.as_str()).collect();
    for e in fs::read_dir(&at).map_err(folder::io(&at, false))?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !listed.contains(&name.as_str()) {
            let _ = fs::remove_file(e.path());
        }
    }
    let manifest = Manifest {
        format: folder::FORMAT.to_string(),
        step,
        model: model.name.clone(),
        shards: Some(world),
        files,
    };
    let text = serde_json::to_string_pretty(&manifest).expect("manifests serialise") + "\n";
    folder::write_synced(&at.join(MANIFEST), text.as_bytes())?;
    folder::sync_dir(&at)?;
    let entry = folder::place(dir, &at, step)?;
    folder::prune(dir, keep.max(1));
    Ok(entry)
}

/// The state in the sharded entry `entry` (verified by [`folder::resolve`]): every rank's
/// slices put back into whole layers. A layer with elements no shard holds, a shard of another
/// model or step, or slices of the wrong size are refused naming the entry.
pub fn load(entry: &Path, model: &Model) -> Result<State, CheckpointError> {
    let manifest = folder::read_manifest(entry)?;
    let incomplete = |problem: String| CheckpointError::Incomplete {
        path: entry.to_path_buf(),
        problem,
    };
    let world = manifest
        .shards
        .ok_or_else(|| incomplete(format!("{MANIFEST} lists no rank shards")))?;
    let moments = model.optimizer != Optimizer::Sgd;
    // Per layer: every rank's slice.
    let mut pieces: Vec<Vec<LayerShard>> = vec![vec![]; model.layers.len()];
    for rank in 0..world {
        let path = entry.join(shard_name(rank));
        let format = |problem: String| CheckpointError::Format {
            path: path.clone(),
            problem,
        };
        let bytes = fs::read(&path).map_err(folder::io(&path, false))?;
        let file = SafeTensors::deserialize(&bytes)
            .map_err(|e| format(format!("not a safetensors file: {e}")))?;
        let (_, meta) = SafeTensors::read_metadata(&bytes)
            .map_err(|e| format(format!("not a safetensors file: {e}")))?;
        let meta = meta.metadata().clone().unwrap_or_default();
        let get = |key: &str| meta.get(key).map(String::as_str).unwrap_or("");
        if get("format") != FORMAT {
            return Err(format("not a checkpoint shard".to_string()));
        }
        if get("model") != model.name {
            return Err(format(format!(
                "a shard of model `{}`, not `{}`",
                get("model"),
                model.name
            )));
        }
        if get("step") != manifest.step.to_string() || get("world") != world.to_string() {
            return Err(format(format!(
                "a shard of step {} of {} ranks in the entry of step {} of {world}",
                get("step"),
                get("world"),
                manifest.step
            )));
        }
        let slices: Slices = serde_json::from_str(get("shards"))
            .map_err(|e| format(format!("metadata `shards`: {e}")))?;
        for (name, (first, padded)) in slices {
            let Some(l) = model.layers.iter().position(|l| l.name == name) else {
                return Err(CheckpointError::Extra {
                    path: path.clone(),
                    model: model.name.clone(),
                    count: 1,
                    first: vec![name],
                });
            };
            if padded < model.layers[l].params as usize {
                return Err(format(format!(
                    "layer `{name}` padded to {padded}, fewer than its {} parameters",
                    model.layers[l].params
                )));
            }
            let read = |suffix: &str| -> Result<Vec<f32>, CheckpointError> {
                let tensor = format!("{name}.{suffix}");
                let t = file.tensor(&tensor).map_err(|_| CheckpointError::Missing {
                    path: path.clone(),
                    tensor: tensor.clone(),
                })?;
                if t.dtype() != StDtype::F32 || t.shape().len() != 1 {
                    return Err(format(format!("tensor `{tensor}` is not a 1-D F32 slice")));
                }
                Ok(t.data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect())
            };
            let master = read("master")?;
            let (m, v) = if moments {
                (read("exp_avg")?, read("exp_avg_sq")?)
            } else {
                (vec![], vec![])
            };
            if first + master.len() > padded
                || (moments && (m.len(), v.len()) != (master.len(), master.len()))
            {
                return Err(format(format!(
                    "layer `{name}`: slices of unequal or excess length"
                )));
            }
            pieces[l].push(LayerShard {
                layer: l,
                first,
                padded,
                master,
                m,
                v,
            });
        }
    }
    let mut layers = vec![];
    for (layer, mut ps) in model.layers.iter().zip(pieces) {
        let n = layer.params as usize;
        ps.sort_by_key(|p| p.first);
        let mut st = LayerState {
            master: vec![0.0; n],
            m: if moments { vec![0.0; n] } else { vec![] },
            v: if moments { vec![0.0; n] } else { vec![] },
            ..LayerState::default()
        };
        let mut covered = 0usize;
        for p in &ps {
            if p.first > covered && covered < n {
                break;
            }
            let end = (p.first + p.master.len()).min(n);
            for i in p.first..end {
                st.master[i] = p.master[i - p.first];
                if moments {
                    st.m[i] = p.m[i - p.first];
                    st.v[i] = p.v[i - p.first];
                }
            }
            covered = covered.max(p.first + p.master.len());
        }
        if covered < n {
            let upto = ps
                .iter()
                .map(|p| p.first)
                .find(|&f| f > covered)
                .unwrap_or(n)
                .min(n);
            return Err(incomplete(format!(
                "no shard holds elements {covered}..{upto} of layer `{}`",
                layer.name
            )));
        }
        st.params = st.master.clone();
        Precision::of(model.dtype).round(&mut st.params);
        layers.push(st);
    }
    Ok(State {
        layers,
        step: manifest.step,
    })
}
