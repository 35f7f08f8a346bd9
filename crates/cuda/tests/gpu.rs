//! Every CUDA kernel against the CPU engine (cohort_cuda::check), where there is a GPU. With
//! no driver or no device this skips with a one-line message; the GPU script runs the same
//! checks through the release binary (`cohort gpu check`), which needs no toolchain.

use cohort_cuda::libraries::Search;
use cohort_cuda::{check, device_count, Device};

#[test]
fn every_kernel_matches_the_cpu_engine() {
    let search = Search::from_env();
    match device_count(&search) {
        Ok(0) => {
            eprintln!("skipped: GPU checks: the driver sees no device");
            return;
        }
        Ok(_) => {}
        Err(e) => {
            eprintln!("skipped: GPU checks: {e}");
            return;
        }
    }
    let dev = Device::open(0, &search).unwrap_or_else(|e| panic!("{e}"));
    let rows = check::run(&dev);
    eprintln!("{}", check::table(&rows));
    assert!(rows.iter().all(|r| r.ok), "{}", check::table(&rows));
}

/// The engine's backend on the GPU against the CPU backend: a short sequence of the model's
/// kernels on buffers each backend allocated, copied back through the engine's copies.
#[test]
fn the_engine_backend_on_the_gpu_matches_the_cpu_backend() {
    use cohort_cuda::CudaBackend;
    use cohort_engine::cpu::Cpu;
    use cohort_engine::optim::{AdamW, AdamWConfig, DecayMask};
    use cohort_engine::{Backend, DType};

    let search = Search::from_env();
    let gpu = match CudaBackend::open(0, DType::F32, &search) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("skipped: the engine backend on the GPU: {e}");
            return;
        }
    };
    let cpu = Cpu::new(2).unwrap();
    let (n, c, oc) = (64, 48, 40);
    let x: Vec<f32> = (0..n * c)
        .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
        .collect();
    let w: Vec<f32> = (0..c * oc)
        .map(|i| ((i * 53) % 97) as f32 / 97.0 - 0.5)
        .collect();
    let targets: Vec<i32> = (0..n as i32)
        .map(|i| if i % 7 == 3 { -1 } else { i % oc as i32 })
        .collect();
    let run = |dev: &dyn Backend| -> (Vec<f32>, f64, f32, Vec<f32>) {
        let mut buf = dev.alloc(n * c + c * oc + 2 * n * oc + 2 * n + n).unwrap();
        let mut v = buf.view_mut();
        let (mut xv, rest) = v.reborrow().split_at_mut(n * c);
        let (mut wv, rest) = rest.split_at_mut(c * oc);
        let (mut out, rest) = rest.split_at_mut(n * oc);
        let (mut dlogits, rest) = rest.split_at_mut(n * oc);
        let (mut losses, rest) = rest.split_at_mut(n);
        let (mut lse, tv) = rest.split_at_mut(n);
        dev.upload(xv.reborrow(), &x).unwrap();
        dev.upload(wv.reborrow(), &w).unwrap();
        let mut tv = tv.cast::<i32>();
        dev.upload(tv.reborrow(), &targets).unwrap();
        let tv = tv.as_view();
        dev.matmul_forward(out.reborrow(), xv.as_view(), wv.as_view(), None, n, c, oc);
        dev.crossentropy_forward(losses.reborrow(), lse.reborrow(), out.as_view(), tv, n, oc);
        let loss = dev.loss_sum(losses.as_view());
        dev.crossentropy_backward(
            dlogits.reborrow(),
            out.as_view(),
            lse.as_view(),
            tv,
            0.5,
            n,
            oc,
            0,
        );
        let mut opt = AdamW::new_on(dev, AdamWConfig::default(), DecayMask::all(c * oc)).unwrap();
        opt.step_on(dev, wv.reborrow(), xv.as_view().slice(..c * oc), 1e-2)
            .unwrap();
        let norm = cohort_engine::optim::grad_norm_on(dev, dlogits.as_view());
        dev.sync().unwrap();
        let (mut o, mut wn) = (vec![0f32; n * oc], vec![0f32; c * oc]);
        dev.download(&mut o, out.as_view()).unwrap();
        dev.download(&mut wn, wv.as_view()).unwrap();
        (o, loss, norm, wn)
    };
    let (want, got) = (run(&cpu), run(&gpu));
    let close = |a: f32, b: f32| (a - b).abs() <= 1e-4 * (1.0 + b.abs());
    assert!(
        want.0.iter().zip(&got.0).all(|(&a, &b)| close(b, a)),
        "products"
    );
    assert!(
        (want.1 - got.1).abs() <= 1e-4 * (1.0 + want.1.abs()),
        "loss {} vs {}",
        got.1,
        want.1
    );
    assert!(close(got.2, want.2), "norm {} vs {}", got.2, want.2);
    assert!(
        want.3.iter().zip(&got.3).all(|(&a, &b)| close(b, a)),
        "AdamW"
    );
}
