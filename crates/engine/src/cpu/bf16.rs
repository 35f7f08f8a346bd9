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

/// The bf16 bits the bf16 products' packs make of `x` (VCVTNEPS2BF16): [`bf16_bits`], but a
/// subnormal `x` becomes a zero of its sign, as the instruction treats it. A kernel that writes
/// an activation in bf16 for those products to read rounds with this, so that they read the
/// very bits they would have packed from the f32 value.
#[inline(always)]
pub(crate) fn bf16_bits_as_packed(x: f32) -> u16 {
    let u = x.to_bits();
    if u & 0x7f80_0000 == 0 {
        (u >> 16) as u16 & 0x8000
    } else {
        bf16_bits(x)
    }
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
    fn the_packs_rounding_zeroes_subnormals_and_keeps_the_rest() {
        let tiny = f32::from_bits(0x007f_ffff); // the largest subnormal: rounds up to a normal
        assert_eq!(bf16_bits(tiny), 0x0080);
        assert_eq!(bf16_bits_as_packed(tiny), 0x0000);
        assert_eq!(bf16_bits_as_packed(-tiny), 0x8000);
        assert_eq!(bf16_bits_as_packed(-0.0), 0x8000);
        for x in [
            1.0f32,
            -3.3e-38,
            f32::MIN_POSITIVE,
            65504.0,
            f32::INFINITY,
            f32::MAX,
        ] {
            assert_eq!(bf16_bits_as_packed(x), bf16_bits(x), "{x}");
        }
        assert!(bf16_to_f32(bf16_bits_as_packed(f32::NAN)).is_nan());
    }

    /// VCVTNEPS2BF16 on 16 floats, where the CPU has it.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn packs_instruction(x: &[f32; 16]) -> [u16; 16] {
        use std::arch::x86_64::*;
        // SAFETY: x is 16 floats; __m256bh and [u16; 16] are both 256 bits.
        unsafe {
            std::mem::transmute::<__m256bh, [u16; 16]>(_mm512_cvtneps_pbh(_mm512_loadu_ps(
                x.as_ptr(),
            )))
        }
    }

    /// The claim of [`bf16_bits_as_packed`], held to the instruction itself.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_packs_rounding_is_the_instructions() {
        if !std::arch::is_x86_feature_detected!("avx512bf16") {
            eprintln!("skipped: this CPU lacks AVX512_BF16");
            return;
        }
        let x: [f32; 16] = [
            f32::from_bits(0x007f_ffff),
            -f32::from_bits(0x0000_0001),
            f32::from_bits(0x0040_8000),
            f32::MIN_POSITIVE,
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            -2.5e-38,
            3.4e38,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -0.0,
            0.0,
            1e-3,
            -7.25,
            f32::MAX,
        ];
        // SAFETY: the CPU has AVX512_BF16 (checked above), and so AVX-512F.
        let hw = unsafe { packs_instruction(&x) };
        for (v, h) in x.iter().zip(hw) {
            assert_eq!(bf16_bits_as_packed(*v), h, "{v:e}");
        }
    }

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
