//! Training data: the corpus and the batch rule of `runtime.md` ("Data and batches").
//!
//! A corpus is a sequence of token ids: the bytes of a text file (token = byte value), or the
//! tokens of a tokenized file ([`formats`]: llm.c's and nanoGPT's `.bin`, NumPy's `.npy`) or of a
//! text run through a Hugging Face `tokenizer.json` ([`text`]). With B = ranks × micro_steps ×
//! micro_batch sequences per step, sequence g = t·B + k (step t, k-th of its global batch) is the
//! seq_len + 1 tokens starting at offset (g·seq_len) mod (len − seq_len − 1): the first seq_len
//! are inputs, the last seq_len targets. In micro-step m, rank r takes
//! k = (m·ranks + r)·micro_batch + j for its j-th sequence ([`Windows::Seeded`], an opt-in,
//! draws each sequence's start from the seed and g instead). The built-in corpus is generated here
//! from a small sentence grammar and a fixed seed, so it is the same everywhere and a byte model's
//! loss visibly falls on it.

pub mod formats;
pub mod text;

use crate::math::Rng;
pub use formats::{Format, FormatProblem};
use std::path::{Path, PathBuf};
pub use text::TextTokenizer;

/// Bytes of the built-in corpus.
pub const BUILTIN_LEN: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("cannot read the corpus {}: {error}", path.display())]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    /// Fewer than seq_len + 2 bytes: not even two distinct sequence offsets.
    #[error(
        "the corpus has {len} bytes, too short for seq_len {seq_len}: it needs at least {} (seq_len + 2)",
        seq_len + 2
    )]
    TooShort { len: usize, seq_len: usize },
    /// A token file with fewer than seq_len + 2 tokens.
    #[error(
        "{}: {len} tokens, too few for seq_len {seq_len}: it needs at least {} (seq_len + 2)",
        path.display(),
        seq_len + 2
    )]
    TooFewTokens {
        path: PathBuf,
        len: usize,
        seq_len: usize,
    },
    /// A file that is not what its name or header says (`formats`).
    #[error("{}: {problem}", path.display())]
    Malformed {
        path: PathBuf,
        problem: FormatProblem,
    },
    /// A token id the model has no embedding row for.
    #[error(
        "{}: token {token} at token offset {index}{} is not below the model's vocabulary of {vocab}",
        path.display(),
        byte.map(|b| format!(" (byte {b} of the file)")).unwrap_or_default()
    )]
    OutOfVocabulary {
        path: PathBuf,
        token: u64,
        index: usize,
        /// Where the token lies in the file (`None` for tokenized text).
        byte: Option<u64>,
        vocab: u64,
    },
    #[error("cannot use the tokenizer {}: {message}", path.display())]
    Tokenizer { path: PathBuf, message: String },
}

/// The vocabulary a corpus's token ids must stay below: the smaller of the model's embedding and
/// lm_head vocabularies (`None` for a model with neither).
pub fn vocabulary(model: &sched_ir::job::Model) -> Option<u64> {
    use sched_ir::job::LayerKind;
    model
        .layers
        .iter()
        .filter_map(|l| match l.kind {
            LayerKind::Embedding { vocab, .. } | LayerKind::LmHead { vocab, .. } => Some(vocab),
            _ => None,
        })
        .min()
}

/// The sequences of one global batch (or of one rank's micro-batch), concatenated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
}

/// Token ids in the narrowest type that holds them (a byte corpus stays its bytes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Tokens {
    Bytes(Vec<u8>),
    U16(Vec<u16>),
    U32(Vec<u32>),
}

impl Tokens {
    pub fn len(&self) -> usize {
        match self {
            Tokens::Bytes(t) => t.len(),
            Tokens::U16(t) => t.len(),
            Tokens::U32(t) => t.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Token `i` (`i < len`).
    pub fn get(&self, i: usize) -> u32 {
        match self {
            Tokens::Bytes(t) => u32::from(t[i]),
            Tokens::U16(t) => u32::from(t[i]),
            Tokens::U32(t) => t[i],
        }
    }

    /// Copies tokens `at..at + out.len()` into `out`.
    fn copy_into(&self, at: usize, out: &mut [u32]) {
        let n = out.len();
        match self {
            Tokens::Bytes(t) => out
                .iter_mut()
                .zip(&t[at..at + n])
                .for_each(|(o, &x)| *o = x.into()),
            Tokens::U16(t) => out
                .iter_mut()
                .zip(&t[at..at + n])
                .for_each(|(o, &x)| *o = x.into()),
            Tokens::U32(t) => out.copy_from_slice(&t[at..at + n]),
        }
    }

    /// The first token ≥ `vocab`: its index and value.
    fn first_at_or_above(&self, vocab: u64) -> Option<(usize, u64)> {
        let find = |it: &mut dyn Iterator<Item = u64>| it.enumerate().find(|&(_, t)| t >= vocab);
        match self {
            Tokens::Bytes(t) => find(&mut t.iter().map(|&x| u64::from(x))),
            Tokens::U16(t) => find(&mut t.iter().map(|&x| u64::from(x))),
            Tokens::U32(t) => find(&mut t.iter().map(|&x| u64::from(x))),
        }
    }
}

/// Where each sequence's window starts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Windows {
    /// The batch rule of `runtime.md`: sequence g starts at (g·seq_len) mod (len − seq_len − 1).
    #[default]
    Strided,
    /// Opt-in (`--windows seeded`): sequence g starts at a position drawn from the seed and g
    /// alone, `splitmix64(seed + splitmix64(g)) mod (len − seq_len − 1)`, so it is the same on
    /// every run with that seed and under every schedule with the same global batch (g counts
    /// global sequences, not ranks).
    Seeded(u64),
}

impl Windows {
    /// Sequence `g`'s start among `span` possible starts.
    fn start(self, g: u64, seq_len: usize, span: usize) -> usize {
        let span = span as u128;
        match self {
            Windows::Strided => ((u128::from(g) * seq_len as u128) % span) as usize,
            Windows::Seeded(seed) => {
                let x = splitmix64(seed.wrapping_add(splitmix64(g)));
                (u128::from(x) % span) as usize
            }
        }
    }
}

/// One step of SplitMix64 (Steele, Lea and Flood): a well-mixed 64-bit value of `x`.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Corpus {
    tokens: Tokens,
    /// How the tokens were read, and from where (`None`: built in or made in memory).
    format: Format,
    path: Option<PathBuf>,
    windows: Windows,
}

impl Corpus {
    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        Corpus {
            tokens: Tokens::Bytes(bytes),
            format: Format::Bytes,
            path: None,
            windows: Windows::Strided,
        }
    }

    /// A corpus of `tokens` read from `path` as `format` says.
    pub fn from_tokens(tokens: Tokens, format: Format, path: Option<PathBuf>) -> Self {
        Corpus {
            tokens,
            format,
            path,
            windows: Windows::Strided,
        }
    }

    /// The file at `path` read by the rule of [`formats`] (no tokenizer: a text file is read
    /// as bytes), or the built-in corpus when `None` (a schedule's `data`).
    pub fn load(path: Option<&Path>) -> Result<Self, DataError> {
        match path {
            None => Ok(Self::builtin()),
            Some(p) => Self::open(p, None),
        }
    }

    /// The file at `path`: tokens by its format ([`formats`]), or its text through `tokenizer`
    /// when one is given.
    pub fn open(path: &Path, tokenizer: Option<&TextTokenizer>) -> Result<Self, DataError> {
        let read = |p: &Path| {
            std::fs::read(p).map_err(|error| DataError::Read {
                path: p.to_path_buf(),
                error,
            })
        };
        let bytes = read(path)?;
        let (format, tokens) = match tokenizer {
            Some(t) => (Format::Text, Tokens::U32(t.encode_file(path, &bytes)?)),
            None => formats::read(path, bytes).map_err(|problem| DataError::Malformed {
                path: path.to_path_buf(),
                problem,
            })?,
        };
        Ok(Corpus {
            tokens,
            format,
            path: Some(path.to_path_buf()),
            windows: Windows::Strided,
        })
    }

    /// The built-in corpus: [`BUILTIN_LEN`] bytes of generated English-like sentences.
    pub fn builtin() -> Self {
        Self::from_bytes(builtin_text())
    }

    /// A byte corpus's bytes; empty for a corpus of tokens.
    pub fn bytes(&self) -> &[u8] {
        match &self.tokens {
            Tokens::Bytes(b) => b,
            _ => &[],
        }
    }

    pub fn tokens(&self) -> &Tokens {
        &self.tokens
    }

    pub fn format(&self) -> Format {
        self.format
    }

    /// The file the corpus was read from (`None`: built in or made in memory).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Tokens (bytes for a byte corpus).
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Refuses a corpus shorter than seq_len + 2 tokens.
    pub fn check(&self, seq_len: usize) -> Result<(), DataError> {
        let len = self.tokens.len();
        if len >= seq_len + 2 {
            return Ok(());
        }
        Err(match (&self.tokens, &self.path) {
            (Tokens::Bytes(_), _) | (_, None) => DataError::TooShort { len, seq_len },
            (_, Some(p)) => DataError::TooFewTokens {
                path: p.clone(),
                len,
                seq_len,
            },
        })
    }

    /// Refuses a token id ≥ `vocab` (the model's vocabulary), naming the first one's offset in
    /// tokens and in bytes of the file.
    pub fn check_vocabulary(&self, vocab: u64) -> Result<(), DataError> {
        let Some((index, token)) = self.tokens.first_at_or_above(vocab) else {
            return Ok(());
        };
        Err(DataError::OutOfVocabulary {
            path: self
                .path
                .clone()
                .unwrap_or_else(|| PathBuf::from("the built-in corpus")),
            token,
            index,
            byte: self.format.byte_offset(index),
            vocab,
        })
    }

    /// The corpus with its windows chosen as `windows` says (the default: [`Windows::Strided`]).
    pub fn with_windows(mut self, windows: Windows) -> Self {
        self.windows = windows;
        self
    }

    pub fn windows(&self) -> Windows {
        self.windows
    }

    /// Where sequence `g` starts: (g·seq_len) mod (len − seq_len − 1), or the seeded start
    /// ([`Windows`]).
    pub fn offset(&self, g: u64, seq_len: usize) -> Result<usize, DataError> {
        self.check(seq_len)?;
        let span = self.tokens.len() - seq_len - 1;
        Ok(self.windows.start(g, seq_len, span))
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
        self.tokens.copy_into(at, inputs);
        self.tokens.copy_into(at + 1, targets);
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
