//! One established shared-memory link to a peer: two rings in a shared segment (one per
//! direction) and the Unix socket that carries doorbells and the peer's death notice.
//!
//! Sending copies the message into the outgoing ring slot by slot (a message larger than a
//! slot is pipelined: the peer copies slot `k` out while this side fills slot `k + 1`).
//! Receiving copies slots straight into the caller's buffer, releasing each slot as soon as
//! it is copied. Matching, stashing of out-of-order messages, stale-tag and mismatch handling
//! are every link's (`crate::links`, shared with the TCP link).
//!
//! Waiting: a side that finds no data (or no room) first polls the ring for the busy-poll
//! window, letting the rest of its task (a collective's concurrent send) run between looks
//! and keeping the CPU, unless the host runs more ranks of the mesh than it has CPUs or the
//! peer last ran on this CPU, in which case it yields it ([`crate::spin`]: each side
//! publishes its CPU in the ring at every wait and every publish); then it asks for
//! a short scheduler slice (once per thread, so that its wake-up preempts a CPU-bound
//! neighbour), raises its `sleeping` flag in the ring, looks once more, and sleeps on the
//! socket. The other side lowers the flag and writes one doorbell byte after it publishes
//! (the flag and the counters form a store-buffering handshake, ordered by `SeqCst` fences:
//! [`super::protocol::raise_sleeping`]). The socket also wakes every sleeper when the peer's
//! process dies (the kernel closes its end: end-of-stream), so a SIGKILLed peer fails
//! waiting operations at once.
//! Every wait is bounded by the no-progress deadline. With learning on
//! ([`crate::deadline`]), once the learned deadline passes with nothing moving, the link
//! looks at the peer's process (same host: its pid, from the socket's credentials, in
//! `/proc`; see [`crate::liveness`]): stopped (SIGSTOP, a debugger) throughout
//! [`PROBE_WITHIN`] fails the wait at once with `Timeout`; running (late, or waiting on
//! somebody else) extends it by another learned deadline, up to the configured ceiling.
//!
//! Anything the peer wrote into shared memory is validated before use (see [`super::ring`]);
//! a violation fails the link with a protocol error.

use super::lane::{self, LaneHeader, LANE_MAX};
use super::protocol::{self, raise_sleeping, take_sleeper};
use super::ring::{Ring, SlotHeader, KIND_CONT, KIND_FIRST};
use super::segment::Mapping;
use crate::activity::{self, LateTrack, PeerBoard, Whereabouts};
use crate::links::{self, Arrival, LinkCore, Poison};
use crate::liveness::{self, PROBE_WITHIN};
use crate::op_lock::OpLock;
use crate::spin;
use crate::{Rank, Silence, Tag, TransportError};
use std::io;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::UnixStream;
use tokio::time::Instant;

/// An established shared-memory link.
pub(crate) struct ShmLink {
    /// The stash, the broken state and the deadline every link keeps.
    core: LinkCore,
    generation: u64,
    max_message: u64,
    /// The peer's process id (from the socket's credentials), if learning is on and it is
    /// visible from here.
    peer_pid: Option<u32>,
    /// The peer's activity board ([`crate::activity`]), handed over at set-up: where it is
    /// when it runs but sends nothing.
    peer_board: Option<PeerBoard>,
    busy_poll: Duration,
    /// More ranks on this host than CPUs: every turn of a spin yields ([`spin::spin_or_yield`]).
    oversubscribed: bool,
    /// Keeps the rings' memory mapped.
    _mapping: Arc<Mapping>,
    tx: Ring,
    rx: Ring,
    /// Doorbells both ways; end-of-stream is the peer's death notice.
    sock: UnixStream,
    /// The producer's head of `tx` (the truth; the shared copy is for the peer).
    writer: OpLock<u64>,
    /// The producer's count of `tx`'s lane.
    lane_writer: OpLock<LaneWriter>,
    /// The consumer's counts of `rx` (ring and lane).
    reader: OpLock<Reader>,
    /// What [`ShmLink::note_cpu`] last published (encoded; 0: nothing yet).
    cpu_noted: AtomicU32,
}

/// The producer's side of the outgoing lane ([`super::lane`]).
#[derive(Default)]
struct LaneWriter {
    /// Lane messages written.
    next: u64,
    /// The consumer's count of lane messages consumed, as last seen (validated).
    consumed: u64,
}

/// The consumer's side of the incoming ring and lane.
struct Reader {
    /// Ring slots consumed.
    tail: u64,
    /// Lane messages consumed.
    lane: u64,
    /// Where a lane message is unpacked ([`LANE_MAX`] bytes, allocated once).
    unpacked: Box<[u8]>,
}

impl Default for Reader {
    fn default() -> Self {
        Self { tail: 0, lane: 0, unpacked: vec![0u8; LANE_MAX].into_boxed_slice() }
    }
}

/// What arrived first on the incoming ring or lane.
enum Next {
    /// The first slot of a ring message, header validated.
    Ring(SlotHeader),
    /// A whole lane message, header validated.
    Lane(LaneHeader),
}

/// Longest tight spin of a small receive ([`ShmLink::spin_tight`]), within the busy-poll
/// window: long enough to cover the peer's side of a small collective step, short enough
/// that the rest of the task (a concurrent send) and of the thread wait no longer than a
/// scheduler tick would make them.
const TIGHT_SPIN: Duration = Duration::from_micros(20);

/// Looks at the ring between two readings of the clock in a tight spin.
const TIGHT_LOOKS: u32 = 32;

/// What the link needs besides its rings.
pub(crate) struct LinkParams {
    pub(crate) peer: Rank,
    pub(crate) generation: u64,
    pub(crate) max_message: u64,
    pub(crate) deadlines: crate::Deadlines,
    /// The pace shared by the mesh's links (see [`crate::deadline`]).
    pub(crate) pace: Arc<crate::deadline::Pace>,
    pub(crate) busy_poll: Duration,
    pub(crate) oversubscribed: bool,
    pub(crate) span: tracing::Span,
    /// The peer's activity board, if it handed one over.
    pub(crate) peer_board: Option<PeerBoard>,
}

impl ShmLink {
    /// Wraps an established pair: `tx` and `rx` must lie in `mapping`. Fails only if the
    /// socket cannot be duplicated (out of descriptors).
    pub(crate) fn new(
        p: LinkParams,
        mapping: Arc<Mapping>,
        tx: Ring,
        rx: Ring,
        sock: UnixStream,
    ) -> Result<Self, TransportError> {
        let peer_pid = match sock.peer_cred() {
            // 0 or absent: the peer lives in a pid namespace this process cannot see.
            Ok(c) if p.deadlines.learning.is_some() => {
                c.pid().and_then(|pid| u32::try_from(pid).ok()).filter(|&p| p > 0)
            }
            _ => None,
        };
        let dup = socket2::SockRef::from(&sock)
            .try_clone()
            .map_err(|e| TransportError::Io(format!("duplicating the shared-memory socket to rank {}: {e}", p.peer)))?;
        Ok(Self {
            core: LinkCore::new(p.peer, "shm", "message", p.deadlines, p.pace, dup, p.span),
            generation: p.generation,
            max_message: p.max_message,
            peer_pid,
            peer_board: p.peer_board,
            busy_poll: p.busy_poll,
            oversubscribed: p.oversubscribed,
            _mapping: mapping,
            tx,
            rx,
            sock,
            writer: OpLock::new(0),
            lane_writer: OpLock::new(LaneWriter::default()),
            reader: OpLock::new(Reader::default()),
            cpu_noted: AtomicU32::new(0),
        })
    }

    /// The outgoing and incoming rings (tests play a hostile peer through them).
    #[cfg(test)]
    pub(crate) fn rings(&self) -> (Ring, Ring) {
        (self.tx, self.rx)
    }

    fn closed(&self, detail: String) -> TransportError {
        self.core.fail(TransportError::PeerClosed { peer: self.core.peer(), detail })
    }

    /// Writes a doorbell byte. A full socket buffer already holds doorbells the peer has not
    /// read, and a dead peer shows up on the next wait, so failures are ignored.
    fn ring_doorbell(&self) {
        let _ = self.sock.try_write(&[1]);
    }

    /// Wakes the peer if it sleeps on `flag` (after this side stored the counter it waits
    /// on: see [`take_sleeper`] for the ordering).
    fn wake_peer(&self, flag: &AtomicU32) {
        if take_sleeper(flag) {
            self.ring_doorbell();
        }
    }

    /// Publishes the CPU this thread runs on in the two words the peer reads when it waits
    /// on this side (as the producer of `tx`, as the consumer of `rx`), if it changed.
    fn note_cpu(&self) {
        let mine = spin::encode_cpu(spin::this_cpu());
        // The link's own copy of what it last published: the shared words are read only by
        // the peer, so a wait on an unchanged CPU touches no shared line here.
        if self.cpu_noted.swap(mine, Ordering::Relaxed) != mine {
            self.tx.producer_cpu().store(mine, Ordering::Relaxed);
            self.rx.consumer_cpu().store(mine, Ordering::Relaxed);
        }
    }

    /// Reads doorbells until the socket is empty. `Err` describes end-of-stream or a socket
    /// error: the peer is gone (what it published before it went may still be read).
    fn drain_doorbells(&self) -> Result<(), String> {
        let mut buf = [0u8; 64];
        loop {
            match self.sock.try_read(&mut buf) {
                Ok(0) => return Err("the peer closed its shared-memory link (its process exited or aborted)".into()),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("shared-memory link socket: {e}")),
            }
        }
    }

    /// Waits until `ready` says so: busy-polls for the window (spinning, or yielding when
    /// `peer_cpu` says the peer last ran on this CPU: [`spin::turn`]), then sleeps on the
    /// socket with `flag` raised. Fails on the peer's death, a broken link, a protocol
    /// violation reported by `ready`, or the no-progress deadline. `seq` is the operation
    /// waited for; with `learn`, the wait's length feeds the link's estimator (if the peer
    /// has been seen in `seq`).
    async fn wait(
        &self,
        seq: u32,
        learn: bool,
        tight: bool,
        flag: &AtomicU32,
        peer_cpu: &AtomicU32,
        mut ready: impl FnMut() -> Result<bool, String>,
    ) -> Result<(), TransportError> {
        self.note_cpu();
        let mut ready = || ready().map_err(|e| self.core.fail_protocol(e));
        if ready()? {
            // Found at the first look: a wait of no length (the clock is not read on this path).
            if learn {
                self.core.progress.observe(seq, Duration::ZERO);
            }
            return Ok(());
        }
        let started = Instant::now();
        let r = self.wait_long(seq, started, tight, flag, peer_cpu, &mut ready).await;
        if learn && r.is_ok() {
            self.core.progress.observe(seq, started.elapsed());
        }
        r
    }

    /// The tight spin of a small receive ([`TIGHT_SPIN`]): looks at the ring between single
    /// `pause`s without leaving the task, until `ready`, the link breaks, or the window ends
    /// (`Ok(false)`). Only when the peer runs on another CPU and the host is not
    /// oversubscribed ([`spin::spin_or_yield`]): otherwise the peer may need this CPU.
    fn spin_tight(
        &self,
        started: Instant,
        peer_cpu: &AtomicU32,
        ready: &mut impl FnMut() -> Result<bool, TransportError>,
    ) -> Result<bool, TransportError> {
        let window = self.busy_poll.min(TIGHT_SPIN);
        let peer = spin::decode_cpu(peer_cpu.load(Ordering::Relaxed));
        if window.is_zero() || spin::spin_or_yield(self.oversubscribed, peer, spin::this_cpu()) != spin::Turn::Spin {
            return Ok(false);
        }
        loop {
            for _ in 0..TIGHT_LOOKS {
                if ready()? {
                    return Ok(true);
                }
                std::hint::spin_loop();
            }
            self.core.check()?;
            if started.elapsed() >= window {
                return Ok(false);
            }
        }
    }

    /// [`ShmLink::wait`] once the first look found nothing.
    async fn wait_long(
        &self,
        seq: u32,
        started: Instant,
        tight: bool,
        flag: &AtomicU32,
        peer_cpu: &AtomicU32,
        ready: &mut impl FnMut() -> Result<bool, TransportError>,
    ) -> Result<(), TransportError> {
        if tight && self.spin_tight(started, peer_cpu, ready)? {
            return Ok(());
        }
        if !self.busy_poll.is_zero() {
            loop {
                self.core.check()?;
                // Keep the CPU unless the peer is known to wait for it (see crate::spin);
                // let the rest of this task (a concurrent send) run between looks.
                let peer = spin::decode_cpu(peer_cpu.load(Ordering::Relaxed));
                spin::spend(spin::spin_or_yield(self.oversubscribed, peer, spin::this_cpu()));
                tokio::task::yield_now().await;
                if ready()? {
                    return Ok(());
                }
                if started.elapsed() >= self.busy_poll {
                    break;
                }
            }
        }
        // Parking: let the doorbell's wake-up preempt a CPU-bound neighbour (crate::spin).
        spin::prefer_short_slice();
        let ceiling = started + self.core.progress.ceiling();
        let mut alive_at: Option<Instant> = None;
        // Whether the peer is late to `seq` (then the late-rank bound replaces the ceiling),
        // and the count of this rank's waits on late peers, which its own board shows.
        let mut late = LateTrack::default();
        let mut late_wait: Option<activity::LateWait<'_>> = None;
        loop {
            let bound = if late.is_late() { started + self.core.progress.late_bound() } else { ceiling };
            let due = (alive_at.unwrap_or(started) + self.core.progress.in_force().value).min(bound);
            self.core.check()?;
            let changed = self.core.changed().notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            raise_sleeping(flag);
            if ready()? {
                flag.store(0, Ordering::SeqCst);
                return Ok(());
            }
            self.core.check()?;
            tokio::select! {
                r = self.sock.readable() => {
                    let gone = match r {
                        Ok(()) => self.drain_doorbells().err(),
                        Err(e) => Some(format!("shared-memory link socket: {e}")),
                    };
                    if let Some(detail) = gone {
                        // Whatever the peer published before it went is still delivered,
                        // as TCP delivers the bytes before the end-of-stream.
                        flag.store(0, Ordering::SeqCst);
                        if ready()? {
                            return Ok(());
                        }
                        return Err(self.closed(detail));
                    }
                }
                () = changed => {}
                () = tokio::time::sleep_until(due) => {
                    flag.store(0, Ordering::SeqCst);
                    if ready()? {
                        return Ok(());
                    }
                    let now = Instant::now();
                    if now >= bound {
                        let silence = if late.is_late() { Silence::Late { cpu: late.cpu_use() } } else { Silence::Unprobed };
                        if late.is_late() {
                            self.core.span.in_scope(|| {
                                tracing::warn!(peer = self.core.peer(), waited_ms = (now - started).as_millis() as u64, "the peer runs but stayed late past the late-rank bound")
                            });
                        }
                        return Err(self.core.fail(TransportError::Timeout {
                            peer: self.core.peer(),
                            after: bound - started,
                            silence,
                        }));
                    }
                    let Some(pid) = self.peer_pid else {
                        alive_at = Some(ceiling);
                        continue;
                    };
                    let answer = liveness::probe_local_process(pid, PROBE_WITHIN).await;
                    if let Some(silence) = answer.silence() {
                        flag.store(0, Ordering::SeqCst);
                        if ready()? {
                            return Ok(());
                        }
                        let in_force = self.core.progress.in_force();
                        self.core.span.in_scope(|| {
                            tracing::warn!(
                                peer = self.core.peer(),
                                pid,
                                stalled_ms = started.elapsed().as_millis() as u64,
                                deadline = %in_force,
                                "no progress past the learned deadline and the peer's process is stopped"
                            )
                        });
                        return Err(self.core.fail(TransportError::Timeout {
                            peer: self.core.peer(),
                            after: started.elapsed(),
                            silence,
                        }));
                    }
                    // Running: inside the operation (the ceiling bounds it), or late to it
                    // (the late-rank bound does); another window either way.
                    let cpu = match answer { liveness::Answer::Alive(Some(st)) => st.cpu, _ => None };
                    let me = self.core.progress.activity().rank();
                    match self.peer_board.as_ref().and_then(|b| b.presence(seq)).map(|p| (p, activity::locate(p, seq, me))) {
                        Some((p, Whereabouts::Late(lateness))) => {
                            let now_std = now.into_std();
                            if let Some(line) = late.late(now_std, started.into_std(), lateness, cpu) {
                                self.core.span.in_scope(|| tracing::info!(peer = self.core.peer(), "waiting on rank {}: {line}", self.core.peer()));
                            }
                            let root = activity::late_root(self.core.peer(), lateness, p);
                            match &late_wait {
                                Some(w) => w.behind(root),
                                None => late_wait = Some(self.core.progress.activity().late_wait(root)),
                            }
                        }
                        Some((_, Whereabouts::InCollective)) | None => {
                            late.clear();
                            late_wait = None;
                        }
                    }
                    alive_at = Some(Instant::now());
                }
            }
        }
    }

    /// Waits for slot `t` of the incoming ring (for operation `seq`: a continuation of the
    /// message being read) and returns its validated header.
    async fn next_header(&self, seq: u32, t: u64) -> Result<SlotHeader, TransportError> {
        let (ring, slots) = (self.rx, u64::from(self.rx.slots()));
        self.wait(seq, true, false, ring.consumer_sleeping(), ring.producer_cpu(), || {
            protocol::filled(ring.head(), t, slots)
        })
        .await?;
        let h = SlotHeader::decode(&ring.read_header(t), self.generation, self.max_message, ring.capacity())
            .map_err(|e| self.core.fail_protocol(e))?;
        self.core.progress.saw(h.tag.seq);
        Ok(h)
    }

    /// Waits for the next message on either the incoming lane or the ring (whichever shows
    /// one first; both are looked at on every turn of the wait), for operation `seq`.
    async fn next_arrival(&self, seq: u32, r: &Reader, tight: bool) -> Result<Next, TransportError> {
        let (ring, slots) = (self.rx, u64::from(self.rx.slots()));
        let (generation, max) = (self.generation, self.max_message);
        let mut on_lane = None;
        self.wait(seq, true, tight, ring.consumer_sleeping(), ring.producer_cpu(), || {
            on_lane = lane::look(ring.lane_cell(r.lane), r.lane, generation, max)?;
            Ok(on_lane.is_some() || protocol::filled(ring.head(), r.tail, slots)?)
        })
        .await?;
        if let Some(h) = on_lane {
            self.core.progress.saw(h.tag.seq);
            return Ok(Next::Lane(h));
        }
        let h = SlotHeader::decode(&ring.read_header(r.tail), self.generation, self.max_message, ring.capacity())
            .map_err(|e| self.core.fail_protocol(e))?;
        self.core.progress.saw(h.tag.seq);
        Ok(Next::Ring(h))
    }

    /// Hands lane message `r.lane` (found whole, `h`) to `put` as one piece, then gives its
    /// cell back.
    fn take_lane(&self, r: &mut Reader, h: LaneHeader, put: impl FnOnce(&[u8])) -> Result<(), TransportError> {
        let ring = self.rx;
        let bytes = &mut r.unpacked[..h.len];
        lane::read(ring.lane_cell(r.lane), r.lane, bytes).map_err(|e| self.core.fail_protocol(e))?;
        r.lane += 1;
        protocol::release(ring.lane_tail(), r.lane);
        self.wake_peer(ring.producer_sleeping());
        put(&r.unpacked[..h.len]);
        Ok(())
    }

    /// Sends a message of at most [`LANE_MAX`] bytes on the lane.
    async fn send_lane(&self, tag: Tag, data: &[u8]) -> Result<(), TransportError> {
        let mut w = self.lane_writer.lock().await;
        self.core.check()?;
        let (ring, cells) = (self.tx, u64::from(lane::LANE_CELLS));
        let n = w.next;
        if n.wrapping_sub(w.consumed) >= cells {
            let mut consumed = w.consumed;
            self.wait(tag.seq, false, false, ring.producer_sleeping(), ring.consumer_cpu(), || {
                consumed = protocol::consumed(ring.lane_tail(), n, cells)?;
                Ok(n.wrapping_sub(consumed) < cells)
            })
            .await?;
            w.consumed = consumed;
        }
        // No await from here on: the message is written whole or not at all.
        lane::write(ring.lane_cell(n), n, self.generation, tag, data);
        w.next = n + 1;
        self.wake_peer(ring.consumer_sleeping());
        Ok(())
    }

    /// Hands the message whose first slot (at `*tail`) is `first` to `put`, slot by slot and
    /// in order, as `put(offset, bytes)` read in place from the ring (together exactly
    /// `first.total` bytes), releasing each slot once `put` returns.
    async fn fold_message(
        &self,
        tail: &mut u64,
        first: SlotHeader,
        put: &mut (impl FnMut(usize, &[u8]) + Send),
    ) -> Result<(), TransportError> {
        let ring = self.rx;
        let mut h = first;
        loop {
            // decode() bounded offset + chunk by total (the receive's length) and chunk by
            // the slot; the continuation check below keeps the offsets consecutive.
            let (off, n) = (h.offset as usize, h.chunk as usize);
            ring.with_payload(*tail, n, |bytes| put(off, bytes));
            *tail += 1;
            protocol::release(ring.tail(), *tail);
            self.wake_peer(ring.producer_sleeping());
            let done = (off + n) as u64;
            if done >= h.total {
                return Ok(());
            }
            let next = self.next_header(h.tag.seq, *tail).await?;
            if next.kind != KIND_CONT || next.tag != h.tag || next.total != h.total || next.offset != done {
                return Err(self.core.fail_protocol(format!(
                    "slot {} does not continue message seq {} step {} at offset {done} (got kind {} seq {} step {} offset {})",
                    *tail, h.tag.seq, h.tag.step, next.kind, next.tag.seq, next.tag.step, next.offset
                )));
            }
            h = next;
        }
    }
}

impl links::Link for ShmLink {
    fn core(&self) -> &LinkCore {
        &self.core
    }

    /// Sends one message, slot by slot.
    async fn send(&self, tag: Tag, data: &[u8]) -> Result<(), TransportError> {
        self.core.check()?;
        if data.len() <= LANE_MAX {
            return self.send_lane(tag, data).await;
        }
        let mut head = self.writer.lock().await;
        self.core.check()?;
        let mut poison = Poison::arm(&self.core);
        let (ring, slots, cap) = (self.tx, u64::from(self.tx.slots()), self.tx.capacity());
        let mut offset = 0usize;
        loop {
            let h = *head;
            self.wait(tag.seq, false, false, ring.producer_sleeping(), ring.consumer_cpu(), || {
                protocol::room(ring.tail(), h, slots)
            })
            .await?;
            let chunk = (data.len() - offset).min(cap);
            let header = SlotHeader {
                kind: if offset == 0 { KIND_FIRST } else { KIND_CONT },
                tag,
                chunk: chunk as u32,
                total: data.len() as u64,
                offset: offset as u64,
            }
            .encode(self.generation);
            ring.write_slot(h, &header, &data[offset..offset + chunk]);
            *head = h + 1;
            protocol::publish(ring.head(), h + 1);
            self.wake_peer(ring.consumer_sleeping());
            offset += chunk;
            if offset >= data.len() {
                break;
            }
        }
        poison.disarm();
        Ok(())
    }

    /// Receives the message tagged `tag` into `buf`.
    async fn recv(&self, tag: Tag, buf: &mut [u8]) -> Result<(), TransportError> {
        let len = buf.len();
        self.receive(tag, len, |off, bytes| buf[off..off + bytes.len()].copy_from_slice(bytes)).await
    }
}

impl ShmLink {
    /// Receives the message tagged `tag` (`len` bytes) and hands it to `consume` in order,
    /// straight from the ring's slots: see [`crate::Transport::recv_with`].
    ///
    /// # Cancel safety
    /// Not cancel safe, as [`links::Link::recv`].
    pub(crate) async fn recv_with(
        &self,
        tag: Tag,
        len: usize,
        mut consume: impl FnMut(&[u8]) + Send,
    ) -> Result<(), TransportError> {
        self.receive(tag, len, |_, bytes| consume(bytes)).await
    }

    /// The one receive path: the message tagged `tag`, `len` bytes, goes to `put(offset,
    /// bytes)` piece by piece (one piece if it was stashed); messages of later operations
    /// that arrive first are stashed.
    async fn receive(
        &self,
        tag: Tag,
        len: usize,
        mut put: impl FnMut(usize, &[u8]) + Send,
    ) -> Result<(), TransportError> {
        let _waiting = self.core.register(tag.seq);
        let Some(mut reader) = self.core.reader_or_stashed_with(&self.reader, tag, len, |data| put(0, data)).await?
        else {
            return Ok(());
        };
        let r = &mut *reader;
        let mut poison = Poison::arm(&self.core);
        // A receive of one slot or less spins tightly first: its message is one hand-off away.
        let tight = len <= self.rx.capacity();
        loop {
            match self.next_arrival(tag.seq, r, tight).await? {
                Next::Lane(h) => match self.core.arrived(tag, len, h.tag, h.len as u64)? {
                    Arrival::Wanted => {
                        self.take_lane(r, h, |bytes| put(0, bytes))?;
                        poison.disarm();
                        return Ok(());
                    }
                    Arrival::Early(early) => {
                        let mut data = vec![0u8; early];
                        self.take_lane(r, h, |bytes| data.copy_from_slice(bytes))?;
                        self.core.stash(h.tag, data);
                    }
                },
                Next::Ring(h) => {
                    if h.kind != KIND_FIRST {
                        return Err(self.core.fail_protocol(format!(
                            "slot {} continues a message where a new one should start",
                            r.tail
                        )));
                    }
                    match self.core.arrived(tag, len, h.tag, h.total)? {
                        Arrival::Wanted => {
                            self.fold_message(&mut r.tail, h, &mut put).await?;
                            poison.disarm();
                            return Ok(());
                        }
                        Arrival::Early(early) => {
                            let mut data = vec![0u8; early];
                            let mut copy =
                                |off: usize, bytes: &[u8]| data[off..off + bytes.len()].copy_from_slice(bytes);
                            self.fold_message(&mut r.tail, h, &mut copy).await?;
                            self.core.stash(h.tag, data);
                        }
                    }
                }
            }
        }
    }
}
