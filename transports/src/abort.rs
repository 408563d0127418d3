//! The abort latch the TCP and shared-memory transports share: set once, read everywhere,
//! and raced against every link operation, so that [`crate::Transport::abort`] is local and
//! immediate.

use crate::{AbortReason, TransportError};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Poll;
use tokio::sync::watch;

/// Holds the reason of the first abort, if any.
///
/// Every link operation looks at the latch first, so the look that finds it untripped (all
/// of them but the few after an abort) reads one atomic flag, not the `watch` (a read lock).
/// The flag is raised inside the `watch`'s update, under its write lock and before the
/// `watch` wakes anyone: whoever sees the flag raised (`Acquire`, pairing with the `Release`
/// store) then reads the reason from the `watch` (its read lock waits for the write to end),
/// and whoever the `watch` woke sees the flag raised too. So [`AbortLatch::reason`] returns
/// what it returned when it read the `watch` every time, but for the span of one `trip` call,
/// during which either answer is a linearisation of the same race.
#[derive(Debug)]
pub(crate) struct AbortLatch {
    tx: watch::Sender<Option<AbortReason>>,
    rx: watch::Receiver<Option<AbortReason>>,
    /// Raised (once, for good) when the `watch` receives its reason.
    tripped: AtomicBool,
}

impl AbortLatch {
    /// A latch that has not tripped.
    pub(crate) fn new() -> Self {
        let (tx, rx) = watch::channel(None);
        Self { tx, rx, tripped: AtomicBool::new(false) }
    }

    /// The first abort's reason, once tripped.
    pub(crate) fn reason(&self) -> Option<AbortReason> {
        if !self.tripped.load(Ordering::Acquire) {
            return None;
        }
        self.rx.borrow().clone()
    }

    /// Records `reason` unless an earlier abort did; true for the first abort only.
    pub(crate) fn trip(&self, reason: &AbortReason) -> bool {
        self.tx.send_if_modified(|cur| {
            if cur.is_none() {
                *cur = Some(reason.clone());
                // Under the write lock, before the watch notifies (see the type's comment).
                self.tripped.store(true, Ordering::Release);
                true
            } else {
                false
            }
        })
    }

    /// Runs one link operation, racing it against the abort: an abort (earlier or during)
    /// wins with [`TransportError::Aborted`] and its reason.
    ///
    /// # Cancel safety
    /// As cancel safe as `op`: dropping this future drops `op`.
    pub(crate) async fn run<F>(&self, op: F) -> Result<(), TransportError>
    where
        F: Future<Output = Result<(), TransportError>>,
    {
        if let Some(r) = self.reason() {
            return Err(TransportError::Aborted(r));
        }
        let mut op = std::pin::pin!(op);
        // Most operations of a small message finish at their first poll: that poll needs no
        // subscription to the latch (it was not tripped above, and an abort cannot interrupt
        // a poll in progress anyway).
        let first = std::future::poll_fn(|cx| Poll::Ready(op.as_mut().poll(cx))).await;
        let result = match first {
            Poll::Ready(r) => r,
            Poll::Pending => {
                let mut rx = self.rx.clone();
                tokio::select! {
                    biased;
                    _ = rx.wait_for(Option::is_some) => Err(TransportError::Aborted(AbortReason::new("aborted"))),
                    r = &mut op => r,
                }
            }
        };
        if result.is_ok() {
            return result;
        }
        match (result, self.reason()) {
            (Err(_), Some(reason)) => Err(TransportError::Aborted(reason)),
            (r, _) => r,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_trip_wins_and_is_read_back() {
        let latch = AbortLatch::new();
        assert!(latch.reason().is_none());
        assert!(latch.trip(&AbortReason::new("first")));
        assert!(!latch.trip(&AbortReason::new("second")));
        assert_eq!(latch.reason().map(|r| r.to_string()), Some("first".to_string()));
    }

    #[tokio::test]
    async fn an_operation_waiting_when_the_latch_trips_fails_with_its_reason() {
        let latch = std::sync::Arc::new(AbortLatch::new());
        let tripper = {
            let latch = latch.clone();
            tokio::spawn(async move {
                tokio::task::yield_now().await;
                latch.trip(&AbortReason::new("stop"))
            })
        };
        let r = latch.run(std::future::pending()).await;
        assert!(tripper.await.unwrap());
        match r {
            Err(TransportError::Aborted(reason)) => assert_eq!(reason.to_string(), "stop"),
            other => panic!("expected the abort, got {other:?}"),
        }
        // And one started after it fails at once.
        assert!(matches!(latch.run(async { Ok(()) }).await, Err(TransportError::Aborted(_))));
    }
}
