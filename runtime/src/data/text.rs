//! Text through a Hugging Face tokenizer (`schedrun --tokenizer tokenizer.json`).
//!
//! A `tokenizer.json` (what `tokenizers` and `transformers`' fast tokenizers save) is loaded with
//! the `tokenizers` crate and a UTF-8 text file is encoded as one sequence, without the special
//! tokens its post-processor would add (a corpus is not a prompt: no BOS or EOS around it) and
//! with the file's truncation and padding settings turned off, so that every token of the text is
//! kept.

use super::{DataError, FormatProblem};
use std::path::{Path, PathBuf};

pub struct TextTokenizer {
    path: PathBuf,
    tokenizer: tokenizers::Tokenizer,
}

impl TextTokenizer {
    /// The tokenizer saved at `path`.
    pub fn load(path: &Path) -> Result<Self, DataError> {
        let fail = |message: String| DataError::Tokenizer {
            path: path.to_path_buf(),
            message,
        };
        if !path.is_file() {
            return Err(fail("no such file".to_string()));
        }
        let mut tokenizer =
            tokenizers::Tokenizer::from_file(path).map_err(|e| fail(e.to_string()))?;
        tokenizer
            .with_truncation(None)
            .map_err(|e| fail(e.to_string()))?;
        tokenizer.with_padding(None);
        Ok(TextTokenizer {
            path: path.to_path_buf(),
            tokenizer,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Ids the tokenizer can produce, its added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// The ids of `text`.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        let encoding =
            self.tokenizer
                .encode_fast(text, false)
                .map_err(|e| DataError::Tokenizer {
                    path: self.path.clone(),
                    message: e.to_string(),
                })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The ids of the text file at `path` whose bytes are `bytes`.
    pub(crate) fn encode_file(&self, path: &Path, bytes: &[u8]) -> Result<Vec<u32>, DataError> {
        let text = std::str::from_utf8(bytes).map_err(|e| DataError::Malformed {
            path: path.to_path_buf(),
            problem: FormatProblem::NotUtf8 {
                at: e.valid_up_to(),
            },
        })?;
        self.encode(text)
    }
}
