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
#[path = "../../tests/unit/lower_buckets.rs"]
mod tests;
