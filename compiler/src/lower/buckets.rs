//! Bucketing: consecutive layers' collectives of one kind are coalesced into one group call while
//! their payload stays within the bucket size (lowering spec §5, "Buckets").
//!
//! Reads the per-layer payloads in issue order; writes a partition into runs of consecutive indices.
//! A layer with no payload joins the run it falls in; a layer larger than the bucket stands alone;
//! a bucket size of 0 turns coalescing off.

/// Splits `0..sizes.len()` into consecutive runs whose payload sum stays within `bucket` bytes.
pub fn partition(sizes: &[u64], bucket: u64) -> Vec<Vec<usize>> {
    let mut runs: Vec<Vec<usize>> = vec![];
    let mut total = 0u64;
    for (i, &s) in sizes.iter().enumerate() {
        let fits = bucket > 0 && !runs.is_empty() && total.saturating_add(s) <= bucket;
        if fits {
            runs.last_mut().expect("non-empty").push(i);
            total += s;
        } else {
            runs.push(vec![i]);
            total = s;
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::partition;

    #[test]
    fn runs_respect_the_bucket() {
        assert_eq!(partition(&[4, 4, 4], 0), vec![vec![0], vec![1], vec![2]]);
        assert_eq!(partition(&[4, 4, 4], 8), vec![vec![0, 1], vec![2]]);
        assert_eq!(partition(&[10, 4, 0, 4], 8), vec![vec![0], vec![1, 2, 3]]);
        assert_eq!(partition(&[], 8), Vec::<Vec<usize>>::new());
    }
}
