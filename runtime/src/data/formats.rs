//! Token files: how a corpus file's bytes become token ids, and why a file is refused.
//!
//! The rule (`runtime.md`, "Data and batches"), by the file's name and first bytes:
//! - `*.npy`: a NumPy array saved by `numpy.save`, 1-D, C order, of little-endian uint16, int32 or
//!   int64 (`<u2`, `<i4`, `<i8`); the header is parsed here.
//! - `*.bin` starting with llm.c's magic: an llm.c shard, a header of 256 little-endian int32
//!   (magic 20240520, version 1, token count, the rest unused) and then that many uint16 tokens
//!   (GPT-2); magic 20240801 with version 7 is llm.c's LLaMA-3 shard of uint32 tokens.
//! - any other `*.bin`: nanoGPT's `prepare.py` output, raw little-endian uint16 tokens with no
//!   header (so an llm.c shard whose magic is damaged is read as nanoGPT's; the vocabulary check
//!   usually catches it).
//! - anything else: text read as bytes (token = byte value), unless a tokenizer is given.
//!
//! A file that does not hold what its name or header says is refused with a [`FormatProblem`]:
//! a truncated shard, a header of another version, a dtype that is not a token type.

use super::Tokens;
use std::fmt;
use std::path::Path;

/// llm.c's GPT-2 shard: magic, version, and the header's size in int32.
pub const LLMC_MAGIC: i32 = 20240520;
pub const LLMC_VERSION: i32 = 1;
/// llm.c's LLaMA-3 shard (uint32 tokens).
pub const LLMC_LLAMA3_MAGIC: i32 = 20240801;
pub const LLMC_LLAMA3_VERSION: i32 = 7;
pub const LLMC_HEADER_INTS: usize = 256;
const LLMC_HEADER_BYTES: usize = 4 * LLMC_HEADER_INTS;
const NPY_MAGIC: &[u8] = b"\x93NUMPY";

/// How a corpus file was read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Text as bytes (token = byte value); also the built-in corpus.
    Bytes,
    /// llm.c's shard: a 1024-byte header, then tokens `width` bytes each.
    Llmc { width: u8 },
    /// nanoGPT's raw uint16 tokens.
    NanoGpt,
    /// A NumPy array: `header` bytes before the data, tokens `width` bytes each.
    Npy { header: u64, width: u8 },
    /// Text through a Hugging Face tokenizer.
    Text,
}

impl Format {
    /// Where token `index` lies in the file, in bytes (`None` for tokenized text, whose tokens
    /// span several bytes).
    pub fn byte_offset(self, index: usize) -> Option<u64> {
        let i = index as u64;
        match self {
            Format::Bytes => Some(i),
            Format::Llmc { width } => Some(LLMC_HEADER_BYTES as u64 + u64::from(width) * i),
            Format::NanoGpt => Some(2 * i),
            Format::Npy { header, width } => Some(header + u64::from(width) * i),
            Format::Text => None,
        }
    }

    /// Whether a token is a byte (the byte corpus) rather than a tokenizer's id.
    pub fn is_bytes(self) -> bool {
        self == Format::Bytes
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Format::Bytes => write!(f, "bytes"),
            Format::Llmc { width: 2 } => write!(f, "llm.c shard, uint16 tokens"),
            Format::Llmc { .. } => write!(f, "llm.c shard, uint32 tokens"),
            Format::NanoGpt => write!(f, "nanoGPT .bin, uint16 tokens"),
            Format::Npy { width, .. } => write!(f, "NumPy array, {}-byte tokens", width),
            Format::Text => write!(f, "text through a tokenizer"),
        }
    }
}

/// Why a token file is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FormatProblem {
    #[error("an llm.c shard (magic {magic}) starts with a 1024-byte header, but the file has only {len} bytes (a truncated shard?)")]
    LlmcHeaderTruncated { magic: i32, len: usize },
    #[error("llm.c shard of version {version} with magic {magic}: only version {LLMC_VERSION} (magic {LLMC_MAGIC}, uint16 tokens) and version {LLMC_LLAMA3_VERSION} (magic {LLMC_LLAMA3_MAGIC}, uint32 tokens) are read")]
    LlmcVersion { magic: i32, version: i32 },
    #[error("the llm.c header says {tokens} tokens ({} bytes after the header), but {found} bytes follow it ({})", *tokens as u64 * u64::from(*width), if (*tokens as u64) * u64::from(*width) > *found as u64 { "a truncated shard?" } else { "trailing bytes" })]
    LlmcLength {
        tokens: i64,
        width: u8,
        found: usize,
    },
    #[error("{len} bytes are not a whole number of uint16 tokens (a .bin without llm.c's magic is read as nanoGPT's raw uint16 tokens; a truncated file?)")]
    OddLength { len: usize },
    #[error("not a NumPy .npy file: it does not start with \\x93NUMPY")]
    NpyMagic,
    #[error("NumPy format version {major}.{minor} is not one of 1.0, 2.0 and 3.0")]
    NpyVersion { major: u8, minor: u8 },
    #[error("the .npy header is cut short: the file has {len} bytes, the header needs {needed} (a truncated file?)")]
    NpyHeaderTruncated { len: usize, needed: usize },
    #[error("the .npy header is not a dictionary of descr, fortran_order and shape: {0}")]
    NpyHeader(String),
    #[error("dtype '{0}' is not a token type: a .npy token array is little-endian uint16, int32 or int64 ('<u2', '<i4' or '<i8')")]
    NpyDtype(String),
    #[error("the array is in Fortran order; a .npy token array must be in C order (fortran_order False)")]
    NpyFortranOrder,
    #[error("shape {0} is not one dimension: a .npy token array is 1-D")]
    NpyShape(String),
    #[error("the header's shape ({tokens} tokens) needs {needed} bytes of data, but {found} follow the header ({})", if needed > found { "a truncated file?" } else { "trailing bytes" })]
    NpyLength {
        tokens: u64,
        needed: u64,
        found: u64,
    },
    #[error("token {token} at token offset {index} is negative")]
    NegativeToken { token: i64, index: usize },
    #[error("token {token} at token offset {index} does not fit in 32 bits")]
    TokenTooLarge { token: i64, index: usize },
    #[error("not UTF-8 text at byte {at}: a tokenizer reads text")]
    NotUtf8 { at: usize },
}

/// Reads `bytes` (the file at `path`) by the rule of this module, without a tokenizer.
pub fn read(path: &Path, bytes: Vec<u8>) -> Result<(Format, Tokens), FormatProblem> {
    let ext = path
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase());
    match ext.as_deref() {
        Some("npy") => npy(&bytes),
        Some("bin") => match first_i32(&bytes) {
            Some(magic @ (LLMC_MAGIC | LLMC_LLAMA3_MAGIC)) => llmc(magic, &bytes),
            _ => {
                if !bytes.len().is_multiple_of(2) {
                    return Err(FormatProblem::OddLength { len: bytes.len() });
                }
                Ok((Format::NanoGpt, Tokens::U16(u16s(&bytes))))
            }
        },
        _ => Ok((Format::Bytes, Tokens::Bytes(bytes))),
    }
}

fn first_i32(b: &[u8]) -> Option<i32> {
    Some(i32::from_le_bytes(b.get(..4)?.try_into().ok()?))
}

fn u16s(b: &[u8]) -> Vec<u16> {
    b.chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}

fn u32s(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn llmc(magic: i32, bytes: &[u8]) -> Result<(Format, Tokens), FormatProblem> {
    if bytes.len() < LLMC_HEADER_BYTES {
        return Err(FormatProblem::LlmcHeaderTruncated {
            magic,
            len: bytes.len(),
        });
    }
    let header: Vec<i32> = bytes[..LLMC_HEADER_BYTES]
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let version = header[1];
    let width: u8 = match (magic, version) {
        (LLMC_MAGIC, LLMC_VERSION) => 2,
        (LLMC_LLAMA3_MAGIC, LLMC_LLAMA3_VERSION) => 4,
        _ => return Err(FormatProblem::LlmcVersion { magic, version }),
    };
    let tokens = header[2];
    let body = &bytes[LLMC_HEADER_BYTES..];
    if tokens < 0 || tokens as u64 * u64::from(width) != body.len() as u64 {
        return Err(FormatProblem::LlmcLength {
            tokens: i64::from(tokens),
            width,
            found: body.len(),
        });
    }
    let t = if width == 2 {
        Tokens::U16(u16s(body))
    } else {
        Tokens::U32(u32s(body))
    };
    Ok((Format::Llmc { width }, t))
}

/// The three keys of a `.npy` header that matter here.
struct NpyHeader {
    descr: String,
    fortran_order: bool,
    shape: Vec<u64>,
    /// The header as written, for messages.
    shape_text: String,
}

fn npy(bytes: &[u8]) -> Result<(Format, Tokens), FormatProblem> {
    if !bytes.starts_with(NPY_MAGIC) {
        return Err(FormatProblem::NpyMagic);
    }
    let short = |needed: usize| FormatProblem::NpyHeaderTruncated {
        len: bytes.len(),
        needed,
    };
    let (major, minor) = match bytes.get(6..8) {
        Some(v) => (v[0], v[1]),
        None => return Err(short(10)),
    };
    let (len_at, len_bytes) = match (major, minor) {
        (1, 0) => (8, 2),
        (2, 0) | (3, 0) => (8, 4),
        _ => return Err(FormatProblem::NpyVersion { major, minor }),
    };
    let start = len_at + len_bytes;
    let Some(l) = bytes.get(len_at..start) else {
        return Err(short(start));
    };
    let header_len = if len_bytes == 2 {
        usize::from(u16::from_le_bytes([l[0], l[1]]))
    } else {
        u32::from_le_bytes([l[0], l[1], l[2], l[3]]) as usize
    };
    let data_at = start + header_len;
    let Some(text) = bytes.get(start..data_at) else {
        return Err(short(data_at));
    };
    let text = std::str::from_utf8(text)
        .map_err(|_| FormatProblem::NpyHeader("the header is not text".into()))?;
    let h = parse_header(text)?;
    let width: u8 = match h.descr.as_str() {
        "<u2" => 2,
        "<i4" => 4,
        "<i8" => 8,
        _ => return Err(FormatProblem::NpyDtype(h.descr)),
    };
    if h.fortran_order {
        return Err(FormatProblem::NpyFortranOrder);
    }
    let &[n] = h.shape.as_slice() else {
        return Err(FormatProblem::NpyShape(h.shape_text));
    };
    let data = &bytes[data_at..];
    let needed = n.saturating_mul(u64::from(width));
    if needed != data.len() as u64 {
        return Err(FormatProblem::NpyLength {
            tokens: n,
            needed,
            found: data.len() as u64,
        });
    }
    let tokens = match width {
        2 => Tokens::U16(u16s(data)),
        4 => {
            let v = u32s(data);
            if let Some((index, &t)) = v.iter().enumerate().find(|(_, &t)| t > i32::MAX as u32) {
                return Err(FormatProblem::NegativeToken {
                    token: i64::from(t as i32),
                    index,
                });
            }
            Tokens::U32(v)
        }
        _ => {
            let mut v = Vec::with_capacity(n as usize);
            for (index, c) in data.chunks_exact(8).enumerate() {
                let t = i64::from_le_bytes(c.try_into().expect("chunks of 8"));
                if t < 0 {
                    return Err(FormatProblem::NegativeToken { token: t, index });
                }
                let t = u32::try_from(t)
                    .map_err(|_| FormatProblem::TokenTooLarge { token: t, index })?;
                v.push(t);
            }
            Tokens::U32(v)
        }
    };
    Ok((
        Format::Npy {
            header: data_at as u64,
            width,
        },
        tokens,
    ))
}

/// Parses the Python dictionary literal of a `.npy` header, as `numpy.lib.format` writes it:
/// `{'descr': '<u2', 'fortran_order': False, 'shape': (1000,), }` (padded with spaces and a
/// newline).
fn parse_header(text: &str) -> Result<NpyHeader, FormatProblem> {
    let bad = |why: &str| FormatProblem::NpyHeader(format!("{why} in {}", text.trim_end()));
    let body = text
        .trim()
        .strip_prefix('{')
        .and_then(|t| t.strip_suffix('}'))
        .ok_or_else(|| bad("no braces"))?;
    let (mut descr, mut fortran, mut shape) = (None, None, None);
    let mut rest = body.trim_start();
    while !rest.is_empty() {
        let (key, after) = quoted(rest).ok_or_else(|| bad("a key that is not a quoted string"))?;
        let after = after
            .trim_start()
            .strip_prefix(':')
            .ok_or_else(|| bad("a key without ':'"))?
            .trim_start();
        let (value, after) = if after.starts_with(['\'', '"']) {
            let (v, a) = quoted(after).ok_or_else(|| bad("an unterminated string"))?;
            (Value::Text(v), a)
        } else if let Some(inner) = after.strip_prefix('(') {
            let end = inner
                .find(')')
                .ok_or_else(|| bad("an unterminated tuple"))?;
            (Value::Tuple(inner[..end].to_string()), &inner[end + 1..])
        } else if let Some(a) = after.strip_prefix("True") {
            (Value::Bool(true), a)
        } else if let Some(a) = after.strip_prefix("False") {
            (Value::Bool(false), a)
        } else {
            return Err(bad("a value that is not a string, a tuple or a boolean"));
        };
        match (key.as_str(), value) {
            ("descr", Value::Text(t)) => descr = Some(t),
            ("fortran_order", Value::Bool(b)) => fortran = Some(b),
            ("shape", Value::Tuple(t)) => shape = Some(t),
            (k @ ("descr" | "fortran_order" | "shape"), _) => {
                return Err(bad(&format!("'{k}' of the wrong kind")))
            }
            _ => {}
        }
        let after = after.trim_start();
        rest = after.strip_prefix(',').unwrap_or(after).trim_start();
        if !after.starts_with(',') && !rest.is_empty() {
            return Err(bad("entries not separated by ','"));
        }
    }
    let descr = descr.ok_or_else(|| bad("no 'descr'"))?;
    let fortran_order = fortran.ok_or_else(|| bad("no 'fortran_order'"))?;
    let shape_inner = shape.ok_or_else(|| bad("no 'shape'"))?;
    let dims = shape_inner
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| d.trim_end_matches('L').parse::<u64>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| bad("a shape that is not a tuple of integers"))?;
    Ok(NpyHeader {
        descr,
        fortran_order,
        shape: dims,
        shape_text: format!("({shape_inner})"),
    })
}

enum Value {
    Text(String),
    Tuple(String),
    Bool(bool),
}

/// A Python string literal in single or double quotes at the start of `s` (no escapes: the
/// header's strings have none): its contents and what follows it.
fn quoted(s: &str) -> Option<(String, &str)> {
    let q = s.chars().next().filter(|c| *c == '\'' || *c == '"')?;
    let inner = &s[1..];
    let end = inner.find(q)?;
    Some((inner[..end].to_string(), &inner[end + 1..]))
}
