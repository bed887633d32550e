//! Unit tests of `sema::values` (a child module of it: they reach its private items).

use super::*;

fn num(text: &str) -> NumberLit {
    NumberLit {
        text: text.to_string(),
        span: Span::default(),
    }
}

fn exact_of(text: &str, n: u128, d: u128) -> Result<u64, &'static str> {
    let (neg, m, e) = decimal(&num(text)).unwrap();
    exact(neg, m, e, n, d)
}

#[test]
fn unit_suggestions_keep_bits_and_bytes_apart() {
    let s = |w: &str, k: UnitKind| suggest_unit(w, k).map(|(u, _)| u);
    assert_eq!(s("GBps", UnitKind::Bandwidth), Some("GB/s"));
    assert_eq!(s("GBPS", UnitKind::Bandwidth), Some("GB/s"));
    assert_eq!(s("gB/s", UnitKind::Bandwidth), Some("GB/s"));
    assert_eq!(s("GiBps", UnitKind::Bandwidth), Some("GiB/s"));
    assert_eq!(s("MBps", UnitKind::Bandwidth), Some("MB/s"));
    assert_eq!(s("gbps", UnitKind::Bandwidth), Some("Gbps"));
    assert_eq!(s("Gb/s", UnitKind::Bandwidth), Some("Gbps"));
    assert_eq!(s("Gbit/s", UnitKind::Bandwidth), Some("Gbps"));
    assert_eq!(s("mbps", UnitKind::Bandwidth), Some("Mbps"));
    // No such unit of the same kind: nothing rather than the other kind.
    assert_eq!(s("TB/s", UnitKind::Bandwidth), None);
    assert_eq!(s("Gibps", UnitKind::Bandwidth), None);
    assert_eq!(s("gib", UnitKind::Bytes), Some("GiB"));
    assert_eq!(s("gb", UnitKind::Bytes), Some("GB"));
    assert_eq!(s("usec", UnitKind::Time), Some("us"));
    assert_eq!(s("sec", UnitKind::Time), Some("s"));
    assert_eq!(s("msecs", UnitKind::Time), Some("ms"));
    assert_eq!(s("seconds", UnitKind::Time), Some("s"));
    assert_eq!(s("NS", UnitKind::Time), Some("ns"));
    assert_eq!(s("tflops", UnitKind::Compute), Some("TFLOPS"));
    assert_eq!(s("TFLOP", UnitKind::Compute), Some("TFLOPS"));
}

#[test]
fn sizes_for_people() {
    assert_eq!(human_bytes(4 << 30), "4 GiB");
    assert_eq!(human_bytes(1024), "1 KiB");
    assert_eq!(human_bytes(99_968), "97.6 KiB (99,968 bytes)");
    assert_eq!(human_bytes(1000), "1000 bytes");
    assert_eq!(human_bytes(1), "1 byte");
    assert_eq!(
        human_bytes(u64::MAX),
        "16.0 EiB (18,446,744,073,709,551,615 bytes)"
    );
}

#[test]
fn byte_quantities_are_exact() {
    assert_eq!(exact_of("80", 1 << 30, 1), Ok(85_899_345_920));
    assert_eq!(exact_of("0.5", 1 << 30, 1), Ok(536_870_912));
    assert_eq!(exact_of("1.1", 1_000_000_000, 1), Ok(1_100_000_000));
    assert_eq!(exact_of("7.5e9", 1, 1), Ok(7_500_000_000));
    assert_eq!(exact_of("1_000_000", 1, 1), Ok(1_000_000));
    assert_eq!(exact_of("0.3", 1, 1), Err("not whole"));
    assert_eq!(exact_of("-1", 1, 1), Err("negative"));
    assert_eq!(exact_of("1e30", 1, 1), Err("too large"));
    assert_eq!(exact_of("1e-400", 1, 1), Err("not whole"));
}
