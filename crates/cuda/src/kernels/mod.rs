//! The CUDA C sources, embedded in the binary, one file per family (as candle's kernel
//! crate): each is compiled by NVRTC at device start with `common.cuh` in front of it.
//!
//! Every kernel is `extern "C"` (unmangled), so the launcher finds it by the name listed here;
//! the compile test checks that each listed name is in its family's ptxas report, so a kernel
//! renamed in the source and not here fails there, not on a GPU. The sources must never
//! include a file besides the CUDA runtime headers (NVRTC sees no others).

/// One `.cu` file and the kernels it defines.
#[derive(Debug, Clone, Copy)]
pub struct Family {
    /// The file's name without `.cu`.
    pub name: &'static str,
    /// The CUDA C source.
    pub source: &'static str,
    /// The `extern "C"` kernels it defines.
    pub kernels: &'static [&'static str],
}

/// Prepended to every family: the bf16 header, warp and block reductions, the grid-stride
/// loop.
pub const COMMON: &str = include_str!("common.cuh");

/// Every family.
pub const FAMILIES: &[Family] = &[
    Family {
        name: "elementwise",
        source: include_str!("elementwise.cu"),
        kernels: &[
            "fill_f32",
            "scale_f32",
            "add_f32",
            "add_bias_f32",
            "gelu_forward",
            "gelu_backward",
            "gelu_forward_and_grad",
            "gelu_backward_with_grad",
            "residual_forward",
            "dropout_forward",
            "dropout_backward",
            "column_sums",
        ],
    },
    Family {
        name: "encoder",
        source: include_str!("encoder.cu"),
        kernels: &["encoder_forward", "encoder_backward"],
    },
    Family {
        name: "layernorm",
        source: include_str!("layernorm.cu"),
        kernels: &[
            "layernorm_forward",
            "layernorm_backward_input",
            "layernorm_backward_params",
        ],
    },
    Family {
        name: "crossentropy",
        source: include_str!("crossentropy.cu"),
        kernels: &[
            "crossentropy_forward",
            "crossentropy_forward_block",
            "crossentropy_backward",
            "crossentropy_fold",
        ],
    },
    Family {
        name: "optim",
        source: include_str!("optim.cu"),
        kernels: &["adamw_step", "sum_squares_partial", "sum_f64"],
    },
    Family {
        name: "cast",
        source: include_str!("cast.cu"),
        kernels: &["f32_to_bf16", "bf16_to_f32"],
    },
    Family {
        name: "llama",
        source: include_str!("llama.cu"),
        kernels: &[
            "rmsnorm_forward",
            "rmsnorm_backward_input",
            "rmsnorm_backward_weight",
            "rope_rotate",
            "swiglu_forward",
            "swiglu_backward",
            "swiglu_interleave",
        ],
    },
    Family {
        name: "attention",
        source: include_str!("attention.cu"),
        kernels: &[
            "attention_forward",
            "attention_backward_delta",
            "attention_backward_dq",
            "attention_backward_dkv",
        ],
    },
];

/// What NVRTC compiles for `family`: the common prelude, then the file, with a `#line` so
/// that errors name the file's own lines.
pub fn full_source(family: &Family) -> String {
    format!(
        "#line 1 \"common.cuh\"\n{COMMON}\n#line 1 \"{}.cu\"\n{}",
        family.name, family.source
    )
}

/// Every kernel name, with its family.
pub fn all_kernels() -> impl Iterator<Item = (&'static str, &'static str)> {
    FAMILIES
        .iter()
        .flat_map(|f| f.kernels.iter().map(move |k| (f.name, *k)))
}
