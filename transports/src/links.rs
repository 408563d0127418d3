//! What every link of the TCP and shared-memory transports shares, and the transport over a
//! set of them: the receive stash (messages that arrived before their receiver asked), the
//! start of every receive, the classification of an arriving header (wanted, early, stale,
//! duplicate, over budget), the broken state, the guard that marks a link unusable when an
//! operation is dropped part-way, and [`Links`], the `Transport` operations over one link per
//! peer. Each link keeps only how it moves bytes (a framed socket, a pair of rings).
//!
//! Also the crate's one mutex lock that tolerates poisoning.

use crate::abort::AbortLatch;
use crate::deadline::{DeadlineInForce, LinkProgress, Pace};
use crate::error::{AbortReason, Signatures, TransportError};
use crate::op_lock::{OpGuard, OpLock};
use crate::wire::{channel_of, other_call, seq_older, Rank, Tag, STASH_BUDGET, STASH_MAX_FRAMES};
use crate::Deadlines;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use tokio::sync::Notify;

/// Locks `m`; the data the transports protect stays consistent even if a holder panicked
/// (plain pushes and removes), so a poisoned lock is taken as it is.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The operation sequence numbers that receivers on one link wait for.
#[derive(Debug, Default)]
struct Waiting(Mutex<Vec<u32>>);

impl Waiting {
    /// The oldest `seq` any receiver waits for on `channel` (in wrapping sequence order).
    fn oldest_on(&self, channel: u32) -> Option<u32> {
        lock(&self.0)
            .iter()
            .copied()
            .filter(|&s| channel_of(s) == channel)
            .reduce(|a, b| if seq_older(b, a) { b } else { a })
    }
}

/// Removes a receive's `seq` from its link's waiting list when it ends.
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

/// A message received ahead of the receiver that wants it.
struct Stashed {
    tag: Tag,
    data: Vec<u8>,
}

#[derive(Default)]
struct Stash {
    frames: Vec<Stashed>,
    bytes: usize,
}

/// What an arriving header means for the receive that read it.
pub(crate) enum Arrival {
    /// The message waited for (tag and length checked): read its payload into the caller's
    /// buffer.
    Wanted,
    /// A message for a later receiver, with room reserved for its `usize` bytes: read it and
    /// [`LinkCore::stash`] it.
    Early(usize),
}

/// The state every link keeps besides how it moves bytes.
pub(crate) struct LinkCore {
    peer: Rank,
    /// `"tcp"` or `"shm"`, for logs.
    kind: &'static str,
    /// What the wire calls one message (`"frame"`, `"message"`), for errors.
    unit: &'static str,
    /// The deadline in force and what it learned.
    pub(crate) progress: LinkProgress,
    stash: Mutex<Stash>,
    /// Woken when a message is stashed or the link breaks.
    changed: Notify,
    /// `seq` of every receive currently waiting on this link (stale-tag detection).
    waiting: Waiting,
    broken: OnceLock<TransportError>,
    /// A duplicate of the link's socket, to shut it down without touching the link's own;
    /// `None` once the socket was carried into a later generation ([`LinkCore::hand_over`]):
    /// it is no longer this link's to shut down, nor to hold open.
    sock: Mutex<Option<socket2::Socket>>,
    /// The owning transport's span (job, generation, rank).
    pub(crate) span: tracing::Span,
}

impl LinkCore {
    /// The core of a link to `peer` over `sock` (a duplicate of its socket), whose unlearned
    /// deadline is its transport's `pace`.
    pub(crate) fn new(
        peer: Rank,
        kind: &'static str,
        unit: &'static str,
        deadlines: Deadlines,
        pace: Arc<Pace>,
        sock: socket2::Socket,
        span: tracing::Span,
    ) -> Self {
        Self {
            peer,
            kind,
            unit,
            progress: LinkProgress::new(deadlines, pace),
            stash: Mutex::new(Stash::default()),
            changed: Notify::new(),
            waiting: Waiting::default(),
            broken: OnceLock::new(),
            sock: Mutex::new(Some(sock)),
            span,
        }
    }

    /// The rank at the other end.
    pub(crate) fn peer(&self) -> Rank {
        self.peer
    }

    /// Woken when a message is stashed or the link breaks (shared-memory waits select on it).
    pub(crate) fn changed(&self) -> &Notify {
        &self.changed
    }

    /// The error that broke this link, if it is broken.
    pub(crate) fn broken(&self) -> Option<&TransportError> {
        self.broken.get()
    }

    /// Fails fast once the link is broken.
    pub(crate) fn check(&self) -> Result<(), TransportError> {
        match self.broken.get() {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Marks the link broken with `err` (first error wins), shuts the socket down so that the
    /// peer notices at once, and wakes every waiter. Returns `err` for the failing operation.
    pub(crate) fn fail(&self, err: TransportError) -> TransportError {
        if self.broken.set(err.clone()).is_ok() {
            self.span.in_scope(|| tracing::debug!(peer = self.peer, error = %err, "{} link down", self.kind));
            self.shutdown();
        }
        err
    }

    /// Fails the link with a protocol error.
    pub(crate) fn fail_protocol(&self, detail: String) -> TransportError {
        self.fail(TransportError::Protocol { peer: self.peer, detail })
    }

    /// Marks the link broken with `err` (unless it already is) without shutting the socket
    /// down, and wakes its waiting receivers.
    fn break_quietly(&self, err: TransportError) {
        if self.broken.set(err.clone()).is_ok() {
            let kind = self.kind;
            self.span.in_scope(|| tracing::debug!(peer = self.peer, error = %err, "{kind} link unusable (left open)"));
            self.changed.notify_waiters();
        }
    }

    /// Shuts the socket down in both directions without waiting for the peer, and wakes
    /// local waiters. A socket carried into a later generation ([`LinkCore::hand_over`]) is
    /// left alone: it belongs to that generation's link now.
    pub(crate) fn shutdown(&self) {
        if let Some(sock) = lock(&self.sock).as_ref() {
            // Errors (e.g. already disconnected) leave nothing to do.
            let _ = sock.shutdown(std::net::Shutdown::Both);
        }
        self.changed.notify_waiters();
    }

    /// Marks the link as handed over to generation `to`: broken for every later operation
    /// here, and its duplicate of the socket closed, so that it is never shut down from here
    /// and closes when its new owner drops it. The caller then owns the socket.
    pub(crate) fn hand_over(&self, to: u64) {
        drop(lock(&self.sock).take());
        self.break_quietly(TransportError::Aborted(AbortReason::new(format!(
            "this link was carried over to generation {to}"
        ))));
    }

    /// Whether the link can still be carried into a later generation: not broken (a link
    /// handed over is broken here).
    pub(crate) fn carriable(&self) -> bool {
        self.broken.get().is_none()
    }

    /// Registers a receive of `seq` until the returned guard drops (stale-tag detection).
    pub(crate) fn register(&self, seq: u32) -> WaitingGuard<'_> {
        lock(&self.waiting.0).push(seq);
        WaitingGuard { waiting: &self.waiting, seq }
    }

    fn take_stashed(&self, tag: Tag) -> Option<Stashed> {
        let mut s = lock(&self.stash);
        // A message of another call in this operation is taken too: delivering it reports the
        // mismatch.
        let i =
            s.frames.iter().position(|f| (f.tag.seq == tag.seq && f.tag.step == tag.step) || other_call(tag, f.tag))?;
        let f = s.frames.swap_remove(i);
        s.bytes -= f.data.len();
        Some(f)
    }

    fn deliver_stashed(
        &self,
        tag: Tag,
        f: Stashed,
        len: usize,
        deliver: &mut impl FnMut(&[u8]),
    ) -> Result<(), TransportError> {
        self.check_match(tag, len, f.tag, f.data.len() as u64)?;
        deliver(&f.data);
        Ok(())
    }

    /// The start of every receive: waits for the link's reader (`reader`), unless the message
    /// `tag` shows up in the stash meanwhile, in which case it is delivered into `buf` and
    /// `None` returned.
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is taken from the stash or the reader unless it completes.
    pub(crate) async fn reader_or_stashed<'a, T>(
        &self,
        reader: &'a OpLock<T>,
        tag: Tag,
        buf: &mut [u8],
    ) -> Result<Option<OpGuard<'a, T>>, TransportError> {
        let len = buf.len();
        self.reader_or_stashed_with(reader, tag, len, |data| buf.copy_from_slice(data)).await
    }

    /// [`LinkCore::reader_or_stashed`] for a receive of `len` bytes that hands a stashed
    /// message to `deliver` (whole, once its tag, signature and length match) rather than
    /// copying it into a buffer.
    ///
    /// # Cancel safety
    /// Cancel safe, as [`LinkCore::reader_or_stashed`].
    pub(crate) async fn reader_or_stashed_with<'a, T>(
        &self,
        reader: &'a OpLock<T>,
        tag: Tag,
        len: usize,
        mut deliver: impl FnMut(&[u8]),
    ) -> Result<Option<OpGuard<'a, T>>, TransportError> {
        self.check()?;
        // The usual case: no other receive holds the reader. Then the stash is looked at
        // once, after taking it, as the loop below does after its wait.
        if let Some(guard) = reader.try_lock() {
            if let Some(f) = self.take_stashed(tag) {
                return self.deliver_stashed(tag, f, len, &mut deliver).map(|()| None);
            }
            return Ok(Some(guard));
        }
        let guard = loop {
            self.check()?;
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(f) = self.take_stashed(tag) {
                return self.deliver_stashed(tag, f, len, &mut deliver).map(|()| None);
            }
            self.check()?;
            tokio::select! {
                g = reader.lock() => break g,
                () = changed => {}
            }
        };
        self.check()?;
        if let Some(f) = self.take_stashed(tag) {
            return self.deliver_stashed(tag, f, len, &mut deliver).map(|()| None);
        }
        Ok(Some(guard))
    }

    /// Fails the link with a mismatch unless a message tagged `got` of `got_len` bytes is the
    /// one a receive of `want` into `len` bytes expects (same signature, same length).
    ///
    /// The link is broken but left open ([`LinkCore::break_quietly`]): the mismatch is this
    /// rank's finding, and it reports it first. Shutting the socket down here made the peer
    /// fail with "the peer closed its link", naming this rank, and that report could reach the
    /// coordinator first and make the healthy detector the root cause. The communicator
    /// closes the links once it gave up (it aborts its transport, or the elastic runtime's
    /// revocation does after the report).
    pub(crate) fn check_match(&self, want: Tag, len: usize, got: Tag, got_len: u64) -> Result<(), TransportError> {
        let (detail, signatures) = if got.signature != want.signature {
            (
                format!(
                    "message seq {} step {}: signature {:#010x} received (step {}), {:#010x} expected",
                    want.seq, want.step, got.signature, got.step, want.signature
                ),
                Some(Signatures { received: got.signature, expected: want.signature }),
            )
        } else if got_len != len as u64 {
            (format!("message seq {} step {}: {got_len} bytes received, {len} expected", want.seq, want.step), None)
        } else {
            return Ok(());
        };
        let err = TransportError::Mismatch { peer: self.peer, detail, signatures };
        self.break_quietly(err.clone());
        Err(err)
    }

    /// Classifies the header of a message tagged `got` of `got_len` bytes, read by a receive
    /// of `want` into `len` bytes: the message wanted (or one of another call in this
    /// operation, which fails the match at once), or an early one with stash room reserved.
    /// A stale tag (older than every receive waiting on its channel), a duplicate of a stashed message and
    /// a message beyond the stash budget fail the link with a protocol error.
    pub(crate) fn arrived(&self, want: Tag, len: usize, got: Tag, got_len: u64) -> Result<Arrival, TransportError> {
        let unit = self.unit;
        if (got.seq == want.seq && got.step == want.step) || other_call(want, got) {
            self.check_match(want, len, got, got_len)?;
            return Ok(Arrival::Wanted);
        }
        // Only a receiver of the message's own channel (communicator) can show it is stale.
        if let Some(oldest) = self.waiting.oldest_on(channel_of(got.seq)) {
            if seq_older(got.seq, oldest) {
                return Err(self.fail_protocol(format!(
                    "stale {unit} seq {} step {} (the oldest message still expected is seq {oldest})",
                    got.seq, got.step
                )));
            }
        }
        // Reserve stash room before reading, so the allocation is bounded by the budget.
        let s = lock(&self.stash);
        if s.frames.iter().any(|f| f.tag.seq == got.seq && f.tag.step == got.step) {
            drop(s);
            return Err(self.fail_protocol(format!("duplicate {unit} seq {} step {}", got.seq, got.step)));
        }
        // The length was checked against the link's limit; it may still exceed usize on
        // 32-bit targets.
        let bytes = usize::try_from(got_len).unwrap_or(usize::MAX);
        if s.frames.len() >= STASH_MAX_FRAMES || bytes > STASH_BUDGET - s.bytes {
            let (held, held_bytes) = (s.frames.len(), s.bytes);
            drop(s);
            return Err(self.fail_protocol(format!(
                "out-of-order {unit}s exceed the stash budget ({held} {unit}s, {held_bytes} bytes held; {bytes} more arrived)"
            )));
        }
        Ok(Arrival::Early(bytes))
    }

    /// Keeps an early message for the receive that will ask for it, and wakes the receives
    /// looking in the stash.
    pub(crate) fn stash(&self, tag: Tag, data: Vec<u8>) {
        {
            let mut s = lock(&self.stash);
            s.bytes += data.len();
            s.frames.push(Stashed { tag, data });
        }
        self.changed.notify_waiters();
    }
}

/// Marks the link broken if an operation is dropped part-way through a message. The link is
/// unusable then, but its socket stays open: the peer did nothing wrong, and closing now would
/// make it blame this rank for a failure elsewhere (this happens when a collective drops its
/// send because its receive from another peer failed). The socket closes when the transport is
/// aborted or dropped, which the caller does after it has reported the real failure.
pub(crate) struct Poison<'a> {
    link: &'a LinkCore,
    armed: bool,
}

impl<'a> Poison<'a> {
    /// Armed: dropping it before [`Poison::disarm`] breaks `link`.
    pub(crate) fn arm(link: &'a LinkCore) -> Self {
        Self { link, armed: true }
    }

    /// Not armed yet: an operation that may still be dropped harmlessly (nothing of its
    /// message moved) arms it with [`Poison::arm_now`] once that changes.
    pub(crate) fn disarmed(link: &'a LinkCore) -> Self {
        Self { link, armed: false }
    }

    /// Part of the message moved: dropping the operation from now on breaks the link.
    pub(crate) fn arm_now(&mut self) {
        self.armed = true;
    }

    /// The operation reached a message boundary: dropping it now is harmless.
    pub(crate) fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for Poison<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.link.break_quietly(TransportError::Aborted(AbortReason::new(
                "an operation on this link was cancelled part-way through a message",
            )));
        }
    }
}

/// One link of a [`Links`] transport: its core and how it moves one message.
pub(crate) trait Link: Send + Sync {
    /// The state every link shares.
    fn core(&self) -> &LinkCore;

    /// Sends one message tagged `tag`, straight from `data`.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropped part-way through a message, it leaves the link broken (the
    /// [`Poison`] guard), though open.
    fn send(&self, tag: Tag, data: &[u8]) -> impl Future<Output = Result<(), TransportError>> + Send;

    /// Receives the message tagged `tag` into `buf`, which it fills exactly.
    ///
    /// # Cancel safety
    /// Not cancel safe, as [`Link::send`] (once it holds the link's reader).
    fn recv(&self, tag: Tag, buf: &mut [u8]) -> impl Future<Output = Result<(), TransportError>> + Send;
}

/// The transport operations over one link per linked peer, raced against one abort latch.
pub(crate) struct Links<L> {
    /// The generation the links were made for.
    pub(crate) generation: u64,
    /// This rank.
    pub(crate) rank: Rank,
    /// The world size.
    pub(crate) world: u32,
    /// Indexed by rank; empty for this rank, for peers linked otherwise, and for peers
    /// not linked yet (links made on first use are installed later, see [`Links::install`]).
    links: Vec<OnceLock<L>>,
    /// Serialises [`Links::install`] against the sweep of [`Links::abort`], so that a link
    /// installed while the transport aborts is shut down by one of the two.
    installing: Mutex<()>,
    abort: AbortLatch,
    /// Whether an abort leaves the sockets open, so that the links can be carried into the
    /// next generation ([`Links::keep_open_on_abort`]).
    keep_open: bool,
    /// What links the peers (`"TCP"`, `"shared memory"`), for errors and logs.
    over: &'static str,
    span: tracing::Span,
}

impl<L: Link> Links<L> {
    /// A transport over `links` (indexed by rank).
    pub(crate) fn new(
        over: &'static str,
        generation: u64,
        rank: Rank,
        links: Vec<Option<L>>,
        span: tracing::Span,
    ) -> Self {
        // The caller checked the world size against u32 when it planned the links.
        let world = links.len() as u32;
        let links = links
            .into_iter()
            .map(|l| {
                let slot = OnceLock::new();
                if let Some(l) = l {
                    // A fresh cell takes its first value.
                    let _ = slot.set(l);
                }
                slot
            })
            .collect();
        Self {
            generation,
            rank,
            world,
            links,
            installing: Mutex::new(()),
            abort: AbortLatch::new(),
            keep_open: false,
            over,
            span,
        }
    }

    /// An abort stops every operation but leaves the sockets open, for the links to be carried
    /// into the next generation; [`Links::close_all`] (or dropping the transport) closes them.
    pub(crate) fn keep_open_on_abort(mut self) -> Self {
        self.keep_open = true;
        self
    }

    /// Shuts every link down that was not handed over (see [`LinkCore::hand_over`]).
    pub(crate) fn close_all(&self) {
        let _sweep = lock(&self.installing);
        for l in self.links.iter().filter_map(OnceLock::get) {
            l.core().shutdown();
        }
    }

    /// Whether the transport was aborted (not merely a link broken).
    pub(crate) fn aborted(&self) -> bool {
        self.abort.reason().is_some()
    }

    /// The link to `peer`, if it is linked here.
    pub(crate) fn get(&self, peer: Rank) -> Option<&L> {
        self.links.get(peer as usize).and_then(OnceLock::get)
    }

    /// How many peers are linked now.
    pub(crate) fn linked(&self) -> usize {
        self.links.iter().filter(|l| l.get().is_some()).count()
    }

    /// Adds the link to `peer` made after the set-up (on first use). Returns false, dropping
    /// `link`, when `peer` is out of range or already linked. A link installed after an abort
    /// is shut down at once.
    pub(crate) fn install(&self, peer: Rank, link: L) -> bool {
        let _sweep = lock(&self.installing);
        let Some(slot) = self.links.get(peer as usize).filter(|_| peer != self.rank) else { return false };
        if slot.set(link).is_err() {
            return false;
        }
        if self.abort.reason().is_some() && !self.keep_open {
            if let Some(l) = slot.get() {
                l.core().shutdown();
            }
        }
        true
    }

    /// Runs `op` (the making of a link) raced against the abort latch, as every operation is.
    ///
    /// # Cancel safety
    /// As cancel safe as `op`.
    pub(crate) async fn guarded<F>(&self, op: F) -> Result<(), TransportError>
    where
        F: Future<Output = Result<(), TransportError>>,
    {
        self.abort.run(op).await
    }

    /// The link to `peer`, or why there is none (`InvalidArgument`).
    pub(crate) fn link(&self, peer: Rank) -> Result<&L, TransportError> {
        match self.links.get(peer as usize).map(OnceLock::get) {
            Some(Some(l)) => Ok(l),
            Some(None) if peer == self.rank => {
                Err(TransportError::InvalidArgument(format!("rank {peer} is this rank")))
            }
            Some(None) => Err(TransportError::InvalidArgument(format!("rank {peer} is not linked over {}", self.over))),
            None => {
                Err(TransportError::InvalidArgument(format!("rank {peer} out of range for a world of {}", self.world)))
            }
        }
    }

    /// [`crate::Transport::send`] over the link to `peer`.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropping it part-way through a message marks the link broken.
    pub(crate) async fn send(&self, peer: Rank, tag: Tag, data: &[u8]) -> Result<(), TransportError> {
        let link = self.link(peer)?;
        let _in_call = link.core().progress.activity().enter(tag.seq);
        self.abort.run(link.send(tag, data)).await
    }

    /// [`crate::Transport::recv`] over the link to `peer`.
    ///
    /// # Cancel safety
    /// Not cancel safe, as [`Links::send`].
    pub(crate) async fn recv(&self, peer: Rank, tag: Tag, buf: &mut [u8]) -> Result<(), TransportError> {
        let link = self.link(peer)?;
        let _in_call = link.core().progress.activity().enter(tag.seq);
        self.abort.run(link.recv(tag, buf)).await
    }

    /// [`crate::Transport::abort`]: trips the latch and shuts every link down (unless they
    /// are kept open for the next generation, [`Links::keep_open_on_abort`]).
    pub(crate) fn abort(&self, reason: AbortReason) {
        // The generation is over for this rank: its board no longer says where it is.
        if let Some(l) = self.links.iter().find_map(OnceLock::get) {
            l.core().progress.activity().close();
        }
        if self.abort.trip(&reason) {
            let _enter = self.span.enter();
            tracing::debug!(%reason, keep_open = self.keep_open, "transport over {} aborted", self.over);
            if !self.keep_open {
                self.close_all();
            }
        }
    }

    /// [`crate::Transport::is_aborted`]: aborted, or a link broke.
    pub(crate) fn is_aborted(&self) -> bool {
        self.abort.reason().is_some()
            || self.links.iter().filter_map(OnceLock::get).any(|l| l.core().broken().is_some())
    }

    /// [`crate::Transport::deadlines_in_force`]: the deadline in force on every link.
    pub(crate) fn deadlines_in_force(&self) -> Vec<(Rank, DeadlineInForce)> {
        self.links
            .iter()
            .enumerate()
            .filter_map(|(peer, l)| l.get().map(|l| (peer as Rank, l.core().progress.in_force())))
            .collect()
    }
}
