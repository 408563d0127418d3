//! What the TCP and shared-memory links share around one operation: the list of receives in
//! flight (to tell a stale frame from an early one), the guard that marks a link unusable when
//! an operation is dropped part-way, and the crate's one mutex lock that tolerates poisoning.

use crate::wire::seq_older;
use crate::{AbortReason, TransportError};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`; the data the transports protect stays consistent even if a holder panicked
/// (plain pushes and removes), so a poisoned lock is taken as it is.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The operation sequence numbers that receivers on one link wait for.
#[derive(Debug, Default)]
pub(crate) struct Waiting(Mutex<Vec<u32>>);

impl Waiting {
    /// Registers a receive of `seq` until the returned guard drops.
    pub(crate) fn register(&self, seq: u32) -> WaitingGuard<'_> {
        lock(&self.0).push(seq);
        WaitingGuard { waiting: self, seq }
    }

    /// The oldest `seq` any receiver waits for (in wrapping sequence order).
    pub(crate) fn oldest(&self) -> Option<u32> {
        lock(&self.0).iter().copied().reduce(|a, b| if seq_older(b, a) { b } else { a })
    }
}

/// Removes a receive's `seq` from its link's [`Waiting`] list when it ends.
pub(crate) struct WaitingGuard<'a> {
    waiting: &'a Waiting,
    seq: u32,
}

impl Drop for WaitingGuard<'_> {
    fn drop(&mut self) {
        let mut w = lock(&self.waiting.0);
        if let Some(i) = w.iter().position(|&s| s == self.seq) {
            w.swap_remove(i);
        }
    }
}

/// A link that can be marked unusable without closing it.
pub(crate) trait BreakQuietly {
    /// Marks the link broken with `err`, leaving its socket open.
    fn break_quietly(&self, err: TransportError);
}

/// Marks the link broken if an operation is dropped part-way through a message. The link is
/// unusable then, but its socket stays open: the peer did nothing wrong, and closing now would
/// make it blame this rank for a failure elsewhere (this happens when a collective drops its
/// send because its receive from another peer failed). The socket closes when the transport is
/// aborted or dropped, which the caller does after it has reported the real failure.
pub(crate) struct Poison<'a, L: BreakQuietly> {
    link: &'a L,
    armed: bool,
}

impl<'a, L: BreakQuietly> Poison<'a, L> {
    /// Armed: dropping it before [`Poison::disarm`] breaks `link`.
    pub(crate) fn arm(link: &'a L) -> Self {
        Self { link, armed: true }
    }

    /// The operation reached a message boundary: dropping it now is harmless.
    pub(crate) fn disarm(&mut self) {
        self.armed = false;
    }
}

impl<L: BreakQuietly> Drop for Poison<'_, L> {
    fn drop(&mut self) {
        if self.armed {
            self.link.break_quietly(TransportError::Aborted(AbortReason::new(
                "an operation on this link was cancelled part-way through a message",
            )));
        }
    }
}
