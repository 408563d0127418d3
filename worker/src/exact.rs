//! Element types whose sums of small integers are exact: what `train` and `bench` use to
//! verify every result bit for bit.

use crate::Element;
use half::{bf16, f16};

/// An element type in which the sums the verifiers compute are exact.
pub trait ExactElement: Element + Copy + PartialEq + Send + Sync + std::fmt::Debug + 'static {
    /// Name as given on the command line.
    const NAME: &'static str;
    /// Largest integer sum that is still exact in this type.
    const EXACT_LIMIT: u64;
    /// The value of a small non-negative integer.
    fn from_small(v: u32) -> Self;
    /// `self + other` in this type.
    fn add(self, other: Self) -> Self;
}

macro_rules! exact_float {
    ($t:ty, $name:literal, $limit:expr) => {
        impl ExactElement for $t {
            const NAME: &'static str = $name;
            const EXACT_LIMIT: u64 = $limit;
            fn from_small(v: u32) -> Self {
                v as $t
            }
            fn add(self, other: Self) -> Self {
                self + other
            }
        }
    };
}
exact_float!(f32, "f32", 1 << 24);
exact_float!(f64, "f64", 1 << 53);

macro_rules! exact_int {
    ($t:ty, $name:literal, $limit:expr) => {
        impl ExactElement for $t {
            const NAME: &'static str = $name;
            const EXACT_LIMIT: u64 = $limit;
            fn from_small(v: u32) -> Self {
                v as $t
            }
            fn add(self, other: Self) -> Self {
                self.wrapping_add(other)
            }
        }
    };
}
exact_int!(i32, "i32", i32::MAX as u64);
exact_int!(i64, "i64", i64::MAX as u64);
exact_int!(u8, "u8", u8::MAX as u64);

impl ExactElement for f16 {
    const NAME: &'static str = "f16";
    const EXACT_LIMIT: u64 = 2048;
    fn from_small(v: u32) -> Self {
        f16::from_f32(v as f32)
    }
    fn add(self, other: Self) -> Self {
        f16::from_f32(self.to_f32() + other.to_f32())
    }
}

impl ExactElement for bf16 {
    const NAME: &'static str = "bf16";
    const EXACT_LIMIT: u64 = 256;
    fn from_small(v: u32) -> Self {
        bf16::from_f32(v as f32)
    }
    fn add(self, other: Self) -> Self {
        bf16::from_f32(self.to_f32() + other.to_f32())
    }
}

/// A deterministic integer-valued contribution and its expected sum over a world.
///
/// Rank `r` contributes `(seed + 3r + j) % 16` at element `j`; the sum over ranks depends
/// only on `(seed + j) % 16`, so the expected result is a 16-entry table and checking a
/// buffer is one pass. A missing, duplicated or misplaced contribution changes the sum.
#[derive(Clone, Debug)]
pub struct Pattern {
    seed: u64,
    table: [u64; 16],
}

impl Pattern {
    /// The pattern of `seed` for a world of `world` ranks.
    pub fn new(seed: u64, world: u32) -> Self {
        let mut table = [0u64; 16];
        for (c, slot) in table.iter_mut().enumerate() {
            *slot = (0..world as u64).map(|r| (c as u64 + 3 * r) % 16).sum();
        }
        Self { seed, table }
    }

    /// Largest element of the expected sum.
    pub fn max_sum(&self) -> u64 {
        self.table.iter().copied().max().unwrap_or(0)
    }

    /// Fills `buf` with rank `rank`'s contribution.
    pub fn fill<E: ExactElement>(&self, rank: u32, buf: &mut [E]) {
        let base = (self.seed + 3 * rank as u64) % 16;
        let values: [E; 16] = std::array::from_fn(|k| E::from_small(((base + k as u64) % 16) as u32));
        for (j, x) in buf.iter_mut().enumerate() {
            *x = values[j % 16];
        }
    }

    /// Checks `buf` against the expected sum; returns the first wrong index.
    pub fn first_mismatch<E: ExactElement>(&self, buf: &[E]) -> Option<usize> {
        let base = self.seed % 16;
        let expected: [E; 16] =
            std::array::from_fn(|k| E::from_small(self.table[((base + k as u64) % 16) as usize] as u32));
        buf.iter().enumerate().position(|(j, x)| *x != expected[j % 16])
    }

    /// The expected value at element `j`.
    pub fn expected<E: ExactElement>(&self, j: usize) -> E {
        E::from_small(self.table[((self.seed + j as u64) % 16) as usize] as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_sums_match_explicit_sums() {
        for world in [1u32, 2, 3, 5, 8] {
            let p = Pattern::new(7, world);
            let n = 37;
            let mut total = vec![0f64; n];
            let mut buf = vec![0f64; n];
            for r in 0..world {
                p.fill(r, &mut buf);
                for (t, b) in total.iter_mut().zip(&buf) {
                    *t += b;
                }
            }
            assert_eq!(p.first_mismatch(&total), None, "world {world}");
            total[5] += 1.0;
            assert_eq!(p.first_mismatch(&total), Some(5));
        }
    }
}
