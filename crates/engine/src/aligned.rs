//! [`AlignedFloats`]: an f32 buffer that starts on a 64-byte boundary, for the buffers the
//! kernels stream through (activations, parameters, gradients, optimizer state).
//!
//! A `Vec<f32>` of that size comes from the allocator 16 bytes past a page boundary, so with
//! rows a multiple of 16 floats every 64-byte vector load and store of a row straddles two cache
//! lines. On config B's bf16 training step that cost 5-8% of the step. This module only
//! allocates; it never computes.

use std::ops::{Deref, DerefMut};

/// Floats in a 64-byte line.
const LINE: usize = 16;

/// A zero-initialised `[f32]` of a fixed length whose first element is 64-byte aligned. Use it
/// as a slice (it derefs to one); offsets that are multiples of 16 floats stay aligned.
///
/// The zeros cost no memory until written: the buffer is a `Vec<f32>` of up to 15 floats more
/// (the allocator's `calloc`, which for a large buffer maps fresh pages and writes nothing),
/// used from its first 64-byte boundary. A `Vec` of 64-byte-aligned lines would be written
/// zero by zero at allocation: every page resident at once, the model's parameters, gradients,
/// activation arena and AdamW's moments included, whatever the step later uses of them (ZeRO-3's
/// peak was its construction, ~0.5 GB above the step's on GPT-2 small).
#[derive(Default)]
pub struct AlignedFloats {
    buf: Vec<f32>,
    /// Where the aligned floats start in `buf`.
    start: usize,
    len: usize,
}

impl AlignedFloats {
    /// `len` zeros.
    pub fn zeroed(len: usize) -> AlignedFloats {
        let buf = vec![0f32; len + LINE - 1];
        // Floats to the first 64-byte boundary: the allocation is at least f32-aligned.
        let misalign = buf.as_ptr() as usize % (LINE * 4);
        let start = ((LINE * 4 - misalign) % (LINE * 4)) / 4;
        AlignedFloats { buf, start, len }
    }

    /// [`AlignedFloats::zeroed`] with every page written now: for state a first use reads
    /// before it writes (an optimizer's moments). A fresh allocation's pages are mapped on
    /// first touch, and a page first read is the kernel's shared zero page, copied again on
    /// the write, each copy flushing the TLB of every other thread of the process; written
    /// first, each page is faulted in once, with no flush. AdamW's first step on 124M
    /// parameters (config G, two threads) took ~1.9 s against a steady ~50 ms.
    pub fn zeroed_written(len: usize) -> AlignedFloats {
        let mut v = AlignedFloats::zeroed(len);
        v.fill(0.0);
        v
    }

    /// The whole buffer as a slice (what `Vec::as_mut_slice` is for a `Vec`).
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        self
    }
}

impl Clone for AlignedFloats {
    /// An aligned copy (a cloned `Vec` may sit elsewhere relative to a line boundary).
    fn clone(&self) -> Self {
        let mut c = AlignedFloats::zeroed(self.len);
        c.copy_from_slice(self);
        c
    }
}

impl Deref for AlignedFloats {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        &self.buf[self.start..self.start + self.len]
    }
}

impl DerefMut for AlignedFloats {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.buf[self.start..self.start + self.len]
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
        for len in [0, 1, 15, 16, 17, 1000, 1 << 22] {
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
