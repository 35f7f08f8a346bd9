use cohort_engine::cpu::{self, Cpu};
use cohort_engine::DType;
use std::time::Instant;
fn main() {
    let cpu = Cpu::with_dtype(1, DType::Bf16).unwrap();
    let (n, k, oc) = (2048usize, 384usize, 1536usize);
    let which = std::env::args().nth(1).unwrap_or("w".into());
    let inp: Vec<f32> = (0..n * k).map(|i| (i % 17) as f32 * 0.01).collect();
    let w: Vec<f32> = (0..k * oc).map(|i| (i % 13) as f32 * 0.01).collect();
    let out: Vec<f32> = (0..n * oc).map(|i| (i % 11) as f32 * 0.01).collect();
    let mut dw = vec![0.0; k * oc];
    let mut o2 = vec![0.0; n * oc];
    let d = cpu.dtype();
    let mut ts = vec![];
    for _ in 0..60 {
        let t0 = Instant::now();
        cpu.install(|| {
            if which == "w" {
                cpu::matmul_backward(d, None, &mut dw, None, &out, &inp, &w, n, k, oc)
            } else {
                cpu::matmul_forward(d, &mut o2, &inp, &w, None, n, k, oc)
            }
        });
        ts.push(t0.elapsed().as_secs_f64());
    }
    ts.sort_by(f64::total_cmp);
    let g = 2.0 * (n * k * oc) as f64 / 1e9;
    println!("{which}: {:.2} ms {:.0} GFLOP/s", ts[30] * 1e3, g / ts[30]);
}
