//! Training data: the corpus and the batch rule of `runtime.md` ("Data and batches").
//!
//! A corpus is bytes (token = byte value). With B = ranks × micro_steps × micro_batch sequences per
//! step, sequence g = t·B + k (step t, k-th of its global batch) is the seq_len + 1 bytes starting at
//! offset (g·seq_len) mod (len − seq_len − 1): the first seq_len are inputs, the last seq_len
//! targets. In micro-step m, rank r takes k = (m·ranks + r)·micro_batch + j for its j-th sequence.
//! The built-in corpus is generated here from a small sentence grammar and a fixed seed, so it is
//! the same everywhere and a byte model's loss visibly falls on it.

use crate::math::Rng;
use std::fmt;
use std::path::{Path, PathBuf};

/// Bytes of the built-in corpus.
pub const BUILTIN_LEN: usize = 64 * 1024;

#[derive(Debug)]
pub enum DataError {
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    /// Fewer than seq_len + 2 bytes: not even two distinct sequence offsets.
    TooShort { len: usize, seq_len: usize },
}

impl fmt::Display for DataError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DataError::Read { path, error } => {
                write!(f, "cannot read the corpus {}: {error}", path.display())
            }
            DataError::TooShort { len, seq_len } => write!(
                f,
                "the corpus has {len} bytes, too short for seq_len {seq_len}: it needs at least {} (seq_len + 2)",
                seq_len + 2
            ),
        }
    }
}

impl std::error::Error for DataError {}

/// The sequences of one global batch (or of one rank's micro-batch), concatenated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Corpus {
    bytes: Vec<u8>,
}

impl Corpus {
    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        Corpus { bytes }
    }

    /// The file at `path`, or the built-in corpus when `None` (a schedule's `data`).
    pub fn load(path: Option<&Path>) -> Result<Self, DataError> {
        match path {
            None => Ok(Self::builtin()),
            Some(p) => std::fs::read(p)
                .map(Self::from_bytes)
                .map_err(|error| DataError::Read {
                    path: p.to_path_buf(),
                    error,
                }),
        }
    }

    /// The built-in corpus: [`BUILTIN_LEN`] bytes of generated English-like sentences.
    pub fn builtin() -> Self {
        Self::from_bytes(builtin_text())
    }

    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Refuses a corpus shorter than seq_len + 2 bytes.
    pub fn check(&self, seq_len: usize) -> Result<(), DataError> {
        if self.bytes.len() < seq_len + 2 {
            return Err(DataError::TooShort {
                len: self.bytes.len(),
                seq_len,
            });
        }
        Ok(())
    }

    /// Where sequence `g` starts: (g·seq_len) mod (len − seq_len − 1).
    pub fn offset(&self, g: u64, seq_len: usize) -> Result<usize, DataError> {
        self.check(seq_len)?;
        let span = (self.bytes.len() - seq_len - 1) as u128;
        Ok(((u128::from(g) * seq_len as u128) % span) as usize)
    }

    /// Writes sequence `g`'s inputs and targets (seq_len each).
    pub fn sequence_into(
        &self,
        g: u64,
        inputs: &mut [u32],
        targets: &mut [u32],
    ) -> Result<(), DataError> {
        let seq_len = inputs.len();
        assert_eq!(
            targets.len(),
            seq_len,
            "inputs and targets differ in length"
        );
        let at = self.offset(g, seq_len)?;
        let window = &self.bytes[at..at + seq_len + 1];
        for (i, (x, y)) in inputs.iter_mut().zip(targets.iter_mut()).enumerate() {
            *x = u32::from(window[i]);
            *y = u32::from(window[i + 1]);
        }
        Ok(())
    }

    /// Sequence `g`: (inputs, targets), seq_len tokens each.
    pub fn sequence(&self, g: u64, seq_len: usize) -> Result<(Vec<u32>, Vec<u32>), DataError> {
        let (mut x, mut y) = (vec![0; seq_len], vec![0; seq_len]);
        self.sequence_into(g, &mut x, &mut y)?;
        Ok((x, y))
    }

    /// Rank `rank`'s micro-batch in micro-step `micro_step` of step `step` (0-based) of a global
    /// batch cut as `shape` says, written into `inputs` and `targets` (micro_batch·seq_len each,
    /// sequence after sequence).
    pub fn batch_into(
        &self,
        shape: &BatchShape,
        (step, micro_step, rank): (u64, usize, usize),
        inputs: &mut [u32],
        targets: &mut [u32],
    ) -> Result<(), DataError> {
        let BatchShape {
            ranks,
            micro_steps,
            micro_batch,
            seq_len,
        } = *shape;
        assert!(
            rank < ranks && micro_step < micro_steps,
            "rank or micro-step out of range"
        );
        assert_eq!(inputs.len(), micro_batch * seq_len, "inputs length");
        assert_eq!(targets.len(), micro_batch * seq_len, "targets length");
        let b = (ranks * micro_steps * micro_batch) as u64;
        for (j, (x, y)) in inputs
            .chunks_exact_mut(seq_len)
            .zip(targets.chunks_exact_mut(seq_len))
            .enumerate()
        {
            let k = ((micro_step * ranks + rank) * micro_batch + j) as u64;
            self.sequence_into(step * b + k, x, y)?;
        }
        Ok(())
    }

    /// [`Corpus::batch_into`], allocating: (inputs, targets).
    pub fn batch(
        &self,
        shape: &BatchShape,
        at: (u64, usize, usize),
    ) -> Result<(Vec<u32>, Vec<u32>), DataError> {
        let n = shape.micro_batch * shape.seq_len;
        let (mut x, mut y) = (vec![0; n], vec![0; n]);
        self.batch_into(shape, at, &mut x, &mut y)?;
        Ok((x, y))
    }

    /// The whole global batch of step `step`: its `sequences` (= B) sequences in order k = 0..B.
    pub fn global_batch(
        &self,
        step: u64,
        sequences: usize,
        seq_len: usize,
    ) -> Result<Batch, DataError> {
        let n = sequences * seq_len;
        let mut batch = Batch {
            inputs: vec![0; n],
            targets: vec![0; n],
        };
        for (k, (x, y)) in batch
            .inputs
            .chunks_exact_mut(seq_len)
            .zip(batch.targets.chunks_exact_mut(seq_len))
            .enumerate()
        {
            self.sequence_into(step * sequences as u64 + k as u64, x, y)?;
        }
        Ok(batch)
    }
}

/// How a step's global batch is cut (the batch rule): `ranks` × `micro_steps` micro-batches of
/// `micro_batch` sequences of `seq_len` tokens; sequence k of step t is corpus sequence t·B + k,
/// B the global batch, and micro-batch (m, r) takes sequences k = (m·ranks + r)·micro_batch + j.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchShape {
    pub ranks: usize,
    pub micro_steps: usize,
    pub micro_batch: usize,
    pub seq_len: usize,
}

const NAMES: &[&str] = &[
    "mira",
    "tomas",
    "ada",
    "kofi",
    "lena",
    "ravi",
    "the miller",
    "the old sailor",
];
const ADJECTIVES: &[&str] = &[
    "small", "red", "quiet", "bright", "heavy", "green", "tired", "clever", "round", "cold",
];
const NOUNS: &[&str] = &[
    "cat", "river", "lamp", "garden", "boat", "window", "bird", "stone", "kettle", "road", "tree",
    "letter",
];
const VERBS: &[(&str, &str)] = &[
    ("sees", "saw"),
    ("finds", "found"),
    ("carries", "carried"),
    ("paints", "painted"),
    ("follows", "followed"),
    ("likes", "liked"),
    ("mends", "mended"),
    ("watches", "watched"),
];
const PLACES: &[&str] = &[
    "near the hill",
    "by the sea",
    "in the morning",
    "after the rain",
    "under the bridge",
    "at the market",
];
const ADVERBS: &[&str] = &[
    "slowly",
    "again",
    "quietly",
    "at once",
    "with care",
    "every day",
];

fn pick<'a>(rng: &mut Rng, words: &[&'a str]) -> &'a str {
    words[rng.below(words.len() as u64) as usize]
}

fn noun_phrase(rng: &mut Rng) -> String {
    let article = if rng.below(3) == 0 { "a" } else { "the" };
    if rng.below(2) == 0 {
        format!("{article} {} {}", pick(rng, ADJECTIVES), pick(rng, NOUNS))
    } else {
        format!("{article} {}", pick(rng, NOUNS))
    }
}

fn sentence(rng: &mut Rng) -> String {
    let (now, past) = VERBS[rng.below(VERBS.len() as u64) as usize];
    let s = match rng.below(5) {
        0 => format!("{} {now} {}.", noun_phrase(rng), noun_phrase(rng)),
        1 => format!(
            "{} {past} {} {}.",
            pick(rng, NAMES),
            noun_phrase(rng),
            pick(rng, PLACES)
        ),
        2 => format!(
            "{} said that {} was {}.",
            pick(rng, NAMES),
            noun_phrase(rng),
            pick(rng, ADJECTIVES)
        ),
        3 => format!(
            "{} {now} {} {}.",
            pick(rng, NAMES),
            noun_phrase(rng),
            pick(rng, ADVERBS)
        ),
        _ => format!(
            "{} {past} {}, and {} {past} it too.",
            pick(rng, NAMES),
            noun_phrase(rng),
            pick(rng, NAMES)
        ),
    };
    let mut c = s.chars();
    c.next()
        .map(|f| f.to_uppercase().collect::<String>() + c.as_str())
        .unwrap_or_default()
}

/// The built-in corpus text: sentences from the grammar above, four or so to a line.
fn builtin_text() -> Vec<u8> {
    let mut rng = Rng::new(0x5eed_c0de);
    let mut out = String::with_capacity(BUILTIN_LEN + 128);
    while out.len() < BUILTIN_LEN {
        out.push_str(&sentence(&mut rng));
        out.push(if rng.below(4) == 0 { '\n' } else { ' ' });
    }
    let mut bytes = out.into_bytes();
    bytes.truncate(BUILTIN_LEN);
    bytes
}
