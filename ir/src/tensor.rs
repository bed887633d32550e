//! Tensor-parallel slices (`spec/parallel.md` §2): what rank k of a tensor group of t ranks holds
//! of a layer. The compiler sizes a rank's parameter shards by it, the runtime cuts checkpoints
//! into slices and gathers them back by it: one definition for both.
//!
//! In a transformer, `attn.qkv` is column-parallel by heads: rank k holds the rows of its heads/t
//! query heads and of its kv_heads/t key and value heads (kv_heads must divide by t, so a kv head
//! never straddles two ranks), in the packed order `[q | k | v]` the attention reads; `attn.proj`
//! is row-parallel (the columns of those heads). In an MLP the first product (`mlp.fc`, or
//! SwiGLU's `mlp.gate` and `mlp.up`) is column-parallel over `ffn`, `mlp.proj` row-parallel.
//! Norms, row-parallel biases and learned positions are replicated. The embedding's `wte` and an
//! untied head's `weight` are split by vocabulary padded to a multiple of t ([`VocabShard`]). A
//! slice is the tensors in the layer's order, each cut this way; [`gather`] is the inverse.
//!
//! [`split_layers`] says which layers a schedule's lowering splits: transformer and mlp layers
//! when t > 1 (the embedding and the head stay whole on every rank of the group until the
//! vocabulary-parallel lowering lands; their slices here serve the slice numerics).

use crate::job::{Layer, LayerKind, TensorSpec};
use std::ops::Range;

/// One rank's place in its tensor group: `index` of `size` (t) ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TensorRank {
    pub size: usize,
    pub index: usize,
}

/// Why a layer cannot be sliced or its slices gathered.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SliceError {
    /// The tensor group is malformed: no ranks, or an index past its size.
    #[error("rank {index} of a tensor group of {size}")]
    Rank { size: usize, index: usize },
    /// The layer cannot be split t ways (spec rule 3), or not by this kind of slice.
    #[error("layer {layer}: {problem}")]
    Split { layer: String, problem: String },
    /// A tensor that the slicing rules do not know or whose shape they cannot split.
    #[error("layer {layer}: tensor `{tensor}` {problem}")]
    Tensor {
        layer: String,
        tensor: String,
        problem: String,
    },
    /// [`gather`] given the wrong number of slices or a slice of the wrong length.
    #[error("layer {layer}: {problem}")]
    Slices { layer: String, problem: String },
}

/// How a tensor is divided over the tensor group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Split {
    /// Whole on every rank: norms, row-parallel biases, learned positions.
    Replicated,
    /// `attn.qkv` (weight rows, bias elements): the rank's query heads, then its key heads, then
    /// its value heads.
    Heads,
    /// Column-parallel over `ffn`: rows k·ffn/t.. of the weight, elements of the bias.
    Rows,
    /// Row-parallel: columns k·n/t.. of every row.
    Columns,
    /// Vocabulary-parallel: rows of the rank's [`VocabShard`], padding rows zero.
    Vocab,
}

/// One tensor of a slice: its name (the full layer's), its shape on the rank, how it is cut and
/// where it sits in the slice's flat vector.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceTensor {
    pub name: String,
    pub shape: Vec<u64>,
    pub split: Split,
    pub range: Range<usize>,
}

/// A contiguous run of `len` values at `full` in the full flat vector and `slice` in the slice's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    pub full: usize,
    pub slice: usize,
    pub len: usize,
    /// Part of a replicated tensor: every rank holds it, [`gather`] takes rank 0's.
    pub replicated: bool,
}

/// Rank `index`'s columns of a vocabulary of `vocab` words split over `size` ranks, padded to a
/// multiple of `size`: `width` = V'/size columns from `start` = index·width, of which
/// [`VocabShard::columns`] are words and the rest padding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VocabShard {
    pub vocab: usize,
    pub size: usize,
    pub width: usize,
    pub start: usize,
}

impl VocabShard {
    pub fn new(vocab: usize, rank: TensorRank) -> Self {
        let size = rank.size.max(1);
        let width = vocab.div_ceil(size);
        VocabShard {
            vocab,
            size,
            width,
            start: rank.index * width,
        }
    }

    /// The padded vocabulary V' (the least multiple of the group's size that holds it).
    pub fn padded(&self) -> usize {
        self.width * self.size
    }

    /// The real words this rank holds (the rest of its `width` columns are padding); 0 for a rank
    /// of padding only.
    pub fn columns(&self) -> usize {
        self.vocab.saturating_sub(self.start).min(self.width)
    }

    /// The words this rank holds, as ids.
    pub fn words(&self) -> Range<usize> {
        self.start..self.start + self.columns()
    }
}

/// Where rank k's slice of a layer comes from: its tensors and the runs it copies from the full
/// flat vector (matrices [out, in] row-major, tensors in the layer's order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceLayout {
    layer: String,
    rank: TensorRank,
    tensors: Vec<SliceTensor>,
    runs: Vec<Run>,
    elements: usize,
    full: usize,
}

fn check_rank(rank: TensorRank) -> Result<(), SliceError> {
    if rank.size == 0 || rank.index >= rank.size {
        return Err(SliceError::Rank {
            size: rank.size,
            index: rank.index,
        });
    }
    Ok(())
}

/// The split of tensor `name` in a layer of kind `kind`, or `None` for a name the rules do not
/// know.
fn split_of(kind: &LayerKind, name: &str) -> Option<Split> {
    let mlp = |name: &str| match name {
        "mlp.fc.weight" | "mlp.fc.bias" | "mlp.gate.weight" | "mlp.gate.bias" | "mlp.up.weight"
        | "mlp.up.bias" => Some(Split::Rows),
        "mlp.proj.weight" => Some(Split::Columns),
        "mlp.proj.bias" => Some(Split::Replicated),
        _ => None,
    };
    let norm = |prefix: &str, name: &str| {
        name.strip_prefix(prefix)
            .is_some_and(|rest| rest == ".weight" || rest == ".bias")
            .then_some(Split::Replicated)
    };
    match kind {
        LayerKind::Transformer(_) => match name {
            "attn.qkv.weight" | "attn.qkv.bias" => Some(Split::Heads),
            "attn.proj.weight" => Some(Split::Columns),
            "attn.proj.bias" => Some(Split::Replicated),
            _ => mlp(name)
                .or_else(|| norm("ln1", name))
                .or_else(|| norm("ln2", name)),
        },
        LayerKind::Mlp(_) => mlp(name).or_else(|| norm("ln", name)),
        LayerKind::Embedding { .. } => match name {
            "wte" => Some(Split::Vocab),
            "wpe" => Some(Split::Replicated),
            _ => None,
        },
        LayerKind::LmHead { .. } => match name {
            "weight" => Some(Split::Vocab),
            _ => norm("norm", name),
        },
        LayerKind::Dense { .. } => None,
    }
}

/// What a layer's kind fixes for cutting its tensors t ways.
struct Cuts {
    rank: TensorRank,
    /// A transformer's heads, kv_heads and head width.
    heads: Option<(usize, usize, usize)>,
    /// A transformer's or mlp's ffn.
    ffn: Option<usize>,
    /// An embedding's or head's vocabulary shard.
    vocab: Option<VocabShard>,
}

impl Cuts {
    /// Refuses a `dense` layer and heads, kv_heads or ffn that t does not divide (rule 3).
    fn of(layer: &Layer, rank: TensorRank) -> Result<Self, SliceError> {
        check_rank(rank)?;
        let t = rank.size;
        let split_err = |problem: String| SliceError::Split {
            layer: layer.name.clone(),
            problem,
        };
        let divides = |what: &str, v: usize| {
            if v > 0 && v.is_multiple_of(t) {
                return Ok(v);
            }
            let why = if what == "kv_heads" {
                ": each rank needs whole kv heads, so kv_heads must be a multiple of t (and at \
                 least t)"
            } else {
                ""
            };
            Err(split_err(format!(
                "{what} = {v} does not divide into {t} tensor slices (rule 3){why}"
            )))
        };
        let mut cuts = Cuts {
            rank,
            heads: None,
            ffn: None,
            vocab: None,
        };
        match &layer.kind {
            LayerKind::Dense { .. } => {
                return Err(split_err(
                    "a `dense` layer cannot be split over a tensor group".into(),
                ))
            }
            LayerKind::Transformer(tr) => {
                let n = divides("heads", tr.heads as usize)?;
                let kv = divides("kv_heads", tr.kv_heads as usize)?;
                cuts.ffn = Some(divides("ffn", tr.ffn as usize)?);
                if !(tr.hidden as usize).is_multiple_of(n) {
                    return Err(split_err(format!(
                        "hidden {} does not split into {n} heads",
                        tr.hidden
                    )));
                }
                cuts.heads = Some((n, kv, tr.hidden as usize / n));
            }
            LayerKind::Mlp(m) => cuts.ffn = Some(divides("ffn", m.ffn as usize)?),
            LayerKind::Embedding { vocab, .. } | LayerKind::LmHead { vocab, .. } => {
                cuts.vocab = Some(VocabShard::new(*vocab as usize, rank));
            }
        }
        Ok(cuts)
    }

    /// The rank's rows of a tensor of `rows` rows cut by `split` (`Heads`, `Rows` or `Vocab`):
    /// blocks (first full row, rows) in slice order, and the slice's row count (more than the
    /// blocks hold by the vocabulary's padding); or what is wrong with `rows`.
    fn row_blocks(
        &self,
        split: Split,
        rows: usize,
    ) -> Result<(Vec<(usize, usize)>, usize), String> {
        let (t, k) = (self.rank.size, self.rank.index);
        match (split, self.heads, self.ffn, self.vocab) {
            (Split::Heads, Some((nh, kv, d)), ..) => {
                if rows != (nh + 2 * kv) * d {
                    return Err(format!(
                        "has {rows} rows, not (heads + 2·kv_heads)·head_dim = {}",
                        (nh + 2 * kv) * d
                    ));
                }
                let (q, kvr) = (nh / t * d, kv / t * d);
                let blocks = vec![
                    (k * q, q),
                    (nh * d + k * kvr, kvr),
                    ((nh + kv) * d + k * kvr, kvr),
                ];
                Ok((blocks, q + 2 * kvr))
            }
            (Split::Rows, _, Some(f), _) => {
                if rows != f {
                    return Err(format!("has {rows} rows, not ffn = {f}"));
                }
                Ok((vec![(k * (f / t), f / t)], f / t))
            }
            (Split::Vocab, .., Some(v)) => {
                if rows != v.vocab {
                    return Err(format!("has {rows} rows, not vocab = {}", v.vocab));
                }
                Ok((vec![(v.start, v.columns())], v.width))
            }
            _ => Err(format!("cannot be cut by {split:?} in this layer")),
        }
    }
}

impl SliceLayout {
    /// Rank `rank.index`'s slice of `layer` for a group of `rank.size`: refuses a `dense` layer,
    /// heads, kv_heads or ffn that t does not divide, and tensors the rules do not know.
    pub fn new(layer: &Layer, rank: TensorRank) -> Result<Self, SliceError> {
        Self::build(layer, rank, true)
    }

    /// [`SliceLayout::new`] without the copy runs ([`SliceLayout::runs`] is empty): the slice's
    /// tensors, shapes and ranges only, for sizing (a row-parallel matrix has a run per row).
    pub fn shapes(layer: &Layer, rank: TensorRank) -> Result<Self, SliceError> {
        Self::build(layer, rank, false)
    }

    fn build(layer: &Layer, rank: TensorRank, with_runs: bool) -> Result<Self, SliceError> {
        let cuts = Cuts::of(layer, rank)?;
        let (t, k) = (rank.size, rank.index);
        let mut out = SliceLayout {
            layer: layer.name.clone(),
            rank,
            tensors: vec![],
            runs: vec![],
            elements: 0,
            full: 0,
        };
        for ts in &layer.tensors {
            let n = ts.elements() as usize;
            let tensor_err = |problem: String| SliceError::Tensor {
                layer: layer.name.clone(),
                tensor: ts.name.clone(),
                problem,
            };
            let split = split_of(&layer.kind, &ts.name)
                .ok_or_else(|| tensor_err("is not known to the tensor-parallel slicing".into()))?;
            let dims: Vec<usize> = ts.shape.iter().map(|&d| d as usize).collect();
            let (rows, width) = match dims[..] {
                [r] => (r, 1),
                [r, c] => (r, c),
                _ => return Err(tensor_err(format!("has shape {dims:?}: not 1-D or 2-D"))),
            };
            let (at, base) = (out.full, out.elements);
            let mut run = |full: usize, slice: usize, len: usize, replicated: bool| {
                if with_runs {
                    out.runs.push(Run {
                        full: at + full,
                        slice: base + slice,
                        len,
                        replicated,
                    })
                }
            };
            let (shape, elements) = match split {
                Split::Replicated => {
                    run(0, 0, n, true);
                    (ts.shape.clone(), n)
                }
                Split::Columns => {
                    if dims.len() != 2 || !width.is_multiple_of(t) {
                        return Err(tensor_err(format!(
                            "has shape {dims:?}: its columns do not divide into {t} slices"
                        )));
                    }
                    let w = width / t;
                    for i in (0..rows).filter(|_| with_runs) {
                        run(i * width + k * w, i * w, w, false);
                    }
                    (vec![rows as u64, w as u64], rows * w)
                }
                Split::Heads | Split::Rows | Split::Vocab => {
                    let (blocks, slice_rows) = cuts.row_blocks(split, rows).map_err(tensor_err)?;
                    let mut r = 0;
                    for (first, count) in blocks {
                        if count > 0 {
                            run(first * width, r * width, count * width, false);
                        }
                        r += count;
                    }
                    let mut shape = vec![slice_rows as u64];
                    shape.extend((dims.len() == 2).then_some(width as u64));
                    (shape, slice_rows * width)
                }
            };
            out.tensors.push(SliceTensor {
                name: ts.name.clone(),
                shape,
                split,
                range: base..base + elements,
            });
            out.full += n;
            out.elements += elements;
        }
        Ok(out)
    }

    pub fn rank(&self) -> TensorRank {
        self.rank
    }

    /// The slice's tensors, in the layer's order.
    pub fn tensors(&self) -> &[SliceTensor] {
        &self.tensors
    }

    /// The copies that make the slice from the full vector (positions no run writes are the
    /// vocabulary's padding rows, zeros).
    pub fn runs(&self) -> &[Run] {
        &self.runs
    }

    /// Length of the slice's flat vector.
    pub fn elements(&self) -> usize {
        self.elements
    }

    /// Length of the full layer's flat vector.
    pub fn full_elements(&self) -> usize {
        self.full
    }

    /// Where tensor `name` sits in the slice's flat vector.
    pub fn range(&self, name: &str) -> Option<Range<usize>> {
        self.tensors
            .iter()
            .find(|t| t.name == name)
            .map(|t| t.range.clone())
    }

    /// Rank k's slice of the full flat vector `full` (panics on a wrong length: the caller's bug).
    pub fn slice(&self, full: &[f32]) -> Vec<f32> {
        assert_eq!(full.len(), self.full, "{}: full vector length", self.layer);
        let mut out = vec![0.0; self.elements];
        for r in &self.runs {
            out[r.slice..r.slice + r.len].copy_from_slice(&full[r.full..r.full + r.len]);
        }
        out
    }

    /// The layer as the slice holds it: the same name and kind, the slice's tensor shapes.
    pub fn narrow(&self, layer: &Layer) -> Layer {
        Layer {
            name: layer.name.clone(),
            kind: layer.kind,
            tensors: self
                .tensors
                .iter()
                .map(|t| TensorSpec {
                    name: t.name.clone(),
                    shape: t.shape.clone(),
                })
                .collect(),
            params: self.elements as u64,
        }
    }
}

/// The full flat vector of `layer` from the slices of its `size` ranks, in rank order (the
/// inverse of [`SliceLayout::slice`]): replicated tensors come from rank 0, padding rows are
/// dropped.
pub fn gather(layer: &Layer, size: usize, slices: &[&[f32]]) -> Result<Vec<f32>, SliceError> {
    let bad = |problem: String| SliceError::Slices {
        layer: layer.name.clone(),
        problem,
    };
    if slices.len() != size {
        return Err(bad(format!(
            "{} slices for a tensor group of {size}",
            slices.len()
        )));
    }
    let mut full = vec![];
    for (index, slice) in slices.iter().enumerate() {
        let layout = SliceLayout::new(layer, TensorRank { size, index })?;
        if slice.len() != layout.elements {
            return Err(bad(format!(
                "rank {index}'s slice has {} values, not {}",
                slice.len(),
                layout.elements
            )));
        }
        full.resize(layout.full, 0.0);
        for r in layout.runs.iter().filter(|r| index == 0 || !r.replicated) {
            full[r.full..r.full + r.len].copy_from_slice(&slice[r.slice..r.slice + r.len]);
        }
    }
    Ok(full)
}

/// Whether a schedule with tensor-parallel degree `t` lowers layer `kind` as slices (its ops
/// split at Megatron's all-reduces): transformer and mlp layers when t > 1.
pub fn split_layers(kind: &LayerKind, t: u32) -> bool {
    t > 1 && matches!(kind, LayerKind::Transformer(_) | LayerKind::Mlp(_))
}

/// The parameters one rank holds of `layer` under tensor-parallel degree `t`: its slice's when
/// the lowering splits the layer ([`split_layers`]), else the whole layer's.
pub fn rank_params(layer: &Layer, t: u32) -> Result<u64, SliceError> {
    if !split_layers(&layer.kind, t) {
        return Ok(layer.params);
    }
    let rank = TensorRank {
        size: t as usize,
        index: 0,
    };
    Ok(SliceLayout::shapes(layer, rank)?.elements() as u64)
}
