//! [`Emulated`]: a device backend whose device memory is host memory, so that code written for
//! a device (a model that allocates through its backend, copies to and from the host, and never
//! reads a buffer on the host between kernels) is tested on a machine without a GPU.
//!
//! Its buffers are [`Device::Emulated`] buffers: their views reach host code only through the
//! backend (a host read of one panics as a GPU buffer's would), and its kernels are the CPU's,
//! so a model on it computes the CPU's bits. Every view a kernel receives is checked against
//! the allocations this backend made and that are still alive; only then is its address read
//! as host memory. It is a test tool: it must never be picked for speed or for real work.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use crate::cpu::Cpu;
use crate::{AlignedFloats, Buffer, DType, Device, EngineError};

/// Live allocations: start address to end address (bytes, exclusive).
type Live = Arc<Mutex<BTreeMap<u64, u64>>>;

/// A device emulated in host memory, computing with a [`Cpu`]'s kernels (see the module doc).
#[derive(Debug)]
pub struct Emulated {
    cpu: Cpu,
    live: Live,
    /// What [`Backend::missing_kernels`](crate::Backend::missing_kernels) reports.
    missing: &'static [&'static str],
}

/// One allocation: its floats, and its entry in the live map while it lives.
struct Allocation {
    _floats: AlignedFloats,
    start: u64,
    live: Live,
}

impl Drop for Allocation {
    fn drop(&mut self) {
        lock(&self.live).remove(&self.start);
    }
}

fn lock(live: &Live) -> std::sync::MutexGuard<'_, BTreeMap<u64, u64>> {
    // A panic while the map is held leaves it consistent (every update is one insert/remove).
    live.lock().unwrap_or_else(|e| e.into_inner())
}

impl Emulated {
    /// An emulated device computing on `threads` CPU threads in `dtype` (f32 where the CPU
    /// lacks the bf16 product, as [`Cpu::with_dtype`]).
    pub fn new(threads: usize, dtype: DType) -> Result<Emulated, EngineError> {
        Ok(Emulated {
            cpu: Cpu::with_dtype(threads, dtype)?,
            live: Live::default(),
            missing: &[],
        })
    }

    /// The same, reporting `kernels` as missing (as a device backend without their bodies
    /// does); it still runs them.
    pub fn lacking(self, kernels: &'static [&'static str]) -> Emulated {
        Emulated {
            missing: kernels,
            ..self
        }
    }

    /// The kernels it reports as missing.
    pub(crate) fn missing(&self) -> &'static [&'static str] {
        self.missing
    }

    /// The CPU that runs its kernels.
    pub(crate) fn cpu(&self) -> &Cpu {
        &self.cpu
    }

    /// `len` zeroed floats, registered as live until the buffer is dropped.
    pub(crate) fn alloc_buffer(&self, len: usize) -> Buffer {
        let floats = AlignedFloats::zeroed(len);
        // Exposed, so that a view's address can be read back as a host pointer.
        let start = floats.as_ptr().expose_provenance() as u64;
        lock(&self.live).insert(start, start + 4 * len as u64);
        let owner = Allocation {
            _floats: floats,
            start,
            live: self.live.clone(),
        };
        Buffer::on_device(Device::Emulated, start, len, Box::new(owner))
    }

    /// Panics unless `bytes` at `addr` on `device` lie in one live allocation of this backend.
    pub(crate) fn check(&self, device: Device, addr: u64, bytes: usize) {
        let live = lock(&self.live);
        let inside = device == Device::Emulated
            && live
                .range(..=addr)
                .next_back()
                .is_some_and(|(_, &end)| addr + bytes as u64 <= end);
        assert!(
            inside,
            "a view of {bytes} bytes at {addr:#x} on {device} is not memory of this emulated device"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Backend;

    #[test]
    fn kernels_run_on_its_buffers_and_host_code_cannot_read_them() {
        let dev = Emulated::new(2, DType::F32).unwrap();
        let dev: &dyn Backend = &dev;
        let mut buf = dev.alloc(8).unwrap();
        assert_eq!(buf.device(), Device::Emulated);
        assert!(buf.host_slice().is_none());
        dev.upload(buf.view_mut(), &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
            .unwrap();
        let (mut a, b) = buf.view_mut().split_at_mut(4);
        dev.add_into(a.reborrow(), b.as_view());
        assert_eq!(dev.sum_squares(a.as_view()), 36.0 + 64.0 + 100.0 + 144.0);
        let mut out = [0f32; 4];
        dev.download(&mut out, buf.view().slice(..4)).unwrap();
        assert_eq!(out, [6.0, 8.0, 10.0, 12.0]);
        assert!(buf.view().try_host().is_none());
    }

    #[test]
    #[should_panic(expected = "is not memory of this emulated device")]
    fn views_of_other_memory_are_refused() {
        let dev = Emulated::new(1, DType::F32).unwrap();
        let other = Emulated::new(1, DType::F32).unwrap();
        let mut buf = other.alloc_buffer(4);
        dev.fill(buf.view_mut(), 1.0);
    }
}
