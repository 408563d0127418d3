//! The ring's synchronisation, apart from its layout ([`super::ring`]) and its waiting
//! ([`super::link`]): how a slot is handed from the producer to the consumer and back (the
//! `head` and `tail` counters), and the doorbell's sleep/wake handshake (the `sleeping` flags).
//!
//! Every memory ordering of the protocol is in this file, in functions generic over the atomic
//! word ([`Word`]): the link runs them on std's atomics in the shared segment, the model check
//! (`shm::model`, a test) runs the same functions on loom's, which explores every interleaving
//! and every value the C++ memory model lets each load return.
//!
//! A slot's life: the producer writes slot `h` only after [`room`] read (`Acquire`) a tail
//! that released it, and [`publish`]es it with a `Release` store of `h + 1`; the consumer reads
//! slot `t` only after [`filled`] read (`Acquire`) a head beyond it, and gives it back with a
//! `Release` store of `t + 1` ([`release`]) once it is done reading. So every write of a slot
//! happens before every read of it that sees its bytes, and every read of it happens before
//! the next write: the slot's bytes are never accessed concurrently (no data race).

use std::sync::atomic::Ordering;

/// An atomic word of the protocol, with the fence that orders it. Implemented for std's
/// atomics (the link's) and, in the tests, for loom's (the model check's).
pub(crate) trait Word {
    /// The word's value type.
    type Value: Copy;
    /// As `AtomicU64::load`.
    fn load(&self, order: Ordering) -> Self::Value;
    /// As `AtomicU64::store`.
    fn store(&self, value: Self::Value, order: Ordering);
    /// As `AtomicU64::swap`.
    fn swap(&self, value: Self::Value, order: Ordering) -> Self::Value;
    /// A fence of this word's memory model (`std::sync::atomic::fence` for std's atomics).
    fn fence(order: Ordering);
}

/// Implements [`Word`] for an atomic type whose inherent methods and fence function have the
/// usual signatures (std's and loom's); the trait must be in scope where it is called.
macro_rules! impl_word {
    ($atomic:ty, $value:ty, $fence:path) => {
        impl Word for $atomic {
            type Value = $value;
            fn load(&self, order: ::std::sync::atomic::Ordering) -> $value {
                <$atomic>::load(self, order)
            }
            fn store(&self, value: $value, order: ::std::sync::atomic::Ordering) {
                <$atomic>::store(self, value, order)
            }
            fn swap(&self, value: $value, order: ::std::sync::atomic::Ordering) -> $value {
                <$atomic>::swap(self, value, order)
            }
            fn fence(order: ::std::sync::atomic::Ordering) {
                $fence(order)
            }
        }
    };
}
// For the model check's impls on loom's atomics.
#[cfg(test)]
pub(crate) use impl_word;

impl_word!(std::sync::atomic::AtomicU32, u32, std::sync::atomic::fence);
impl_word!(std::sync::atomic::AtomicU64, u64, std::sync::atomic::fence);

/// The producer's look: whether slot `head` (its own count of published slots) is free,
/// reading the consumer's `tail`. `Acquire`: the consumer's reads of the slot it released
/// happen before the producer writes it again. `Err` when the peer's tail is out of range.
pub(crate) fn room<W: Word<Value = u64>>(tail: &W, head: u64, slots: u64) -> Result<bool, String> {
    let tail = tail.load(Ordering::Acquire);
    let used = head.wrapping_sub(tail);
    if used > slots {
        return Err(format!("the consumer's tail {tail} is out of range of the head {head} (ring of {slots})"));
    }
    Ok(used < slots)
}

/// The producer publishes the slots before `new_head` (it wrote them). `Release`: pairs with
/// [`filled`]'s `Acquire`, so the consumer that sees the count sees the bytes.
pub(crate) fn publish<W: Word<Value = u64>>(head: &W, new_head: u64) {
    head.store(new_head, Ordering::Release);
}

/// The consumer's look: whether slot `tail` (its own count of consumed slots) is published,
/// reading the producer's `head`. `Acquire`: pairs with [`publish`]. `Err` when the peer's
/// head is out of range.
pub(crate) fn filled<W: Word<Value = u64>>(head: &W, tail: u64, slots: u64) -> Result<bool, String> {
    let head = head.load(Ordering::Acquire);
    let avail = head.wrapping_sub(tail);
    if avail > slots {
        return Err(format!("the producer's head {head} is out of range of the tail {tail} (ring of {slots})"));
    }
    Ok(avail > 0)
}

/// The consumer gives back the slots before `new_tail` (it is done reading them). `Release`:
/// pairs with [`room`]'s `Acquire`, so its reads happen before the producer's next writes.
pub(crate) fn release<W: Word<Value = u64>>(tail: &W, new_tail: u64) {
    tail.store(new_tail, Ordering::Release);
}

/// The waiter's half of the doorbell handshake: raises its `sleeping` flag; the caller then
/// looks at the counter it waits on once more ([`filled`] or [`room`]) before it sleeps.
///
/// This is a store-buffering (Dekker) pattern with [`take_sleeper`]: the waiter stores the
/// flag and loads the counter, the publisher stores the counter and loads the flag, and at
/// least one of them must see the other's store, or the waiter sleeps on data it missed while
/// the publisher rings no doorbell (a lost wake-up, caught only by the deadline's re-check).
/// A store followed by a load of another location may be reordered unless a sequentially
/// consistent fence (or SeqCst on both accesses) sits between them: an `Acquire` load after a
/// `SeqCst` store is not enough on weakly ordered CPUs (x86's `xchg` happens to order them).
/// So both halves put a `SeqCst` fence between their store and their load. The model check
/// fails if either fence is removed.
pub(crate) fn raise_sleeping<W: Word<Value = u32>>(flag: &W) {
    flag.store(1, Ordering::SeqCst);
    W::fence(Ordering::SeqCst);
}

/// The publisher's half of the doorbell handshake ([`raise_sleeping`]), called after it
/// stored the counter the peer may sleep on ([`publish`] or [`release`]): whether the peer
/// sleeps, in which case the flag is lowered here and the caller must ring the doorbell.
pub(crate) fn take_sleeper<W: Word<Value = u32>>(flag: &W) -> bool {
    W::fence(Ordering::SeqCst);
    flag.load(Ordering::Relaxed) != 0 && flag.swap(0, Ordering::SeqCst) != 0
}

/// The producer's look at the consumer's count (`tail`) from its own count `head`: the tail,
/// once validated (not beyond the head, at most `slots` behind it). `Acquire`, as [`room`]:
/// the consumer's reads of every slot before the tail happen before whatever the producer
/// writes after this look, so the producer may remember the value and write up to
/// `tail + slots` without looking again (the small-message lane does: `shm::lane`).
pub(crate) fn consumed<W: Word<Value = u64>>(tail: &W, head: u64, slots: u64) -> Result<u64, String> {
    let tail = tail.load(Ordering::Acquire);
    if head.wrapping_sub(tail) > slots {
        return Err(format!("the consumer's tail {tail} is out of range of the head {head} (ring of {slots})"));
    }
    Ok(tail)
}

/// Stores one word of a small-message lane cell (flag and data together: `shm::lane`).
/// `Relaxed`: the word carries its own flag, so the reader needs no other store ordered
/// before it; the cell's reuse is ordered by [`consumed`] and [`release`] instead.
pub(crate) fn put_word<W: Word<Value = u64>>(word: &W, value: u64) {
    word.store(value, Ordering::Relaxed);
}

/// Loads one word of a lane cell (see [`put_word`]).
pub(crate) fn get_word<W: Word<Value = u64>>(word: &W) -> u64 {
    word.load(Ordering::Relaxed)
}
