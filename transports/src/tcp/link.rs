//! One established connection to a peer: framed, deadline-bounded, full-duplex I/O.
//!
//! The writer half and the reader half sit behind separate async mutexes, so a send and a
//! receive on the same link (and operations on different links) run concurrently.
//!
//! Receiving: a receiver reads the 40-byte header, then the payload straight into the
//! caller's buffer (the stash, matching and stale-tag rules below are every link's:
//! `crate::links`). Headers are read through a small read-ahead buffer ([`READ_AHEAD`]
//! bytes) so that a small frame costs one system call; whatever payload bytes were read ahead
//! are copied out of it, everything beyond goes from the socket directly into the caller's
//! buffer. A frame for another tag than the one being waited for is
//! - a protocol error if its `seq` is older than the oldest `seq` any receiver is waiting for
//!   on this link (a stale tag: nothing will ever consume it);
//! - otherwise stashed (copied) for the receiver that will ask for it, within a budget of
//!   [`crate::wire::STASH_BUDGET`] bytes and [`crate::wire::STASH_MAX_FRAMES`] frames per
//!   link; beyond it the link fails with a protocol error. Receivers look in the stash without taking the reader lock, so a
//!   receiver whose frame was stashed never waits behind one still reading.
//!
//! A frame whose tag matches but whose signature or length differs fails the receive with
//! `Mismatch` and closes the link: its payload is not drained, since the two ranks disagree
//! about the call and the generation must be re-formed anyway.
//!
//! Every read and write is bounded by the no-progress deadline: the timer restarts whenever
//! bytes move, so a large transfer over a slow link is fine as long as it keeps moving.
//! With learning on ([`crate::deadline`]), the link learns how long its gaps between
//! progress normally are; when the learned deadline passes with nothing moving, it asks the
//! peer's process whether it runs ([`crate::liveness`]): no answer fails the operation at
//! once with `Timeout`; an answer (the peer is late, or waits on somebody else) extends the
//! wait by another learned deadline, asking again each time, up to the configured ceiling.
//! Any failure marks the link broken (first error wins), shuts the socket down so the peer
//! notices at once, and makes every later operation on the link fail fast with that error.
//! The exception is an operation dropped part-way through a frame (a collective abandoning a
//! send because another link failed): that link is marked broken but left open, so the peer
//! does not take this rank for the failed one; it closes when the transport is aborted or
//! dropped.
//! (The descriptor itself closes when the transport is dropped; until then a peer that only
//! writes to a broken link sees its writes stall and fails on its own no-progress deadline,
//! while a peer that reads sees end-of-stream at once.)

use super::frame::{FrameHeader, HEADER_LEN};
use crate::activity::{self, LateTrack, LateWait, Whereabouts};
use crate::deadline::Pace;
use crate::links::{self, Arrival, LinkCore, Poison};
use crate::liveness::{self, PROBE_WITHIN};
use crate::op_lock::OpLock;
use crate::spin;
use crate::{Deadlines, Rank, Silence, Tag, TransportError};
use std::future::Future;
use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

/// Size of the per-link read-ahead buffer used for headers and small payloads.
pub const READ_AHEAD: usize = 16 * 1024;

/// Why a socket operation stopped.
enum IoFail {
    /// No bytes moved for this long: the ceiling, or a learned deadline after which the
    /// peer's process did not answer a liveness probe (what was found out about it).
    Stalled(Duration, Silence),
    /// The peer closed the connection (`what` says where in the frame).
    Eof(&'static str),
    /// The socket reported an error.
    Io(io::Error),
}

/// Where a link asks whether its peer's process runs.
struct PeerProbe {
    /// The peer's endpoint address (its liveness responder listens on the same port, UDP).
    target: SocketAddr,
    /// Set once the responder answered after the link came up; until then a stall waits
    /// for the ceiling (a silence proves nothing about a peer never heard).
    verified: Arc<AtomicBool>,
}

/// Bounds one operation on a link by the no-progress deadline, restarted whenever bytes
/// move. The timer is re-armed lazily: progress only records the time, and when the timer
/// fires early it is pushed to the deadline then in force.
struct Watchdog<'a> {
    link: &'a TcpLink,
    /// The operation waited for (gaps are learned only once the peer has been seen in it).
    seq: u32,
    /// Whether gaps of this operation feed the estimator (receives do, sends do not).
    learn: bool,
    last: Instant,
    /// When a liveness probe last found the peer alive during the current stall.
    alive_at: Option<Instant>,
    /// Whether the peer is late to `seq` (its status said so at the last probe): then the
    /// late-rank bound replaces the ceiling ([`crate::activity`]).
    late: LateTrack,
    /// Counts this wait among this rank's waits on late peers while it is one.
    late_wait: Option<LateWait<'a>>,
    sleep: Pin<&'a mut Sleep>,
}

/// What a fired timer means.
enum Wake {
    /// Not due yet: sleep until then.
    Until(Instant),
    /// The learned deadline passed: ask the peer.
    Probe(SocketAddr),
    /// Out of time: the ceiling, or the late-rank bound on a late peer.
    Stalled(Duration, Silence),
}

impl<'a> Watchdog<'a> {
    fn new(link: &'a TcpLink, seq: u32, learn: bool, sleep: Pin<&'a mut Sleep>) -> Self {
        // An operation may park on the socket: let its wake-up preempt a CPU-bound neighbour.
        spin::prefer_short_slice();
        let mut wd = Self {
            link,
            seq,
            learn,
            last: Instant::now(),
            alive_at: None,
            late: LateTrack::default(),
            late_wait: None,
            sleep,
        };
        let first = wd.last + wd.link.core.progress.in_force().value;
        wd.sleep.as_mut().reset(first);
        wd
    }

    /// Bytes moved just now.
    fn progressed(&mut self) {
        let now = Instant::now();
        if self.learn {
            self.link.core.progress.observe(self.seq, now - self.last);
        }
        self.last = now;
        self.alive_at = None;
        if self.late.is_late() {
            self.late.clear();
            self.late_wait = None;
        }
    }

    fn wake(&self) -> Wake {
        let now = Instant::now();
        let progress = &self.link.core.progress;
        let (bound, silence) = if self.late.is_late() {
            (progress.late_bound(), Silence::Late { cpu: self.late.cpu_use() })
        } else {
            (progress.ceiling(), Silence::Unprobed)
        };
        let ceiling = self.last + bound;
        if now >= ceiling {
            return Wake::Stalled(bound, silence);
        }
        let window = self.link.core.progress.in_force().value;
        let due = self.alive_at.unwrap_or(self.last) + window;
        if now < due {
            return Wake::Until(due.min(ceiling));
        }
        match self.link.probe.get() {
            Some(p) if self.link.core.progress.learning() && p.verified.load(Ordering::Relaxed) => {
                Wake::Probe(p.target)
            }
            _ => Wake::Until(ceiling),
        }
    }

    /// Awaits one socket call under the no-progress deadline.
    async fn step<T>(&mut self, fut: impl Future<Output = io::Result<T>>) -> Result<T, IoFail> {
        tokio::pin!(fut);
        loop {
            tokio::select! {
                biased;
                r = &mut fut => {
                    self.progressed();
                    return r.map_err(IoFail::Io);
                }
                () = self.sleep.as_mut() => {}
            }
            match self.wake() {
                Wake::Until(t) => self.sleep.as_mut().reset(t),
                Wake::Stalled(after, silence) => {
                    if let Silence::Late { .. } = silence {
                        self.link.core.span.in_scope(|| {
                            tracing::warn!(
                                peer = self.link.core.peer(),
                                waited_ms = after.as_millis() as u64,
                                "the peer runs but stayed late past the late-rank bound"
                            )
                        });
                    }
                    return Err(IoFail::Stalled(after, silence));
                }
                Wake::Probe(target) => {
                    let link: &'a TcpLink = self.link;
                    let board = link.core.progress.activity();
                    let query = liveness::Query {
                        job: board.job(),
                        generation: self.link.generation,
                        rank: self.link.core.peer(),
                        seq: self.seq,
                    };
                    let answer = tokio::select! {
                        biased;
                        r = &mut fut => {
                            self.progressed();
                            return r.map_err(IoFail::Io);
                        }
                        a = liveness::probe(target, PROBE_WITHIN, query) => a,
                    };
                    let now = Instant::now();
                    if let Some(silence) = answer.silence() {
                        let in_force = self.link.core.progress.in_force();
                        self.link.core.span.in_scope(|| {
                            tracing::warn!(
                                peer = self.link.core.peer(),
                                stalled_ms = (now - self.last).as_millis() as u64,
                                deadline = %in_force,
                                "no progress past the learned deadline and the peer's process does not answer"
                            )
                        });
                        return Err(IoFail::Stalled(now - self.last, silence));
                    }
                    // Alive: inside the operation (the ceiling bounds the wait) or late to it
                    // (the late-rank bound does); or no verdict (nobody on that port, a local
                    // failure to probe): another window, then ask again.
                    match answer {
                        liveness::Answer::Alive(Some(liveness::Status { presence: Some(p), cpu })) => {
                            match activity::locate(p, self.seq, board.rank()) {
                                Whereabouts::Late(lateness) => {
                                    if let Some(line) =
                                        self.late.late(now.into_std(), self.last.into_std(), lateness, cpu)
                                    {
                                        let peer = self.link.core.peer();
                                        self.link
                                            .core
                                            .span
                                            .in_scope(|| tracing::info!(peer, "waiting on rank {peer}: {line}"));
                                    }
                                    let root = activity::late_root(link.core.peer(), lateness, p);
                                    match &self.late_wait {
                                        Some(w) => w.behind(root),
                                        None => self.late_wait = Some(board.late_wait(root)),
                                    }
                                }
                                Whereabouts::InCollective => {
                                    self.late.clear();
                                    self.late_wait = None;
                                }
                            }
                        }
                        _ => {
                            self.late.clear();
                            self.late_wait = None;
                        }
                    }
                    self.alive_at = Some(now);
                    let next = self.wake();
                    if let Wake::Until(t) = next {
                        self.sleep.as_mut().reset(t);
                    } else {
                        self.sleep.as_mut().reset(now);
                    }
                }
            }
        }
    }
}

/// Spinning before parking: see [`super::TcpOptions::busy_poll`].
struct BusyPoll {
    /// A duplicate of the socket (same open file, so non-blocking like tokio's), read with
    /// plain `recv` calls: tokio's own `try_read` only consults readiness that its I/O
    /// driver records, and the driver does not run while this thread spins.
    sock: socket2::Socket,
    window: Duration,
}

impl BusyPoll {
    /// Non-blocking reads into `dst` for up to the window: `Some` once bytes (or EOF, or an
    /// error) came, `None` if the window passed with nothing to read. Between reads the thread
    /// keeps the CPU (a yield would hand it to a CPU-bound neighbour for a whole slice; see
    /// [`crate::spin`]).
    fn read(&self, dst: &mut [u8]) -> Option<io::Result<usize>> {
        let until = std::time::Instant::now() + self.window;
        loop {
            match io::Read::read(&mut &self.sock, dst) {
                Ok(n) => return Some(Ok(n)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Some(Err(e)),
            }
            if std::time::Instant::now() >= until {
                return None;
            }
            spin::spend(spin::Turn::Spin);
        }
    }
}

/// The reading side of a link.
struct ReadState {
    /// `None` once the socket was carried into a later generation ([`TcpLink::carry_over`]).
    half: Option<OwnedReadHalf>,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    busy_poll: Option<BusyPoll>,
}

impl ReadState {
    async fn read_header(&mut self, wd: &mut Watchdog<'_>) -> Result<[u8; HEADER_LEN], IoFail> {
        // Spin (once per frame) before the first park: a frame that arrives within the
        // window costs no sleep and wake-up of this thread.
        let mut spun = false;
        while self.end - self.start < HEADER_LEN {
            if self.buf.len() - self.start < HEADER_LEN {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            }
            let Self { half, buf, end, busy_poll, .. } = self;
            let spin = match busy_poll {
                Some(bp) if !spun => {
                    spun = true;
                    bp.read(&mut buf[*end..])
                }
                _ => None,
            };
            let n = match spin {
                Some(r) => {
                    wd.progressed();
                    r.map_err(IoFail::Io)?
                }
                None => wd.step(half.as_mut().ok_or_else(carried)?.read(&mut buf[*end..])).await?,
            };
            if n == 0 {
                return Err(IoFail::Eof(if self.end == self.start {
                    "between frames"
                } else {
                    "inside a frame header"
                }));
            }
            self.end += n;
        }
        let mut h = [0u8; HEADER_LEN];
        h.copy_from_slice(&self.buf[self.start..self.start + HEADER_LEN]);
        self.consume(HEADER_LEN);
        Ok(h)
    }

    async fn read_payload(&mut self, dst: &mut [u8], wd: &mut Watchdog<'_>) -> Result<(), IoFail> {
        let buffered = (self.end - self.start).min(dst.len());
        dst[..buffered].copy_from_slice(&self.buf[self.start..self.start + buffered]);
        self.consume(buffered);
        let mut done = buffered;
        let half = self.half.as_mut().ok_or_else(carried)?;
        while done < dst.len() {
            let n = wd.step(half.read(&mut dst[done..])).await?;
            if n == 0 {
                return Err(IoFail::Eof("inside a frame payload"));
            }
            done += n;
        }
        Ok(())
    }

    fn consume(&mut self, n: usize) {
        self.start += n;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }
}

/// The error of an operation on a link whose socket went to a later generation (the link is
/// marked broken first, so operations fail before they get here).
fn carried() -> IoFail {
    IoFail::Io(io::Error::other("the link's socket was carried over to a later generation"))
}

/// A link's socket taken out of a generation that ended, to be re-bound to the next one
/// ([`super::carry`]): the stream and the bytes its reader had read ahead.
pub(crate) struct TakenSocket {
    pub(crate) stream: TcpStream,
    pub(crate) read_ahead: Vec<u8>,
}

/// An established, authenticated connection to one peer.
pub(crate) struct TcpLink {
    /// The stash, the broken state and the deadline every link keeps.
    core: LinkCore,
    generation: u64,
    max_frame: u64,
    /// How to ask whether the peer's process runs (learning on, address known): set when the
    /// link is made, or later for a link accepted before the peer's address was known
    /// ([`Self::learn_probe_target`]).
    probe: OnceLock<PeerProbe>,
    /// Whether deadlines are learned (else the peer is never probed).
    learning: bool,
    reader: OpLock<ReadState>,
    /// `None` once the socket was carried into a later generation.
    writer: tokio::sync::Mutex<Option<OwnedWriteHalf>>,
}

impl TcpLink {
    /// Wraps an authenticated stream (socket options already applied); its links share `pace`
    /// (see [`crate::deadline`]). With learning on,
    /// `peer_addr` (the peer's endpoint) is where its liveness responder answers; it is asked
    /// once now, in the background, so that later silences can be trusted.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        peer: Rank,
        generation: u64,
        max_frame: u64,
        deadlines: Deadlines,
        pace: Arc<Pace>,
        peer_addr: Option<SocketAddr>,
        busy_poll: Duration,
        stream: TcpStream,
        span: tracing::Span,
    ) -> Result<Self, TransportError> {
        let dup = || {
            socket2::SockRef::from(&stream)
                .try_clone()
                .map_err(|e| TransportError::Io(format!("duplicating the socket to rank {peer}: {e}")))
        };
        let sock = dup()?;
        let busy_poll = if busy_poll.is_zero() { None } else { Some(BusyPoll { sock: dup()?, window: busy_poll }) };
        let (r, w) = stream.into_split();
        let probe = OnceLock::new();
        if let Some(target) = peer_addr.filter(|_| deadlines.learning.is_some()) {
            let _ = probe.set(PeerProbe { target, verified: liveness::verify_in_background(target) });
        }
        Ok(Self {
            core: LinkCore::new(peer, "tcp", "frame", deadlines, pace, sock, span),
            generation,
            max_frame,
            probe,
            learning: deadlines.learning.is_some(),
            reader: OpLock::new(ReadState {
                half: Some(r),
                buf: vec![0u8; READ_AHEAD].into_boxed_slice(),
                start: 0,
                end: 0,
                busy_poll,
            }),
            writer: tokio::sync::Mutex::new(Some(w)),
        })
    }

    /// Takes the socket out of this link for generation `to`, if the link is clean: not
    /// broken, no operation on it (none holds its reader or writer), and so every frame on
    /// it sent or received whole. The link is then broken here for good and never shuts the
    /// socket down ([`crate::links::LinkCore::hand_over`]). `None` leaves the link as it was.
    pub(crate) fn carry_over(&self, to: u64) -> Option<TakenSocket> {
        if !self.core.carriable() {
            return None;
        }
        let mut reader = self.reader.try_lock()?;
        let mut writer = self.writer.try_lock().ok()?;
        if !self.core.carriable() {
            return None;
        }
        let (read, write) = (reader.half.take()?, writer.take()?);
        self.core.hand_over(to);
        // The spinning reader's duplicate of the descriptor goes too: the socket must close
        // when its new owner drops it.
        reader.busy_poll = None;
        let stream = match read.reunite(write) {
            Ok(s) => s,
            // The halves of one stream always reunite; were it otherwise, dropping them closes
            // the socket and the peer falls back to a fresh link.
            Err(_) => return None,
        };
        let read_ahead = reader.buf[reader.start..reader.end].to_vec();
        Some(TakenSocket { stream, read_ahead })
    }

    /// Gives a link made without the peer's address (one accepted on first use from a peer
    /// outside a sparse view) its probe target once the address is found: the peer's
    /// endpoint, asked once now in the background, as [`Self::new`] does. Nothing when
    /// learning is off or the link has a target already.
    pub(crate) fn learn_probe_target(&self, target: SocketAddr) {
        if !self.learning || self.probe.get().is_some() {
            return;
        }
        let _ = self.probe.set(PeerProbe { target, verified: liveness::verify_in_background(target) });
    }

    /// Whether the peer's liveness responder has answered (stalls past the learned deadline
    /// are then settled by asking it).
    pub(crate) fn peer_probed(&self) -> bool {
        self.probe.get().is_some_and(|p| p.verified.load(Ordering::Relaxed))
    }

    fn io_error(&self, e: IoFail) -> TransportError {
        let peer = self.core.peer();
        match e {
            IoFail::Stalled(after, silence) => TransportError::Timeout { peer, after, silence },
            IoFail::Eof(at) => TransportError::PeerClosed { peer, detail: format!("connection closed by peer {at}") },
            IoFail::Io(e) => TransportError::PeerClosed { peer, detail: e.to_string() },
        }
    }

    /// Fails the link with the error `e` stands for.
    fn io_fail(&self, e: IoFail) -> TransportError {
        self.core.fail(self.io_error(e))
    }

    async fn read_until(
        &self,
        r: &mut ReadState,
        wd: &mut Watchdog<'_>,
        tag: Tag,
        buf: &mut [u8],
    ) -> Result<(), TransportError> {
        loop {
            let raw = r.read_header(wd).await.map_err(|e| self.io_fail(e))?;
            let h = FrameHeader::decode(&raw, self.generation, self.max_frame)
                .map_err(|e| self.core.fail_protocol(e.to_string()))?;
            self.core.progress.saw(h.tag.seq);
            // Between frames the reader is consistent (a header read part-way stays in the
            // read-ahead buffer); inside a payload it is not, so dropping the receive there
            // breaks the link.
            let mut poison = Poison::arm(&self.core);
            match self.core.arrived(tag, buf.len(), h.tag, h.len)? {
                Arrival::Wanted => {
                    let read = r.read_payload(buf, wd).await.map_err(|e| self.io_fail(e));
                    poison.disarm();
                    return read;
                }
                Arrival::Early(len) => {
                    let mut data = vec![0u8; len];
                    r.read_payload(&mut data, wd).await.map_err(|e| self.io_fail(e))?;
                    poison.disarm();
                    self.core.stash(h.tag, data);
                }
            }
        }
    }
}

impl links::Link for TcpLink {
    fn core(&self) -> &LinkCore {
        &self.core
    }

    /// Sends one frame: header and payload, straight from `data`.
    async fn send(&self, tag: Tag, data: &[u8]) -> Result<(), TransportError> {
        self.core.check()?;
        let mut guard = self.writer.lock().await;
        self.core.check()?;
        let w = guard.as_mut().ok_or_else(|| self.io_error(carried()))?;
        let header = FrameHeader { generation: self.generation, tag, len: data.len() as u64 }.encode();
        // Armed once part of the frame is out: a send dropped before its first byte leaves
        // the link clean.
        let mut poison = Poison::disarmed(&self.core);
        let sleep = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(sleep);
        let mut wd = Watchdog::new(self, tag.seq, false, sleep);
        let total = HEADER_LEN + data.len();
        let mut done = 0;
        let mut result = Ok(());
        while done < total {
            let n = if done < HEADER_LEN {
                let bufs = [IoSlice::new(&header[done..]), IoSlice::new(data)];
                wd.step(w.write_vectored(&bufs)).await
            } else {
                wd.step(w.write(&data[done - HEADER_LEN..])).await
            };
            match n {
                Ok(0) => {
                    result = Err(IoFail::Io(io::ErrorKind::WriteZero.into()));
                    break;
                }
                Ok(n) => {
                    done += n;
                    poison.arm_now();
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        poison.disarm();
        result.map_err(|e| self.io_fail(e))
    }

    /// Receives the frame tagged `tag` into `buf`.
    async fn recv(&self, tag: Tag, buf: &mut [u8]) -> Result<(), TransportError> {
        let _waiting = self.core.register(tag.seq);
        let Some(mut reader) = self.core.reader_or_stashed(&self.reader, tag, buf).await? else {
            return Ok(());
        };
        let sleep = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(sleep);
        let mut wd = Watchdog::new(self, tag.seq, true, sleep);
        self.read_until(&mut reader, &mut wd, tag, buf).await
    }
}
