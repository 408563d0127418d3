//! Splitting `n` items into contiguous blocks over `parts`: the layout of `reduce_scatter`'s
//! output, of every schedule that splits a vector, and of ranks placed on hosts
//! ([`crate::HostLayout::blocks`]).

use std::ops::Range;

/// Block sizes when `n` elements are split over `parts`: the first `n % parts` blocks get one
/// element more.
pub fn counts_for(n: usize, parts: u32) -> Vec<usize> {
    let parts = parts.max(1) as usize;
    (0..parts).map(|i| block_range(n, parts, i).len()).collect()
}

/// Range of block `i` when `n` elements are split over `parts` (see [`counts_for`]).
pub(crate) fn block_range(n: usize, parts: usize, i: usize) -> Range<usize> {
    let (base, extra) = (n / parts, n % parts);
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

/// Prefix sums: offsets of consecutive blocks of the given sizes.
pub(crate) fn offsets(counts: &[usize]) -> Vec<usize> {
    let mut acc = 0;
    counts
        .iter()
        .map(|c| {
            let o = acc;
            acc += c;
            o
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_the_vector() {
        assert_eq!(counts_for(10, 4), [3, 3, 2, 2]);
        assert_eq!(counts_for(2, 3), [1, 1, 0]);
        assert_eq!(block_range(10, 4, 2), 6..8);
        assert_eq!(block_range(10, 4, 3), 8..10);
        assert_eq!(offsets(&[2, 0, 3]), [0, 2, 2]);
    }
}
