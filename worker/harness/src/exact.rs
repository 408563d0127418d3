//! Element types whose sums of small integers are exact: what `train` and `bench` use to
//! verify every result bit for bit.

use cohort::{Element, ReduceOp};
use half::{bf16, f16};

/// An element type in which the sums the verifiers compute are exact.
pub trait ExactElement: Element + Copy + PartialEq + Send + Sync + std::fmt::Debug + 'static {
    /// Name as given on the command line.
    const NAME: &'static str;
    /// Largest integer sum that is still exact in this type.
    const EXACT_LIMIT: u64;
    /// Whether integer arithmetic in this type wraps (two's complement): sums and products
    /// are then exact modulo 2^bits whatever their size.
    const WRAPS: bool;
    /// Modulus (a power of two) of `train`'s parameters in this type: small enough that a
    /// parameter plus the largest contribution stays exact.
    const PARAM_MODULUS: u64;
    /// The value of a small non-negative integer.
    fn from_small(v: u32) -> Self;
    /// The value of an integer: exact for floats within [`ExactElement::EXACT_LIMIT`], modulo
    /// 2^bits for integer types.
    fn from_int(v: i64) -> Self;
    /// The integer this value holds (truncated toward zero; NaN reads as 0).
    fn to_int(self) -> i64;
    /// [`ExactElement::from_int`] for values that fit an `i32` (a conversion that
    /// vectorises, for the per-element loops of `train`).
    fn from_i32(v: i32) -> Self;
    /// [`ExactElement::to_int`] for values that fit an `i32` (beyond, floats saturate and
    /// integers truncate).
    fn to_i32(self) -> i32;
    /// `self + other` in this type.
    fn add(self, other: Self) -> Self;
}

macro_rules! exact_float {
    ($t:ty, $name:literal, $limit:expr) => {
        impl ExactElement for $t {
            const NAME: &'static str = $name;
            const EXACT_LIMIT: u64 = $limit;
            const WRAPS: bool = false;
            const PARAM_MODULUS: u64 = 1 << 16;
            fn from_small(v: u32) -> Self {
                v as $t
            }
            fn from_int(v: i64) -> Self {
                v as $t
            }
            fn to_int(self) -> i64 {
                self as i64
            }
            fn from_i32(v: i32) -> Self {
                v as $t
            }
            fn to_i32(self) -> i32 {
                self as i32
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
    ($t:ty, $name:literal, $limit:expr, $modulus:expr) => {
        impl ExactElement for $t {
            const NAME: &'static str = $name;
            const EXACT_LIMIT: u64 = $limit;
            const WRAPS: bool = true;
            const PARAM_MODULUS: u64 = $modulus;
            fn from_small(v: u32) -> Self {
                v as $t
            }
            fn from_int(v: i64) -> Self {
                v as $t
            }
            fn to_int(self) -> i64 {
                self as i64
            }
            fn from_i32(v: i32) -> Self {
                v as $t
            }
            fn to_i32(self) -> i32 {
                self as i32
            }
            fn add(self, other: Self) -> Self {
                self.wrapping_add(other)
            }
        }
    };
}
exact_int!(i32, "i32", i32::MAX as u64, 1 << 16);
exact_int!(i64, "i64", i64::MAX as u64, 1 << 16);
exact_int!(u8, "u8", u8::MAX as u64, 1 << 8);

impl ExactElement for f16 {
    const NAME: &'static str = "f16";
    const EXACT_LIMIT: u64 = 2048;
    const WRAPS: bool = false;
    const PARAM_MODULUS: u64 = 1 << 8;
    fn from_small(v: u32) -> Self {
        f16::from_f32(v as f32)
    }
    fn from_int(v: i64) -> Self {
        f16::from_f32(v as f32)
    }
    fn to_int(self) -> i64 {
        self.to_f32() as i64
    }
    fn from_i32(v: i32) -> Self {
        Self::from_f32(v as f32)
    }
    fn to_i32(self) -> i32 {
        self.to_f32() as i32
    }
    fn add(self, other: Self) -> Self {
        f16::from_f32(self.to_f32() + other.to_f32())
    }
}

impl ExactElement for bf16 {
    const NAME: &'static str = "bf16";
    const EXACT_LIMIT: u64 = 256;
    const WRAPS: bool = false;
    const PARAM_MODULUS: u64 = 1 << 5;
    fn from_small(v: u32) -> Self {
        bf16::from_f32(v as f32)
    }
    fn from_int(v: i64) -> Self {
        bf16::from_f32(v as f32)
    }
    fn to_int(self) -> i64 {
        self.to_f32() as i64
    }
    fn from_i32(v: i32) -> Self {
        Self::from_f32(v as f32)
    }
    fn to_i32(self) -> i32 {
        self.to_f32() as i32
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

/// A mix of the seed and the index (splitmix64's finaliser).
fn hash(seed: u64, j: usize) -> u64 {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (j as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// `c(seed, j)`: [`hash`] reduced to `0..16`.
fn position(seed: u64, j: usize) -> u64 {
    hash(seed, j) % 16
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

    /// Rank `rank`'s contribution at element `j` (what [`Pattern::fill`] writes there).
    pub fn contribution(&self, rank: u32, j: usize) -> u64 {
        position(self.seed, j) + u64::from(rank) + 1
    }

    /// The sum over ranks `1..world` of their contributions at element `j` (every rank but 0).
    pub fn sum_without_rank0(&self, j: usize) -> u64 {
        (self.world.saturating_sub(1)) * position(self.seed, j) + self.rank_sum.saturating_sub(1)
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

/// Contributions and expected results for every [`ReduceOp`], integer-valued and exact in
/// every [`ExactElement`] within the bound [`OpPattern::check_exact`] checks. With
/// `c = c(seed, j)` in `0..16` as in [`Pattern`], rank `r` of `n` contributes at element `j`:
///
/// - `Sum`: [`Pattern`]'s `c + r + 1`;
/// - `Min`, `Max`: `16·((k + r) mod n) + c`, with `k` another hash of (seed, j): the ranks
///   hold distinct multiples of 16 and which rank holds the extreme moves with the element,
///   so a missing or duplicated rank shows where it held it. Min is `c`, max `16(n-1) + c`;
/// - `Prod`: `±2^b`, sign and `b` in {0, 1} hashed from (seed, rank, element): every partial
///   product is a power of two (exact in any order), the expected one is computed from the
///   known inputs; integer types wrap, which is exact modulo 2^bits;
/// - `Avg`: `f + (2r - n + 1)·h` with `f = c + 1` and `h` in 1..=4: the sum is exactly `n·f`
///   (the offsets cancel), so the average is `f` (floats and truncating integers alike).
#[derive(Clone, Debug)]
pub struct OpPattern {
    op: ReduceOp,
    seed: u64,
    world: u64,
    sum: Pattern,
}

/// Salt of the second per-element hash (`k` of min/max, `h` of avg).
const SALT: u64 = 0x5851_F42D_4C95_7F2D;

impl OpPattern {
    /// The pattern of `op` for `seed` in a world of `world` ranks.
    pub fn new(op: ReduceOp, seed: u64, world: u32) -> Self {
        Self { op, seed, world: u64::from(world), sum: Pattern::new(seed, world) }
    }

    /// The operator.
    pub fn op(&self) -> ReduceOp {
        self.op
    }

    /// Whether `E` holds every value and partial result of this op exactly for this world.
    pub fn check_exact<E: ExactElement>(&self) -> Result<(), String> {
        let n = self.world;
        let (largest, what) = match self.op {
            ReduceOp::Sum => (self.sum.max_sum(), "sums"),
            ReduceOp::Min | ReduceOp::Max => (16 * n, "values"),
            // Partial sums stay within the sum of the magnitudes.
            ReduceOp::Avg => (n * (16 + 4 * n.saturating_sub(1)), "sums"),
            ReduceOp::Prod if E::WRAPS => (0, "products"),
            ReduceOp::Prod => (1u64.checked_shl(n as u32).unwrap_or(u64::MAX), "products"),
        };
        if largest <= E::EXACT_LIMIT {
            Ok(())
        } else {
            Err(format!("{} cannot hold exact {} {what} over {n} ranks", E::NAME, self.op))
        }
    }

    /// Hash of (seed, rank, element) for `Prod`.
    fn prod_bits(&self, rank: u64, j: usize) -> u64 {
        hash(self.seed ^ (rank + 1).wrapping_mul(SALT), j)
    }

    /// Rank `rank`'s contribution at element `j`, as an integer.
    fn value(&self, rank: u64, j: usize) -> i64 {
        let c = position(self.seed, j) as i64;
        match self.op {
            ReduceOp::Sum => c + rank as i64 + 1,
            ReduceOp::Min | ReduceOp::Max => {
                16 * ((hash(self.seed ^ SALT, j) % self.world + rank) % self.world) as i64 + c
            }
            ReduceOp::Prod => {
                let bits = self.prod_bits(rank, j);
                let magnitude = 1 + (bits & 1) as i64;
                if bits & 2 == 0 {
                    magnitude
                } else {
                    -magnitude
                }
            }
            ReduceOp::Avg => {
                let h = (hash(self.seed ^ SALT, j) % 4) as i64 + 1;
                c + 1 + (2 * rank as i64 - self.world as i64 + 1) * h
            }
        }
    }

    /// The expected result at element `j`, as an integer (modulo 2^64 for `Prod`).
    fn expected_int(&self, j: usize) -> i64 {
        let c = position(self.seed, j) as i64;
        match self.op {
            ReduceOp::Sum => (self.world * c as u64 + self.world * (self.world + 1) / 2) as i64,
            ReduceOp::Min => c,
            ReduceOp::Max => 16 * (self.world as i64 - 1) + c,
            ReduceOp::Prod => (0..self.world).fold(1i64, |acc, r| acc.wrapping_mul(self.value(r, j))),
            ReduceOp::Avg => c + 1,
        }
    }

    /// Fills `buf` with rank `rank`'s contribution.
    pub fn fill<E: ExactElement>(&self, rank: u32, buf: &mut [E]) {
        if self.op == ReduceOp::Sum {
            return self.sum.fill(rank, buf);
        }
        for (j, x) in buf.iter_mut().enumerate() {
            *x = E::from_int(self.value(u64::from(rank), j));
        }
    }

    /// The expected result at element `j`.
    pub fn expected<E: ExactElement>(&self, j: usize) -> E {
        E::from_int(self.expected_int(j))
    }

    /// Checks `buf` against the expected result; returns the first wrong index.
    pub fn first_mismatch<E: ExactElement>(&self, buf: &[E]) -> Option<usize> {
        if self.op == ReduceOp::Sum {
            return self.sum.first_mismatch(buf);
        }
        buf.iter().enumerate().position(|(j, x)| *x != self.expected::<E>(j))
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

    /// What an allreduce of `op` over the contributions of `ranks` produces, by the crate's
    /// own kernels (combined in rank order, then the average's one division).
    fn reduce_ranks<E: ExactElement>(p: &OpPattern, ranks: &[u32], world: u32, n: usize) -> Vec<E> {
        let mut acc = vec![E::from_int(0); n];
        p.fill(ranks[0], &mut acc);
        let mut buf = vec![E::from_int(0); n];
        for &r in &ranks[1..] {
            p.fill(r, &mut buf);
            cohort::reduce::reduce(p.op(), &mut acc, &buf);
        }
        cohort::reduce::finish_avg(p.op(), &mut acc, world);
        acc
    }

    fn every_op_verifies<E: ExactElement>(worlds: &[u32]) {
        for op in ReduceOp::ALL {
            for &world in worlds {
                let p = OpPattern::new(op, 11, world);
                if p.check_exact::<E>().is_err() {
                    continue;
                }
                let all: Vec<u32> = (0..world).collect();
                let good = reduce_ranks::<E>(&p, &all, world, 67);
                assert_eq!(p.first_mismatch(&good), None, "{} {op} world {world}", E::NAME);
                // In reverse order too (prod and sum of exact values do not depend on it).
                let rev: Vec<u32> = (0..world).rev().collect();
                assert_eq!(
                    p.first_mismatch(&reduce_ranks::<E>(&p, &rev, world, 67)),
                    None,
                    "{} {op} reversed",
                    E::NAME
                );
                if world < 2 {
                    continue;
                }
                // Rank 1 missing, and rank 0's contribution twice in its place.
                let missing: Vec<u32> = (0..world).filter(|&r| r != 1).collect();
                let caught = p.first_mismatch(&reduce_ranks::<E>(&p, &missing, world, 67)).is_some();
                assert!(caught, "{} {op} world {world}: a missing rank went unseen", E::NAME);
                let mut dup = missing.clone();
                dup.push(0);
                let caught = p.first_mismatch(&reduce_ranks::<E>(&p, &dup, world, 67)).is_some();
                assert!(caught, "{} {op} world {world}: a duplicated rank went unseen", E::NAME);
                // Blocks of 16 swapped.
                let mut swapped = good.clone();
                let (a, b) = swapped.split_at_mut(16);
                a.swap_with_slice(&mut b[..16]);
                assert!(p.first_mismatch(&swapped).is_some(), "{} {op} world {world}: a swap went unseen", E::NAME);
            }
        }
    }

    #[test]
    fn every_op_verifies_and_catches_missing_duplicated_and_displaced_contributions() {
        let worlds = [1u32, 2, 3, 4, 5, 8];
        every_op_verifies::<f32>(&worlds);
        every_op_verifies::<f64>(&worlds);
        every_op_verifies::<i32>(&worlds);
        every_op_verifies::<i64>(&worlds);
        every_op_verifies::<u8>(&worlds);
        every_op_verifies::<f16>(&worlds);
        every_op_verifies::<bf16>(&worlds);
    }

    #[test]
    fn op_bounds_refuse_what_a_type_cannot_hold() {
        assert!(OpPattern::new(ReduceOp::Prod, 0, 8).check_exact::<f16>().is_ok());
        assert!(OpPattern::new(ReduceOp::Prod, 0, 12).check_exact::<f16>().is_err());
        assert!(OpPattern::new(ReduceOp::Prod, 0, 200).check_exact::<i32>().is_ok());
        assert!(OpPattern::new(ReduceOp::Max, 0, 15).check_exact::<u8>().is_ok());
        assert!(OpPattern::new(ReduceOp::Max, 0, 16).check_exact::<u8>().is_err());
        assert!(OpPattern::new(ReduceOp::Avg, 0, 6).check_exact::<bf16>().is_ok());
        assert!(OpPattern::new(ReduceOp::Avg, 0, 7).check_exact::<bf16>().is_err());
    }
}
