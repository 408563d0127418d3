//! The model check of the ring's synchronisation ([`super::protocol`]) under loom: every
//! interleaving of a producer and a consumer, and every value the C++ memory model lets each
//! of their loads return (store buffering included: loom models `fence(SeqCst)`), explored
//! exhaustively. Unlike a stress test on the host CPU (x86 never reorders a store after a
//! locked instruction), it fails on a missing fence or a weakened ordering: the tests at the
//! bottom run the same model on deliberately broken variants and expect it to fail.
//!
//! The model: a ring of one slot, carrying two messages, with the link's waits reduced to one
//! look, then the doorbell handshake, then one more look ([`wait`], as
//! `ShmLink::wait_long` does before it sleeps on the socket). The slot's bytes are a loom
//! `UnsafeCell`, so a read that is not ordered after the write it should see, or a write not
//! ordered after the previous read, is reported as a data race. After both sides finish, a
//! side that went to sleep must have been rung for, unless nobody published what it waits on.
//!
//! Test-only (the inner `cfg`, so that `tests/module_arrows.rs` reads this file's imports).
#![cfg(test)]

use super::protocol::{self, Word};
use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicU32, AtomicU64};
use loom::sync::Arc;
use std::sync::atomic::Ordering;

protocol::impl_word!(loom::sync::atomic::AtomicU32, u32, loom::sync::atomic::fence);
protocol::impl_word!(loom::sync::atomic::AtomicU64, u64, loom::sync::atomic::fence);

/// The protocol's steps the model runs: the real ones ([`Steps::REAL`]) or a broken variant.
#[derive(Clone, Copy)]
struct Steps {
    raise_sleeping: fn(&AtomicU32),
    take_sleeper: fn(&AtomicU32) -> bool,
    publish: fn(&AtomicU64, u64),
}

impl Steps {
    /// The link's.
    const REAL: Self = Self {
        raise_sleeping: protocol::raise_sleeping::<AtomicU32>,
        take_sleeper: protocol::take_sleeper::<AtomicU32>,
        publish: protocol::publish::<AtomicU64>,
    };
}

/// One direction's shared words and its single slot.
struct Pair {
    head: AtomicU64,
    tail: AtomicU64,
    consumer_sleeping: AtomicU32,
    producer_sleeping: AtomicU32,
    slot: UnsafeCell<u64>,
}

/// How a wait ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Waited {
    /// What it waited for was there (at the first look or after raising the flag).
    Ready,
    /// Nothing at the look after the flag: the side sleeps until a doorbell.
    Slept,
}

/// The link's wait, shortened: a look; then the flag, and a look again; a side that sees
/// nothing then sleeps on the socket (the model stops it there).
fn wait(steps: Steps, flag: &AtomicU32, mut ready: impl FnMut() -> bool) -> Waited {
    if ready() {
        return Waited::Ready;
    }
    (steps.raise_sleeping)(flag);
    if ready() {
        flag.store(0, Ordering::SeqCst);
        return Waited::Ready;
    }
    Waited::Slept
}

/// What the producer did: whether it rang the consumer after each publish, and how its wait
/// for the slot's return ended.
struct Produced {
    rang: [bool; 2],
    second: Waited,
}

/// What the consumer did: how its wait for the first message ended, and (if it read it)
/// whether it rang the producer after releasing the slot.
struct Consumed {
    first: Waited,
    rang: bool,
}

fn producer(steps: Steps, p: &Pair) -> Produced {
    let mut rang = [false; 2];
    for (n, message) in [1u64, 2].into_iter().enumerate() {
        let head = n as u64;
        let waited = wait(steps, &p.producer_sleeping, || protocol::room(&p.tail, head, 1).unwrap());
        if waited == Waited::Slept {
            return Produced { rang, second: waited };
        }
        // SAFETY (loom's cell checks it): `room` saw the slot released.
        p.slot.with_mut(|b| unsafe { *b = message });
        (steps.publish)(&p.head, head + 1);
        rang[n] = (steps.take_sleeper)(&p.consumer_sleeping);
    }
    Produced { rang, second: Waited::Ready }
}

fn consumer(steps: Steps, p: &Pair) -> Consumed {
    let first = wait(steps, &p.consumer_sleeping, || protocol::filled(&p.head, 0, 1).unwrap());
    if first == Waited::Slept {
        return Consumed { first, rang: false };
    }
    // SAFETY (loom's cell checks it): `filled` saw the slot published.
    let got = p.slot.with(|b| unsafe { *b });
    assert_eq!(got, 1, "the consumer read slot 0 before the producer's bytes");
    protocol::release(&p.tail, 1);
    Consumed { first, rang: (steps.take_sleeper)(&p.producer_sleeping) }
}

/// Explores every execution of `model` (no preemption bound, whatever LOOM_* variables
/// say); panics on a failed assertion or a data race. Returns the executions explored.
fn explore(model: impl Fn() + Send + Sync + 'static) -> usize {
    // Outside the model: std's, not loom's.
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = None;
    builder.max_permutations = None;
    builder.max_duration = None;
    let counted = runs.clone();
    builder.check(move || {
        counted.fetch_add(1, Ordering::Relaxed);
        model();
    });
    runs.load(Ordering::Relaxed)
}

/// Runs the model exhaustively; panics on a lost wake-up, a wrong value or a data race.
/// Returns the executions explored.
fn check(steps: Steps) -> usize {
    explore(move || {
        let p = Arc::new(Pair {
            head: AtomicU64::new(0),
            tail: AtomicU64::new(0),
            consumer_sleeping: AtomicU32::new(0),
            producer_sleeping: AtomicU32::new(0),
            slot: UnsafeCell::new(0),
        });
        let theirs = p.clone();
        let consumed = loom::thread::spawn(move || consumer(steps, &theirs));
        let produced = producer(steps, &p);
        let consumed = consumed.join().unwrap();
        assert!(
            consumed.first == Waited::Ready || produced.rang[0],
            "lost wake-up: the consumer sleeps on a published slot and the producer rang no doorbell"
        );
        assert!(
            produced.second == Waited::Ready || consumed.first == Waited::Slept || consumed.rang,
            "lost wake-up: the producer sleeps on a released slot and the consumer rang no doorbell"
        );
    })
}

#[test]
fn loom_the_ring_and_the_doorbell_lose_no_wake_up_and_race_on_no_slot() {
    let runs = check(Steps::REAL);
    eprintln!("loom explored {runs} executions");
}

/// [`protocol::raise_sleeping`] without its fence.
fn raise_without_fence(flag: &AtomicU32) {
    flag.store(1, Ordering::SeqCst);
}

/// [`protocol::take_sleeper`] without its fence.
fn take_without_fence(flag: &AtomicU32) -> bool {
    flag.load(Ordering::Relaxed) != 0 && flag.swap(0, Ordering::SeqCst) != 0
}

#[test]
#[should_panic(expected = "lost wake-up")]
fn loom_the_model_catches_a_waiter_without_its_fence() {
    check(Steps { raise_sleeping: raise_without_fence, ..Steps::REAL });
}

#[test]
#[should_panic(expected = "lost wake-up")]
fn loom_the_model_catches_a_publisher_without_its_fence() {
    check(Steps { take_sleeper: take_without_fence, ..Steps::REAL });
}

#[test]
#[should_panic(expected = "Causality violation")]
fn loom_the_model_catches_a_relaxed_publish() {
    check(Steps { publish: |head, n| head.store(n, Ordering::Relaxed), ..Steps::REAL });
}

/// The small-message lane's model (`shm::lane`): one cell, reused. The producer writes lane
/// message 0 into it, then message `LANE_CELLS` (the next message of the same cell; the ones
/// between go to other cells and are left out), which it may write only once the consumer gave
/// message 0 back; the consumer waits for message 0 with the link's look, flag and second look,
/// reads it, and gives it back. The words are loom atomics (the lane has no non-atomic bytes);
/// the checks are: the consumer reads exactly message 0 (never a word of the later message),
/// the peer's words always pass validation, and no side sleeps on what the other published
/// without a doorbell.
mod lane_model {
    use super::*;
    use crate::shm::lane;
    use crate::Tag;

    const GENERATION: u64 = 3;
    /// Words of the model's cell: enough for the header and 4 bytes of payload.
    const WORDS: usize = 8;

    /// The model's steps: the real ones, or a broken variant.
    #[derive(Clone, Copy)]
    pub(super) struct LaneSteps {
        pub(super) take_sleeper: fn(&AtomicU32) -> bool,
        /// Whether the producer looks at the consumer's count before reusing the cell.
        pub(super) check_room: bool,
    }

    pub(super) const REAL: LaneSteps =
        LaneSteps { take_sleeper: protocol::take_sleeper::<AtomicU32>, check_room: true };

    struct Lane {
        cell: Vec<AtomicU64>,
        tail: AtomicU64,
        consumer_sleeping: AtomicU32,
        producer_sleeping: AtomicU32,
    }

    fn message(n: u64) -> [u8; 4] {
        [n as u8 + 1, 2, 3, 4]
    }

    fn tag(n: u64) -> Tag {
        Tag::new(n as u32, 1, 2)
    }

    pub(super) fn check(steps: LaneSteps) -> usize {
        let ring_steps = Steps { take_sleeper: steps.take_sleeper, ..Steps::REAL };
        explore(move || {
            let l = Arc::new(Lane {
                cell: (0..WORDS).map(|_| AtomicU64::new(0)).collect(),
                tail: AtomicU64::new(0),
                consumer_sleeping: AtomicU32::new(0),
                producer_sleeping: AtomicU32::new(0),
            });
            let theirs = l.clone();
            let consumer = loom::thread::spawn(move || {
                let l = theirs;
                let mut found = None;
                let first = wait(ring_steps, &l.consumer_sleeping, || {
                    found = lane::look(&l.cell, 0, GENERATION, 1 << 20).unwrap();
                    found.is_some()
                });
                if first == Waited::Slept {
                    return (first, false);
                }
                let h = found.unwrap();
                assert_eq!((h.len, h.tag), (4, tag(0)), "the consumer saw another message's header");
                let mut out = [0u8; 4];
                lane::read(&l.cell, 0, &mut out).unwrap();
                assert_eq!(out, message(0), "the consumer read another message's bytes");
                protocol::release(&l.tail, 1);
                (first, (steps.take_sleeper)(&l.producer_sleeping))
            });
            let cells = u64::from(lane::LANE_CELLS);
            let mut rang = [false; 2];
            let mut second = Waited::Ready;
            for (i, n) in [0, cells].into_iter().enumerate() {
                if i == 1 && steps.check_room {
                    second = wait(ring_steps, &l.producer_sleeping, || {
                        n - protocol::consumed(&l.tail, n, cells).unwrap() < cells
                    });
                    if second == Waited::Slept {
                        break;
                    }
                }
                lane::write(&l.cell, n, GENERATION, tag(n), &message(n));
                rang[i] = (steps.take_sleeper)(&l.consumer_sleeping);
            }
            let (first, consumer_rang) = consumer.join().unwrap();
            assert!(
                first == Waited::Ready || rang.contains(&true),
                "lost wake-up: the consumer sleeps on a written lane message and the producer rang no doorbell"
            );
            assert!(
                second == Waited::Ready || first == Waited::Slept || consumer_rang,
                "lost wake-up: the producer sleeps on a released cell and the consumer rang no doorbell"
            );
        })
    }
}

#[test]
fn loom_the_lane_reads_whole_messages_and_loses_no_wake_up() {
    let runs = lane_model::check(lane_model::REAL);
    eprintln!("loom explored {runs} executions");
}

/// Caught as a word changing under the reader, or as message 0 overwritten before the
/// consumer saw it (which then sleeps with no doorbell for it): loom reports whichever
/// execution it reaches first.
#[test]
#[should_panic]
fn loom_the_lane_model_catches_a_producer_that_reuses_a_cell_too_early() {
    lane_model::check(lane_model::LaneSteps { check_room: false, ..lane_model::REAL });
}

#[test]
#[should_panic(expected = "lost wake-up")]
fn loom_the_lane_model_catches_a_publisher_without_its_fence() {
    lane_model::check(lane_model::LaneSteps { take_sleeper: take_without_fence, ..lane_model::REAL });
}
