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
/// Rank `r` contributes `c(seed, j) + r + 1` at element `j`, where `c` is a hash of the seed
/// (the step or iteration) and the element's index, reduced to `0..16`: it has no period, so
/// a block displaced by any distance (a ring that sends a block to the wrong place) changes
/// the result, and it changes with every seed. The sum over a world of `n` ranks is
/// `n * c(seed, j) + n(n+1)/2`, checked in one pass. A missing, duplicated or foreign
/// contribution changes the sum, since every rank's offset differs.
#[derive(Clone, Debug)]
pub struct Pattern {
    seed: u64,
    world: u64,
    rank_sum: u64,
}

/// `c(seed, j)`: a mix of the seed and the index (splitmix64's finaliser), in `0..16`.
fn position(seed: u64, j: usize) -> u64 {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (j as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    (x ^ (x >> 31)) % 16
}

impl Pattern {
    /// The pattern of `seed` for a world of `world` ranks.
    pub fn new(seed: u64, world: u32) -> Self {
        let world = u64::from(world);
        Self { seed, world, rank_sum: world * (world + 1) / 2 }
    }

    /// Largest element of the expected sum.
    pub fn max_sum(&self) -> u64 {
        self.world * 15 + self.rank_sum
    }

    /// Fills `buf` with rank `rank`'s contribution.
    pub fn fill<E: ExactElement>(&self, rank: u32, buf: &mut [E]) {
        let offset = u64::from(rank) + 1;
        for (j, x) in buf.iter_mut().enumerate() {
            *x = E::from_small((position(self.seed, j) + offset) as u32);
        }
    }

    /// Checks `buf` against the expected sum; returns the first wrong index.
    pub fn first_mismatch<E: ExactElement>(&self, buf: &[E]) -> Option<usize> {
        let expected: [E; 16] = std::array::from_fn(|c| E::from_small((self.world * c as u64 + self.rank_sum) as u32));
        buf.iter().enumerate().position(|(j, x)| *x != expected[position(self.seed, j) as usize])
    }

    /// The expected value at element `j`.
    pub fn expected<E: ExactElement>(&self, j: usize) -> E {
        E::from_small((self.world * position(self.seed, j) + self.rank_sum) as u32)
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

    /// The sum of every rank's contribution for `world` ranks over `n` elements.
    fn reduced(p: &Pattern, world: u32, n: usize) -> Vec<f64> {
        let mut total = vec![0f64; n];
        let mut buf = vec![0f64; n];
        for r in 0..world {
            p.fill(r, &mut buf);
            total.iter_mut().zip(&buf).for_each(|(t, b)| *t += b);
        }
        total
    }

    #[test]
    fn blocks_swapped_16_elements_apart_are_caught() {
        // The old pattern repeated every 16 elements: a ring that swapped two such blocks,
        // or delivered a block 16 places off, still verified.
        for world in [2u32, 3, 4, 16] {
            for seed in 0..20 {
                let p = Pattern::new(seed, world);
                let good = reduced(&p, world, 64);
                assert_eq!(p.first_mismatch(&good), None);
                let mut swapped = good.clone();
                let (a, b) = swapped.split_at_mut(16);
                a.swap_with_slice(&mut b[..16]);
                assert!(p.first_mismatch(&swapped).is_some(), "world {world} seed {seed}: a swap went unseen");
                let mut shifted = good.clone();
                shifted.copy_within(0..32, 16);
                assert!(p.first_mismatch(&shifted).is_some(), "world {world} seed {seed}: a shift went unseen");
            }
        }
    }

    #[test]
    fn a_missing_or_duplicated_rank_is_caught_and_every_step_differs() {
        let world = 4;
        let p = Pattern::new(9, world);
        let mut buf = vec![0f64; 40];
        let mut total = vec![0f64; 40];
        for r in [0, 1, 2, 2] {
            // rank 3's contribution replaced by a second copy of rank 2's
            p.fill(r, &mut buf);
            total.iter_mut().zip(&buf).for_each(|(t, b)| *t += b);
        }
        assert_eq!(p.first_mismatch(&total), Some(0));
        // A world of 16 no longer expects one constant everywhere, and seeds differ.
        let e: Vec<f64> = (0..64).map(|j| Pattern::new(1, 16).expected::<f64>(j)).collect();
        assert!(e.iter().any(|x| *x != e[0]));
        assert_ne!(reduced(&Pattern::new(1, 3), 3, 64), reduced(&Pattern::new(2, 3), 3, 64));
    }
}
