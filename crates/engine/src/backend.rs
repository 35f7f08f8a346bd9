//! The device boundary: every kernel the model calls, as one trait. The model holds a
//! `Box<dyn Backend>` and never names a device; [`Cpu`](crate::cpu::Cpu) is the only
//! implementation today.
//!
//! Each kernel is declared once, in the [`kernels!`] list below: its doc, its arguments and the
//! CPU function that runs it. The list generates both the [`Backend`] trait and the CPU
//! backend's implementation, so a kernel is added in one place (plus its CPU body).
//!
//! Precision and device are part of a backend's type: [`Backend::device`] says where its
//! buffers live and [`Backend::dtype`] what its matrix products compute in. Buffers stay `f32`
//! slices in both precisions: with [`DType::Bf16`] the products round their operands to bf16
//! and sum in f32 over the same f32 master weights, as PyTorch's CPU autocast does, so the
//! model does not change. Kernels whose result depends on the precision are marked `@dtype`
//! in the list below and receive the backend's dtype first.
//! A GPU backend adds a [`Device`] variant; its buffers live in device memory, so the kernel
//! arguments then become a buffer type of the engine instead of host slices (one edit of the
//! list below, since every kernel is declared there once).
//!
//! Conventions (llm.c's): outputs first, then inputs, then weights, then dims. Backward
//! kernels accumulate (`+=`) into parameter gradients; where a backward overwrites an
//! activation gradient instead, its doc says so.

use crate::cpu::{self, AttnDims, Cpu, DecodeDims, DecodeMatrix, RopeDims};
use crate::Dropout;

/// Where a backend's buffers live and its kernels run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Device {
    /// Host memory and the host's cores.
    Cpu,
}

/// The number format a backend's kernels compute in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// IEEE single precision throughout.
    F32,
    /// Matrix products on bf16-rounded operands with f32 sums (bf16 autocast); everything
    /// else, and every stored buffer, f32.
    Bf16,
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<DType, String> {
        match s {
            "fp32" | "f32" | "float32" => Ok(DType::F32),
            "bf16" | "bfloat16" => Ok(DType::Bf16),
            _ => Err(format!("unknown precision {s:?} (expected fp32 or bf16)")),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Device::Cpu => "cpu",
        })
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::F32 => "fp32",
            DType::Bf16 => "bf16",
        })
    }
}

/// Generates the [`Backend`] trait and the CPU backend's implementation from one list of
/// kernels: `doc; fn name(args) => cpu function;`. The CPU function takes the same arguments
/// in the same order (a closure adapts the one that takes more); after `=> @dtype` it takes the
/// backend's [`DType`] first.
macro_rules! kernels {
    ($( $(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) => $(@$dtype:ident)? $cpu:expr; )*) => {
        /// The kernels of a GPT-2 training step, on one device in one precision.
        #[allow(clippy::too_many_arguments)]
        pub trait Backend: Send + Sync + std::fmt::Debug {
            /// Short name for logs ("cpu").
            fn name(&self) -> &'static str;
            /// Where the buffers the kernels take live.
            fn device(&self) -> Device;
            /// What the kernels compute in.
            fn dtype(&self) -> DType;
            /// Intra-op threads.
            fn num_threads(&self) -> usize;
            /// Runs `f` with the backend's threads ready for the kernels it calls (one pool
            /// entry per forward or backward instead of one per kernel).
            fn install(&self, f: &mut (dyn FnMut() + Send));
            /// Scratch floats the attention kernels need for sequence length `t`.
            fn attention_scratch_len(&self, t: usize) -> usize;
            $( $(#[$doc])* fn $name(&self, $($arg: $ty),*); )*
        }

        #[allow(clippy::too_many_arguments)]
        impl Backend for Cpu {
            fn name(&self) -> &'static str {
                "cpu"
            }
            fn device(&self) -> Device {
                Device::Cpu
            }
            fn dtype(&self) -> DType {
                Cpu::dtype(self)
            }
            fn num_threads(&self) -> usize {
                Cpu::num_threads(self)
            }
            fn install(&self, f: &mut (dyn FnMut() + Send)) {
                Cpu::install(self, f)
            }
            fn attention_scratch_len(&self, t: usize) -> usize {
                cpu::attention_scratch_len(t, self.num_threads())
            }
            $( #[inline] fn $name(&self, $($arg: $ty),*) {
                ($cpu)($(Cpu::$dtype(self),)? $($arg),*)
            } )*
        }
    };
}

kernels! {
    /// out (B,T,C) = wte[ids] + wpe[t].
    fn encoder_forward(out: &mut [f32], ids: &[u32], wte: &[f32], wpe: &[f32], b: usize, t: usize, c: usize) => cpu::encoder_forward;
    /// dwte[ids] += dout, dwpe[t] += dout.
    fn encoder_backward(dwte: &mut [f32], dwpe: &mut [f32], dout: &[f32], ids: &[u32], b: usize, t: usize, c: usize) => cpu::encoder_backward;
    /// out (N,C) = wte[ids]: the token embedding alone (models with rotary positions).
    fn embedding_forward(out: &mut [f32], ids: &[u32], wte: &[f32], n: usize, c: usize) => cpu::embedding_forward;
    /// dwte[ids] += dout.
    fn embedding_backward(dwte: &mut [f32], dout: &[f32], ids: &[u32], n: usize, c: usize) => cpu::embedding_backward;
    /// RMSNorm over C (out = inp · rstd · w); writes rstd (N) for backward.
    fn rmsnorm_forward(out: &mut [f32], rstd: &mut [f32], inp: &[f32], w: &[f32], eps: f32, n: usize, c: usize) => cpu::rmsnorm_forward;
    /// dinp, dw += RMSNorm backward.
    fn rmsnorm_backward(dinp: &mut [f32], dw: &mut [f32], dout: &[f32], inp: &[f32], rstd: &[f32], w: &[f32], n: usize, c: usize) => cpu::rmsnorm_backward;
    /// Rotary embedding in place (rotate_half convention): each row's first `dims.heads` heads turned by the angles of position `pos[row]` (tables positions × HS/2).
    fn rope_forward(x: &mut [f32], pos: &[u32], cos: &[f32], sin: &[f32], dims: RopeDims) => cpu::rope_forward;
    /// Backward of `rope_forward`, in place (the opposite angles).
    fn rope_backward(dx: &mut [f32], pos: &[u32], cos: &[f32], sin: &[f32], dims: RopeDims) => cpu::rope_backward;
    /// out (N, F) = silu(inp[:, :F]) · inp[:, F:], inp (N, 2F) (gate | up).
    fn swiglu_forward(out: &mut [f32], inp: &[f32], n: usize, f: usize) => cpu::swiglu_forward;
    /// out (N, F) = silu(inp[:, :F]) · inp[:, F:] of a product kept interleaved (tiles of 16 gate then 16 up columns, see `matmul_swiglu_forward`).
    fn swiglu_interleaved_forward(out: &mut [f32], inp: &[f32], n: usize, f: usize) => cpu::swiglu_interleaved_forward;
    /// LayerNorm over C; writes mean and rstd (N) for backward.
    fn layernorm_forward(out: &mut [f32], mean: &mut [f32], rstd: &mut [f32], inp: &[f32], w: &[f32], b: Option<&[f32]>, n: usize, c: usize) => cpu::layernorm_forward;
    /// dinp, dw, db += LayerNorm backward.
    fn layernorm_backward(dinp: &mut [f32], dw: &mut [f32], db: Option<&mut [f32]>, dout: &[f32], inp: &[f32], mean: &[f32], rstd: &[f32], w: &[f32], n: usize, c: usize) => cpu::layernorm_backward;
    /// out (N,OC) = inp (N,C) · w (C,OC) + bias.
    fn matmul_forward(out: &mut [f32], inp: &[f32], w: &[f32], bias: Option<&[f32]>, n: usize, c: usize, oc: usize) => @dtype cpu::matmul_forward;
    /// dinp = dout · wᵀ (overwritten), dw += inpᵀ · dout, dbias += Σ_rows dout.
    fn matmul_backward(dinp: Option<&mut [f32]>, dw: &mut [f32], dbias: Option<&mut [f32]>, dout: &[f32], inp: &[f32], w: &[f32], n: usize, c: usize, oc: usize) => @dtype cpu::matmul_backward;
    /// dinp = dout · wᵀ (overwritten) alone, for a dinp buffer that still holds the input.
    fn matmul_backward_input(dinp: &mut [f32], dout: &[f32], w: &[f32], n: usize, c: usize, oc: usize) => @dtype cpu::matmul_backward_input;
    /// out (N,OC) = inp (N,C) · wᵀ + bias for weights kept in a decode format (bf16 or 8-bit blocks, see `DecodeMatrix`): a decode step's product of a few rows.
    fn decode_matmul_forward(out: &mut [f32], inp: &[f32], w: &DecodeMatrix, bias: Option<&[f32]>, n: usize) => cpu::decode_matmul_forward;
    /// logits (N,V) = inp (N,C) · wᵀ, w (V,C).
    fn head_forward(out: &mut [f32], inp: &[f32], w: &[f32], n: usize, c: usize, v: usize) => @dtype cpu::head_forward;
    /// dinp = dout · w (overwritten), dw += doutᵀ · inp.
    fn head_backward(dinp: &mut [f32], dw: &mut [f32], dout: &[f32], inp: &[f32], w: &[f32], n: usize, c: usize, v: usize) => @dtype cpu::head_backward;
    /// `pre (N, OC) = inp · w + bias`, `out = gelu(pre)` in one pass (same bits as `matmul_forward` then `gelu_forward`).
    fn matmul_gelu_forward(pre: &mut [f32], out: &mut [f32], inp: &[f32], w: &[f32], bias: Option<&[f32]>, n: usize, c: usize, oc: usize) => @dtype cpu::matmul_gelu_forward;
    /// `matmul_gelu_forward` with `out` kept in bf16 (its bits) and `grad` = gelu'(pre-activation) instead of the pre-activation. Only on a backend of `DType::Bf16`.
    fn matmul_gelu_forward_bf16(grad: &mut [f32], out: &mut [u16], inp: &[f32], w: &[f32], bias: Option<&[f32]>, n: usize, c: usize, oc: usize) => @dtype cpu::matmul_gelu_forward_bf16;
    /// `pre (N, 2F) = inp · w + bias` (w's columns gate then up), `out (N, F) = silu(gate) · up` in one pass; `pre` is left interleaved (tiles of 16 gate then 16 up columns), each value the bits of `matmul_forward` then `swiglu_forward`.
    fn matmul_swiglu_forward(pre: &mut [f32], out: &mut [f32], inp: &[f32], w: &[f32], bias: Option<&[f32]>, n: usize, c: usize, f: usize) => @dtype cpu::matmul_swiglu_forward;
    /// `matmul_swiglu_forward` with `out` kept in bf16 (its bits) and `grad` (interleaved) = (silu(gate), up · silu'(gate)) instead of the pre-activation. Only on a backend of `DType::Bf16`.
    fn matmul_swiglu_forward_bf16(grad: &mut [f32], out: &mut [u16], inp: &[f32], w: &[f32], bias: Option<&[f32]>, n: usize, c: usize, f: usize) => @dtype cpu::matmul_swiglu_forward_bf16;
    /// dinp (N, 2F), gate then up, = SwiGLU backward at the interleaved `pre` of d(output) = dout (N, C) · wᵀ (w (F, C)), which `dact` (N, F) receives on the way: `matmul_backward_input` and `swiglu_interleaved_backward` in one pass (the same bits).
    fn matmul_backward_input_swiglu(dinp: &mut [f32], dact: &mut [f32], dout: &[f32], w: &[f32], pre: &[f32], n: usize, f: usize, c: usize) => @dtype cpu::matmul_backward_input_swiglu;
    /// `matmul_backward_input_swiglu` from the derivatives `matmul_swiglu_forward_bf16` kept in `grad` (`swiglu_backward_with_grad` fused, the same bits).
    fn matmul_backward_input_swiglu_with_grad(dinp: &mut [f32], dact: &mut [f32], dout: &[f32], w: &[f32], grad: &[f32], n: usize, f: usize, c: usize) => @dtype cpu::matmul_backward_input_swiglu_with_grad;
    /// `matmul_forward` of an input kept in bf16 (its bits). Only on a backend of `DType::Bf16`.
    fn matmul_forward_bf16_input(out: &mut [f32], inp: &[u16], w: &[f32], bias: Option<&[f32]>, n: usize, c: usize, oc: usize) => @dtype cpu::matmul_forward_bf16_input;
    /// dw += inpᵀ · dout, dbias += column sums of dout, for an input kept in bf16. Only on a backend of `DType::Bf16`.
    fn matmul_backward_weight_bf16_input(dw: &mut [f32], dbias: Option<&mut [f32]>, dout: &[f32], inp: &[u16], n: usize, c: usize, oc: usize) => @dtype cpu::matmul_backward_weight_bf16_input;
    /// out = gelu(inp) (tanh form).
    fn gelu_forward(out: &mut [f32], inp: &[f32]) => cpu::gelu_forward;
    /// dinout *= gelu'(inp).
    fn gelu_backward(dinout: &mut [f32], inp: &[f32]) => cpu::gelu_backward;
    /// dinout *= grad, where the forward kept GELU's derivative `grad` (see matmul_gelu_forward_bf16).
    fn gelu_backward_with_grad(dinout: &mut [f32], grad: &[f32]) => cpu::gelu_backward_with_grad;
    /// out = residual + dropout(out + bias), rows of c.
    fn residual_forward(out: &mut [f32], residual: &[f32], bias: Option<&[f32]>, c: usize, dropout: Option<Dropout>) => cpu::residual_forward;
    /// x = dropout(x).
    fn dropout_forward(x: &mut [f32], d: Dropout) => |x, d| cpu::dropout_forward(x, d, 0);
    /// dx = dropout mask applied to dy (overwritten).
    fn dropout_backward(dx: &mut [f32], dy: &[f32], d: Dropout) => |dx, dy, d| cpu::dropout_backward(dx, dy, d, 0);
    /// acc += Σ_rows x.
    fn column_sums(acc: &mut [f32], x: &[f32]) => cpu::column_sums;
    /// Causal attention with key padding mask, within each row's segments (runs of equal ids) when given; lse (B,NH,T) kept for backward.
    fn attention_forward(out: &mut [f32], lse: &mut [f32], qkv: &[f32], mask: Option<&[u8]>, segments: Option<&[u32]>, dims: AttnDims, dropout: Option<Dropout>, scratch: &mut [f32]) => @dtype cpu::attention_forward;
    /// dqkv = attention backward (overwritten); optionally recomputes the forward output.
    fn attention_backward(dqkv: &mut [f32], recompute_out: Option<&mut [f32]>, dout: &[f32], qkv: &[f32], lse: &[f32], mask: Option<&[u8]>, segments: Option<&[u32]>, dims: AttnDims, dropout: Option<Dropout>, scratch: &mut [f32]) => @dtype cpu::attention_backward;
    /// `attention_forward` of grouped rows (N, (NH+2·NKV)·HS) as the qkv product writes them: query head h attends with key/value head h / (NH/NKV); `nkv` = NH is `attention_forward`.
    fn attention_forward_grouped(out: &mut [f32], lse: &mut [f32], qkv: &[f32], mask: Option<&[u8]>, segments: Option<&[u32]>, dims: AttnDims, nkv: usize, dropout: Option<Dropout>, scratch: &mut [f32]) => @dtype cpu::attention_forward_grouped;
    /// Backward of `attention_forward_grouped`: dqkv (N, (NH+2·NKV)·HS) overwritten, each key/value head's gradient summed over its query group in the group's order.
    fn attention_backward_grouped(dqkv: &mut [f32], recompute_out: Option<&mut [f32]>, dout: &[f32], qkv: &[f32], lse: &[f32], mask: Option<&[u8]>, segments: Option<&[u32]>, dims: AttnDims, nkv: usize, dropout: Option<Dropout>, scratch: &mut [f32]) => @dtype cpu::attention_backward_grouped;
    /// One query row (C) over `ctx` cached key and value rows (stride c): a decode step's
    /// attention for one sequence; `scores` holds `nh·ctx` floats.
    fn attention_decode_row(out: &mut [f32], scores: &mut [f32], q: &[f32], k: &[f32], v: &[f32], dims: DecodeDims) => cpu::attention_decode_row;
    /// `attention_decode_row` over a cache kept in bf16 (`k` and `v` are bf16 bits), in the
    /// same order on their f32 values.
    fn attention_decode_row_bf16(out: &mut [f32], scores: &mut [f32], q: &[f32], k: &[u16], v: &[u16], dims: DecodeDims) => cpu::attention_decode_row_bf16;
    /// Per-row loss (0 for ignored targets) and log-sum-exp.
    fn crossentropy_forward(losses: &mut [f32], lse: &mut [f32], logits: &[f32], targets: &[i32], n: usize, v: usize) => cpu::crossentropy_forward;
    /// One block of vocabulary columns v0..v0+v: lse (start at -inf) takes in the block's
    /// log-sum-exp; target_logit gets the target's logit where it is in the block.
    fn crossentropy_forward_block(lse: &mut [f32], target_logit: &mut [f32], logits: &[f32], targets: &[i32], n: usize, v: usize, v0: usize) => cpu::crossentropy_forward_block;
    /// dlogits = scale * (softmax - onehot) for vocabulary columns v0..v0+v (overwritten; zero
    /// rows for ignored targets).
    fn crossentropy_backward(dlogits: &mut [f32], logits: &[f32], lse: &[f32], targets: &[i32], scale: f32, n: usize, v: usize, v0: usize) => cpu::crossentropy_backward;
}
