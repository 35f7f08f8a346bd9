//! What the model needs of its backend: the kernels its configuration runs, and its buffers as
//! the backend allocated them (allocation with the model's errors, host access for the host API
//! `params()`, `grads()`, ..., and copies to and from the host for a model whose buffers live on
//! a device). Shared by the whole model and pipeline stages.
//!
//! This module never computes; a host reference into a device buffer is a panic that names
//! the buffer and the call to use instead, never a read of device memory.

use cohort_engine::{Backend, Buffer, DType};

use super::QKV16_KERNELS;
use crate::{GPTConfig, GptError, Mlp, Norm, Positions};

/// An error unless `dev` has a body for every kernel a model of `cfg` runs in training (see
/// [`Backend::missing_kernels`]): a backend that lacks one fails here, at build, naming it.
pub(crate) fn check_kernels(cfg: &GPTConfig, dev: &dyn Backend) -> Result<(), GptError> {
    let rope = cfg.positions != Positions::Learned;
    let (swiglu, rms) = (
        cfg.mlp == Mlp::SwiGlu,
        matches!(cfg.norm, Norm::RmsNorm { .. }),
    );
    let bf16 = dev.dtype() == DType::Bf16;
    let needed = |k: &str| {
        let family = match k {
            _ if k.starts_with("rmsnorm") => rms,
            _ if k.starts_with("layernorm") => !rms,
            _ if k.starts_with("rope") || k.starts_with("embedding") => rope,
            _ if k.starts_with("encoder") => !rope,
            _ if k.contains("swiglu") => swiglu,
            _ if k.contains("gelu") => !swiglu,
            _ if k.starts_with("decode") || k.starts_with("attention_decode") => false,
            _ if k.starts_with("dropout") => cfg.dropout > 0.0,
            // used only where the backend has them (see `ActLayout::qkv16`)
            _ if QKV16_KERNELS.contains(&k) => false,
            _ => true,
        };
        let bf16_only =
            k.ends_with("_bf16") || k.ends_with("_bf16_input") || k.ends_with("with_grad");
        family && (bf16 || !bf16_only)
    };
    let missing: Vec<&str> = dev
        .missing_kernels()
        .iter()
        .copied()
        .filter(|k| needed(k))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(GptError::Engine {
        op: "build the model",
        reason: format!("not yet on {}: {}", dev.device(), missing.join(", ")),
    })
}

/// Whether `dev` has a body for each of `kernels` (optional ones: a model without them takes
/// another path).
pub(crate) fn has_kernels(dev: &dyn Backend, kernels: &[&str]) -> bool {
    let missing = dev.missing_kernels();
    kernels.iter().all(|k| !missing.contains(k))
}

/// `len` zeroed floats from `dev` for the model's `what`.
pub(crate) fn alloc(dev: &dyn Backend, len: usize, what: &'static str) -> Result<Buffer, GptError> {
    dev.alloc(len).map_err(|e| GptError::Engine {
        op: what,
        reason: e.to_string(),
    })
}

#[cold]
#[inline(never)]
fn on_device(b: &Buffer, what: &str) -> ! {
    panic!(
        "{what} of a model on {}: its buffers are in device memory; use copy_{what}_to_host / \
         copy_{what}_from_host",
        b.device()
    )
}

/// `b`'s floats, for the host API (`what`: "params", "grads", "logits").
pub(crate) fn host<'a>(b: &'a Buffer, what: &str) -> &'a [f32] {
    match b.host_slice() {
        Some(s) => s,
        None => on_device(b, what),
    }
}

/// `b`'s floats, writable, for the host API.
pub(crate) fn host_mut<'a>(b: &'a mut Buffer, what: &str) -> &'a mut [f32] {
    if b.host_slice().is_none() {
        on_device(b, what);
    }
    b.host_slice_mut().expect("checked above")
}

/// Runs `f` on `b`'s floats on the host: in place in host memory, else on a zeroed host copy
/// that is then copied into the device's.
pub(crate) fn write_on_host(
    dev: &dyn Backend,
    b: &mut Buffer,
    f: impl FnOnce(&mut [f32]),
) -> Result<(), GptError> {
    if let Some(s) = b.host_slice_mut() {
        f(s);
        return Ok(());
    }
    let mut staged = vec![0f32; b.len()];
    f(&mut staged);
    copy_in(dev, b, &staged, "parameters to the device")
}

/// Copies `src` into `b` (equal lengths).
pub(crate) fn copy_in(
    dev: &dyn Backend,
    b: &mut Buffer,
    src: &[f32],
    what: &'static str,
) -> Result<(), GptError> {
    check_len(b, src.len(), what)?;
    dev.upload(b.view_mut(), src).map_err(|e| GptError::Engine {
        op: what,
        reason: e.to_string(),
    })
}

/// Copies `b` into `out` (equal lengths), after the kernels before it.
pub(crate) fn copy_out(
    dev: &dyn Backend,
    b: &Buffer,
    out: &mut [f32],
    what: &'static str,
) -> Result<(), GptError> {
    check_len(b, out.len(), what)?;
    dev.download(out, b.view()).map_err(|e| GptError::Engine {
        op: what,
        reason: e.to_string(),
    })
}

fn check_len(b: &Buffer, len: usize, what: &'static str) -> Result<(), GptError> {
    if b.len() == len {
        return Ok(());
    }
    Err(GptError::Engine {
        op: what,
        reason: format!("the host buffer has {len} floats, the model's {}", b.len()),
    })
}
