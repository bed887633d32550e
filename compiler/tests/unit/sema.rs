//! Unit tests of `sema` (a child module of it: they reach its private items).

use super::*;

#[test]
fn paths_normalise() {
    assert_eq!(
        normalize(Path::new("a/./b/../c.sched")),
        PathBuf::from("a/c.sched")
    );
    assert_eq!(normalize(Path::new("../x/../y")), PathBuf::from("../y"));
}

#[test]
fn files_are_identified_by_their_absolute_path() {
    let here = std::env::current_dir().unwrap();
    let dir = here.file_name().unwrap().to_str().unwrap();
    // `a.sched` and `../<this dir>/a.sched` are one file, though their texts differ.
    assert_eq!(absolute(Path::new("a.sched")), here.join("a.sched"));
    assert_eq!(
        absolute(Path::new(&format!("../{dir}/a.sched"))),
        here.join("a.sched")
    );
    assert_eq!(
        absolute(Path::new("/x/../y/./z.sched")),
        PathBuf::from("/y/z.sched")
    );
    let mem = MemLoader::default().in_dir("/p/sub").with("a.sched", "");
    assert_eq!(
        mem.identity(Path::new("../sub/a.sched")),
        PathBuf::from("/p/sub/a.sched")
    );
    assert!(mem.read(Path::new("../sub/a.sched")).is_ok());
}
