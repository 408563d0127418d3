//! Registered memory: page-aligned buffers registered with the device once and reused.
//!
//! Registering memory pins it and programs the NIC's translation tables, which costs far
//! more than a message; so the transport registers its receive rings and send staging
//! buffers through a [`BufferPool`] owned by the endpoint. A buffer returned to the pool
//! (when a generation's transport is dropped, after its queue pairs are destroyed) keeps
//! its registration and is handed out again to the next generation. Buffers are deregistered
//! (`ibv_dereg_mr`) and freed only when dropped by the pool.

use super::device::Device;
use crate::TransportError;
use rdma_sys as ffi;
use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

const ALIGN: usize = 4096;

/// A page-aligned buffer with its memory registration.
pub struct RegisteredBuffer {
    ptr: NonNull<u8>,
    layout: Layout,
    mr: NonNull<ffi::ibv_mr>,
    // Keeps the PD alive while the MR exists.
    _device: Arc<Device>,
}

// SAFETY: the buffer is plain memory plus an MR handle; verbs handles are thread-safe, and
// all access to the bytes goes through the bounds-checked copy methods below.
unsafe impl Send for RegisteredBuffer {}
// SAFETY: see Send; concurrent copies touch disjoint slots by the credit protocol.
unsafe impl Sync for RegisteredBuffer {}

impl RegisteredBuffer {
    /// Allocates `len` zeroed bytes (at least 1) and registers them for local writes and, if
    /// `remote_write`, for RDMA writes by peers.
    pub fn new(device: &Arc<Device>, len: usize, remote_write: bool) -> Result<Self, TransportError> {
        let layout = Layout::from_size_align(len.max(1), ALIGN)
            .map_err(|e| TransportError::InvalidArgument(format!("registered buffer of {len} bytes: {e}")))?;
        // SAFETY: layout has a non-zero size.
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })
            .ok_or_else(|| TransportError::Io(format!("out of memory allocating a {len}-byte registered buffer")))?;
        let mut access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE;
        if remote_write {
            access |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
        }
        // SAFETY: the PD is alive (we hold the device) and [ptr, ptr+size) is our allocation,
        // which stays allocated until after ibv_dereg_mr in Drop.
        let mr = unsafe { ffi::ibv_reg_mr(device.pd(), ptr.as_ptr().cast(), layout.size(), access.0 as i32) };
        let Some(mr) = NonNull::new(mr) else {
            let e = std::io::Error::last_os_error();
            // SAFETY: allocated above with this layout, not registered.
            unsafe { std::alloc::dealloc(ptr.as_ptr(), layout) };
            return Err(TransportError::Io(format!(
                "ibv_reg_mr of {len} bytes failed: {e} (check the locked-memory limit, ulimit -l)"
            )));
        };
        Ok(Self { ptr, layout, mr, _device: device.clone() })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    /// Whether the buffer is empty (never: buffers hold at least one byte).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Address of the first byte, as the device sees it.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Local key of the registration.
    pub fn lkey(&self) -> u32 {
        // SAFETY: the MR is valid until Drop.
        unsafe { self.mr.as_ref().lkey }
    }

    /// Remote key of the registration.
    pub fn rkey(&self) -> u32 {
        // SAFETY: the MR is valid until Drop.
        unsafe { self.mr.as_ref().rkey }
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), TransportError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(TransportError::InvalidArgument(format!(
                "range {offset}+{len} outside a registered buffer of {} bytes",
                self.len()
            ))),
        }
    }

    /// Copies `src` into the buffer at `offset`. The caller must own that range under the
    /// credit protocol (no RDMA operation reads or writes it meanwhile).
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<(), TransportError> {
        self.check(offset, src.len())?;
        // SAFETY: the range is inside our allocation (checked); `src` cannot overlap it
        // because no reference to the buffer's bytes is ever handed out.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len()) };
        Ok(())
    }

    /// Copies from the buffer at `offset` into `dst`, under the same ownership rule.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<(), TransportError> {
        self.check(offset, dst.len())?;
        // SAFETY: as in write_at.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
}

impl Drop for RegisteredBuffer {
    fn drop(&mut self) {
        // SAFETY: deregister first (the NIC stops using the pages), then free the memory;
        // both handles are released exactly once.
        unsafe {
            ffi::ibv_dereg_mr(self.mr.as_ptr());
            std::alloc::dealloc(self.ptr.as_ptr(), self.layout);
        }
    }
}

/// A cache of registered buffers keyed by (size, remote access), shared by the generations
/// of one endpoint.
#[derive(Clone)]
pub struct BufferPool {
    inner: Arc<PoolInner>,
}

struct PoolInner {
    device: Arc<Device>,
    free: Mutex<Vec<(usize, bool, RegisteredBuffer)>>,
    max_cached_bytes: usize,
}

impl BufferPool {
    /// A pool registering on `device`, keeping at most `max_cached_bytes` of idle buffers.
    pub fn new(device: Arc<Device>, max_cached_bytes: usize) -> Self {
        Self { inner: Arc::new(PoolInner { device, free: Mutex::new(Vec::new()), max_cached_bytes }) }
    }

    /// A buffer of exactly `len` bytes: a cached registration if one fits, else a new one.
    pub fn get(&self, len: usize, remote_write: bool) -> Result<PooledBuffer, TransportError> {
        let cached = {
            let mut free = self.inner.free.lock().unwrap_or_else(|e| e.into_inner());
            free.iter().position(|(l, r, _)| *l == len && *r == remote_write).map(|i| free.swap_remove(i).2)
        };
        let buf = match cached {
            Some(b) => b,
            None => RegisteredBuffer::new(&self.inner.device, len, remote_write)?,
        };
        Ok(PooledBuffer { buf: Some(buf), len, remote_write, pool: self.inner.clone() })
    }

    /// Bytes of idle registered memory held.
    pub fn cached_bytes(&self) -> usize {
        self.inner.free.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|(l, _, _)| *l).sum()
    }
}

/// A buffer on loan from a [`BufferPool`]; goes back to it on drop.
pub struct PooledBuffer {
    buf: Option<RegisteredBuffer>,
    len: usize,
    remote_write: bool,
    pool: Arc<PoolInner>,
}

impl std::ops::Deref for PooledBuffer {
    type Target = RegisteredBuffer;
    fn deref(&self) -> &RegisteredBuffer {
        // Only None during drop.
        self.buf.as_ref().expect("pooled buffer present until drop")
    }
}

impl Drop for PooledBuffer {
    fn drop(&mut self) {
        let Some(buf) = self.buf.take() else { return };
        let mut free = self.pool.free.lock().unwrap_or_else(|e| e.into_inner());
        let held: usize = free.iter().map(|(l, _, _)| *l).sum();
        if held + self.len <= self.pool.max_cached_bytes {
            free.push((self.len, self.remote_write, buf));
        }
        // Otherwise `buf` drops here and is deregistered.
    }
}
