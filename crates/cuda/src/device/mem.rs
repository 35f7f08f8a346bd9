//! [`Mem`]: the device memory a kernel method reads or writes, whoever owns it: a cudarc
//! buffer of this crate's own (the check, the tests) or an engine buffer view's address and
//! length ([`Raw`], what the engine backend passes). The kernel methods only need a pointer and
//! a length, checked against the dims before each launch; this module never launches.

use std::marker::PhantomData;

use cudarc::driver::{CudaSlice, DevicePtr};

use super::Device;

/// Device memory of `len()` elements of `T`.
pub trait Mem<T> {
    /// Number of elements.
    fn len(&self) -> usize;
    /// Whether it holds no element.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Its address on `dev`, as a kernel argument.
    fn ptr(&self, dev: &Device) -> u64;
}

impl<T> Mem<T> for CudaSlice<T> {
    fn len(&self) -> usize {
        CudaSlice::len(self)
    }
    fn ptr(&self, dev: &Device) -> u64 {
        self.device_ptr(&dev.stream).0
    }
}

/// `len` elements at a device address some other owner keeps allocated (an engine buffer's
/// view) for as long as the kernel method that takes it runs.
#[derive(Debug)]
pub struct Raw<T> {
    addr: u64,
    len: usize,
    _elem: PhantomData<T>,
}

impl<T> Raw<T> {
    /// The memory at `addr`: `len` elements that stay allocated while it is used.
    pub fn new(addr: u64, len: usize) -> Raw<T> {
        Raw {
            addr,
            len,
            _elem: PhantomData,
        }
    }
}

impl<T> Raw<T> {
    /// The same memory as bytes.
    pub fn bytes(&self) -> Raw<u8> {
        Raw::new(self.addr, self.len * std::mem::size_of::<T>())
    }
}

impl<T> Mem<T> for Raw<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn ptr(&self, _: &Device) -> u64 {
        self.addr
    }
}
