//! Attention over a qkv buffer kept in bf16 (its bits). Under bf16 products the attention
//! kernels are the qkv product's only readers, and they round Q, K and V to bf16 as they pack
//! them: written in bf16 by the product (`matmul_forward_bf16_out`), the buffer holds the
//! very bits they would read, at half the bytes, and the fused heads (`attention_fused`)
//! pack them without converting (Q, already its pairs, read in place on zmm).
//!
//! It must never give other results than the f32 buffer these bits round from. Where heads
//! are not fused (`COHORT_FUSED_ATTENTION=0`, or a CPU without a bf16 kernel) the buffer is
//! widened to f32 (exact) into a buffer kept per thread and the general path runs on it:
//! that path rounds it back to the same bits.

use super::{backward_with, forward_with, fused_heads, AttnDims};
use crate::cpu::bf16::bf16_to_f32;
use crate::{DType, Dropout};

/// A qkv buffer as the kernels read it: f32, or bf16 bits.
#[derive(Clone, Copy)]
pub(in crate::cpu) enum Qkv<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl Qkv<'_> {
    pub(in crate::cpu) fn len(self) -> usize {
        match self {
            Qkv::F32(x) => x.len(),
            Qkv::Bf16(x) => x.len(),
        }
    }
}

/// The f32 buffer the general (unfused) heads read: a bf16 one reaches only fused heads
/// ([`with_qkv`] widens it otherwise), so it gives them nothing.
pub(super) fn general(qkv: Qkv<'_>) -> &'_ [f32] {
    match qkv {
        Qkv::F32(x) => x,
        Qkv::Bf16(_) => &[],
    }
}

/// [`attention_forward_grouped`](super::attention_forward_grouped) of a qkv buffer kept in
/// bf16 (its bits): the bits of the f32 buffer they round from (as the bf16 products' packs
/// round), in the same precision. For a backend of `DType::Bf16`.
pub fn attention_forward_bf16_qkv(
    dtype: DType,
    out: &mut [f32],
    lse: &mut [f32],
    qkv: &[u16],
    mask: Option<&[u8]>,
    segments: Option<&[u32]>,
    dims: AttnDims,
    nkv: usize,
    dropout: Option<Dropout>,
    scratch: &mut [f32],
) {
    let fused_ok = fused_heads();
    with_qkv(fused_ok, dtype, qkv, |qkv| {
        let d = (dims, nkv);
        forward_with(
            fused_ok, dtype, out, lse, qkv, mask, segments, d, dropout, scratch,
        )
    })
}

/// [`attention_backward_grouped`](super::attention_backward_grouped) of a qkv buffer kept in
/// bf16, as [`attention_forward_bf16_qkv`].
pub fn attention_backward_bf16_qkv(
    dtype: DType,
    dqkv: &mut [f32],
    recompute_out: Option<&mut [f32]>,
    dout: &[f32],
    qkv: &[u16],
    lse: &[f32],
    mask: Option<&[u8]>,
    segments: Option<&[u32]>,
    dims: AttnDims,
    nkv: usize,
    dropout: Option<Dropout>,
    scratch: &mut [f32],
) {
    let fused_ok = fused_heads();
    with_qkv(fused_ok, dtype, qkv, |qkv| {
        backward_with(
            fused_ok,
            dtype,
            dqkv,
            recompute_out,
            dout,
            qkv,
            lse,
            mask,
            segments,
            (dims, nkv),
            dropout,
            scratch,
        )
    })
}

/// Runs `f` on `qkv` as the heads will read it: the bf16 bits where heads are fused (the
/// decision `forward_with` and `backward_with` make), else widened to f32.
pub(super) fn with_qkv<R>(
    fused_ok: bool,
    dtype: DType,
    qkv: &[u16],
    f: impl FnOnce(Qkv) -> R,
) -> R {
    #[cfg(target_arch = "x86_64")]
    let fused = super::fused_for(dtype, fused_ok).is_some();
    #[cfg(not(target_arch = "x86_64"))]
    let fused = {
        let _ = (fused_ok, dtype);
        false
    };
    if fused {
        return f(Qkv::Bf16(qkv));
    }
    thread_local! {
        static WIDE: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
    }
    // Taken out of the thread's slot while in use, so that nothing is borrowed across the
    // heads' parallel loop; kept for the next call (no allocation after the largest).
    let mut wide = WIDE.take();
    wide.clear();
    wide.extend(qkv.iter().map(|&b| bf16_to_f32(b)));
    let r = f(Qkv::F32(&wide));
    WIDE.set(wide);
    r
}
