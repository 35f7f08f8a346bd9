//! Element types that collectives move and reduce, and their wire codes.
//!
//! Collectives run on byte buffers underneath; [`Element`] is the only door
//! from typed slices to bytes, and it is sealed so that every implementor is
//! plain old data for which every bit pattern is a valid value. This module
//! must never grow an implementation for a type with padding or invalid bit
//! patterns (bool, char, references): the byte views below would be unsound.

use half::bf16;

/// The element type of a buffer, as carried in frame headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 64-bit float.
    F64,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// Unsigned byte.
    U8,
    /// bfloat16 ([`half::bf16`]).
    BF16,
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::U8 => 1,
            DType::BF16 => 2,
        }
    }

    /// The name PyTorch users know (`float32`, `bfloat16`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
            DType::BF16 => "bfloat16",
        }
    }

    /// Whether the type is a floating-point type (the only ones [`Avg`](crate::ReduceOp::Avg) accepts).
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::BF16)
    }

    pub(crate) const fn code(self) -> u8 {
        match self {
            DType::F32 => 1,
            DType::F64 => 2,
            DType::I32 => 3,
            DType::I64 => 4,
            DType::U8 => 5,
            DType::BF16 => 6,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<DType> {
        Some(match code {
            1 => DType::F32,
            2 => DType::F64,
            3 => DType::I32,
            4 => DType::I64,
            5 => DType::U8,
            6 => DType::BF16,
            _ => return None,
        })
    }

    /// Parses a name as printed by [`DType::name`] or its short form (`f32`, `bf16`, ...).
    pub fn parse(s: &str) -> Option<DType> {
        Some(match s {
            "f32" | "float32" | "float" => DType::F32,
            "f64" | "float64" | "double" => DType::F64,
            "i32" | "int32" | "int" => DType::I32,
            "i64" | "int64" | "long" => DType::I64,
            "u8" | "uint8" | "byte" => DType::U8,
            "bf16" | "bfloat16" => DType::BF16,
            _ => return None,
        })
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A type whose slices can be sent and reduced: f32, f64, i32, i64, u8, bf16.
///
/// Sealed: implemented only for plain-old-data types without padding, for
/// which every bit pattern is a value.
pub trait Element: Copy + Send + Sync + 'static + sealed::Sealed {
    /// The wire code of this type.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$d;
        }
    )*};
}

element!(f32 => F32, f64 => F64, i32 => I32, i64 => I64, u8 => U8, bf16 => BF16);

/// The bytes of a typed slice.
pub(crate) fn as_bytes<T: Element>(s: &[T]) -> &[u8] {
    // safety: `Element` types are plain old data without padding (sealed), so
    // every byte of the slice is initialised; u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

/// The bytes of a typed slice, writable.
pub(crate) fn as_bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    // safety: as in `as_bytes`; additionally every bit pattern written
    // through the byte view is a valid `T` (sealed trait).
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

/// Views bytes as `T`s. Panics if misaligned or not a whole number of
/// elements: callers only pass ranges cut at element boundaries of buffers
/// that started as `&[T]` or as 8-byte-aligned scratch.
pub(crate) fn cast_mut<T: Element>(b: &mut [u8]) -> &mut [T] {
    // safety: every bit pattern is a valid `T` (sealed trait); align_to_mut
    // only yields the aligned middle part, which the asserts require to be all of it.
    let (head, mid, tail) = unsafe { b.align_to_mut::<T>() };
    assert!(
        head.is_empty() && tail.is_empty(),
        "buffer not aligned to its element type"
    );
    mid
}

/// Views bytes as `T`s, read-only; see [`cast_mut`].
pub(crate) fn cast<T: Element>(b: &[u8]) -> &[T] {
    // safety: as in `cast_mut`.
    let (head, mid, tail) = unsafe { b.align_to::<T>() };
    assert!(
        head.is_empty() && tail.is_empty(),
        "buffer not aligned to its element type"
    );
    mid
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_sizes_match_rust() {
        for d in [
            DType::F32,
            DType::F64,
            DType::I32,
            DType::I64,
            DType::U8,
            DType::BF16,
        ] {
            assert_eq!(DType::from_code(d.code()), Some(d));
            assert_eq!(DType::parse(d.name()), Some(d));
        }
        assert_eq!(DType::BF16.size(), std::mem::size_of::<bf16>());
        assert_eq!(DType::from_code(0), None);
    }

    #[test]
    fn byte_views_round_trip() {
        let mut v = [1.5f32, -2.0, 3.25];
        let b = as_bytes_mut(&mut v);
        assert_eq!(b.len(), 12);
        cast_mut::<f32>(b)[1] = 7.0;
        assert_eq!(cast::<f32>(as_bytes(&v)), &[1.5, 7.0, 3.25]);
    }
}
