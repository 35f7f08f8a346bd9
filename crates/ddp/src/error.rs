//! Errors of the data-parallel layer. Each variant carries what was wrong:
//! the parameter, the ranks, the range. Never a panic for bad input.

use std::ops::Range;

/// What went wrong in [`Ddp`](crate::Ddp).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DdpError {
    /// The parameter list does not tile the flat buffer.
    #[error(
        "parameter {name}: range {range:?} does not follow the previous one \
         (expected start {expected_start}, {numel} elements from its shape)"
    )]
    BadLayout {
        /// The parameter.
        name: String,
        /// Its range.
        range: Range<usize>,
        /// Where it should start.
        expected_start: usize,
        /// The product of its shape.
        numel: usize,
    },
    /// Two parameters share a name.
    #[error("two parameters are named {0}")]
    DuplicateName(String),
    /// A flat buffer does not match the parameter list.
    #[error("{what} buffer has {got} elements, the parameters need {expected}")]
    BufferLength {
        /// `parameter` or `gradient`.
        what: &'static str,
        /// Its length.
        got: usize,
        /// The parameters' total length.
        expected: usize,
    },
    /// The ranks built different models.
    #[error(
        "ranks built different models: rank {rank} has {theirs} where rank 0 has {ours} \
         (parameter #{index}); every rank must construct the same model before Ddp"
    )]
    ModelMismatch {
        /// The first rank that differs from rank 0.
        rank: usize,
        /// Position of the first differing parameter.
        index: usize,
        /// Rank 0's parameter there (`name [shape]`, or `nothing`).
        ours: String,
        /// The other rank's parameter there.
        theirs: String,
    },
    /// Backward reported a gradient range that is not a fresh part of the buffer.
    #[error("backward reported gradient range {range:?} ({len} elements) that {why}")]
    BadReadyRange {
        /// The range reported.
        range: Range<usize>,
        /// The length of the slice that came with it.
        len: usize,
        /// What is wrong with it.
        why: &'static str,
    },
    /// Backward never reported a parameter's gradient (and find_unused_parameters is off).
    #[error(
        "parameter {name} received no gradient in this backward (gradient range {range:?} was \
         never reported ready); if the model really leaves it unused, construct Ddp with \
         find_unused_parameters = true, which treats its gradient as zero"
    )]
    UnusedParameter {
        /// The first parameter without a gradient.
        name: String,
        /// Its gradient range.
        range: Range<usize>,
    },
    /// The model's backward failed.
    #[error("backward failed: {0}")]
    Backward(Box<dyn std::error::Error + Send + Sync>),
    /// A collective failed.
    #[error("{op}{}: {error}", bucket.map(|b| format!(" of gradient bucket {b}")).unwrap_or_default())]
    Comm {
        /// What Ddp was doing (`all_reduce`, `broadcast`, ...).
        op: &'static str,
        /// The bucket, when the operation was a bucket's reduction.
        bucket: Option<usize>,
        /// The communication error.
        error: cohort_comm::CommError,
    },
}
