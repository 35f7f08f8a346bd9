//! [`AlignedFloats`]: an f32 buffer that starts on a 64-byte boundary, for the buffers the
//! kernels stream through (activations, parameters, gradients, optimizer state).
//!
//! A `Vec<f32>` of that size comes from the allocator 16 bytes past a page boundary, so with
//! rows a multiple of 16 floats every 64-byte vector load and store of a row straddles two cache
//! lines. On config B's bf16 training step that cost 5-8% of the step. This module only
//! allocates; it never computes.

use std::ops::{Deref, DerefMut};

/// 16 floats, one cache line: a `Vec` of these starts 64-byte aligned.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// A zero-initialised `[f32]` of a fixed length whose first element is 64-byte aligned. Use it
/// as a slice (it derefs to one); offsets that are multiples of 16 floats stay aligned.
#[derive(Clone, Default)]
pub struct AlignedFloats {
    lines: Vec<Line>,
    len: usize,
}

impl AlignedFloats {
    /// `len` zeros.
    pub fn zeroed(len: usize) -> AlignedFloats {
        AlignedFloats {
            lines: vec![Line([0.0; 16]); len.div_ceil(16)],
            len,
        }
    }

    /// The whole buffer as a slice (what `Vec::as_mut_slice` is for a `Vec`).
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        self
    }
}

impl Deref for AlignedFloats {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        // SAFETY: a Line is 16 f32 with no padding (repr(C), size 64), so `lines` holds
        // 16 * lines.len() >= len initialised, contiguous f32, borrowed for self's lifetime.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr() as *const f32, self.len) }
    }
}

impl DerefMut for AlignedFloats {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in deref, borrowed mutably and exclusively for self's lifetime.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr() as *mut f32, self.len) }
    }
}

impl std::fmt::Debug for AlignedFloats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedFloats")
            .field("len", &self.len)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_on_a_cache_line_and_holds_exactly_its_length() {
        for len in [0, 1, 15, 16, 17, 1000] {
            let mut b = AlignedFloats::zeroed(len);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0.0));
            assert_eq!(b.as_ptr() as usize % 64, 0, "len {len}");
            b.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32);
            let c = b.clone();
            assert_eq!(&c[..], &b[..]);
            assert_eq!(c.as_ptr() as usize % 64, 0);
        }
    }
}
