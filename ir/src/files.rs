//! Writing output files without ever leaving a partial one.
//!
//! A regular file (or a new one) is written through a temporary file in the same directory and
//! renamed over the target, so a failure leaves the old file or none. Anything else that already
//! exists at the path — a terminal, a pipe, `/dev/null` — is written in place: renaming over it
//! would replace the device or FIFO with a regular file (as root, even `/dev/null`).

use std::path::Path;

/// Writes `bytes` to `path` atomically where the path is, or will be, a regular file.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Ok(meta) = std::fs::metadata(path) {
        if !meta.is_file() {
            return std::fs::write(path, bytes);
        }
    }
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let result = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, path));
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
#[path = "../tests/unit/files.rs"]
mod tests;
