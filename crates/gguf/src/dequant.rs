//! Dequantisation to f32 of the ggml types cohort reads: F32, F16, BF16, Q8_0, Q4_0 and Q4_1.
//! The block layouts are ggml's (`ggml-common.h`), all little-endian:
//!
//! ```text
//! Q8_0 (34 bytes, 32 values):  d: f16 | qs: [i8; 32]        x[j] = qs[j] · d
//! Q4_0 (18 bytes, 32 values):  d: f16 | qs: [u8; 16]        x[j] = (lo(qs[j]) − 8) · d,  x[j+16] = (hi(qs[j]) − 8) · d
//! Q4_1 (20 bytes, 32 values):  d: f16 | m: f16 | qs: [u8; 16]  x[j] = lo(qs[j]) · d + m, x[j+16] = hi(qs[j]) · d + m
//! ```
//!
//! lo/hi are a byte's low and high nibble: the first half of a block sits in the low nibbles.
//! The arithmetic is the `gguf` Python package's (scales widened to f32, then one product and
//! one sum), so the values agree bit for bit with its `dequantize`, the reference of the tests.
//!
//! A [`Dequantizer`] only exists for a supported type and never fails: the reader has already
//! checked each tensor's byte length against its element count.

use half::{bf16, f16};

use crate::types::GgmlType;

/// The function that turns one supported type's bytes into f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dequantizer {
    ty: GgmlType,
}

impl Dequantizer {
    /// The dequantiser of `ty`, or `None` when it is not one of the supported types.
    pub fn for_type(ty: GgmlType) -> Option<Dequantizer> {
        [
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::BF16,
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
        ]
        .contains(&ty)
        .then_some(Dequantizer { ty })
    }

    /// Decodes `bytes` into `out`. The caller passes a tensor's whole data: `out.len()` values
    /// and the bytes that hold them (a whole number of blocks); a shorter side leaves the rest
    /// of the other untouched.
    pub fn run(self, bytes: &[u8], out: &mut [f32]) {
        match self.ty {
            GgmlType::F32 => {
                for (x, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            GgmlType::F16 => {
                for (x, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *x = f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            GgmlType::BF16 => {
                for (x, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *x = bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            GgmlType::Q8_0 => blocks(bytes, out, 34, q8_0),
            GgmlType::Q4_0 => blocks(bytes, out, 18, q4_0),
            GgmlType::Q4_1 => blocks(bytes, out, 20, q4_1),
            // `for_type` makes no other.
            _ => {}
        }
    }
}

impl Dequantizer {
    /// Decodes a tensor's `n` values to little-endian f32 bytes (safetensors' layout), a chunk
    /// of blocks at a time, so that no whole f32 copy exists beside the bytes.
    pub fn run_to_le_bytes(self, bytes: &[u8], n: usize) -> Vec<u8> {
        // Every supported type has a block layout; (1, 4) only keeps this total.
        let (block, block_bytes) = self.ty.block().unwrap_or((1, 4));
        let (block, block_bytes) = (block as usize, block_bytes as usize);
        const CHUNK_BLOCKS: usize = 4096;
        let mut values = vec![0f32; CHUNK_BLOCKS * block];
        let mut out = Vec::with_capacity(n * 4);
        for chunk in bytes.chunks(CHUNK_BLOCKS * block_bytes) {
            let m = (chunk.len() / block_bytes * block).min(n - out.len() / 4);
            self.run(chunk, &mut values[..m]);
            for v in &values[..m] {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        out
    }
}

/// The 32-value blocks of `bytes`, each `size` bytes, decoded by `block` into `out`.
fn blocks(bytes: &[u8], out: &mut [f32], size: usize, block: fn(&[u8], &mut [f32])) {
    for (b, x) in bytes.chunks_exact(size).zip(out.chunks_exact_mut(32)) {
        block(b, x);
    }
}

fn half_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

fn q8_0(b: &[u8], x: &mut [f32]) {
    let d = half_at(b, 0);
    for (x, &q) in x.iter_mut().zip(&b[2..34]) {
        *x = f32::from(q as i8) * d;
    }
}

fn q4_0(b: &[u8], x: &mut [f32]) {
    let d = half_at(b, 0);
    let (lo, hi) = x.split_at_mut(16);
    for (j, &q) in b[2..18].iter().enumerate() {
        lo[j] = (f32::from(q & 0x0f) - 8.0) * d;
        hi[j] = (f32::from(q >> 4) - 8.0) * d;
    }
}

fn q4_1(b: &[u8], x: &mut [f32]) {
    let (d, m) = (half_at(b, 0), half_at(b, 2));
    let (lo, hi) = x.split_at_mut(16);
    for (j, &q) in b[4..20].iter().enumerate() {
        lo[j] = f32::from(q & 0x0f) * d + m;
        hi[j] = f32::from(q >> 4) * d + m;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(ty: GgmlType, bytes: &[u8], n: usize) -> Vec<f32> {
        let mut out = vec![f32::NAN; n];
        Dequantizer::for_type(ty).unwrap().run(bytes, &mut out);
        out
    }

    fn half(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_le_bytes()
    }

    #[test]
    fn plain_floats() {
        let v = [1.5f32, -2.25, 0.0, 65504.0];
        let f32_bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(run(GgmlType::F32, &f32_bytes, 4), v);
        let f16_bytes: Vec<u8> = v.iter().flat_map(|&x| half(x)).collect();
        assert_eq!(run(GgmlType::F16, &f16_bytes, 4), v);
        // bf16 is f32's top half: 1.5 = 0x3fc0, -2.25 = 0xc010.
        let bf16_bytes = [0xc0, 0x3f, 0x10, 0xc0, 0, 0, 0x80, 0x47];
        assert_eq!(
            run(GgmlType::BF16, &bf16_bytes, 4),
            [1.5, -2.25, 0.0, 65536.0]
        );
    }

    #[test]
    fn q8_0_block() {
        let mut b = half(0.5).to_vec();
        b.extend((0..32).map(|j| (j as i8 - 16) as u8));
        let x = run(GgmlType::Q8_0, &b, 32);
        let want: Vec<f32> = (0..32).map(|j| (j - 16) as f32 * 0.5).collect();
        assert_eq!(x, want);
    }

    #[test]
    fn q4_0_block_low_nibbles_first() {
        let mut b = half(2.0).to_vec();
        // Byte j holds value j (low nibble) and value 15 - j (high nibble).
        b.extend((0..16u8).map(|j| j | (15 - j) << 4));
        let x = run(GgmlType::Q4_0, &b, 32);
        for j in 0..16 {
            assert_eq!(x[j], (j as f32 - 8.0) * 2.0, "value {j}");
            assert_eq!(x[j + 16], (15.0 - j as f32 - 8.0) * 2.0, "value {}", j + 16);
        }
    }

    #[test]
    fn q4_1_block_scale_and_min() {
        let mut b = half(0.25).to_vec();
        b.extend(half(-1.0));
        b.extend((0..16u8).map(|j| j | (15 - j) << 4));
        let x = run(GgmlType::Q4_1, &b, 32);
        for j in 0..16 {
            assert_eq!(x[j], j as f32 * 0.25 - 1.0);
            assert_eq!(x[j + 16], (15 - j) as f32 * 0.25 - 1.0);
        }
    }

    #[test]
    fn several_blocks_in_order() {
        let mut b = Vec::new();
        for d in [1.0f32, -3.0] {
            b.extend(half(d));
            b.extend([1u8; 32]);
        }
        let x = run(GgmlType::Q8_0, &b, 64);
        assert!(x[..32].iter().all(|&v| v == 1.0) && x[32..].iter().all(|&v| v == -3.0));
    }

    #[test]
    fn chunked_bytes_equal_whole_values() {
        // More than one chunk of Q4_1 blocks, with varied scales and nibbles.
        let n_blocks = 4096 * 2 + 7;
        let mut b = Vec::new();
        for i in 0..n_blocks {
            b.extend(half(0.01 * (i % 13) as f32));
            b.extend(half(-0.5 + (i % 5) as f32));
            b.extend((0..16).map(|j| (i * 31 + j * 7) as u8));
        }
        let k = Dequantizer::for_type(GgmlType::Q4_1).unwrap();
        let values = run(GgmlType::Q4_1, &b, n_blocks * 32);
        let want: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(k.run_to_le_bytes(&b, n_blocks * 32), want);
        let f32_bytes: Vec<u8> = (0..100).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let f32s = Dequantizer::for_type(GgmlType::F32).unwrap();
        assert_eq!(f32s.run_to_le_bytes(&f32_bytes, 100), f32_bytes);
    }

    #[test]
    fn other_types_have_no_dequantizer() {
        for ty in [GgmlType(6), GgmlType(12), GgmlType(14), GgmlType(999)] {
            assert!(Dequantizer::for_type(ty).is_none(), "{ty}");
        }
    }
}
