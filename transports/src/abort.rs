//! The abort latch the TCP and shared-memory transports share: set once, read everywhere,
//! and raced against every link operation, so that [`crate::Transport::abort`] is local and
//! immediate.

use crate::{AbortReason, TransportError};
use std::future::Future;
use std::task::Poll;
use tokio::sync::watch;

/// Holds the reason of the first abort, if any.
#[derive(Debug)]
pub(crate) struct AbortLatch {
    tx: watch::Sender<Option<AbortReason>>,
    rx: watch::Receiver<Option<AbortReason>>,
}

impl AbortLatch {
    /// A latch that has not tripped.
    pub(crate) fn new() -> Self {
        let (tx, rx) = watch::channel(None);
        Self { tx, rx }
    }

    /// The first abort's reason, once tripped.
    pub(crate) fn reason(&self) -> Option<AbortReason> {
        self.rx.borrow().clone()
    }

    /// Records `reason` unless an earlier abort did; true for the first abort only.
    pub(crate) fn trip(&self, reason: &AbortReason) -> bool {
        self.tx.send_if_modified(|cur| {
            if cur.is_none() {
                *cur = Some(reason.clone());
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
