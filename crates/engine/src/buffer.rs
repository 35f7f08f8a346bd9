//! [`Buffer`]: memory a backend allocated (host or device), and the borrowed views
//! ([`View`], [`ViewMut`]) its kernels take.
//!
//! A buffer is one allocation of f32s: on the host today's [`AlignedFloats`] (64-byte aligned,
//! zeroed), on a device an address, a length and an owner object the device backend supplies
//! (dropping the owner frees the memory, so the engine never links a device library). Views
//! are what a buffer's borrow hands out: an address, a length and the [`Device`] it lives on,
//! with the lifetime and mutability of a `&[T]` / `&mut [T]`. They are carved as slices are
//! ([`ViewMut::slice_mut`], [`ViewMut::split_at_mut`], consuming `into_*` forms that keep the
//! lifetime), so two `ViewMut`s never overlap: the borrow checker sees the same borrows it
//! saw for slices. A view may be reinterpreted as the other element types the kernels read
//! ([`Elem`]: bf16 bits, token ids, targets, mask bytes) over the same bytes.
//!
//! Only a host view is ever dereferenced, and only through [`View::host`] /
//! [`ViewMut::host`]; a host view is only ever made from a real slice, so holding one is as
//! sound as holding the slice. A device address is carried, offset and compared, never read.
//! This module never computes and never allocates after a buffer is made.

use std::any::Any;
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};

use crate::{AlignedFloats, Device};

mod sealed {
    pub trait Sealed {}
}

/// An element type a view may hold: plain data with no invalid bit patterns.
pub trait Elem: Copy + Send + Sync + 'static + sealed::Sealed {}

macro_rules! elems {
    ($($t:ty),*) => { $( impl sealed::Sealed for $t {} impl Elem for $t {} )* };
}
elems!(f32, u16, u32, i32, u8);

/// Device memory: its address, its length in f32s, and what frees it when dropped.
struct DeviceMemory {
    addr: u64,
    len: usize,
    device: Device,
    owner: Box<dyn Any + Send + Sync>,
}

enum Memory {
    Host(AlignedFloats),
    Device(DeviceMemory),
}

/// A backend's allocation of f32s (see the module doc). `Default` is an empty host buffer.
pub struct Buffer {
    mem: Memory,
}

impl Default for Buffer {
    /// Empty, allocating nothing (what a released buffer is replaced by).
    fn default() -> Buffer {
        AlignedFloats::default().into()
    }
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("device", &self.device())
            .field("len", &self.len())
            .finish()
    }
}

impl From<AlignedFloats> for Buffer {
    fn from(floats: AlignedFloats) -> Buffer {
        Buffer {
            mem: Memory::Host(floats),
        }
    }
}

impl Buffer {
    /// `len` zeros in host memory, 64-byte aligned (what the CPU backend allocates).
    pub fn host(len: usize) -> Buffer {
        AlignedFloats::zeroed(len).into()
    }

    /// A buffer of `len` f32s at `addr` in `device`'s memory, which stays allocated until
    /// `owner` is dropped: how a device backend hands out what it allocated (the owner is its
    /// own allocation type, which [`Buffer::owner`] gives back). Panics if `device` is the host:
    /// a host buffer is only ever made from host memory ([`Buffer::host`]).
    pub fn on_device(
        device: Device,
        addr: u64,
        len: usize,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Buffer {
        assert!(
            device != Device::Cpu,
            "Buffer::on_device: a device buffer on the host (use Buffer::host)"
        );
        Buffer {
            mem: Memory::Device(DeviceMemory {
                addr,
                len,
                device,
                owner,
            }),
        }
    }

    /// Number of f32s.
    pub fn len(&self) -> usize {
        match &self.mem {
            Memory::Host(h) => h.len(),
            Memory::Device(d) => d.len,
        }
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where it lives.
    pub fn device(&self) -> Device {
        match &self.mem {
            Memory::Host(_) => Device::Cpu,
            Memory::Device(d) => d.device,
        }
    }

    /// The owner a device backend gave [`Buffer::on_device`] (None for a host buffer).
    pub fn owner(&self) -> Option<&(dyn Any + Send + Sync)> {
        match &self.mem {
            Memory::Host(_) => None,
            Memory::Device(d) => Some(&*d.owner),
        }
    }

    /// The whole buffer, readable.
    pub fn view(&self) -> View<'_, f32> {
        match &self.mem {
            Memory::Host(h) => View::from(&h[..]),
            Memory::Device(d) => View {
                ptr: device_ptr(d.addr),
                len: d.len,
                device: d.device,
                _borrow: PhantomData,
            },
        }
    }

    /// The whole buffer, writable.
    pub fn view_mut(&mut self) -> ViewMut<'_, f32> {
        match &mut self.mem {
            Memory::Host(h) => ViewMut::from(&mut h[..]),
            Memory::Device(d) => ViewMut {
                ptr: device_ptr(d.addr),
                len: d.len,
                device: d.device,
                _borrow: PhantomData,
            },
        }
    }

    /// The floats, when the buffer is in host memory.
    pub fn host_slice(&self) -> Option<&[f32]> {
        match &self.mem {
            Memory::Host(h) => Some(h),
            Memory::Device(_) => None,
        }
    }

    /// The floats, writable, when the buffer is in host memory.
    pub fn host_slice_mut(&mut self) -> Option<&mut [f32]> {
        match &mut self.mem {
            Memory::Host(h) => Some(h),
            Memory::Device(_) => None,
        }
    }
}

/// A device address as a pointer that is never dereferenced (it carries no host provenance).
fn device_ptr<T>(addr: u64) -> *mut T {
    std::ptr::without_provenance_mut(addr as usize)
}

/// `range` of `0..len` as `start..end`, panicking as slice indexing does when out of bounds.
fn bounds(range: impl RangeBounds<usize>, len: usize) -> (usize, usize) {
    let start = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s + 1,
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e + 1,
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    assert!(
        start <= end && end <= len,
        "view range {start}..{end} out of bounds for a view of {len}"
    );
    (start, end)
}

/// Where a view's elements live and how many: shared by both kinds of view.
macro_rules! view_common {
    ($v:ident) => {
        impl<'a, T: Elem> $v<'a, T> {
            /// Number of elements.
            #[inline]
            pub fn len(&self) -> usize {
                self.len
            }
            /// Whether it has no element.
            #[inline]
            pub fn is_empty(&self) -> bool {
                self.len == 0
            }
            /// Where its elements live.
            #[inline]
            pub fn device(&self) -> Device {
                self.device
            }
            /// Its first element's address: a host pointer, or a device address as an integer
            /// (what a device backend passes to its kernels).
            #[inline]
            pub fn addr(&self) -> u64 {
                self.ptr as usize as u64
            }
            /// The view over `range` of its elements, `start..end` with `start <= end <= len`
            /// (the pointer of an empty view at `len` is one past the end, as a slice's).
            #[inline]
            fn at(self, (start, end): (usize, usize)) -> Self {
                $v {
                    // wrapping: a device address is not a host allocation (in bounds anyway)
                    ptr: self.ptr.wrapping_add(start),
                    len: end - start,
                    ..self
                }
            }
            /// The same bytes as elements of `U` (f32 as bf16 bits, token ids, mask bytes...).
            /// Panics where the bytes do not divide into whole, aligned `U`s.
            #[inline]
            pub fn cast<U: Elem>(self) -> $v<'a, U> {
                let bytes = self.len * std::mem::size_of::<T>();
                let (size, align) = (std::mem::size_of::<U>(), std::mem::align_of::<U>());
                assert!(
                    bytes % size == 0 && (self.ptr as usize) % align == 0,
                    "view cast: {bytes} bytes at {:#x} are not whole {}s",
                    self.ptr as usize,
                    std::any::type_name::<U>()
                );
                $v {
                    ptr: self.ptr as _,
                    len: bytes / size,
                    device: self.device,
                    _borrow: PhantomData,
                }
            }
        }
        // SAFETY: a view is a borrow of `len` elements of a `T: Send + Sync`, as `&[T]` /
        // `&mut [T]` is; sending or sharing it across threads is sound for the same reasons.
        unsafe impl<T: Elem> Send for $v<'_, T> {}
        // SAFETY: as above (a `&mut [T]` is `Sync` when `T` is).
        unsafe impl<T: Elem> Sync for $v<'_, T> {}
        impl<T: Elem> std::fmt::Debug for $v<'_, T> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($v))
                    .field("device", &self.device)
                    .field("len", &self.len)
                    .finish()
            }
        }
    };
}

/// A read-only borrow of `len` elements of a buffer (or of a host slice), like `&'a [T]`.
#[derive(Clone, Copy)]
pub struct View<'a, T: Elem> {
    ptr: *const T,
    len: usize,
    device: Device,
    _borrow: PhantomData<&'a [T]>,
}

/// A writable, exclusive borrow of `len` elements of a buffer (or of a host slice), like
/// `&'a mut [T]`: no other view overlaps it while it lives.
pub struct ViewMut<'a, T: Elem> {
    ptr: *mut T,
    len: usize,
    device: Device,
    _borrow: PhantomData<&'a mut [T]>,
}

impl<T: Elem> Default for View<'_, T> {
    /// An empty host view (as `&[]` is).
    fn default() -> Self {
        View::from(&[][..])
    }
}

impl<T: Elem> Default for ViewMut<'_, T> {
    /// An empty host view (as `&mut []` is).
    fn default() -> Self {
        ViewMut::from(&mut [][..])
    }
}

view_common!(View);
view_common!(ViewMut);

impl<'a, T: Elem> From<&'a [T]> for View<'a, T> {
    #[inline]
    fn from(s: &'a [T]) -> View<'a, T> {
        View {
            ptr: s.as_ptr(),
            len: s.len(),
            device: Device::Cpu,
            _borrow: PhantomData,
        }
    }
}

impl<'a, T: Elem> From<&'a mut [T]> for View<'a, T> {
    #[inline]
    fn from(s: &'a mut [T]) -> View<'a, T> {
        View::from(&*s)
    }
}

impl<'a, T: Elem> From<&'a mut [T]> for ViewMut<'a, T> {
    #[inline]
    fn from(s: &'a mut [T]) -> ViewMut<'a, T> {
        ViewMut {
            ptr: s.as_mut_ptr(),
            len: s.len(),
            device: Device::Cpu,
            _borrow: PhantomData,
        }
    }
}

impl<'a, T: Elem> From<ViewMut<'a, T>> for View<'a, T> {
    #[inline]
    fn from(v: ViewMut<'a, T>) -> View<'a, T> {
        View {
            ptr: v.ptr,
            len: v.len,
            device: v.device,
            _borrow: PhantomData,
        }
    }
}

#[cold]
#[inline(never)]
fn not_on_host(device: Device, len: usize) -> ! {
    panic!(
        "a view of {len} elements on {device} reached host code: only a host buffer's views \
         can be read on the host (copy it to the host first)"
    )
}

impl<'a, T: Elem> View<'a, T> {
    /// `range` of it.
    #[inline]
    pub fn slice(self, range: impl RangeBounds<usize>) -> View<'a, T> {
        let b = bounds(range, self.len);
        self.at(b)
    }

    /// The first `mid` elements and the rest.
    #[inline]
    pub fn split_at(self, mid: usize) -> (View<'a, T>, View<'a, T>) {
        (self.slice(..mid), self.slice(mid..))
    }

    /// The host slice it is, or None on a device.
    #[inline]
    pub fn try_host(self) -> Option<&'a [T]> {
        // SAFETY: a host view is only made from a `&'a [T]` or `&'a mut [T]` (a slice or a
        // host buffer's floats, possibly cast to an `Elem` of whole aligned elements) and
        // narrowed within it, and no `ViewMut` of those elements lives while it does.
        (self.device == Device::Cpu)
            .then(|| unsafe { std::slice::from_raw_parts(self.ptr, self.len) })
    }

    /// The host slice it is. Panics for a device view: a backend's kernels only ever see
    /// views of the buffers that backend allocated.
    #[inline]
    pub fn host(self) -> &'a [T] {
        match self.try_host() {
            Some(s) => s,
            None => not_on_host(self.device, self.len),
        }
    }
}

impl<'a, T: Elem> View<'a, T> {
    /// The elements of a device view whose device memory is host memory (the emulated
    /// device's).
    ///
    /// # Safety
    /// The view's bytes must lie in a live host allocation whose address was exposed
    /// (`expose_provenance`), borrowed as this view is.
    pub(crate) unsafe fn emulated_host(self) -> &'a [T] {
        let ptr = std::ptr::with_exposed_provenance::<T>(self.ptr as usize);
        // SAFETY: the caller's contract: `len` elements at `ptr` in a live, exposed host
        // allocation, aligned (views are carved from aligned floats and cast checks alignment).
        unsafe { std::slice::from_raw_parts(ptr, self.len) }
    }
}

impl<'a, T: Elem> ViewMut<'a, T> {
    /// [`View::emulated_host`], writable.
    ///
    /// # Safety
    /// As for [`View::emulated_host`], and no other view of these bytes lives while it does.
    pub(crate) unsafe fn emulated_host(self) -> &'a mut [T] {
        let ptr = std::ptr::with_exposed_provenance_mut::<T>(self.ptr as usize);
        // SAFETY: the caller's contract, and a `ViewMut` borrows its elements exclusively.
        unsafe { std::slice::from_raw_parts_mut(ptr, self.len) }
    }
}

impl<'a, T: Elem> ViewMut<'a, T> {
    /// A shorter-lived view of the same elements (what `&mut *slice` is for a slice).
    #[inline]
    pub fn reborrow(&mut self) -> ViewMut<'_, T> {
        ViewMut {
            ptr: self.ptr,
            len: self.len,
            device: self.device,
            _borrow: PhantomData,
        }
    }

    /// A read-only view of the same elements for as long as this one is not used.
    #[inline]
    pub fn as_view(&self) -> View<'_, T> {
        View {
            ptr: self.ptr,
            len: self.len,
            device: self.device,
            _borrow: PhantomData,
        }
    }

    /// `range` of it, read-only, borrowed from it.
    #[inline]
    pub fn slice(&self, range: impl RangeBounds<usize>) -> View<'_, T> {
        self.as_view().slice(range)
    }

    /// `range` of it, writable, borrowed from it.
    #[inline]
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> ViewMut<'_, T> {
        self.reborrow().into_slice(range)
    }

    /// `range` of it, for the whole of its lifetime.
    #[inline]
    pub fn into_slice(self, range: impl RangeBounds<usize>) -> ViewMut<'a, T> {
        let b = bounds(range, self.len);
        self.at(b)
    }

    /// The first `mid` elements and the rest: two views that do not overlap.
    #[inline]
    pub fn split_at_mut(self, mid: usize) -> (ViewMut<'a, T>, ViewMut<'a, T>) {
        let (_, mid) = bounds(..mid, self.len);
        let (ptr, len, device) = (self.ptr, self.len, self.device);
        let part = |start: usize, end: usize| ViewMut {
            // wrapping: a device address is not a host allocation (in bounds anyway)
            ptr: ptr.wrapping_add(start),
            len: end - start,
            device,
            _borrow: PhantomData,
        };
        (part(0, mid), part(mid, len))
    }

    /// The one view over `self` and `next`, which must start where `self` ends, on the same
    /// device: what two pieces of one buffer handed out apart (a backward's ranges of the
    /// gradient buffer) become again to be reduced in one collective. `None` (both views
    /// given up) where they are not adjacent.
    ///
    /// # Safety
    /// Both views must have been carved (sliced or split) from one buffer or one slice:
    /// adjacent addresses alone do not make two allocations one.
    #[inline]
    pub unsafe fn join(self, next: ViewMut<'a, T>) -> Option<ViewMut<'a, T>> {
        let adjacent =
            self.device == next.device && std::ptr::eq(self.ptr.wrapping_add(self.len), next.ptr);
        adjacent.then_some(ViewMut {
            len: self.len + next.len,
            ..self
        })
    }

    /// The host slice it is, or None on a device.
    #[inline]
    pub fn try_host(self) -> Option<&'a mut [T]> {
        // SAFETY: a host view is only made from a `&'a mut [T]` (a slice or a host buffer's
        // floats, possibly cast to an `Elem` of whole aligned elements) and narrowed or split
        // within it without overlap, so these elements are borrowed by this view alone.
        (self.device == Device::Cpu)
            .then(|| unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }

    /// The host slice it is. Panics for a device view: a backend's kernels only ever see
    /// views of the buffers that backend allocated.
    #[inline]
    pub fn host(self) -> &'a mut [T] {
        let (device, len) = (self.device, self.len);
        match self.try_host() {
            Some(s) => s,
            None => not_on_host(device, len),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adjacent_pieces_of_one_buffer_join_and_others_do_not() {
        let mut b = Buffer::host(10);
        let (lo, hi) = b.view_mut().split_at_mut(4);
        let (mid, top) = hi.split_at_mut(3);
        // SAFETY: all three are pieces of `b`.
        let joined = unsafe { lo.join(mid) }.unwrap();
        assert_eq!(joined.len(), 7);
        let (mut joined, top) = (joined, top);
        joined.slice_mut(..).host().fill(1.0);
        top.host().fill(2.0);
        assert_eq!(b.host_slice().unwrap()[6..8], [1.0, 2.0]);
        let (lo, hi) = b.view_mut().split_at_mut(5);
        // SAFETY: both pieces of `b`; out of order, so not adjacent.
        assert!(unsafe { hi.join(lo) }.is_none());
    }

    #[test]
    fn host_buffers_are_aligned_zeroed_and_viewed_in_place() {
        let mut b = Buffer::host(40);
        assert_eq!((b.len(), b.device()), (40, Device::Cpu));
        assert!(b.owner().is_none());
        let p = b.host_slice().unwrap().as_ptr();
        assert_eq!(p as usize % 64, 0);
        let v = b.view_mut();
        assert_eq!(v.addr(), p as u64);
        let (mut lo, hi) = v.split_at_mut(16);
        lo.slice_mut(2..4).host().fill(1.0);
        hi.into_slice(..3).host().fill(2.0);
        let got = b.host_slice().unwrap();
        assert_eq!(&got[..5], &[0.0, 0.0, 1.0, 1.0, 0.0]);
        assert_eq!(&got[15..20], &[0.0, 2.0, 2.0, 2.0, 0.0]);
        assert_eq!(b.view().slice(16..).split_at(1).0.host(), &[2.0]);
    }

    #[test]
    fn casts_cover_the_same_bytes() {
        let mut b = Buffer::host(4);
        let halves = b.view_mut().cast::<u16>();
        assert_eq!(halves.len(), 8);
        halves.host()[1] = 0x3f80; // bf16 1.0 in the upper half of float 0 (little endian)
        assert_eq!(b.host_slice().unwrap()[0], 1.0);
        assert_eq!(b.view().cast::<u8>().len(), 16);
        let mut ids = [1u32, 2, 3];
        let v = ViewMut::from(&mut ids[..]).cast::<i32>();
        assert_eq!(v.as_view().host(), &[1, 2, 3]);
    }

    #[test]
    #[should_panic(expected = "out of bounds")]
    fn slicing_past_the_end_panics_as_a_slice_does() {
        Buffer::host(4).view().slice(2..5);
    }

    #[test]
    #[should_panic(expected = "not whole")]
    fn casting_to_a_wider_type_checks_the_bytes() {
        let mut h = [0u16; 3];
        ViewMut::from(&mut h[..]).cast::<f32>();
    }

    /// A device buffer as a device backend would make one: views carry its address, are carved
    /// as host views are, and never reach host code.
    #[test]
    fn device_views_carry_addresses_and_never_deref() {
        let dev = Device::Cuda(0);
        let mut b = Buffer::on_device(dev, 0x1000, 64, Box::new(7u32));
        assert_eq!((b.len(), b.device()), (64, dev));
        assert!(b.host_slice().is_none() && b.host_slice_mut().is_none());
        assert_eq!(b.owner().unwrap().downcast_ref::<u32>(), Some(&7));
        let (a, c) = b.view_mut().split_at_mut(16);
        assert_eq!((a.addr(), a.len()), (0x1000, 16));
        assert_eq!((c.addr(), c.len(), c.device()), (0x1000 + 64, 48, dev));
        assert!(c.try_host().is_none());
        let v = b.view().slice(4..).cast::<u16>();
        assert_eq!((v.addr(), v.len()), (0x1010, 120));
        let v = std::panic::AssertUnwindSafe(b.view());
        let err = std::panic::catch_unwind(move || {
            let v = v;
            v.0.host().len()
        })
        .unwrap_err();
        let msg = err.downcast_ref::<String>().unwrap();
        assert!(msg.contains("on cuda:0 reached host code"), "{msg}");
    }
}
