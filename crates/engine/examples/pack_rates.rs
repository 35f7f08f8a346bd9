//! GB/s of f32 read (bf16 for an A kept in bf16; and ns per element) of each packing path of the bf16 product, one thread,
//! on config G's operands (1024 tokens; d 768; d_ff 3072; vocab 50257) as a training step
//! meets them: cold, beyond L3 (each call packs the next of several copies, > 96 MB in all),
//! block by block as the zmm kernel packs them, 64-byte aligned as the model's buffers are. Each figure is the median of 15 calls.
//!
//! With `fp32`, instead: the fp32 product's B panels on configs B's and G's operands (tokens
//! 2048 and 1024; d 384 and 768; d_ff 1536 and 3072), packed as a one-thread product packs them
//! (where A spans several strips of rows, once per K block for all of them): GB/s of panel
//! floats written.
//!
//! ```sh
//! cargo run --release -p cohort-engine --example pack_rates [-- fp32]
//! ```

use std::time::Instant;

use cohort_engine::cpu::pack_rates::{pack_panels_f32, Packer};
use cohort_engine::AlignedFloats;

/// Bytes of copies of each operand cycled through: well beyond a 32 MB L3.
const COLD_BYTES: usize = 96 << 20;
const CALLS: usize = 15;

/// How an operand is packed.
#[derive(Clone, Copy)]
enum Side {
    /// As B, with or without the column sums of a weight gradient.
    B { sums: bool },
    /// As A.
    A,
    /// As A kept in bf16 (an activation the products round anyway): GB/s of bf16 read.
    ABf16,
}

fn main() {
    if std::env::args().nth(1).as_deref() == Some("fp32") {
        fp32_panels();
        return;
    }
    let Some(mut packer) = Packer::new() else {
        eprintln!("pack_rates: this CPU has no AVX512_BF16");
        std::process::exit(2);
    };
    let (t, c, f, v) = (1024usize, 768usize, 3072usize, 50257usize);
    // (what, side, rows, cols, transposed): rows x cols is the operand as packed (K x N for B,
    // M x K for A); transposed operands are stored the other way round (row stride 1).
    let cases: [(&str, Side, usize, usize, bool); 15] = [
        ("B fwd qkv W", Side::B { sums: false }, c, 3 * c, false),
        ("B fwd fc W", Side::B { sums: false }, c, f, false),
        ("B fwd proj W", Side::B { sums: false }, f, c, false),
        (
            "B wgrad qkv dY +sums",
            Side::B { sums: true },
            t,
            3 * c,
            false,
        ),
        ("B wgrad fc dY +sums", Side::B { sums: true }, t, f, false),
        ("B wgrad proj dY +sums", Side::B { sums: true }, t, c, false),
        ("B dgrad qkv W^T", Side::B { sums: false }, 3 * c, c, true),
        ("B dgrad fc W^T", Side::B { sums: false }, f, c, true),
        ("B dgrad proj W^T", Side::B { sums: false }, c, f, true),
        ("A fwd X", Side::A, t, c, false),
        ("A fwd X (fc out)", Side::A, t, f, false),
        ("A wgrad X^T", Side::A, c, t, true),
        ("A wgrad X^T (fc out)", Side::A, f, t, true),
        ("B head dgrad wte", Side::B { sums: false }, v, c, false),
        ("B head fwd wte^T", Side::B { sums: false }, c, v, true),
    ];
    // The head's backward: dinp = dlogits · wte (A row-major, K = vocab in blocks), dwte =
    // dlogitsᵀ · X (A transposed, rows 50257 floats apart).
    let extra: [(&str, Side, usize, usize, bool); 5] = [
        ("B head wgrad dlogits", Side::B { sums: false }, t, v, false),
        ("A head dgrad dlogits", Side::A, t, v, false),
        ("A head wgrad dlogits^T", Side::A, v, t, true),
        ("A bf16 fwd X (fc out)", Side::ABf16, t, f, false),
        ("A bf16 wgrad X^T", Side::ABf16, c, t, true),
    ];
    println!(
        "{:<24} {:>13} {:>8} {:>8}",
        "operand", "rows x cols", "GB/s", "ns/elem"
    );
    for (name, side, rows, cols, transposed) in cases.into_iter().chain(extra) {
        let elems = rows * cols;
        let data = cold_copies(elems);
        let copies = data.len();
        let (rs, cs) = if transposed { (1, rows) } else { (cols, 1) };
        let mut sums = vec![0.0f32; cols];
        let mut times = Vec::with_capacity(CALLS);
        for call in 0..CALLS + 2 {
            let x = &data[call % copies];
            let t0 = Instant::now();
            match side {
                Side::B { sums: s } => {
                    packer.pack_b(x, (rows, cols), (rs, cs), s.then_some(&mut sums[..]))
                }
                Side::A => packer.pack_a(x, (rows, cols), (rs, cs)),
                Side::ABf16 => {
                    // SAFETY: the floats' memory read as twice as many u16 (any bits are a
                    // valid u16); the first `elems` of them are the operand.
                    let h = unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u16, elems) };
                    packer.pack_a_bf16(h, (rows, cols), (rs, cs))
                }
            }
            if call >= 2 {
                times.push(t0.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        let s = times[CALLS / 2];
        let bytes = if matches!(side, Side::ABf16) { 2 } else { 4 };
        println!(
            "{name:<24} {:>13} {:>8.1} {:>8.3}",
            format!("{rows} x {cols}"),
            (bytes * elems) as f64 / s / 1e9,
            s * 1e9 / elems as f64
        );
        std::hint::black_box(&sums);
    }
}

/// Copies of `elems` floats, > COLD_BYTES in all, each a little different, 64-byte aligned as
/// the model's activations and parameters are.
fn cold_copies(elems: usize) -> Vec<AlignedFloats> {
    let copies = (COLD_BYTES / (4 * elems)).max(2);
    (0..copies)
        .map(|k| {
            let mut x = AlignedFloats::zeroed(elems);
            for (i, v) in x.iter_mut().enumerate() {
                *v = ((i + k) % 251) as f32 * 0.01;
            }
            x
        })
        .collect()
}

/// The fp32 product's B panels: forward (W row-major, m = tokens), weight gradient (dY
/// row-major, m = d_in) and input gradient (W^T, m = tokens) of each block product.
fn fp32_panels() {
    println!(
        "{:<26} {:>13} {:>5} {:>8} {:>8}",
        "operand", "k x n", "m", "GB/s", "ns/elem"
    );
    for (cfg, t, c, f) in [
        ("B", 2048usize, 384usize, 1536usize),
        ("G", 1024, 768, 3072),
    ] {
        // (what, m, k, n, transposed)
        let cases = [
            ("fwd qkv W", t, c, 3 * c, false),
            ("fwd fc W", t, c, f, false),
            ("fwd proj W", t, f, c, false),
            ("wgrad qkv dY", c, t, 3 * c, false),
            ("wgrad fc dY", c, t, f, false),
            ("wgrad proj dY", f, t, c, false),
            ("dgrad qkv W^T", t, 3 * c, c, true),
            ("dgrad fc W^T", t, f, c, true),
            ("dgrad proj W^T", t, c, f, true),
        ];
        for (name, m, k, n, transposed) in cases {
            let data = cold_copies(k * n);
            let (rs, cs) = if transposed { (1, k) } else { (n, 1) };
            let mut times = Vec::with_capacity(CALLS);
            let mut floats = 0;
            for call in 0..CALLS + 2 {
                let x = &data[call % data.len()];
                let t0 = Instant::now();
                let Some(packed) = pack_panels_f32(x, m, (k, n), (rs, cs)) else {
                    eprintln!("pack_rates: this CPU has no AVX-512F");
                    std::process::exit(2);
                };
                if call >= 2 {
                    times.push(t0.elapsed().as_secs_f64());
                }
                floats = packed;
            }
            times.sort_by(f64::total_cmp);
            let s = times[CALLS / 2];
            println!(
                "{:<26} {:>13} {m:>5} {:>8.1} {:>8.3}",
                format!("{cfg} {name}"),
                format!("{k} x {n}"),
                (4 * floats) as f64 / s / 1e9,
                s * 1e9 / floats as f64
            );
        }
    }
}
