//! A completion queue driven by tokio.
//!
//! The CQ is bound to a completion channel whose file descriptor is made non-blocking
//! (`fcntl(O_NONBLOCK)`) and registered with tokio through [`AsyncFd`]. Waiting for work
//! ([`CompletionQueue::wait`]) is, in this order:
//!
//! 1. wait until the channel's fd is readable;
//! 2. `ibv_get_cq_event` (returns `EAGAIN` on a spurious wake-up: clear readiness, go to 1);
//! 3. `ibv_ack_cq_events` for that event (unacknowledged events would make
//!    `ibv_destroy_cq` block);
//! 4. `ibv_req_notify_cq` to re-arm.
//!
//! The caller then polls ([`CompletionQueue::poll`]) until the CQ is empty. Re-arming *before*
//! draining is what makes this lossless: a completion that lands after the last poll raises
//! a new event. The CQ is armed once at creation, so completions that precede the first wait
//! are found by that first drain. In busy-poll mode the caller skips the wait and polls in a
//! loop instead, trading a core for latency.

use super::device::Device;
use crate::TransportError;
use rdma_sys as ffi;
use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::NonNull;
use std::sync::Arc;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// One work completion, copied out of the CQ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The work request id given when posting.
    pub wr_id: u64,
    /// `ibv_wc_status` value.
    pub status: u32,
    /// `ibv_wc_opcode` value (meaningful only on success).
    pub opcode: u32,
    /// Vendor-specific error syndrome.
    pub vendor_err: u32,
    /// Bytes transferred (receives).
    pub byte_len: u32,
    /// Immediate data in host order, if the completion carries one.
    pub imm: Option<u32>,
    /// Local queue pair number.
    pub qp_num: u32,
}

/// The channel's fd, borrowed for AsyncFd (the channel owns and closes it).
struct ChannelFd(RawFd);

impl AsRawFd for ChannelFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// A completion queue with its completion channel.
///
/// Dropped in order: the tokio registration, the CQ, then the channel (which closes the fd). Queue pairs using
/// the CQ hold an `Arc` to it and so are destroyed first.
pub struct CompletionQueue {
    fd: ManuallyDrop<AsyncFd<ChannelFd>>,
    cq: NonNull<ffi::ibv_cq>,
    channel: NonNull<ffi::ibv_comp_channel>,
    capacity: i32,
    _device: Arc<Device>,
}

// SAFETY: verbs CQ and channel handles may be used from any thread; polling is serialised by
// the transport (one progress task polls).
unsafe impl Send for CompletionQueue {}
// SAFETY: see Send.
unsafe impl Sync for CompletionQueue {}

fn os_err(what: &str, rc: i32) -> TransportError {
    let e = if rc > 0 { std::io::Error::from_raw_os_error(rc) } else { std::io::Error::last_os_error() };
    TransportError::Io(format!("{what} failed: {e}"))
}

impl CompletionQueue {
    /// Creates a CQ of at least `entries` entries (capped by the device) on a non-blocking
    /// channel registered with the current tokio runtime, and arms it.
    pub fn new(device: &Arc<Device>, entries: i32) -> Result<Self, TransportError> {
        let entries = entries.clamp(1, device.max_cqe().max(1));
        // SAFETY: the context is open while we hold the device.
        let channel = NonNull::new(unsafe { ffi::ibv_create_comp_channel(device.ctx()) })
            .ok_or_else(|| os_err("ibv_create_comp_channel", 0))?;
        // From here on, the guard destroys the channel on early return.
        struct ChanGuard(Option<NonNull<ffi::ibv_comp_channel>>);
        impl Drop for ChanGuard {
            fn drop(&mut self) {
                if let Some(c) = self.0 {
                    // SAFETY: created above, no CQ uses it when this runs.
                    unsafe { ffi::ibv_destroy_comp_channel(c.as_ptr()) };
                }
            }
        }
        let mut chan_guard = ChanGuard(Some(channel));
        // SAFETY: the channel is valid; reading its fd field is a plain load.
        let fd = unsafe { channel.as_ref().fd };
        // SAFETY: fcntl on an fd we own through the channel.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(os_err("fcntl(O_NONBLOCK) on the completion channel", 0));
        }
        // SAFETY: valid context and channel; no cq_context.
        let cq = NonNull::new(unsafe {
            ffi::ibv_create_cq(device.ctx(), entries, std::ptr::null_mut(), channel.as_ptr(), 0)
        })
        .ok_or_else(|| os_err(&format!("ibv_create_cq({entries} entries)"), 0))?;
        // SAFETY: valid CQ.
        let rc = unsafe { ffi::ibv_req_notify_cq(cq.as_ptr(), 0) };
        let registered = if tokio::runtime::Handle::try_current().is_err() {
            Err("no tokio runtime is running".to_owned())
        } else {
            // SAFETY: the channel owns this fd and keeps it open until after the AsyncFd is
            // dropped (see Drop), and ChannelFd always returns the same fd.
            unsafe { AsyncFd::register_with_interest(ChannelFd(fd), Interest::READABLE) }.map_err(|e| e.to_string())
        };
        let fd = match (rc, registered) {
            (0, Ok(fd)) => fd,
            (rc, r) => {
                // SAFETY: the CQ has no QPs and no unacknowledged events.
                unsafe { ffi::ibv_destroy_cq(cq.as_ptr()) };
                return Err(match r {
                    Err(e) => TransportError::Io(format!("registering the completion channel with tokio: {e}")),
                    Ok(_) => os_err("ibv_req_notify_cq", rc),
                });
            }
        };
        chan_guard.0 = None;
        Ok(Self { fd: ManuallyDrop::new(fd), cq, channel, capacity: entries, _device: device.clone() })
    }

    /// Number of entries.
    pub fn capacity(&self) -> i32 {
        self.capacity
    }

    pub(crate) fn raw(&self) -> *mut ffi::ibv_cq {
        self.cq.as_ptr()
    }

    /// Waits for the next completion event, acknowledges it and re-arms the CQ (see the
    /// module docs). Afterwards drain with [`CompletionQueue::poll`].
    ///
    /// # Cancel safety
    /// Cancel safe: an event is consumed only after readiness, synchronously.
    pub async fn wait(&self) -> Result<(), TransportError> {
        loop {
            let mut guard =
                self.fd.readable().await.map_err(|e| TransportError::Io(format!("completion channel: {e}")))?;
            let mut ev_cq: *mut ffi::ibv_cq = std::ptr::null_mut();
            let mut ev_ctx: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: valid channel (non-blocking) and out-pointers.
            let rc = unsafe { ffi::ibv_get_cq_event(self.channel.as_ptr(), &mut ev_cq, &mut ev_ctx) };
            if rc != 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::WouldBlock {
                    guard.clear_ready();
                    continue;
                }
                return Err(TransportError::Io(format!("ibv_get_cq_event failed: {e}")));
            }
            // Only our CQ is bound to this channel; acknowledge the event on it.
            // SAFETY: the event came from our CQ; acknowledging exactly one.
            unsafe { ffi::ibv_ack_cq_events(self.cq.as_ptr(), 1) };
            // SAFETY: valid CQ.
            let rc = unsafe { ffi::ibv_req_notify_cq(self.cq.as_ptr(), 0) };
            if rc != 0 {
                return Err(os_err("ibv_req_notify_cq", rc));
            }
            return Ok(());
        }
    }

    /// Moves up to `max` completions into `out`; returns how many.
    pub fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize, TransportError> {
        const BATCH: usize = 32;
        let mut total = 0;
        while total < max {
            // SAFETY: ibv_wc is plain old data; zero is a valid value.
            let mut wcs: [ffi::ibv_wc; BATCH] = unsafe { std::mem::zeroed() };
            let want = (max - total).min(BATCH) as i32;
            // SAFETY: valid CQ; `wcs` has room for `want` entries.
            let n = unsafe { ffi::ibv_poll_cq(self.cq.as_ptr(), want, wcs.as_mut_ptr()) };
            if n < 0 {
                return Err(TransportError::Io(format!("ibv_poll_cq failed ({n})")));
            }
            for wc in &wcs[..n as usize] {
                let has_imm = wc.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
                out.push(Completion {
                    wr_id: wc.wr_id,
                    status: wc.status,
                    opcode: wc.opcode,
                    vendor_err: wc.vendor_err,
                    byte_len: wc.byte_len,
                    // SAFETY: with IBV_WC_WITH_IMM the union holds the immediate (network order).
                    imm: has_imm.then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data })),
                    qp_num: wc.qp_num,
                });
            }
            total += n as usize;
            if (n as usize) < want as usize {
                break;
            }
        }
        Ok(total)
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: `fd` is not used after this line. Dropping the AsyncFd only removes the fd
        // from tokio's reactor (ChannelFd does not close it), which must happen before the
        // channel closes the fd.
        unsafe { ManuallyDrop::drop(&mut self.fd) };
        // SAFETY: every event was acknowledged in `wait`; queue pairs using this CQ hold an
        // Arc to it and are gone. The CQ is destroyed before its channel; each handle once.
        unsafe {
            ffi::ibv_destroy_cq(self.cq.as_ptr());
            ffi::ibv_destroy_comp_channel(self.channel.as_ptr());
        }
    }
}
