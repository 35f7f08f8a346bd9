//! The seam a host-staged collective needs from a backend: an [`Event`] (a point in the
//! backend's queue of kernels, recorded as backward hands a range of gradients over) and
//! [`Staging`] (host memory the backend's copies write at full speed: page-locked on a GPU).
//!
//! With them a data-parallel step overlaps its communication with backward on a device
//! (`Backend::record_event`, then `Backend::copy_to_host_after` on another thread): the copy
//! of a finished range waits for the kernels before its event only, not for the ones backward
//! launches after it; `Backend::copy_from_host_beside` brings a reduced bucket back while they
//! run. On the CPU and the emulated device kernels are done when they return, so an event is
//! [`Event::done`] and the copies are immediate.
//!
//! This module only carries and frees memory and handles; it never computes, and never hands
//! out host memory a device may still be writing (a copy into a [`Staging`] returns only once
//! it has landed).

use std::any::Any;
use std::ops::{Deref, DerefMut};

use crate::AlignedFloats;

/// A point in a backend's queue of kernels: the kernels launched before it was recorded (see
/// `Backend::record_event`). On a device it holds the device's event object; on a backend whose
/// kernels finish before they return it holds nothing ([`Event::done`]).
pub struct Event {
    device: Option<Box<dyn Any + Send + Sync>>,
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.device {
            Some(_) => "Event(device)",
            None => "Event(done)",
        })
    }
}

impl Event {
    /// An event already complete: what a backend that runs its kernels synchronously records,
    /// and what a device records after waiting for its kernels instead.
    pub fn done() -> Event {
        Event { device: None }
    }

    /// A device's event object, which its backend gets back with [`Event::device`].
    pub fn on_device(event: Box<dyn Any + Send + Sync>) -> Event {
        Event {
            device: Some(event),
        }
    }

    /// The device's event object (None for [`Event::done`]).
    pub fn device(&self) -> Option<&(dyn Any + Send + Sync)> {
        self.device.as_deref()
    }
}

/// Host floats a backend's copies to and from the host use: page-locked on a GPU (a copy into
/// pageable memory is staged through the driver's own buffer at a fraction of the speed), a
/// 64-byte aligned allocation elsewhere. Zeroed when made; a slice of f32 to the host.
pub struct Staging {
    ptr: *mut f32,
    len: usize,
    /// Frees the floats when dropped (a device's page-locked allocation, or the host floats).
    _owner: Box<dyn Any + Send + Sync>,
}

// SAFETY: a `Staging` owns its floats exclusively (the constructors' contract) as a `Vec<f32>`
// does, and its owner is `Send + Sync`; moving or sharing it across threads is sound for the
// same reasons as for a `Vec<f32>`.
unsafe impl Send for Staging {}
// SAFETY: as above: `&Staging` only reads the floats.
unsafe impl Sync for Staging {}

impl std::fmt::Debug for Staging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staging").field("len", &self.len).finish()
    }
}

impl Default for Staging {
    /// Empty.
    fn default() -> Staging {
        Staging::host(0)
    }
}

impl Staging {
    /// `len` zeroed floats of ordinary host memory (what the CPU backend stages in).
    pub fn host(len: usize) -> Staging {
        let mut floats = AlignedFloats::zeroed(len);
        let ptr = floats.as_mut_slice().as_mut_ptr();
        // SAFETY: `ptr` is the start of `len` initialised floats that `floats` owns and keeps
        // in place (its heap buffer does not move when the `AlignedFloats` value does), and
        // nothing else reaches them once `floats` is moved into the owner.
        unsafe { Staging::from_raw(ptr, len, Box::new(floats)) }
    }

    /// Staging over `len` floats at `ptr`, freed when `owner` is dropped: how a device backend
    /// hands out page-locked memory it allocated.
    ///
    /// # Safety
    /// `ptr` must be aligned and point to `len` initialised floats that stay allocated, at the
    /// same address, until `owner` is dropped; nothing but this `Staging` may read or write
    /// them meanwhile (a device copy into them must have completed before the call that made
    /// it returns), and `owner`'s drop must not touch them before it frees them.
    pub unsafe fn from_raw(
        ptr: *mut f32,
        len: usize,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Staging {
        Staging {
            ptr,
            len,
            _owner: owner,
        }
    }
}

impl Deref for Staging {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // SAFETY: `len` initialised floats owned by this value (the constructors' contract),
        // borrowed as `self` is.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl DerefMut for Staging {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as for `deref`, and `&mut self` makes this borrow the only one.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_staging_is_zeroed_aligned_and_writable() {
        let mut s = Staging::host(40);
        assert_eq!(s.len(), 40);
        assert!(s.iter().all(|&x| x == 0.0));
        assert_eq!(s.as_ptr() as usize % 64, 0);
        s[39] = 2.0;
        let moved = s;
        assert_eq!(moved[39], 2.0);
        assert!(Staging::default().is_empty());
        assert!(Event::done().device().is_none());
        assert!(Event::on_device(Box::new(3u8)).device().is_some());
    }
}
