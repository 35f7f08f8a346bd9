//! ggml's tensor types: their numbers in a GGUF file, names, and block layouts (elements per
//! block, bytes per block), as the `gguf` Python package's `GGML_QUANT_SIZES` lists them. The
//! layouts are needed to bounds-check every tensor of a file, also those of types that cannot be
//! dequantised here; this module never decodes a value.

/// A ggml tensor type, by its number in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GgmlType(pub u32);

/// (number, name, elements per block, bytes per block).
const TYPES: &[(u32, &str, u64, u64)] = &[
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 40),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
    (40, "NVFP4", 64, 36),
    (41, "Q1_0", 128, 18),
];

impl GgmlType {
    /// 32-bit float.
    pub const F32: GgmlType = GgmlType(0);
    /// IEEE half.
    pub const F16: GgmlType = GgmlType(1);
    /// 32 weights: an f16 scale and 4-bit values offset by 8.
    pub const Q4_0: GgmlType = GgmlType(2);
    /// 32 weights: an f16 scale, an f16 minimum and 4-bit values.
    pub const Q4_1: GgmlType = GgmlType(3);
    /// 32 weights: an f16 scale and 8-bit signed values.
    pub const Q8_0: GgmlType = GgmlType(8);
    /// bfloat16.
    pub const BF16: GgmlType = GgmlType(30);

    fn entry(self) -> Option<&'static (u32, &'static str, u64, u64)> {
        TYPES.iter().find(|t| t.0 == self.0)
    }

    /// The type's name in ggml ("Q4_1"), or `None` for a number ggml does not define.
    pub fn name(self) -> Option<&'static str> {
        self.entry().map(|t| t.1)
    }

    /// (elements per block, bytes per block), or `None` for an unknown type.
    pub fn block(self) -> Option<(u64, u64)> {
        self.entry().map(|t| (t.2, t.3))
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.name() {
            Some(name) => f.write_str(name),
            None => write!(f, "unknown ggml type {}", self.0),
        }
    }
}
