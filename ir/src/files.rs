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
mod tests {
    use super::*;

    #[test]
    fn regular_files_are_replaced_and_devices_written_in_place() {
        let dir = std::env::temp_dir().join(format!("schedc-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("out.json");
        write_atomically(&f, b"one").unwrap();
        write_atomically(&f, b"two").unwrap();
        assert_eq!(std::fs::read(&f).unwrap(), b"two");
        let leftovers: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "a temporary file was left behind");
        std::fs::remove_dir_all(&dir).unwrap();
        // A FIFO stays one, and the reader gets the bytes.
        #[cfg(unix)]
        {
            use std::os::unix::fs::FileTypeExt;
            let fifo = std::env::temp_dir().join(format!("schedc-fifo-{}", std::process::id()));
            let made = std::process::Command::new("mkfifo").arg(&fifo).status();
            if made.is_ok_and(|s| s.success()) {
                let reader = {
                    let fifo = fifo.clone();
                    std::thread::spawn(move || std::fs::read(fifo).unwrap())
                };
                write_atomically(&fifo, b"through").unwrap();
                assert_eq!(reader.join().unwrap(), b"through");
                let meta = std::fs::symlink_metadata(&fifo).unwrap();
                assert!(meta.file_type().is_fifo(), "the FIFO was replaced");
                std::fs::remove_file(&fifo).unwrap();
            }
        }
    }
}
