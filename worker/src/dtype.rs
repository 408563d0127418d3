//! Element types the collectives move and reduce, their arithmetic, and byte views of their
//! slices.

use crate::kernels::{apply, through_f32};
use half::{bf16, f16};
use std::fmt;
use std::str::FromStr;

/// The element type of a buffer, for the untyped entry points (`*_bytes`) and call signatures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary64.
    F64,
    /// IEEE 754 binary16 ([`half::f16`]); reduced through f32.
    F16,
    /// bfloat16 ([`half::bf16`]); reduced through f32.
    BF16,
    /// Signed 32-bit integer (sum and product wrap).
    I32,
    /// Signed 64-bit integer (sum and product wrap).
    I64,
    /// Unsigned byte (sum and product wrap).
    U8,
}

impl DType {
    /// Every supported dtype.
    pub const ALL: [DType; 7] = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64, DType::U8];

    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    /// Lower-case name, as the CLI spells it (`f32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
        }
    }

    /// Stable numeric code used in call signatures.
    pub(crate) fn code(self) -> u8 {
        match self {
            DType::F32 => 1,
            DType::F64 => 2,
            DType::F16 => 3,
            DType::BF16 => 4,
            DType::I32 => 5,
            DType::I64 => 6,
            DType::U8 => 7,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Error of [`DType::from_str`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown dtype {0:?} (expected one of f32, f64, f16, bf16, i32, i64, u8)")]
pub struct ParseDTypeError(pub String);

impl FromStr for DType {
    type Err = ParseDTypeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DType::ALL.into_iter().find(|d| d.name().eq_ignore_ascii_case(s)).ok_or_else(|| ParseDTypeError(s.to_owned()))
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A plain numeric element the collectives can move and reduce.
///
/// Sealed: implemented for `f32`, `f64`, [`half::f16`], [`half::bf16`], `i32`, `i64` and `u8`
/// only. Every implementor has no padding and no invalid bit patterns, which is what makes the
/// byte views ([`as_bytes`], [`as_bytes_mut`]) sound.
pub trait Element: sealed::Sealed + Copy + Default + PartialEq + fmt::Debug + Send + Sync + 'static {
    /// The matching [`DType`].
    const DTYPE: DType;

    /// `acc[i] += other[i]` (wrapping for integers) over the common length; `other_first`
    /// puts `other[i]` on the left. What [`crate::reduce`] runs for `Sum` and `Avg`.
    #[doc(hidden)]
    fn add_into(acc: &mut [Self], other: &[Self], other_first: bool);

    /// `acc[i] *= other[i]` (wrapping for integers); see [`Element::add_into`].
    #[doc(hidden)]
    fn mul_into(acc: &mut [Self], other: &[Self], other_first: bool);

    /// `acc[i] = min(acc[i], other[i])` (IEEE minNum for floats); see [`Element::add_into`].
    #[doc(hidden)]
    fn min_into(acc: &mut [Self], other: &[Self], other_first: bool);

    /// `acc[i] = max(acc[i], other[i])` (IEEE maxNum for floats); see [`Element::add_into`].
    #[doc(hidden)]
    fn max_into(acc: &mut [Self], other: &[Self], other_first: bool);

    /// Divides every element by `n` (the final step of `Avg`; truncating for integers).
    #[doc(hidden)]
    fn divide(data: &mut [Self], n: u32);
}

macro_rules! float_element {
    ($t:ty, $d:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline]
            fn add_into(acc: &mut [Self], other: &[Self], other_first: bool) {
                apply(acc, other, other_first, |a, b| a + b);
            }
            #[inline]
            fn mul_into(acc: &mut [Self], other: &[Self], other_first: bool) {
                apply(acc, other, other_first, |a, b| a * b);
            }
            #[inline]
            fn min_into(acc: &mut [Self], other: &[Self], other_first: bool) {
                apply(acc, other, other_first, <$t>::min);
            }
            #[inline]
            fn max_into(acc: &mut [Self], other: &[Self], other_first: bool) {
                apply(acc, other, other_first, <$t>::max);
            }
            fn divide(data: &mut [Self], n: u32) {
                let n = n as $t;
                for x in data {
                    *x /= n;
                }
            }
        }
    };
}

macro_rules! int_element {
    ($t:ty, $wide:ty, $d:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline]
            fn add_into(acc: &mut [Self], other: &[Self], other_first: bool) {
                apply(acc, other, other_first, <$t>::wrapping_add);
            }
            #[inline]
            fn mul_into(acc: &mut [Self], other: &[Self], other_first: bool) {
                apply(acc, other, other_first, <$t>::wrapping_mul);
            }
            #[inline]
            fn min_into(acc: &mut [Self], other: &[Self], other_first: bool) {
                apply(acc, other, other_first, Ord::min);
            }
            #[inline]
            fn max_into(acc: &mut [Self], other: &[Self], other_first: bool) {
                apply(acc, other, other_first, Ord::max);
            }
            fn divide(data: &mut [Self], n: u32) {
                let n = <$wide>::from(n);
                for x in data {
                    // |x / n| <= |x|, so the narrowing cannot lose anything.
                    *x = (<$wide>::from(*x) / n) as $t;
                }
            }
        }
    };
}

macro_rules! half_element {
    ($t:ty, $d:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline]
            fn add_into(acc: &mut [Self], other: &[Self], other_first: bool) {
                through_f32(acc, other, |a, b| f32::add_into(a, b, other_first));
            }
            #[inline]
            fn mul_into(acc: &mut [Self], other: &[Self], other_first: bool) {
                through_f32(acc, other, |a, b| f32::mul_into(a, b, other_first));
            }
            #[inline]
            fn min_into(acc: &mut [Self], other: &[Self], other_first: bool) {
                through_f32(acc, other, |a, b| f32::min_into(a, b, other_first));
            }
            #[inline]
            fn max_into(acc: &mut [Self], other: &[Self], other_first: bool) {
                through_f32(acc, other, |a, b| f32::max_into(a, b, other_first));
            }
            fn divide(data: &mut [Self], n: u32) {
                through_f32(data, &[], |a, _| f32::divide(a, n));
            }
        }
    };
}

float_element!(f32, DType::F32);
float_element!(f64, DType::F64);
int_element!(i32, i64, DType::I32);
int_element!(i64, i128, DType::I64);
int_element!(u8, u32, DType::U8);
half_element!(f16, DType::F16);
half_element!(bf16, DType::BF16);

/// The bytes of an element slice (native byte order), without copying.
pub fn as_bytes<E: Element>(s: &[E]) -> &[u8] {
    // SAFETY: `Element` is sealed and implemented only for primitive numbers and half's
    // `repr(transparent)` u16 wrappers: no padding, so every byte of the slice is initialised;
    // u8 has alignment 1 and the length is exactly the slice's size in bytes.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

/// The bytes of an element slice, writable, without copying.
pub fn as_bytes_mut<E: Element>(s: &mut [E]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`; in addition every bit pattern is a valid value of every
    // `Element` type, so any bytes written through the view leave valid elements behind.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

/// Views bytes as elements if they are aligned for `E` and a whole number of elements.
pub(crate) fn from_bytes<E: Element>(b: &[u8]) -> Option<&[E]> {
    // SAFETY: every bit pattern is a valid `E` (see `as_bytes_mut`); `align_to` only
    // reinterprets the properly aligned middle part.
    let (pre, mid, post) = unsafe { b.align_to::<E>() };
    (pre.is_empty() && post.is_empty()).then_some(mid)
}

/// Views bytes as elements if they are aligned for `E` and a whole number of elements.
pub(crate) fn from_bytes_mut<E: Element>(b: &mut [u8]) -> Option<&mut [E]> {
    // SAFETY: every bit pattern is a valid `E` (see `as_bytes_mut`); `align_to_mut` only
    // reinterprets the properly aligned middle part.
    let (pre, mid, post) = unsafe { b.align_to_mut::<E>() };
    (pre.is_empty() && post.is_empty()).then_some(mid)
}

/// Reusable, 8-byte aligned scratch memory that can be viewed as any [`Element`] type.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    words: Vec<u64>,
}

impl Scratch {
    /// A zeroed-on-growth view of `len` elements; grows (never shrinks) the backing buffer.
    pub(crate) fn get<E: Element>(&mut self, len: usize) -> &mut [E] {
        let words = (len * std::mem::size_of::<E>()).div_ceil(8);
        if self.words.len() < words {
            self.words.resize(words, 0);
        }
        // SAFETY: the buffer holds at least `len * size_of::<E>()` initialised bytes; u64's
        // alignment (8) is at least that of every `Element`; every bit pattern is a valid `E`;
        // the returned borrow is tied to `&mut self`, so nothing else aliases it.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<E>(), len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_sizes() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
        assert!("f8".parse::<DType>().is_err());
        assert_eq!(<bf16 as Element>::DTYPE.size(), 2);
        assert_eq!(<i64 as Element>::DTYPE.size(), 8);
    }

    #[test]
    fn byte_views_round_trip() {
        let mut v = [1.5f32, -2.0];
        assert_eq!(as_bytes(&v), [1.5f32.to_ne_bytes(), (-2.0f32).to_ne_bytes()].concat());
        as_bytes_mut(&mut v)[..4].copy_from_slice(&3.0f32.to_ne_bytes());
        assert_eq!(v, [3.0, -2.0]);
        let mut raw = [0i64; 2];
        let bytes = as_bytes_mut(&mut raw[..]);
        let view: &mut [f32] = from_bytes_mut(bytes).unwrap();
        assert_eq!(view.len(), 4);
        assert!(from_bytes_mut::<f32>(&mut as_bytes_mut(&mut raw[..])[1..9]).is_none());
        let mut s = Scratch::default();
        assert_eq!(s.get::<f64>(3).len(), 3);
        assert_eq!(s.get::<u8>(17).len(), 17);
    }
}
