//! Unit tests of `files` (a child module of it: they reach its private items).

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
