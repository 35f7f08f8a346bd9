//! bf16 numbers stored as their bits (`u16`): rounding f32 to bf16 and widening back. One
//! definition of the rounding for every kernel that keeps or packs bf16 (the bf16 matrix
//! product, its activations kept in bf16, a bf16 KV cache).

/// The bf16 bits of `x`, rounded to nearest even (what VCVTNE2PS2BF16 and PyTorch's
/// `.to(torch.bfloat16)` do); a NaN stays a (quiet) NaN.
#[inline(always)]
pub(crate) fn bf16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    if x.is_nan() {
        return ((u >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((u >> 16) & 1);
    (u.wrapping_add(round) >> 16) as u16
}

/// The f32 value of bf16 bits `b` (exact: the bits shifted into the top half).
#[inline(always)]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// `out[i]` = `x[i]` rounded to bf16, to nearest even, as bits. Only the first
/// `min(out.len(), x.len())` elements are written.
pub fn round_to_bf16(out: &mut [u16], x: &[f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = bf16_bits(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_is_to_nearest_even() {
        assert_eq!(bf16_bits(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between two bf16 values: ties go to the even one (1.0).
        assert_eq!(bf16_bits(1.0 + 1.0 / 256.0), 0x3f80);
        // 1 + 3·2^-8 is halfway too: the even neighbour is 1 + 2^-6.
        assert_eq!(bf16_bits(1.0 + 3.0 / 256.0), 0x3f82);
        assert!(bf16_to_f32(bf16_bits(f32::NAN)).is_nan());
        let mut out = [0u16; 3];
        round_to_bf16(&mut out, &[1.0, -2.5, 1.0 + 3.0 / 256.0]);
        assert_eq!(out, [0x3f80, 0xc020, 0x3f82]);
        assert_eq!(bf16_to_f32(0xc020), -2.5);
    }
}
