//! Reduction operators, and reducing slices of any [`Element`] type with them.
//!
//! Each element type carries its arithmetic (wrapping integer sums, IEEE minNum, f16 and bf16
//! through f32; the vectorised loops are in `kernels.rs`); an operator chooses which of it a
//! reduction runs.
//!
//! # Semantics per op
//! - `Sum`, `Prod`: IEEE arithmetic for floats; wrapping arithmetic for integers.
//! - `Min`, `Max`: for floats, IEEE 754 minNum/maxNum (Rust's `f32::min`): a NaN operand is
//!   ignored unless both are NaN, so the result is NaN only if every rank contributed NaN at that
//!   position. Which zero `min(+0.0, -0.0)` returns is unspecified, but every rank gets the
//!   same bytes (see below).
//! - `Avg`: reduced as `Sum`, then divided by the world size exactly once, after the last
//!   combination, the same way on every rank. Integer averages truncate toward zero (after a
//!   wrapping sum).
//!
//! Bit-exactness: the collectives combine every element in an order fixed by the schedule, and
//! either compute each final value on one rank and copy its bytes, or have both partners of an
//! exchange compute `lower-rank operand op higher-rank operand`; so all ranks end with
//! identical bytes even for non-associative float sums.

use crate::dtype::{as_bytes_mut, from_bytes, Element};
use std::fmt;
use std::str::FromStr;

/// How contributions are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum (wrapping for integers).
    Sum,
    /// Product (wrapping for integers).
    Prod,
    /// Minimum (IEEE minNum for floats: NaN is ignored unless all are NaN).
    Min,
    /// Maximum (IEEE maxNum for floats).
    Max,
    /// Sum divided once by the world size (truncating for integers).
    Avg,
}

impl ReduceOp {
    /// Every operator.
    pub const ALL: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg];

    /// Lower-case name (`sum`, `prod`, `min`, `max`, `avg`).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }

    /// Stable numeric code used in call signatures.
    pub(crate) fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 1,
            ReduceOp::Prod => 2,
            ReduceOp::Min => 3,
            ReduceOp::Max => 4,
            ReduceOp::Avg => 5,
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Error of [`ReduceOp::from_str`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown reduce op {0:?} (expected one of sum, prod, min, max, avg)")]
pub struct ParseReduceOpError(pub String);

impl FromStr for ReduceOp {
    type Err = ParseReduceOpError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ReduceOp::ALL
            .into_iter()
            .find(|o| o.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| ParseReduceOpError(s.to_owned()))
    }
}

/// `acc[i] = acc[i] op other[i]` for every `i` (`Avg` combines as `Sum`; divide with
/// [`finish_avg`]).
///
/// # Panics
/// If the slices differ in length.
pub fn reduce<E: Element>(op: ReduceOp, acc: &mut [E], other: &[E]) {
    assert_eq!(acc.len(), other.len(), "reduce: operand lengths differ");
    combine(op, acc, other, false);
}

/// `acc[i] = other[i] op acc[i]` for every `i`: like [`reduce`] with the operands swapped,
/// for schedules that must put a fixed rank's operand first.
///
/// # Panics
/// If the slices differ in length.
pub fn reduce_rev<E: Element>(op: ReduceOp, acc: &mut [E], other: &[E]) {
    assert_eq!(acc.len(), other.len(), "reduce_rev: operand lengths differ");
    combine(op, acc, other, true);
}

/// The final step of [`ReduceOp::Avg`] over `world_size` contributions: divides every element.
/// Does nothing for other ops.
pub fn finish_avg<E: Element>(op: ReduceOp, data: &mut [E], world_size: u32) {
    if op == ReduceOp::Avg && world_size > 1 {
        E::divide(data, world_size);
    }
}

/// `acc[i] = acc[i] op other[i]`, or `other[i] op acc[i]` when `other_first`, over the common
/// length of the slices (`Avg` combines as `Sum`): what the schedules combine segments with.
#[inline]
pub(crate) fn combine<E: Element>(op: ReduceOp, acc: &mut [E], other: &[E], other_first: bool) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => E::add_into(acc, other, other_first),
        ReduceOp::Prod => E::mul_into(acc, other, other_first),
        ReduceOp::Min => E::min_into(acc, other, other_first),
        ReduceOp::Max => E::max_into(acc, other, other_first),
    }
}

/// Elements [`CombineInto`] converts per turn when a piece is unaligned for its type.
const BOUNCE: usize = 256;

/// Combines a message into `acc` as its bytes arrive, piece by piece and in order (what
/// [`cohort_transports::Transport::recv_with`] hands out), with the result [`combine`] gives
/// for the whole message at once. A piece may end inside an element or start unaligned for
/// `E`; such bytes go through a small buffer, the rest is combined in place.
pub(crate) struct CombineInto<'a, E> {
    op: ReduceOp,
    acc: &'a mut [E],
    other_first: bool,
    /// Elements of `acc` combined so far.
    done: usize,
    /// The first bytes of an element split between two pieces.
    carry: [u8; 16],
    carried: usize,
}

impl<'a, E: Element> CombineInto<'a, E> {
    /// Combines into `acc` with `op`, the incoming operand first when `other_first`.
    pub(crate) fn new(op: ReduceOp, acc: &'a mut [E], other_first: bool) -> Self {
        Self { op, acc, other_first, done: 0, carry: [0; 16], carried: 0 }
    }

    /// The next `piece` of the message. Bytes past `acc`'s length are ignored (the transport
    /// checked the message's length against it).
    pub(crate) fn feed(&mut self, mut piece: &[u8]) {
        let size = std::mem::size_of::<E>();
        if self.carried > 0 {
            let take = (size - self.carried).min(piece.len());
            self.carry[self.carried..self.carried + take].copy_from_slice(&piece[..take]);
            self.carried += take;
            piece = &piece[take..];
            if self.carried < size {
                return;
            }
            let mut one = [E::default()];
            as_bytes_mut(&mut one).copy_from_slice(&self.carry[..size]);
            self.carried = 0;
            self.next(&one);
        }
        let (body, rest) = piece.split_at(piece.len() / size * size);
        match from_bytes::<E>(body) {
            Some(aligned) => self.next(aligned),
            None => {
                let mut bounce = [E::default(); BOUNCE];
                for chunk in body.chunks(BOUNCE * size) {
                    let k = chunk.len() / size;
                    as_bytes_mut(&mut bounce[..k]).copy_from_slice(chunk);
                    self.next(&bounce[..k]);
                }
            }
        }
        self.carry[..rest.len()].copy_from_slice(rest);
        self.carried = rest.len();
    }

    /// Whether every element of `acc` has been combined.
    pub(crate) fn is_complete(&self) -> bool {
        self.done == self.acc.len() && self.carried == 0
    }

    fn next(&mut self, other: &[E]) {
        let n = other.len().min(self.acc.len() - self.done);
        combine(self.op, &mut self.acc[self.done..self.done + n], &other[..n], self.other_first);
        self.done += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    /// Feeds `other`'s bytes to [`CombineInto`] split at `cuts`, starting `skew` bytes into
    /// a buffer (so that the pieces are unaligned for `E` when `skew` is not a multiple of
    /// its alignment), and checks the result against [`combine`] over the whole slice.
    fn combine_in_pieces<E: Element>(acc: &[E], other: &[E], cuts: &[usize], skew: usize, op: ReduceOp, first: bool) {
        let mut want = acc.to_vec();
        combine(op, &mut want, other, first);
        let bytes = crate::dtype::as_bytes(other);
        let mut shifted = vec![0u8; skew + bytes.len()];
        shifted[skew..].copy_from_slice(bytes);
        let bytes = &shifted[skew..];
        let mut got = acc.to_vec();
        let mut into = CombineInto::new(op, &mut got, first);
        let mut at = 0;
        for &cut in cuts.iter().chain(std::iter::once(&bytes.len())) {
            let cut = cut.clamp(at, bytes.len());
            into.feed(&bytes[at..cut]);
            at = cut;
        }
        assert!(into.is_complete(), "cuts {cuts:?} skew {skew}");
        let (g, w) = (crate::dtype::as_bytes(&got), crate::dtype::as_bytes(&want));
        assert!(g == w, "{op:?} cuts {cuts:?} skew {skew}: pieces give other bytes than the whole");
    }

    #[test]
    fn combining_in_pieces_gives_the_bytes_of_combining_the_whole() {
        let n = 1000;
        let a32: Vec<f32> = (0..n).map(|i| (i as f32).sin() * 1e3).collect();
        let b32: Vec<f32> = (0..n).map(|i| (i as f32 * 0.7).cos() * 1e-3).collect();
        let a64: Vec<i64> = (0..n).map(|i| i as i64 * 7_919 - 3).collect();
        let b64: Vec<i64> = (0..n).map(|i| i64::MAX - i as i64).collect();
        let ah: Vec<bf16> = a32.iter().map(|&x| bf16::from_f32(x)).collect();
        let bh: Vec<bf16> = b32.iter().map(|&x| bf16::from_f32(x)).collect();
        let cut_sets: [&[usize]; 5] = [&[], &[1], &[3, 5, 6, 1001, 2002], &[4, 8, 4000], &[7; 3]];
        for op in ReduceOp::ALL {
            for cuts in cut_sets {
                for skew in [0, 1, 2, 3, 4] {
                    for first in [false, true] {
                        combine_in_pieces(&a32, &b32, cuts, skew, op, first);
                        combine_in_pieces(&a64, &b64, cuts, skew, op, first);
                        combine_in_pieces(&ah, &bh, cuts, skew, op, first);
                    }
                }
            }
        }
    }

    #[test]
    fn combining_stops_at_the_accumulator_and_reports_a_short_message() {
        let mut acc = [1i32; 4];
        let mut into = CombineInto::new(ReduceOp::Sum, &mut acc, false);
        into.feed(crate::dtype::as_bytes(&[1i32; 3]));
        into.feed(&[9, 0]);
        assert!(!into.is_complete(), "three and a half elements of four");
        into.feed(&[0, 0]);
        assert!(into.is_complete());
        into.feed(crate::dtype::as_bytes(&[5i32; 2]));
        assert_eq!(acc, [2, 2, 2, 10]);
    }

    #[test]
    fn float_ops() {
        let mut a: Vec<f32> = (0..100).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..100).map(|i| (100 - i) as f32).collect();
        let mut s = a.clone();
        reduce(ReduceOp::Sum, &mut s, &b);
        assert!(s.iter().all(|&x| x == 100.0));
        let mut m = a.clone();
        reduce(ReduceOp::Min, &mut m, &b);
        assert_eq!(m[10], 10.0);
        assert_eq!(m[90], 10.0);
        reduce(ReduceOp::Max, &mut a, &b);
        assert_eq!(a[10], 90.0);
        let mut p = vec![2.0f64; 3];
        reduce(ReduceOp::Prod, &mut p, &[3.0, 0.5, -1.0]);
        assert_eq!(p, [6.0, 1.0, -2.0]);
        let mut avg = vec![6.0f32, 9.0];
        reduce(ReduceOp::Avg, &mut avg, &[0.0, 0.0]);
        finish_avg(ReduceOp::Avg, &mut avg, 3);
        assert_eq!(avg, [2.0, 3.0]);
    }

    #[test]
    fn nan_is_ignored_by_min_and_max() {
        let mut a = [f32::NAN, 1.0, f32::NAN];
        reduce(ReduceOp::Min, &mut a, &[2.0, f32::NAN, f32::NAN]);
        assert_eq!(a[0], 2.0);
        assert_eq!(a[1], 1.0);
        assert!(a[2].is_nan());
    }

    #[test]
    fn integer_ops_wrap_and_truncate() {
        let mut a = [250u8, 3, 7];
        reduce(ReduceOp::Sum, &mut a, &[10, 4, 0]);
        assert_eq!(a, [4, 7, 7]);
        let mut b = [i32::MAX, -7];
        reduce(ReduceOp::Prod, &mut b, &[2, 1]);
        assert_eq!(b, [-2, -7]);
        finish_avg(ReduceOp::Avg, &mut b, 2);
        assert_eq!(b, [-1, -3]);
        let mut c = [5i64, -5];
        reduce_rev(ReduceOp::Min, &mut c, &[1, 1]);
        assert_eq!(c, [1, -5]);
    }

    #[test]
    fn half_types_reduce_through_f32() {
        let mut a: Vec<f16> = (0..130).map(|i| f16::from_f32(i as f32)).collect();
        let b: Vec<f16> = (0..130).map(|_| f16::from_f32(0.5)).collect();
        reduce(ReduceOp::Sum, &mut a, &b);
        assert!(a.iter().enumerate().all(|(i, x)| x.to_f32() == i as f32 + 0.5));
        let mut c = vec![bf16::from_f32(3.0); 70];
        reduce(ReduceOp::Max, &mut c, &[bf16::from_f32(4.0); 70]);
        assert!(c.iter().all(|x| x.to_f32() == 4.0));
        finish_avg(ReduceOp::Avg, &mut c, 8);
        assert!(c.iter().all(|x| x.to_f32() == 0.5));
    }

    #[test]
    fn op_order_matters_only_when_asked() {
        // minNum of +0 and -0 may depend on operand order; reduce_rev swaps it.
        let mut a = [1.0f32];
        reduce_rev(ReduceOp::Sum, &mut a, &[2.0]);
        assert_eq!(a, [3.0]);
        assert_eq!("AVG".parse::<ReduceOp>().unwrap(), ReduceOp::Avg);
    }
}
