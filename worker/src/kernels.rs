//! The element-wise loops every reduction runs on, written so that LLVM vectorises them:
//! fixed-width inner loops over `chunks_exact` and a scalar tail. f16 and bf16 are widened to
//! f32 in blocks of 64, combined there, and rounded back once per combination.
//!
//! Each [`crate::dtype::Element`] type builds its arithmetic from these; which arithmetic a
//! reduction uses is [`crate::reduce::ReduceOp`]'s choice.

use half::slice::HalfFloatSliceExt;

/// Elements per inner loop: wide enough for AVX-512 on 4-byte types and a few iterations of
/// unrolling on narrower units.
const LANES: usize = 32;

/// Applies `f` element-wise: `acc[i] = f(acc[i], other[i])` (or `f(other[i], acc[i])` when
/// `other_first`), in fixed-width chunks that vectorise.
#[inline(always)]
pub(crate) fn apply<E: Copy, F: Fn(E, E) -> E>(acc: &mut [E], other: &[E], other_first: bool, f: F) {
    if other_first {
        zip_chunks(acc, other, |a, b| f(b, a));
    } else {
        zip_chunks(acc, other, f);
    }
}

#[inline(always)]
fn zip_chunks<E: Copy, F: Fn(E, E) -> E>(acc: &mut [E], other: &[E], f: F) {
    let n = acc.len().min(other.len());
    let (acc, other) = (&mut acc[..n], &other[..n]);
    let mut a = acc.chunks_exact_mut(LANES);
    let mut b = other.chunks_exact(LANES);
    for (ca, cb) in (&mut a).zip(&mut b) {
        for i in 0..LANES {
            ca[i] = f(ca[i], cb[i]);
        }
    }
    for (x, y) in a.into_remainder().iter_mut().zip(b.remainder()) {
        *x = f(*x, *y);
    }
}

/// Widens `acc` (and `other`, if not empty) to f32 in blocks of 64, runs `f` on the blocks and
/// narrows the result back into `acc` (round to nearest even).
#[inline]
pub(crate) fn through_f32<H, F>(acc: &mut [H], other: &[H], f: F)
where
    [H]: HalfFloatSliceExt,
    F: Fn(&mut [f32], &[f32]),
{
    const BLOCK: usize = 64;
    let mut wa = [0f32; BLOCK];
    let mut wb = [0f32; BLOCK];
    for (i, ca) in acc.chunks_mut(BLOCK).enumerate() {
        let n = ca.len();
        ca.convert_to_f32_slice(&mut wa[..n]);
        let wb = if other.is_empty() {
            &wb[..0]
        } else {
            other[i * BLOCK..i * BLOCK + n].convert_to_f32_slice(&mut wb[..n]);
            &wb[..n]
        };
        f(&mut wa[..n], wb);
        ca.convert_from_f32_slice(&wa[..n]);
    }
}
