//! The device boundary: every kernel the model calls, as one trait. The model holds a
//! `Box<dyn Backend>` and never names a device. [`Cpu`](crate::cpu::Cpu) implements it, and so
//! do [`Emulated`] (a test device in host memory) and, outside the engine, `cohort-cuda`'s
//! `CudaBackend`.
//!
//! Each kernel is declared once, in the [`kernels!`] list below: its doc, its arguments and the
//! CPU function that runs it. The list generates the [`Backend`] trait, [`KERNELS`] and the CPU
//! and emulated backends' implementations, so a kernel is added in one place (plus its CPU
//! body; a device backend then implements it or lists it in
//! [`Backend::missing_kernels`]).
//!
//! Precision and device are part of a backend's type: [`Backend::device`] says where its
//! buffers live and [`Backend::dtype`] what its matrix products compute in. Buffers stay `f32`
//! in both precisions: with [`DType::Bf16`] the products round their operands to bf16 and sum
//! in f32 over the same f32 master weights, as PyTorch's CPU autocast does, so the model does
//! not change. Kernels whose result depends on the precision are marked `@dtype` in the list
//! below and receive the backend's dtype first.
//!
//! Kernels take [`View`]s and [`ViewMut`]s of [`Buffer`]s the backend allocated
//! ([`Backend::alloc`]), never host slices (the two decode-row kernels excepted: a decode's KV
//! caches are host memory). The CPU backend turns each view into the slice it is (a check of
//! its device tag, O(1) per call); a device backend passes the views' addresses to its kernels.
//! Kernels may run asynchronously on a device: [`Backend::sync`] waits for them and reports
//! the first error, and the few kernels that return a value to the host wait by themselves.
//! A device backend implements the trait by hand (the list's CPU bodies are the CPU's own);
//! it lives in its own crate, which may depend on the engine but never the reverse.
//!
//! Conventions (llm.c's): outputs first, then inputs, then weights, then dims. Backward
//! kernels accumulate (`+=`) into parameter gradients; where a backward overwrites an
//! activation gradient instead, its doc says so. The products that write a weight matrix's
//! gradient take a last `accumulate` flag: false overwrites it (the first backward after a
//! lazy `zero_grad`, which leaves those gradients unwritten), with the bits adding into
//! +0.0 would give; bias, norm and embedding gradients always accumulate.

use crate::cpu::{self, AttnDims, Cpu, DecodeDims, DecodeMatrix, RopeDims};
use crate::optim::{self, AdamCoeffs};
use crate::{Buffer, Dropout, Elem, Emulated, EngineError, Event, Staging, View, ViewMut};

/// Where a backend's buffers live and its kernels run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Device {
    /// Host memory and the host's cores.
    Cpu,
    /// The CUDA device of this ordinal (as `cuda:N` counts them).
    Cuda(u32),
    /// A device emulated in host memory ([`Emulated`]): device code paths tested without one.
    Emulated,
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
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
            Device::Emulated => f.write_str("emulated"),
        }
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
/// kernels: `doc; fn name(args) [-> ret] => cpu function;`. The CPU function takes the same
/// arguments in the same order, each view as the host slice it is ([`HostArg`]); a closure
/// adapts one that takes more. After `=> @dtype` it takes the backend's [`DType`] first.
macro_rules! kernels {
    ($( $(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? => $(@$dtype:ident)? $cpu:expr; )*) => {
        /// The kernels of a training step (and a decode step), on one device in one precision,
        /// with the memory they work on.
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
            /// `len` zeroed f32s in this backend's memory (on the host 64-byte aligned).
            fn alloc(&self, len: usize) -> Result<Buffer, EngineError>;
            /// Copies host bytes into a view of this backend's memory (equal lengths).
            fn copy_from_host(&self, dst: ViewMut<'_, u8>, src: &[u8]) -> Result<(), EngineError>;
            /// Copies a view of this backend's memory to host bytes (equal lengths), after the
            /// kernels before it.
            fn copy_to_host(&self, dst: &mut [u8], src: View<'_, u8>) -> Result<(), EngineError>;
            /// Waits for every kernel launched so far; the first error any of them met.
            fn sync(&self) -> Result<(), EngineError>;
            /// A point in the queue of kernels, after every kernel launched so far: what
            /// [`Backend::copy_to_host_after`] waits for (a data-parallel step records one as
            /// backward hands a range of gradients over). Never fails: a device that cannot
            /// record one waits for its kernels instead and keeps the error for the next
            /// [`Backend::sync`]. A backend whose kernels are done when they return (the CPU,
            /// the emulated device) returns [`Event::done`].
            fn record_event(&self) -> Event {
                Event::done()
            }
            /// Copies `src` to host bytes `dst` (equal lengths) once the kernels before `after`
            /// (an event of this backend) have run, on a queue apart from the kernels' so that
            /// it overlaps the kernels launched since; returns when the bytes have landed
            /// (blocking the calling thread only: call it from a thread beside the one that
            /// launches). `src` must not be written by a kernel launched after `after`.
            fn copy_to_host_after(
                &self,
                dst: &mut [u8],
                src: View<'_, u8>,
                after: &Event,
            ) -> Result<(), EngineError> {
                let _ = after;
                self.copy_to_host(dst, src)
            }
            /// Copies host bytes `src` into `dst` (equal lengths) on a queue apart from the
            /// kernels' (so that it overlaps the kernels in flight) and returns when they have
            /// landed: how a host-staged collective hands a reduced bucket back while backward
            /// goes on. No kernel in flight or launched before it returns may read or write
            /// `dst`.
            fn copy_from_host_beside(
                &self,
                dst: ViewMut<'_, u8>,
                src: &[u8],
            ) -> Result<(), EngineError> {
                self.copy_from_host(dst, src)?;
                self.sync()
            }
            /// `len` zeroed host floats for this backend's copies: page-locked on a GPU, so
            /// that they run at the link's speed; ordinary host memory elsewhere. An upload
            /// from page-locked memory may still be queued when [`Backend::copy_from_host`]
            /// returns: [`Backend::sync`] before writing the floats again.
            fn alloc_staging(&self, len: usize) -> Result<Staging, EngineError> {
                Ok(Staging::host(len))
            }
            /// The kernels of [`KERNELS`] this backend has no body for yet: a model checks the
            /// ones it needs when it is built, so that a missing one is an error there (a
            /// call of one anyway is an error at the next [`Backend::sync`], never a panic).
            fn missing_kernels(&self) -> &'static [&'static str] {
                &[]
            }
            /// The native handle of the queue the kernels run on, in order (a `CUstream` for
            /// CUDA), so that a device collective library (NCCL) can queue its work in order
            /// with them; `None` where kernels run on the host.
            fn stream_handle(&self) -> Option<u64> {
                None
            }
            $( $(#[$doc])* fn $name(&self, $($arg: $ty),*) $(-> $ret)?; )*
        }

        /// The name of every kernel of [`Backend`], in the list's order.
        pub const KERNELS: &[&str] = &[$(stringify!($name)),*];

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
            fn alloc(&self, len: usize) -> Result<Buffer, EngineError> {
                Ok(Buffer::host(len))
            }
            fn copy_from_host(&self, dst: ViewMut<'_, u8>, src: &[u8]) -> Result<(), EngineError> {
                dst.host().copy_from_slice(src);
                Ok(())
            }
            fn copy_to_host(&self, dst: &mut [u8], src: View<'_, u8>) -> Result<(), EngineError> {
                dst.copy_from_slice(src.host());
                Ok(())
            }
            fn sync(&self) -> Result<(), EngineError> {
                Ok(())
            }
            $( #[inline] fn $name(&self, $($arg: $ty),*) $(-> $ret)? {
                ($cpu)($(Cpu::$dtype(self),)? $(HostArg::host($arg)),*)
            } )*
        }

        // The same CPU bodies on the emulated device's buffers (see `emulated.rs`).
        #[allow(clippy::too_many_arguments)]
        impl Backend for Emulated {
            fn name(&self) -> &'static str {
                "emulated"
            }
            fn device(&self) -> Device {
                Device::Emulated
            }
            fn dtype(&self) -> DType {
                self.cpu().dtype()
            }
            fn num_threads(&self) -> usize {
                self.cpu().num_threads()
            }
            fn install(&self, f: &mut (dyn FnMut() + Send)) {
                self.cpu().install(f)
            }
            fn attention_scratch_len(&self, t: usize) -> usize {
                cpu::attention_scratch_len(t, self.num_threads())
            }
            fn alloc(&self, len: usize) -> Result<Buffer, EngineError> {
                Ok(self.alloc_buffer(len))
            }
            fn copy_from_host(&self, dst: ViewMut<'_, u8>, src: &[u8]) -> Result<(), EngineError> {
                HostArg::emulated(dst, self).copy_from_slice(src);
                Ok(())
            }
            fn copy_to_host(&self, dst: &mut [u8], src: View<'_, u8>) -> Result<(), EngineError> {
                dst.copy_from_slice(HostArg::emulated(src, self));
                Ok(())
            }
            fn sync(&self) -> Result<(), EngineError> {
                Ok(())
            }
            fn missing_kernels(&self) -> &'static [&'static str] {
                self.missing()
            }
            $( fn $name(&self, $($arg: $ty),*) $(-> $ret)? {
                ($cpu)($(Cpu::$dtype(self.cpu()),)? $(HostArg::emulated($arg, self)),*)
            } )*
        }
    };
}

impl dyn Backend + '_ {
    /// Runs `f` on the backend's threads ([`Backend::install`]) and returns what it returns:
    /// a host pass the kernels do not make (an optimizer's step) splits over the same threads
    /// as the kernels.
    pub fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        let (mut f, mut out) = (Some(f), None);
        self.install(&mut || {
            if let Some(f) = f.take() {
                out = Some(f());
            }
        });
        out.expect("install runs its closure")
    }

    /// Copies `src` into `dst` (equal lengths), in the backend's memory.
    pub fn upload<T: Elem>(&self, dst: ViewMut<'_, T>, src: &[T]) -> Result<(), EngineError> {
        assert_eq!(
            dst.len(),
            src.len(),
            "upload: destination and source lengths"
        );
        self.copy_from_host(dst.cast(), View::from(src).cast().host())
    }

    /// Copies `src` from the backend's memory into `dst` (equal lengths).
    pub fn download<T: Elem>(&self, dst: &mut [T], src: View<'_, T>) -> Result<(), EngineError> {
        assert_eq!(
            dst.len(),
            src.len(),
            "download: destination and source lengths"
        );
        self.copy_to_host(ViewMut::from(dst).cast().host(), src.cast())
    }
}

/// A kernel argument as the CPU body takes it: a view as the host slice it is, anything else
/// as it is. O(1): a view's conversion checks its device tag (a device view never reaches the
/// CPU backend, whose model allocates every buffer it hands a kernel through it).
pub(crate) trait HostArg: Sized {
    type Host;
    fn host(self) -> Self::Host;
    /// The same for the emulated device, whose device views are host memory it checks.
    fn emulated(self, _dev: &Emulated) -> Self::Host {
        self.host()
    }
}

impl<'a, T: Elem> HostArg for View<'a, T> {
    type Host = &'a [T];
    #[inline(always)]
    fn host(self) -> &'a [T] {
        View::host(self)
    }
    fn emulated(self, dev: &Emulated) -> &'a [T] {
        if self.device() == Device::Cpu {
            return self.host();
        }
        dev.check(
            self.device(),
            self.addr(),
            self.len() * std::mem::size_of::<T>(),
        );
        // SAFETY: `check` found the view inside a live allocation of this emulated device
        // (host memory whose address was exposed), and the view borrows it as a `&[T]` would.
        unsafe { self.emulated_host() }
    }
}

impl<'a, T: Elem> HostArg for ViewMut<'a, T> {
    type Host = &'a mut [T];
    #[inline(always)]
    fn host(self) -> &'a mut [T] {
        ViewMut::host(self)
    }
    fn emulated(self, dev: &Emulated) -> &'a mut [T] {
        if self.device() == Device::Cpu {
            return self.host();
        }
        dev.check(
            self.device(),
            self.addr(),
            self.len() * std::mem::size_of::<T>(),
        );
        // SAFETY: as for `View`, and the view borrows its elements exclusively.
        unsafe { self.emulated_host() }
    }
}

impl<'a, T: Elem> HostArg for Option<View<'a, T>> {
    type Host = Option<&'a [T]>;
    #[inline(always)]
    fn host(self) -> Option<&'a [T]> {
        self.map(View::host)
    }
    fn emulated(self, dev: &Emulated) -> Option<&'a [T]> {
        self.map(|v| v.emulated(dev))
    }
}

impl<'a, T: Elem> HostArg for Option<ViewMut<'a, T>> {
    type Host = Option<&'a mut [T]>;
    #[inline(always)]
    fn host(self) -> Option<&'a mut [T]> {
        self.map(ViewMut::host)
    }
    fn emulated(self, dev: &Emulated) -> Option<&'a mut [T]> {
        self.map(|v| v.emulated(dev))
    }
}

/// Arguments that are the same on every device: references to host data, dims and scalars.
macro_rules! as_is {
    ($($t:ty),*) => { $(
        impl HostArg for $t {
            type Host = $t;
            #[inline(always)]
            fn host(self) -> $t {
                self
            }
        }
    )* };
}
as_is!(
    usize,
    bool,
    f32,
    Option<Dropout>,
    Dropout,
    AttnDims,
    RopeDims,
    DecodeDims,
    AdamCoeffs
);

impl<'a, T: ?Sized> HostArg for &'a T {
    type Host = &'a T;
    #[inline(always)]
    fn host(self) -> &'a T {
        self
    }
}

impl<'a, T: ?Sized> HostArg for &'a mut T {
    type Host = &'a mut T;
    #[inline(always)]
    fn host(self) -> &'a mut T {
        self
    }
}

kernels! {
    /// out (B,T,C) = wte[ids] + wpe[t].
    fn encoder_forward(out: ViewMut<f32>, ids: View<u32>, wte: View<f32>, wpe: View<f32>, b: usize, t: usize, c: usize) => cpu::encoder_forward;
    /// dwte[ids] += dout, dwpe[t] += dout.
    fn encoder_backward(dwte: ViewMut<f32>, dwpe: ViewMut<f32>, dout: View<f32>, ids: View<u32>, b: usize, t: usize, c: usize) => cpu::encoder_backward;
    /// out (N,C) = wte[ids]: the token embedding alone (models with rotary positions).
    fn embedding_forward(out: ViewMut<f32>, ids: View<u32>, wte: View<f32>, n: usize, c: usize) => cpu::embedding_forward;
    /// dwte[ids] += dout.
    fn embedding_backward(dwte: ViewMut<f32>, dout: View<f32>, ids: View<u32>, n: usize, c: usize) => cpu::embedding_backward;
    /// RMSNorm over C (out = inp · rstd · w); writes rstd (N) for backward.
    fn rmsnorm_forward(out: ViewMut<f32>, rstd: ViewMut<f32>, inp: View<f32>, w: View<f32>, eps: f32, n: usize, c: usize) => cpu::rmsnorm_forward;
    /// `rmsnorm_forward` with `out` in bf16 (the bits of its f32 values rounded to nearest even): the input of bf16 products only. For a backend of `DType::Bf16`.
    fn rmsnorm_forward_bf16(out: ViewMut<u16>, rstd: ViewMut<f32>, inp: View<f32>, w: View<f32>, eps: f32, n: usize, c: usize) => cpu::rmsnorm_forward_bf16;
    /// dinp, dw += RMSNorm backward.
    fn rmsnorm_backward(dinp: ViewMut<f32>, dw: ViewMut<f32>, dout: View<f32>, inp: View<f32>, rstd: View<f32>, w: View<f32>, n: usize, c: usize) => cpu::rmsnorm_backward;
    /// Rotary embedding in place (rotate_half convention): each row's first `dims.heads` heads turned by the angles of position `pos[row]` (tables positions × HS/2).
    fn rope_forward(x: ViewMut<f32>, pos: View<u32>, cos: View<f32>, sin: View<f32>, dims: RopeDims) => cpu::rope_forward;
    /// Backward of `rope_forward`, in place (the opposite angles).
    fn rope_backward(dx: ViewMut<f32>, pos: View<u32>, cos: View<f32>, sin: View<f32>, dims: RopeDims) => cpu::rope_backward;
    /// out (N, F) = silu(inp[:, :F]) · inp[:, F:], inp (N, 2F) (gate | up).
    fn swiglu_forward(out: ViewMut<f32>, inp: View<f32>, n: usize, f: usize) => cpu::swiglu_forward;
    /// out (N, F) = silu(inp[:, :F]) · inp[:, F:] of a product kept interleaved (tiles of 16 gate then 16 up columns, see `matmul_swiglu_forward`).
    fn swiglu_interleaved_forward(out: ViewMut<f32>, inp: View<f32>, n: usize, f: usize) => cpu::swiglu_interleaved_forward;
    /// LayerNorm over C; writes mean and rstd (N) for backward.
    fn layernorm_forward(out: ViewMut<f32>, mean: ViewMut<f32>, rstd: ViewMut<f32>, inp: View<f32>, w: View<f32>, b: Option<View<f32>>, n: usize, c: usize) => cpu::layernorm_forward;
    /// `layernorm_forward` with `out` in bf16 (the bits of its f32 values rounded to nearest even): the input of bf16 products only. For a backend of `DType::Bf16`.
    fn layernorm_forward_bf16(out: ViewMut<u16>, mean: ViewMut<f32>, rstd: ViewMut<f32>, inp: View<f32>, w: View<f32>, b: Option<View<f32>>, n: usize, c: usize) => cpu::layernorm_forward_bf16;
    /// dinp, dw, db += LayerNorm backward.
    fn layernorm_backward(dinp: ViewMut<f32>, dw: ViewMut<f32>, db: Option<ViewMut<f32>>, dout: View<f32>, inp: View<f32>, mean: View<f32>, rstd: View<f32>, w: View<f32>, n: usize, c: usize) => cpu::layernorm_backward;
    /// out (N,OC) = inp (N,C) · w (C,OC) + bias.
    fn matmul_forward(out: ViewMut<f32>, inp: View<f32>, w: View<f32>, bias: Option<View<f32>>, n: usize, c: usize, oc: usize) => @dtype cpu::matmul_forward;
    /// dinp = dout · wᵀ (overwritten), dw += inpᵀ · dout (dw = inpᵀ · dout unless `accumulate`: the same bits as adding into +0.0), dbias += Σ_rows dout.
    fn matmul_backward(dinp: Option<ViewMut<f32>>, dw: ViewMut<f32>, dbias: Option<ViewMut<f32>>, dout: View<f32>, inp: View<f32>, w: View<f32>, n: usize, c: usize, oc: usize, accumulate: bool) => @dtype cpu::matmul_backward;
    /// dinp = dout · wᵀ (overwritten) alone, for a dinp buffer that still holds the input.
    fn matmul_backward_input(dinp: ViewMut<f32>, dout: View<f32>, w: View<f32>, n: usize, c: usize, oc: usize) => @dtype cpu::matmul_backward_input;
    /// out (N,OC) = inp (N,C) · wᵀ + bias for weights kept in a decode format (bf16 or 8-bit blocks, see `DecodeMatrix`): a decode step's product of a few rows.
    fn decode_matmul_forward(out: ViewMut<f32>, inp: View<f32>, w: &DecodeMatrix, bias: Option<View<f32>>, n: usize) => cpu::decode_matmul_forward;
    /// logits (N,V) = inp (N,C) · wᵀ, w (V,C).
    fn head_forward(out: ViewMut<f32>, inp: View<f32>, w: View<f32>, n: usize, c: usize, v: usize) => @dtype cpu::head_forward;
    /// dinp = dout · w (overwritten), dw += doutᵀ · inp (dw = doutᵀ · inp unless `accumulate`: the same bits as adding into +0.0).
    fn head_backward(dinp: ViewMut<f32>, dw: ViewMut<f32>, dout: View<f32>, inp: View<f32>, w: View<f32>, n: usize, c: usize, v: usize, accumulate: bool) => @dtype cpu::head_backward;
    /// `pre (N, OC) = inp · w + bias`, `out = gelu(pre)` in one pass (same bits as `matmul_forward` then `gelu_forward`).
    fn matmul_gelu_forward(pre: ViewMut<f32>, out: ViewMut<f32>, inp: View<f32>, w: View<f32>, bias: Option<View<f32>>, n: usize, c: usize, oc: usize) => @dtype cpu::matmul_gelu_forward;
    /// `matmul_gelu_forward` of an input in bf16 (its bits), with `out` kept in bf16 (its bits) and `grad` = gelu'(pre-activation) instead of the pre-activation. Only on a backend of `DType::Bf16`.
    fn matmul_gelu_forward_bf16(grad: ViewMut<f32>, out: ViewMut<u16>, inp: View<u16>, w: View<f32>, bias: Option<View<f32>>, n: usize, c: usize, oc: usize) => @dtype cpu::matmul_gelu_forward_bf16;
    /// `pre (N, 2F) = inp · w + bias` (w's columns gate then up), `out (N, F) = silu(gate) · up` in one pass; `pre` is left interleaved (tiles of 16 gate then 16 up columns), each value the bits of `matmul_forward` then `swiglu_forward`.
    fn matmul_swiglu_forward(pre: ViewMut<f32>, out: ViewMut<f32>, inp: View<f32>, w: View<f32>, bias: Option<View<f32>>, n: usize, c: usize, f: usize) => @dtype cpu::matmul_swiglu_forward;
    /// `matmul_swiglu_forward` of an input in bf16 (its bits), with `out` kept in bf16 (its bits) and `grad` (interleaved) = (silu(gate), up · silu'(gate)) instead of the pre-activation. Only on a backend of `DType::Bf16`.
    fn matmul_swiglu_forward_bf16(grad: ViewMut<f32>, out: ViewMut<u16>, inp: View<u16>, w: View<f32>, bias: Option<View<f32>>, n: usize, c: usize, f: usize) => @dtype cpu::matmul_swiglu_forward_bf16;
    /// dinp (N, 2F), gate then up, = SwiGLU backward at the interleaved `pre` of d(output) = dout (N, C) · wᵀ (w (F, C)), which `dact` (N, F) receives on the way: `matmul_backward_input` and `swiglu_interleaved_backward` in one pass (the same bits).
    fn matmul_backward_input_swiglu(dinp: ViewMut<f32>, dact: ViewMut<f32>, dout: View<f32>, w: View<f32>, pre: View<f32>, n: usize, f: usize, c: usize) => @dtype cpu::matmul_backward_input_swiglu;
    /// `matmul_backward_input_swiglu` from the derivatives `matmul_swiglu_forward_bf16` kept in `grad` (`swiglu_backward_with_grad` fused, the same bits).
    fn matmul_backward_input_swiglu_with_grad(dinp: ViewMut<f32>, dact: ViewMut<f32>, dout: View<f32>, w: View<f32>, grad: View<f32>, n: usize, f: usize, c: usize) => @dtype cpu::matmul_backward_input_swiglu_with_grad;
    /// `matmul_forward` of an input kept in bf16 (its bits). Only on a backend of `DType::Bf16`.
    fn matmul_forward_bf16_input(out: ViewMut<f32>, inp: View<u16>, w: View<f32>, bias: Option<View<f32>>, n: usize, c: usize, oc: usize) => @dtype cpu::matmul_forward_bf16_input;
    /// `matmul_forward_bf16_input` with `out` kept in bf16 (its bits, rounded as the bf16 products round their operands), `sums` (N, OC) receiving the f32 product as scratch: a product whose only readers round it to bf16 (attention's qkv). Only on a backend of `DType::Bf16`; optional (a model uses it where the backend has it).
    fn matmul_forward_bf16_out(sums: ViewMut<f32>, out: ViewMut<u16>, inp: View<u16>, w: View<f32>, bias: Option<View<f32>>, n: usize, c: usize, oc: usize) => @dtype cpu::matmul_forward_bf16_out;
    /// dw += inpᵀ · dout (dw = inpᵀ · dout unless `accumulate`), dbias += column sums of dout, for an input kept in bf16. Only on a backend of `DType::Bf16`.
    fn matmul_backward_weight_bf16_input(dw: ViewMut<f32>, dbias: Option<ViewMut<f32>>, dout: View<f32>, inp: View<u16>, n: usize, c: usize, oc: usize, accumulate: bool) => @dtype cpu::matmul_backward_weight_bf16_input;
    /// out = gelu(inp) (tanh form).
    fn gelu_forward(out: ViewMut<f32>, inp: View<f32>) => cpu::gelu_forward;
    /// dinout *= gelu'(inp).
    fn gelu_backward(dinout: ViewMut<f32>, inp: View<f32>) => cpu::gelu_backward;
    /// out = gelu(pre), then pre = gelu'(pre), in one pass (a backward's recompute that keeps the derivative for `gelu_backward_with_grad`).
    fn gelu_forward_and_grad(out: ViewMut<f32>, pre: ViewMut<f32>) => cpu::gelu_forward_and_grad;
    /// dinout *= grad, where the forward kept GELU's derivative `grad` (see matmul_gelu_forward_bf16).
    fn gelu_backward_with_grad(dinout: ViewMut<f32>, grad: View<f32>) => cpu::gelu_backward_with_grad;
    /// out = residual + dropout(out + bias), rows of c.
    fn residual_forward(out: ViewMut<f32>, residual: View<f32>, bias: Option<View<f32>>, c: usize, dropout: Option<Dropout>) => cpu::residual_forward;
    /// x = dropout(x).
    fn dropout_forward(x: ViewMut<f32>, d: Dropout) => |x, d| cpu::dropout_forward(x, d, 0);
    /// dx = dropout mask applied to dy (overwritten).
    fn dropout_backward(dx: ViewMut<f32>, dy: View<f32>, d: Dropout) => |dx, dy, d| cpu::dropout_backward(dx, dy, d, 0);
    /// acc += Σ_rows x.
    fn column_sums(acc: ViewMut<f32>, x: View<f32>) => cpu::column_sums;
    /// Causal attention with key padding mask, within each row's segments (runs of equal ids) when given; lse (B,NH,T) kept for backward.
    fn attention_forward(out: ViewMut<f32>, lse: ViewMut<f32>, qkv: View<f32>, mask: Option<View<u8>>, segments: Option<View<u32>>, dims: AttnDims, dropout: Option<Dropout>, scratch: ViewMut<f32>) => @dtype cpu::attention_forward;
    /// dqkv = attention backward (overwritten); optionally recomputes the forward output.
    fn attention_backward(dqkv: ViewMut<f32>, recompute_out: Option<ViewMut<f32>>, dout: View<f32>, qkv: View<f32>, lse: View<f32>, mask: Option<View<u8>>, segments: Option<View<u32>>, dims: AttnDims, dropout: Option<Dropout>, scratch: ViewMut<f32>) => @dtype cpu::attention_backward;
    /// `attention_forward` of grouped rows (N, (NH+2·NKV)·HS) as the qkv product writes them: query head h attends with key/value head h / (NH/NKV); `nkv` = NH is `attention_forward`.
    fn attention_forward_grouped(out: ViewMut<f32>, lse: ViewMut<f32>, qkv: View<f32>, mask: Option<View<u8>>, segments: Option<View<u32>>, dims: AttnDims, nkv: usize, dropout: Option<Dropout>, scratch: ViewMut<f32>) => @dtype cpu::attention_forward_grouped;
    /// Backward of `attention_forward_grouped`: dqkv (N, (NH+2·NKV)·HS) overwritten, each key/value head's gradient summed over its query group in the group's order.
    fn attention_backward_grouped(dqkv: ViewMut<f32>, recompute_out: Option<ViewMut<f32>>, dout: View<f32>, qkv: View<f32>, lse: View<f32>, mask: Option<View<u8>>, segments: Option<View<u32>>, dims: AttnDims, nkv: usize, dropout: Option<Dropout>, scratch: ViewMut<f32>) => @dtype cpu::attention_backward_grouped;
    /// `attention_forward_grouped` of a qkv buffer kept in bf16 (its bits, as `matmul_forward_bf16_out` writes them): the bits of the f32 buffer they round from. Only on a backend of `DType::Bf16`; optional (a model uses it where the backend has it).
    fn attention_forward_bf16_qkv(out: ViewMut<f32>, lse: ViewMut<f32>, qkv: View<u16>, mask: Option<View<u8>>, segments: Option<View<u32>>, dims: AttnDims, nkv: usize, dropout: Option<Dropout>, scratch: ViewMut<f32>) => @dtype cpu::attention_forward_bf16_qkv;
    /// `attention_backward_grouped` of a qkv buffer kept in bf16, as `attention_forward_bf16_qkv`. Optional likewise.
    fn attention_backward_bf16_qkv(dqkv: ViewMut<f32>, recompute_out: Option<ViewMut<f32>>, dout: View<f32>, qkv: View<u16>, lse: View<f32>, mask: Option<View<u8>>, segments: Option<View<u32>>, dims: AttnDims, nkv: usize, dropout: Option<Dropout>, scratch: ViewMut<f32>) => @dtype cpu::attention_backward_bf16_qkv;
    /// One query row (C) over `ctx` cached key and value rows (stride c): a decode step's
    /// attention for one sequence; `scores` holds `nh·ctx` floats.
    fn attention_decode_row(out: &mut [f32], scores: &mut [f32], q: &[f32], k: &[f32], v: &[f32], dims: DecodeDims) => cpu::attention_decode_row;
    /// `attention_decode_row` over a cache kept in bf16 (`k` and `v` are bf16 bits), in the
    /// same order on their f32 values.
    fn attention_decode_row_bf16(out: &mut [f32], scores: &mut [f32], q: &[f32], k: &[u16], v: &[u16], dims: DecodeDims) => cpu::attention_decode_row_bf16;
    /// Per-row loss (0 for ignored targets) and log-sum-exp.
    fn crossentropy_forward(losses: ViewMut<f32>, lse: ViewMut<f32>, logits: View<f32>, targets: View<i32>, n: usize, v: usize) => cpu::crossentropy_forward;
    /// One block of vocabulary columns v0..v0+v: lse (start at -inf) takes in the block's
    /// log-sum-exp; target_logit gets the target's logit where it is in the block.
    fn crossentropy_forward_block(lse: ViewMut<f32>, target_logit: ViewMut<f32>, logits: View<f32>, targets: View<i32>, n: usize, v: usize, v0: usize) => cpu::crossentropy_forward_block;
    /// The logits become dlogits = scale * (softmax - onehot) for vocabulary columns
    /// v0..v0+v, in place (zero rows for ignored targets).
    fn crossentropy_backward(logits: ViewMut<f32>, lse: View<f32>, targets: View<i32>, scale: f32, n: usize, v: usize, v0: usize) => cpu::crossentropy_backward;
    /// x = value.
    fn fill(x: ViewMut<f32>, value: f32) => cpu::fill;
    /// acc += x, elementwise.
    fn add_into(acc: ViewMut<f32>, x: View<f32>) => cpu::add_into;
    /// The blocked cross-entropy's last step: `losses` holds each row's target logit and becomes
    /// its loss, lse - target logit (0 for ignored targets, < 0).
    fn crossentropy_fold(losses: ViewMut<f32>, lse: View<f32>, targets: View<i32>) => cpu::crossentropy_fold;
    /// Σ losses in f64, in order (the same bits whatever the thread count). Returns to the host:
    /// a device backend waits for the kernels before it.
    fn loss_sum(losses: View<f32>) -> f64 => cpu::loss_sum;
    /// One AdamW step on one segment of the flat buffers (`p`, `g`, moments `m` and `v` of equal
    /// length) with the step's coefficients (what [`AdamW::step_on`](crate::optim::AdamW::step_on) passes).
    fn adamw_step(p: ViewMut<f32>, g: View<f32>, m: ViewMut<f32>, v: ViewMut<f32>, c: AdamCoeffs) => optim::adamw_segment;
    /// Σ x² in f64, in fixed blocks added in order (the squared global norm clipping takes).
    /// Returns to the host: a device backend waits for the kernels before it.
    fn sum_squares(x: View<f32>) -> f64 => optim::sum_squares;
    /// x *= s (clipping's scale).
    fn scale(x: ViewMut<f32>, s: f32) => optim::scale;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernels that replaced the model's host loops compute what those loops did.
    #[test]
    fn host_loops_as_kernels() {
        let cpu = Cpu::new(2).unwrap();
        let dev: &dyn Backend = &cpu;
        let mut buf = dev.alloc(12).unwrap();
        let (mut a, mut b) = buf.view_mut().split_at_mut(6);
        dev.fill(a.reborrow(), 1.5);
        dev.upload(b.reborrow(), &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
            .unwrap();
        dev.add_into(a.reborrow(), b.as_view());
        assert_eq!(a.as_view().host(), &[2.5, 3.5, 4.5, 5.5, 6.5, 7.5]);
        // losses hold target logits; fold against lse with the second target ignored
        let targets = [3i32, -1, 0];
        let (mut losses, lse) = a.split_at_mut(3);
        dev.crossentropy_fold(losses.reborrow(), lse.as_view(), View::from(&targets[..]));
        assert_eq!(losses.as_view().host(), &[5.5 - 2.5, 0.0, 7.5 - 4.5]);
        assert_eq!(dev.loss_sum(losses.as_view()), 6.0);
        assert_eq!(dev.sum_squares(b.as_view()), 91.0);
        dev.scale(b.reborrow(), 0.5);
        let mut out = [0f32; 6];
        dev.download(&mut out, buf.view().slice(6..)).unwrap();
        assert_eq!(out, [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]);
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
    }
}
