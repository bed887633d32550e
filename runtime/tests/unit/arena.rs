//! Unit tests of `arena` (a child module of it: they reach its private items).

use super::*;

#[test]
fn fp32_round_trip_and_bounds() {
    let a = Arena::new(64);
    a.write(8, Dtype::Fp32, &[1.5, -2.0]).unwrap();
    assert_eq!(a.read(8, 2, Dtype::Fp32).unwrap(), vec![1.5, -2.0]);
    assert!(a.write(62, Dtype::Fp32, &[1.0]).is_err());
    assert!(a.read(6, 1, Dtype::Fp32).is_err(), "misaligned fp32");
    assert_eq!(a.high_water(), 16);
}

#[test]
fn bulk_fp32_copies_are_the_atomic_words() {
    let a = Arena::new(64);
    a.write(4, Dtype::Fp32, &[1.5, -2.0, 3.25]).unwrap();
    a.set_bulk(true);
    assert_eq!(a.read(4, 3, Dtype::Fp32).unwrap(), vec![1.5, -2.0, 3.25]);
    a.write(8, Dtype::Fp32, &[7.0]).unwrap();
    a.set_bulk(false);
    assert_eq!(a.read(4, 3, Dtype::Fp32).unwrap(), vec![1.5, 7.0, 3.25]);
    a.set_bulk(true);
    assert!(
        a.write(60, Dtype::Fp32, &[1.0, 2.0]).is_err(),
        "bounds still checked"
    );
}

#[test]
fn bf16_halves_do_not_disturb_neighbours() {
    let a = Arena::new(16);
    a.write(0, Dtype::Bf16, &[1.0, 2.0, 3.0]).unwrap();
    a.write(6, Dtype::Bf16, &[-4.0]).unwrap();
    assert_eq!(
        a.read(0, 4, Dtype::Bf16).unwrap(),
        vec![1.0, 2.0, 3.0, -4.0]
    );
    a.add(2, Dtype::Bf16, &[0.5]).unwrap();
    assert_eq!(
        a.read(0, 4, Dtype::Bf16).unwrap(),
        vec![1.0, 2.5, 3.0, -4.0]
    );
    let raw = a.read_bytes(2, 4).unwrap();
    a.write_bytes(10, &raw).unwrap();
    assert_eq!(a.read(10, 2, Dtype::Bf16).unwrap(), vec![2.5, 3.0]);
}
