//! The lock a link's operations in one direction take turns on (its reader, its writer):
//! held across the awaits of one operation, as `tokio::sync::Mutex` is, but cheaper when
//! nobody else wants it, which is nearly always (the operations of one direction of a link
//! rarely overlap: two receives of different collectives on the same link at once).
//!
//! Taking it free is one compare-and-swap; letting it go is one swap and one load, and a
//! wake-up only if a task waits. `tokio::sync::Mutex` takes its semaphore's internal lock on
//! every release, waiters or not (a profile of the 8-byte allreduce over shared memory put
//! that at about 2% of the operation).
//!
//! Waking, without losing a wake-up: a task that finds the lock held counts itself in
//! `waiting` (a `SeqCst` read-modify-write) before it looks again, and registers for the
//! `released` notification before each look; the holder lets go with a `SeqCst` swap of `held`
//! and then reads `waiting` (`SeqCst`). All four are `SeqCst`, so they fall in one total order:
//! if the holder's read of `waiting` precedes the waiter's count in it (it missed the waiter),
//! then its swap precedes the waiter's next look too, and that look finds the lock free; and
//! if it sees the waiter, it notifies every task registered, the waiter included (its
//! registration precedes its look, which precedes the swap that let go of the lock it saw
//! held). Unlike tokio's, the lock is not fair: a waiter may lose the race to a later comer.

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use tokio::sync::Notify;

/// A lock held across awaits (see the module's comment).
pub(crate) struct OpLock<T> {
    held: AtomicBool,
    /// Tasks in [`OpLock::lock`] that found it held.
    waiting: AtomicUsize,
    /// Notified when the lock is let go while a task waits.
    released: Notify,
    value: UnsafeCell<T>,
}

// SAFETY: the value is reached only through a guard, and at most one guard exists at a time
// (`held`); taking the lock (`SeqCst` compare-and-swap, which acquires) synchronises with the
// swap that let it go (`SeqCst`, which releases), so the holders' accesses are ordered. As
// for `std::sync::Mutex`, `T: Send` is enough to share the lock.
unsafe impl<T: Send> Send for OpLock<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for OpLock<T> {}

/// The lock, held; lets it go on drop.
pub(crate) struct OpGuard<'a, T> {
    lock: &'a OpLock<T>,
    /// Shares as `&mut T` does: the guard is `Sync` only if `T` is.
    _value: std::marker::PhantomData<&'a mut T>,
}

/// Counts a task among the waiters while it waits (also when its wait is dropped).
struct Counted<'a>(&'a AtomicUsize);

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl<T> OpLock<T> {
    /// A free lock around `value`.
    pub(crate) fn new(value: T) -> Self {
        Self {
            held: AtomicBool::new(false),
            waiting: AtomicUsize::new(0),
            released: Notify::new(),
            value: UnsafeCell::new(value),
        }
    }

    /// Takes the lock if it is free.
    pub(crate) fn try_lock(&self) -> Option<OpGuard<'_, T>> {
        self.held
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::Relaxed)
            .ok()
            .map(|_| OpGuard { lock: self, _value: std::marker::PhantomData })
    }

    /// Takes the lock, waiting for its holder to let go.
    ///
    /// # Cancel safety
    /// Cancel safe: dropped before it returns, it holds nothing and counts no waiter.
    pub(crate) async fn lock(&self) -> OpGuard<'_, T> {
        if let Some(g) = self.try_lock() {
            return g;
        }
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let _counted = Counted(&self.waiting);
        loop {
            let released = self.released.notified();
            tokio::pin!(released);
            // Registered before the look, so that a release after the look wakes it.
            released.as_mut().enable();
            if let Some(g) = self.try_lock() {
                return g;
            }
            released.await;
        }
    }
}

impl<T> Deref for OpGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: this guard is the only one (see `OpLock`'s `Sync`).
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for OpGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`, and `&mut self` makes this borrow the only one.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for OpGuard<'_, T> {
    fn drop(&mut self) {
        self.lock.held.swap(false, Ordering::SeqCst);
        if self.lock.waiting.load(Ordering::SeqCst) > 0 {
            self.lock.released.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_held_lock_is_not_taken_twice() {
        let lock = OpLock::new(1u32);
        let mut g = lock.try_lock().expect("free");
        *g += 1;
        assert!(lock.try_lock().is_none());
        drop(g);
        assert_eq!(*lock.try_lock().expect("free again"), 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn tasks_taking_turns_across_awaits_lose_no_update_and_no_wake_up() {
        let lock = Arc::new(OpLock::new(0u64));
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let lock = lock.clone();
                tokio::spawn(async move {
                    for _ in 0..2_000 {
                        let mut g = lock.lock().await;
                        let v = *g;
                        tokio::task::yield_now().await;
                        *g = v + 1;
                    }
                })
            })
            .collect();
        for t in tasks {
            // A lost wake-up leaves a task waiting for good: the timeout reports it.
            tokio::time::timeout(std::time::Duration::from_secs(60), t)
                .await
                .expect("a task hung")
                .expect("a task panicked");
        }
        assert_eq!(*lock.try_lock().expect("free"), 16_000);
        assert_eq!(lock.waiting.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn a_dropped_wait_leaves_no_waiter_counted() {
        let lock = OpLock::new(());
        let g = lock.try_lock().expect("free");
        {
            let wait = lock.lock();
            tokio::pin!(wait);
            assert!(futures_poll_once(wait.as_mut()).await.is_none());
        }
        assert_eq!(lock.waiting.load(Ordering::SeqCst), 0);
        drop(g);
        drop(lock.lock().await);
    }

    /// Polls `f` once.
    async fn futures_poll_once<F: std::future::Future + Unpin>(mut f: F) -> Option<F::Output> {
        std::future::poll_fn(|cx| {
            std::task::Poll::Ready(match std::pin::Pin::new(&mut f).poll(cx) {
                std::task::Poll::Ready(v) => Some(v),
                std::task::Poll::Pending => None,
            })
        })
        .await
    }
}
