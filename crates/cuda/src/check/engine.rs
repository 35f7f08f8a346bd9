//! The engine's backend on the GPU ([`CudaBackend`]) against the CPU backend: a short sequence
//! of a training step's kernels (product, cross-entropy, loss sum, its backward, gradient norm,
//! AdamW) on buffers each backend allocated, read back through the engine's copies. What the
//! per-kernel checks cannot see: the views' carving, the copies, the kept errors and `sync`;
//! and the host-staging seam (an event, a copy after it on another thread, page-locked staging,
//! a copy back beside the kernels).

use cohort_engine::cpu::Cpu;
use cohort_engine::optim::{grad_norm_on, AdamW, AdamWConfig, DecayMask};
use cohort_engine::{Backend, EngineError, View, ViewMut};

use super::{max_err, rand_vec, CheckRow};
use crate::CudaBackend;

/// What one backend computed.
struct Outputs {
    product: Vec<f32>,
    loss: f32,
    dlogits: Vec<f32>,
    norm: f32,
    params: Vec<f32>,
}

/// The sequence on `dev`.
fn sequence(dev: &dyn Backend) -> Result<Outputs, EngineError> {
    let (n, c, oc) = (64, 48, 40);
    let x = rand_vec(n * c, 40, 1.0);
    let w = rand_vec(c * oc, 41, 0.5);
    let targets: Vec<i32> = (0..n as i32)
        .map(|i| if i % 7 == 3 { -100 } else { i % oc as i32 })
        .collect();
    let mut buf = dev.alloc(n * c + c * oc + 2 * n * oc + 3 * n)?;
    let (mut xv, rest) = buf.view_mut().split_at_mut(n * c);
    let (mut wv, rest) = rest.split_at_mut(c * oc);
    let (mut out, rest) = rest.split_at_mut(n * oc);
    let (mut dlogits, rest) = rest.split_at_mut(n * oc);
    let (mut losses, rest) = rest.split_at_mut(n);
    let (mut lse, tv) = rest.split_at_mut(n);
    let mut tv = tv.cast::<i32>();
    dev.upload(xv.reborrow(), &x)?;
    dev.upload(wv.reborrow(), &w)?;
    dev.upload(tv.reborrow(), &targets)?;
    let tv = tv.as_view();
    dev.matmul_forward(out.reborrow(), xv.as_view(), wv.as_view(), None, n, c, oc);
    let (ls, le) = (losses.reborrow(), lse.reborrow());
    dev.crossentropy_forward(ls, le, out.as_view(), tv, n, oc);
    let counted = targets.iter().filter(|&&t| t >= 0).count();
    let loss = (dev.loss_sum(losses.as_view()) / counted as f64) as f32;
    let scale = 1.0 / counted as f32;
    // The backward turns logits into dlogits in place: on a copy, so the product stays to compare.
    dev.fill(dlogits.reborrow(), 0.0);
    dev.add_into(dlogits.reborrow(), out.as_view());
    dev.crossentropy_backward(dlogits.reborrow(), lse.as_view(), tv, scale, n, oc, 0);
    let norm = grad_norm_on(dev, dlogits.as_view());
    let mut opt =
        AdamW::new_on(dev, AdamWConfig::default(), DecayMask::all(c * oc)).map_err(|e| {
            EngineError::Device {
                device: dev.device(),
                reason: e.to_string(),
            }
        })?;
    // a step with the first rows of the input standing in for the weights' gradient
    let g = xv.as_view().slice(..c * oc);
    opt.step_on(dev, wv.reborrow(), g, 1e-2)
        .map_err(|e| EngineError::Device {
            device: dev.device(),
            reason: e.to_string(),
        })?;
    dev.sync()?;
    let mut o = Outputs {
        product: vec![0.0; n * oc],
        loss,
        dlogits: vec![0.0; n * oc],
        norm,
        params: vec![0.0; c * oc],
    };
    dev.download(&mut o.product, out.as_view())?;
    dev.download(&mut o.dlogits, dlogits.as_view())?;
    dev.download(&mut o.params, wv.as_view())?;
    Ok(o)
}

/// The host-staging seam on `dev`: a region written by 20 kernels, an event after them, then
/// kernels on another region while a thread copies the first to page-locked staging after the
/// event, adds 1 there and copies it back beside the kernels (what host-staged DDP does with a
/// bucket while backward goes on). Returns the staged floats, the first region's and the
/// other region's.
fn staged_copy(dev: &dyn Backend) -> Result<[Vec<f32>; 3], EngineError> {
    let m = 4096;
    let mut buf = dev.alloc(2 * m)?;
    let (mut a, mut b) = buf.view_mut().split_at_mut(m);
    dev.fill(a.reborrow(), 1.0);
    dev.fill(b.reborrow(), 1.0);
    for _ in 0..20 {
        dev.add_into(a.reborrow(), b.as_view());
    }
    let done = dev.record_event();
    let mut staging = dev.alloc_staging(m)?;
    let mut staged = vec![0f32; m];
    std::thread::scope(|s| {
        let copier = s.spawn(|| {
            let bytes = ViewMut::from(&mut staging[..]).cast::<u8>().host();
            dev.copy_to_host_after(bytes, a.as_view().cast(), &done)?;
            staged.copy_from_slice(&staging);
            staging.iter_mut().for_each(|x| *x += 1.0);
            let bytes = View::from(&staging[..]).cast::<u8>().host();
            dev.copy_from_host_beside(a.reborrow().cast(), bytes)
        });
        // Kernels after the event, on the other region only, while the copies run.
        dev.fill(b.reborrow(), -5.0);
        for _ in 0..20 {
            dev.scale(b.reborrow(), 2.0);
        }
        copier.join().expect("the copy thread panicked")
    })?;
    dev.sync()?;
    let (mut first, mut other) = (vec![0f32; m], vec![0f32; m]);
    dev.download(&mut first, a.as_view())?;
    dev.download(&mut other, b.as_view())?;
    Ok([staged, first, other])
}

/// The sequence on `gpu` and on a CPU backend: one row per output.
/// Then the host-staging seam and the fused SwiGLU products (`swiglu_products.rs`).
pub fn engine_backend(gpu: &CudaBackend) -> Vec<CheckRow> {
    let mut rows = sequence_rows(gpu);
    rows.push(host_staging(gpu));
    rows.extend(super::swiglu_products::rows(gpu));
    rows
}

/// The host-staging seam's row (an event, a copy after it on another thread into page-locked
/// staging and back while kernels write elsewhere): every region exactly the CPU's.
pub fn host_staging(gpu: &CudaBackend) -> CheckRow {
    let cpu = Cpu::new(1).expect("a one-thread pool");
    let want = staged_copy(&cpu).expect("the CPU backend cannot fail here");
    let kernel = "backend.copy_to_host_after".to_string();
    match staged_copy(gpu) {
        Ok(got) => {
            let e = (got.iter().zip(&want)).fold(0.0, |e: f64, (g, w)| e.max(max_err(g, w)));
            CheckRow {
                kernel,
                max_err: e,
                tolerance: 0.0,
                ok: e == 0.0,
                error: None,
            }
        }
        Err(e) => CheckRow {
            kernel,
            max_err: f64::NAN,
            tolerance: 0.0,
            ok: false,
            error: Some(e.to_string()),
        },
    }
}

fn sequence_rows(gpu: &CudaBackend) -> Vec<CheckRow> {
    let cpu = Cpu::new(1).expect("a one-thread pool");
    let want = sequence(&cpu).expect("the CPU backend cannot fail here");
    let got = match sequence(gpu) {
        Ok(got) => got,
        Err(e) => {
            return vec![CheckRow {
                kernel: "engine backend".to_string(),
                max_err: f64::NAN,
                tolerance: 0.0,
                ok: false,
                error: Some(e.to_string()),
            }]
        }
    };
    [
        ("backend.matmul_forward", got.product, want.product),
        ("backend.loss_sum", vec![got.loss], vec![want.loss]),
        ("backend.crossentropy_backward", got.dlogits, want.dlogits),
        ("backend.sum_squares", vec![got.norm], vec![want.norm]),
        ("backend.adamw_step", got.params, want.params),
    ]
    .into_iter()
    .map(|(kernel, got, want)| {
        let e = max_err(&got, &want);
        CheckRow {
            kernel: kernel.to_string(),
            max_err: e,
            tolerance: 1e-4,
            ok: e <= 1e-4,
            error: None,
        }
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use cohort_engine::{DType, Emulated};

    /// The sequence itself, on the CPU and on a device emulated in host memory: the same bits,
    /// so on a GPU only the GPU's kernels can differ.
    #[test]
    fn the_sequence_runs_on_a_device_backend() {
        let (cpu, emu) = (Cpu::new(2).unwrap(), Emulated::new(2, DType::F32).unwrap());
        let (a, b) = (sequence(&cpu).unwrap(), sequence(&emu).unwrap());
        assert_eq!(
            (a.product, a.dlogits, a.params),
            (b.product, b.dlogits, b.params)
        );
        assert_eq!((a.loss, a.norm), (b.loss, b.norm));
        assert!(a.loss > 0.0 && a.norm > 0.0);
        let (a, b) = (staged_copy(&cpu).unwrap(), staged_copy(&emu).unwrap());
        assert_eq!(a, b);
        let all = |v: &[f32], x: f32| v.iter().all(|&y| y == x);
        assert!(all(&a[0], 21.0) && all(&a[1], 22.0) && all(&a[2], -5.0 * 1048576.0));
    }
}
