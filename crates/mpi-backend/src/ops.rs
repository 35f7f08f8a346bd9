//! cohort's element types and reduce operators as MPI datatypes and
//! operators.
//!
//! Built-in operators where MPI's agree with cohort's bit for bit (Sum and
//! Product on every non-bf16 type, Min/Max on integers); user-defined ones
//! (`MPI_Op_create`, commutative) that run cohort's own kernel where they
//! would not: bf16 has no MPI type (it travels as `MPI_UINT16_T`, which MPI
//! cannot add as floats), and MPI's float Min/Max let NaN through from one
//! side only. Avg is Sum here; the backend divides afterwards. This module
//! must never reduce in any other way than [`cohort_comm::reduce_into`], so
//! that both backends give the same answers.

use std::os::raw::{c_int, c_void};

use cohort_comm::{bf16, reduce_into, DType, ReduceOp};
use mpi::ffi::{self, MPI_Datatype, MPI_Op};

/// The MPI datatype that carries `dtype`.
pub(crate) fn datatype(dtype: DType) -> MPI_Datatype {
    // safety: the RSMPI_* handles are constants of the C shim of `mpi-sys`,
    // initialised before main.
    unsafe {
        match dtype {
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::F64 => ffi::RSMPI_DOUBLE,
            DType::I32 => ffi::RSMPI_INT32_T,
            DType::I64 => ffi::RSMPI_INT64_T,
            DType::U8 => ffi::RSMPI_UINT8_T,
            DType::BF16 => ffi::RSMPI_UINT16_T,
            // DType is non_exhaustive; a new type needs a mapping here
            // before it can travel over MPI.
            _ => ffi::RSMPI_DATATYPE_NULL,
        }
    }
}

/// The (dtype, op) pairs that need a user-defined operator, in the order of
/// [`Reductions::user`].
const USER_OPS: [(DType, ReduceOp); 8] = [
    (DType::BF16, ReduceOp::Sum),
    (DType::BF16, ReduceOp::Product),
    (DType::BF16, ReduceOp::Min),
    (DType::BF16, ReduceOp::Max),
    (DType::F32, ReduceOp::Min),
    (DType::F32, ReduceOp::Max),
    (DType::F64, ReduceOp::Min),
    (DType::F64, ReduceOp::Max),
];

/// `inoutvec[i] = invec[i] op inoutvec[i]` for MPI, on `*len` elements.
///
/// # Safety
/// MPI's contract for user functions: `invec` and `inoutvec` point to `*len`
/// elements of `dtype` each, and do not overlap.
unsafe fn combine(
    dtype: DType,
    op: ReduceOp,
    invec: *mut c_void,
    inoutvec: *mut c_void,
    len: *mut c_int,
) {
    let n = usize::try_from(*len).unwrap_or(0) * dtype.size();
    if n == 0 {
        return;
    }
    let src = std::slice::from_raw_parts(invec as *const u8, n);
    let dst = std::slice::from_raw_parts_mut(inoutvec as *mut u8, n);
    let align = match dtype {
        DType::BF16 => std::mem::align_of::<bf16>(),
        DType::F32 => std::mem::align_of::<f32>(),
        _ => std::mem::align_of::<f64>(),
    };
    if (invec as usize | inoutvec as usize).is_multiple_of(align) {
        reduce_into(dtype, op, dst, src);
    } else {
        // MPI's own buffers are aligned for the type in every implementation
        // we know, but reduce_into would panic (and abort: this is called
        // from C) on one that is not: reduce aligned copies instead.
        let words = n.div_ceil(8);
        let mut a = vec![0u64; words];
        let mut b = vec![0u64; words];
        let (a, b) = (&mut bytes_of(&mut a)[..n], &mut bytes_of(&mut b)[..n]);
        a.copy_from_slice(dst);
        b.copy_from_slice(src);
        reduce_into(dtype, op, a, b);
        dst.copy_from_slice(a);
    }
}

fn bytes_of(words: &mut [u64]) -> &mut [u8] {
    // safety: u64 has no padding and every byte pattern is a u8.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast(), words.len() * 8) }
}

macro_rules! user_functions {
    ($($name:ident => $dtype:ident, $op:ident;)*) => {
        $(
            unsafe extern "C" fn $name(
                invec: *mut c_void,
                inoutvec: *mut c_void,
                len: *mut c_int,
                _datatype: *mut MPI_Datatype,
            ) {
                combine(DType::$dtype, ReduceOp::$op, invec, inoutvec, len)
            }
        )*
    };
}

user_functions! {
    bf16_sum => BF16, Sum;
    bf16_product => BF16, Product;
    bf16_min => BF16, Min;
    bf16_max => BF16, Max;
    f32_min => F32, Min;
    f32_max => F32, Max;
    f64_min => F64, Min;
    f64_max => F64, Max;
}

type UserFunction = unsafe extern "C" fn(*mut c_void, *mut c_void, *mut c_int, *mut MPI_Datatype);

const FUNCTIONS: [UserFunction; 8] = [
    bf16_sum,
    bf16_product,
    bf16_min,
    bf16_max,
    f32_min,
    f32_max,
    f64_min,
    f64_max,
];

/// The operators of one MPI initialisation; freed with [`Reductions::free`]
/// before MPI is finalised.
pub(crate) struct Reductions {
    user: [MPI_Op; 8],
}

impl Reductions {
    /// Creates the user-defined operators; returns the MPI error code of the
    /// first `MPI_Op_create` that fails.
    pub(crate) fn create() -> Result<Reductions, c_int> {
        // safety: RSMPI_SUM is a constant handle, used only as a placeholder
        // for slots that are overwritten below.
        let mut user = [unsafe { ffi::RSMPI_SUM }; 8];
        for (slot, f) in user.iter_mut().zip(FUNCTIONS) {
            // safety: `f` has MPI_User_function's signature and honours its
            // contract (see `combine`); `slot` is a valid MPI_Op to write.
            let rc = unsafe { ffi::MPI_Op_create(Some(f), 1, slot) };
            if rc != 0 {
                return Err(rc);
            }
        }
        Ok(Reductions { user })
    }

    /// The MPI datatype and operator that compute `op` on `dtype` (Avg as Sum).
    pub(crate) fn get(&self, dtype: DType, op: ReduceOp) -> (MPI_Datatype, MPI_Op) {
        let op = if op == ReduceOp::Avg {
            ReduceOp::Sum
        } else {
            op
        };
        let mpi_op = match USER_OPS.iter().position(|&u| u == (dtype, op)) {
            Some(i) => self.user[i],
            // safety: constant handles of the `mpi-sys` shim.
            None => unsafe {
                match op {
                    ReduceOp::Product => ffi::RSMPI_PROD,
                    ReduceOp::Min => ffi::RSMPI_MIN,
                    ReduceOp::Max => ffi::RSMPI_MAX,
                    _ => ffi::RSMPI_SUM,
                }
            },
        };
        (datatype(dtype), mpi_op)
    }

    /// Frees the user-defined operators (before `MPI_Finalize`).
    pub(crate) fn free(&mut self) {
        for op in &mut self.user {
            // safety: each was created by MPI_Op_create and is freed once;
            // no call that uses it is in flight when the backend is dropped.
            unsafe { ffi::MPI_Op_free(op) };
        }
    }
}

/// The second half of Avg: divides a summed float buffer by `world`, as
/// cohort's TCP backend does (bf16 through f32, rounded to nearest-even).
pub(crate) fn finish_avg(dtype: DType, buf: &mut [u8], world: usize) {
    fn each<const N: usize>(buf: &mut [u8], f: impl Fn([u8; N]) -> [u8; N]) {
        for chunk in buf.chunks_exact_mut(N) {
            let x: [u8; N] = chunk.try_into().expect("chunks_exact gives N bytes");
            chunk.copy_from_slice(&f(x));
        }
    }
    match dtype {
        DType::F32 => each::<4>(buf, |x| {
            (f32::from_ne_bytes(x) / world as f32).to_ne_bytes()
        }),
        DType::F64 => each::<8>(buf, |x| {
            (f64::from_ne_bytes(x) / world as f64).to_ne_bytes()
        }),
        DType::BF16 => each::<2>(buf, |x| {
            bf16::from_f32(bf16::from_ne_bytes(x).to_f32() / world as f32).to_ne_bytes()
        }),
        // The group rejects Avg on integer types before the call.
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn avg_divides_like_cohort() {
        let mut f = [3.0f32, -1.0];
        let b: &mut [u8] = bytes_of_f32(&mut f);
        finish_avg(DType::F32, b, 2);
        assert_eq!(f, [1.5, -0.5]);
        let mut h = [bf16::from_f32(3.0), bf16::from_f32(1.0)];
        // safety: bf16 is two bytes without padding.
        let b = unsafe { std::slice::from_raw_parts_mut(h.as_mut_ptr().cast::<u8>(), 4) };
        finish_avg(DType::BF16, b, 3);
        assert_eq!(h, [bf16::from_f32(1.0), bf16::from_f32(1.0 / 3.0)]);
    }

    fn bytes_of_f32(v: &mut [f32]) -> &mut [u8] {
        // safety: f32 has no padding.
        unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), v.len() * 4) }
    }

    #[test]
    fn user_functions_run_cohorts_kernel_even_on_unaligned_buffers() {
        // bf16 sum of 1.0 + 2^-8 rounds to even (1.0), as cohort's kernel does.
        let mut store = [0u8; 9];
        let dst = &mut store[1..5]; // odd address: unaligned for bf16
        dst[..2].copy_from_slice(&bf16::from_f32(1.0).to_ne_bytes());
        dst[2..].copy_from_slice(&bf16::from_f32(f32::NAN).to_ne_bytes());
        let mut src = [bf16::from_f32(1.0 / 256.0), bf16::from_f32(2.0)];
        let mut len: c_int = 2;
        // safety: both buffers hold `len` bf16 values.
        unsafe {
            combine(
                DType::BF16,
                ReduceOp::Sum,
                src.as_mut_ptr().cast(),
                dst.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let out0 = bf16::from_ne_bytes([dst[0], dst[1]]);
        let out1 = bf16::from_ne_bytes([dst[2], dst[3]]);
        assert_eq!(out0, bf16::from_f32(1.0));
        assert!(out1.is_nan());

        let mut a = [1.0f32, f32::NAN];
        let mut b = [f32::NAN, 5.0];
        let mut len: c_int = 2;
        // safety: both buffers hold `len` f32 values.
        unsafe {
            combine(
                DType::F32,
                ReduceOp::Max,
                b.as_mut_ptr().cast(),
                a.as_mut_ptr().cast(),
                &mut len,
            )
        };
        assert!(a[0].is_nan() && a[1].is_nan(), "NaN wins from either side");
    }
}
