//! Times lowering and verification of one schedule: `cargo run --release --example phases -- FILE [SCHEDULE]`.
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let a = schedc::analyze(std::path::Path::new(&args[1]), &schedc::FsLoader).unwrap();
    let job = a.select(args.get(2).map(|s| s.as_str())).unwrap();
    let t = std::time::Instant::now();
    let p = schedc::lower::lower(job).unwrap();
    let lowered = t.elapsed();
    let t = std::time::Instant::now();
    let ok = schedc::verify::verify(&p, schedc::verify_ctx(job)).is_ok();
    println!(
        "{} ops, {} buffers: lower {:?}, verify {:?} (ok {ok})",
        p.ops.len(),
        p.buffers.len(),
        lowered,
        t.elapsed()
    );
}
