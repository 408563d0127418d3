//! Where a rank is: inside a collective, or late to it. A busy rank is not a hung one.
//!
//! A link that has moved nothing past its learned deadline asks whether the peer's process
//! runs ([`crate::liveness`]). A running peer may be *inside* the operation the link waits
//! for (its own part of the schedule is blocked, or its data plane is stuck) or *late* to it:
//! still computing its step, writing a checkpoint, evaluating, compiling, or waiting on
//! another rank that is itself late. The first is what the no-progress ceiling
//! (`--no-progress-timeout`) bounds; the second is not a failure at all, and only the much
//! longer late-rank bound ([`crate::Learning::late_rank`], minutes) catches a process that
//! never comes (an endless loop or a deadlock in user code).
//!
//! To tell them apart, every mesh keeps an [`Activity`] board that its own transport calls
//! write and that peers read:
//! - the newest operation (`seq`, channel included) this rank has entered on each channel
//!   (any send or receive of it);
//! - how many transport calls are in progress (a rank between two calls of a schedule, or
//!   outside any collective, has none);
//! - how many of its own waits currently wait on a peer judged late (so a rank blocked
//!   behind a late rank passes the lateness on: in a ring every rank behind the late one
//!   waits, and none of them is to blame), and the rank at the root of that chain (the one
//!   that is itself late). A waiter that finds itself named as the root is in a cycle of
//!   waits, not behind a late rank: [`locate`] then says "in the collective", so a deadlock
//!   inside the collective still meets the ceiling instead of holding itself up as "late".
//!
//! The board lives in a sealed memory file: shared-memory peers map it (handed over with
//! the pair's segment) and read it without a system call; TCP and RDMA peers ask for it with
//! the liveness probe, whose responder reads it from the process-wide registry
//! (`Activity::lookup`). [`locate`] turns what was read into a verdict; it is pure and
//! tested without sockets.

use crate::shm::segment::Mapping;
use crate::wire::{channel_of, seq_older};
use crate::Rank;
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::time::Duration;

/// Bytes of a board (one page).
pub(crate) const BOARD_BYTES: usize = 4096;
const MAGIC: u32 = u32::from_le_bytes(*b"CHAB");
/// The magic of a board whose mesh was aborted or dropped: it says nothing any more.
const CLOSED: u32 = u32::from_le_bytes(*b"CHAX");
/// Channels a board tracks; a channel beyond them reads as unknown (a peer waiting on it
/// treats this rank as late: never a false failure, only the later bound).
const CHANNEL_SLOTS: usize = 32;
/// Byte offsets of the words.
const AT_MAGIC: usize = 0;
const AT_PENDING: usize = 4;
const AT_LATE_WAITS: usize = 8;
/// The late rank at the root of the newest wait on a late peer, plus one (0: none).
const AT_LATE_ROOT: usize = 12;
const AT_CHANNELS: usize = 16;
/// When that wait found its peer late, in ms of [`epoch`] (u64, after the channel slots).
const AT_LATE_SINCE: usize = AT_CHANNELS + 8 * CHANNEL_SLOTS;
/// An occupied channel slot: this bit, then the full `seq` in the low 32 bits.
const OCCUPIED: u64 = 1 << 32;

/// Memory behind a board: a sealed memory file (shareable) or, where one cannot be made,
/// the heap (TCP peers can still ask for it).
enum Backing {
    Shared { mapping: Mapping, fd: OwnedFd },
    Heap(#[allow(dead_code)] Box<[AtomicU64]>),
}

/// This rank's board for one mesh (module docs). Written only by this process.
pub struct Activity {
    backing: Backing,
    base: *mut u8,
    /// Serialises the claiming of channel slots (readers never take it).
    claim: Mutex<()>,
    /// [`job_digest`] of the mesh's job (0 for an unregistered board).
    job: u64,
    /// The rank whose board this is (`Rank::MAX` for an unregistered board).
    rank: Rank,
}

// SAFETY: the board is plain memory accessed only through atomics (see `word`/`slot`); the
// backing it points into lives as long as the struct.
unsafe impl Send for Activity {}
// SAFETY: as above.
unsafe impl Sync for Activity {}

impl std::fmt::Debug for Activity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Activity").field("presence", &self.read_all()).finish()
    }
}

/// The word at byte `at` of a board at `base` as an atomic.
///
/// # Safety
/// `base` must point to a live board of [`BOARD_BYTES`] bytes, aligned to 8, and `at + 4`
/// must be within it.
unsafe fn word<'a>(base: *mut u8, at: usize) -> &'a AtomicU32 {
    // SAFETY: per the caller; AtomicU32 has the size and alignment of u32.
    unsafe { &*base.add(at).cast::<AtomicU32>() }
}

/// Channel slot `i` of a board at `base`.
///
/// # Safety
/// As [`word`], with `i < CHANNEL_SLOTS`.
unsafe fn slot<'a>(base: *mut u8, i: usize) -> &'a AtomicU64 {
    // SAFETY: per the caller; slots start 8-aligned.
    unsafe { &*base.add(AT_CHANNELS + 8 * i).cast::<AtomicU64>() }
}

type Key = (Arc<str>, u64, Rank);

fn registry() -> &'static Mutex<HashMap<Key, Weak<Activity>>> {
    static BOARDS: OnceLock<Mutex<HashMap<Key, Weak<Activity>>>> = OnceLock::new();
    BOARDS.get_or_init(Mutex::default)
}

impl Activity {
    /// The board of `rank` in `job`'s `generation` in this process: the one already made
    /// for that mesh (a generation over shared memory and TCP at once has one board for
    /// both), or a new one, registered for [`Activity::lookup`].
    pub(crate) fn for_mesh(job: &str, generation: u64, rank: Rank) -> Arc<Self> {
        let mut boards = registry().lock().unwrap_or_else(PoisonError::into_inner);
        let key: Key = (Arc::from(job), generation, rank);
        if let Some(b) = boards.get(&key).and_then(Weak::upgrade) {
            return b;
        }
        boards.retain(|_, b| b.strong_count() > 0);
        let mut board = Self::new();
        board.job = job_digest(job);
        board.rank = rank;
        let board = Arc::new(board);
        boards.insert(key, Arc::downgrade(&board));
        board
    }

    /// The board registered for (`job_hash`, `generation`, `rank`) in this process, if its
    /// mesh still exists (what the liveness responder answers from).
    pub(crate) fn lookup(job_hash: u64, generation: u64, rank: Rank) -> Option<Arc<Self>> {
        let boards = registry().lock().unwrap_or_else(PoisonError::into_inner);
        boards
            .iter()
            .find(|((job, g, r), _)| *g == generation && *r == rank && job_digest(job) == job_hash)
            .and_then(|(_, b)| b.upgrade())
    }

    /// A fresh, unregistered board.
    pub(crate) fn new() -> Self {
        let (backing, base) = match Mapping::create("cohort-activity", BOARD_BYTES) {
            Ok((mapping, fd)) => {
                let base = mapping.base();
                (Backing::Shared { mapping, fd }, base)
            }
            Err(e) => {
                tracing::debug!("activity board on the heap (shared-memory peers will not see it): {e}");
                let words: Box<[AtomicU64]> = (0..BOARD_BYTES / 8).map(|_| AtomicU64::new(0)).collect();
                let base = words.as_ptr().cast_mut().cast::<u8>();
                (Backing::Heap(words), base)
            }
        };
        let board = Self { backing, base, claim: Mutex::new(()), job: 0, rank: Rank::MAX };
        board.word(AT_MAGIC).store(MAGIC, Ordering::Release);
        board
    }

    /// [`job_digest`] of the mesh's job, what a status probe about a peer of this mesh
    /// carries.
    pub(crate) fn job(&self) -> u64 {
        self.job
    }

    /// The rank whose board this is (what [`locate`] needs to tell a cycle of waits).
    pub(crate) fn rank(&self) -> Rank {
        self.rank
    }

    /// The memory file to hand a shared-memory peer, if the board has one.
    pub(crate) fn fd(&self) -> Option<&OwnedFd> {
        match &self.backing {
            Backing::Shared { fd, mapping } => {
                debug_assert!(mapping.len() == BOARD_BYTES);
                Some(fd)
            }
            Backing::Heap(_) => None,
        }
    }

    fn word(&self, at: usize) -> &AtomicU32 {
        // SAFETY: base is this board's, alive as long as self; offsets are constants within it.
        unsafe { word(self.base, at) }
    }

    fn slot(&self, i: usize) -> &AtomicU64 {
        // SAFETY: as `word`; callers keep i < CHANNEL_SLOTS.
        unsafe { slot(self.base, i) }
    }

    /// A transport call of operation `seq` starts: records that this rank entered it and
    /// counts the call as in progress until the returned guard drops.
    pub(crate) fn enter(&self, seq: u32) -> InCall<'_> {
        self.word(AT_PENDING).fetch_add(1, Ordering::Relaxed);
        self.note_entered(seq);
        InCall(self)
    }

    fn note_entered(&self, seq: u32) {
        let channel = channel_of(seq);
        let found = (0..CHANNEL_SLOTS).map(|i| self.slot(i)).find(|s| {
            let v = s.load(Ordering::Relaxed);
            v & OCCUPIED != 0 && channel_of(v as u32) == channel
        });
        let s = match found {
            Some(s) => s,
            None => {
                let _claiming = self.claim.lock().unwrap_or_else(PoisonError::into_inner);
                // Only this process writes the board, and only under `claim` for a new slot.
                match (0..CHANNEL_SLOTS).map(|i| self.slot(i)).find(|s| {
                    let v = s.load(Ordering::Relaxed);
                    v & OCCUPIED == 0 || channel_of(v as u32) == channel
                }) {
                    Some(s) => {
                        if s.load(Ordering::Relaxed) & OCCUPIED == 0 {
                            s.store(OCCUPIED | u64::from(seq), Ordering::Release);
                        }
                        s
                    }
                    None => return,
                }
            }
        };
        let cur = s.load(Ordering::Relaxed) as u32;
        if cur != seq && seq_older(cur, seq) {
            s.store(OCCUPIED | u64::from(seq), Ordering::Release);
        }
    }

    /// One of this rank's waits waits on a peer judged late, behind late rank `root` (the
    /// peer itself, or the root its own board names), until the guard drops (shown by
    /// [`waiting_on_late`]).
    pub(crate) fn late_wait(&self, root: Rank) -> LateWait<'_> {
        self.word(AT_LATE_WAITS).fetch_add(1, Ordering::Relaxed);
        let wait = LateWait(self);
        wait.behind(root);
        wait
    }

    fn since(&self) -> &AtomicU64 {
        // SAFETY: as `word`; AT_LATE_SINCE is 8-aligned and within the board.
        unsafe { &*self.base.add(AT_LATE_SINCE).cast::<AtomicU64>() }
    }

    /// What a peer waiting for operation `seq` learns of this rank (`None` once closed).
    pub(crate) fn presence(&self, seq: u32) -> Option<Presence> {
        read_presence(self.base, seq)
    }

    /// The mesh was aborted (or is dropped): the board says nothing any more, so a peer that
    /// still waits on this rank is judged as before boards existed (up to the ceiling), never
    /// as late because of what a mesh that is gone last wrote.
    pub(crate) fn close(&self) {
        self.word(AT_MAGIC).store(CLOSED, Ordering::Release);
    }

    fn read_all(&self) -> (u32, u32) {
        (self.word(AT_PENDING).load(Ordering::Relaxed), self.word(AT_LATE_WAITS).load(Ordering::Relaxed))
    }
}

/// Reads a board (this process's or a mapped peer's) for a waiter on `seq`: `None` if it is
/// closed (or not a board).
fn read_presence(base: *mut u8, seq: u32) -> Option<Presence> {
    // SAFETY: base is a live board of BOARD_BYTES (an Activity's or a PeerBoard's mapping,
    // checked for its size when mapped); only atomics are read, so a peer writing anything
    // at all gives numbers, never undefined behaviour.
    let (magic, pending, late_waits, late_root) = unsafe {
        (
            word(base, AT_MAGIC).load(Ordering::Acquire),
            word(base, AT_PENDING).load(Ordering::Relaxed),
            word(base, AT_LATE_WAITS).load(Ordering::Relaxed),
            word(base, AT_LATE_ROOT).load(Ordering::Relaxed),
        )
    };
    if magic != MAGIC {
        return None;
    }
    let channel = channel_of(seq);
    let entered = (0..CHANNEL_SLOTS)
        // SAFETY: as above, i < CHANNEL_SLOTS.
        .map(|i| unsafe { slot(base, i) }.load(Ordering::Acquire))
        .find(|v| v & OCCUPIED != 0 && channel_of(*v as u32) == channel)
        .map(|v| v as u32);
    let late_root = if late_waits > 0 { late_root.checked_sub(1) } else { None };
    Some(Presence { entered, pending, late_waits, late_root })
}

impl Drop for Activity {
    fn drop(&mut self) {
        // Shared-memory peers keep their mapping of the board after this process lets go.
        self.close();
    }
}

/// A transport call in progress ([`Activity::enter`]).
pub(crate) struct InCall<'a>(&'a Activity);

impl Drop for InCall<'_> {
    fn drop(&mut self) {
        self.0.word(AT_PENDING).fetch_sub(1, Ordering::Relaxed);
    }
}

/// A wait on a late peer ([`Activity::late_wait`]).
pub(crate) struct LateWait<'a>(&'a Activity);

impl LateWait<'_> {
    /// The wait is now behind late rank `root` (a chain's root can move as its ranks look
    /// again); the board's "since" restarts when the root changes.
    pub(crate) fn behind(&self, root: Rank) {
        let word = root.saturating_add(1);
        if self.0.word(AT_LATE_ROOT).swap(word, Ordering::Relaxed) != word {
            self.0.since().store(epoch().elapsed().as_millis() as u64, Ordering::Relaxed);
        }
    }
}

impl Drop for LateWait<'_> {
    fn drop(&mut self) {
        if self.0.word(AT_LATE_WAITS).fetch_sub(1, Ordering::Relaxed) == 1 {
            self.0.word(AT_LATE_ROOT).store(0, Ordering::Relaxed);
        }
    }
}

fn epoch() -> std::time::Instant {
    static EPOCH: OnceLock<std::time::Instant> = OnceLock::new();
    *EPOCH.get_or_init(std::time::Instant::now)
}

/// A rank of this process waits on a late peer ([`waiting_on_late`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LateNotice {
    /// The late rank at the root of the newest wait on a late peer (the one everybody
    /// waits for, not the neighbour in between).
    pub peer: Rank,
    /// For how long it has been judged late.
    pub for_: Duration,
}

impl std::fmt::Display for LateNotice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "waiting on late rank {} for {:.0} s", self.peer, self.for_.as_secs_f64())
    }
}

/// Whether a mesh of `job`'s `generation` in this process waits on a late peer, and which:
/// what a worker's heartbeat says, so that the coordinator's status shows who waits on whom.
pub fn waiting_on_late(job: &str, generation: u64) -> Option<LateNotice> {
    let boards: Vec<Arc<Activity>> = {
        let reg = registry().lock().unwrap_or_else(PoisonError::into_inner);
        reg.iter().filter(|((j, g, _), _)| &**j == job && *g == generation).filter_map(|(_, b)| b.upgrade()).collect()
    };
    boards.iter().find_map(|b| {
        let peer = b.word(AT_LATE_ROOT).load(Ordering::Relaxed).checked_sub(1)?;
        let since = Duration::from_millis(b.since().load(Ordering::Relaxed));
        Some(LateNotice { peer, for_: epoch().elapsed().saturating_sub(since) })
    })
}

/// A shared-memory peer's board, mapped read side.
pub(crate) struct PeerBoard {
    mapping: Mapping,
}

impl PeerBoard {
    /// Maps a board received from a peer (sealed, exactly [`BOARD_BYTES`]).
    pub(crate) fn open(fd: &OwnedFd) -> Result<Self, String> {
        Ok(Self { mapping: Mapping::open(fd, BOARD_BYTES)? })
    }

    /// What the board says to a waiter on `seq` (`None` once the peer's mesh closed it).
    pub(crate) fn presence(&self, seq: u32) -> Option<Presence> {
        read_presence(self.mapping.base(), seq)
    }
}

/// A stable 64-bit digest of a job id (FNV-1a), carried by status probes instead of the id.
pub(crate) fn job_digest(job: &str) -> u64 {
    job.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// What a peer's board says, read for a waiter on one operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Presence {
    /// The newest operation the peer entered on the waiter's channel (`None`: none yet, or
    /// the channel is not tracked).
    pub entered: Option<u32>,
    /// Transport calls the peer has in progress.
    pub pending: u32,
    /// The peer's own waits that wait on a late peer.
    pub late_waits: u32,
    /// The late rank at the root of the peer's newest such wait (`None`: no such wait, or a
    /// peer too old to say).
    pub late_root: Option<Rank>,
}

/// Where a running peer is, for a waiter on one operation ([`locate`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Whereabouts {
    /// Inside the operation waited for (or a later one), in a transport call, and not
    /// blocked behind a late rank: the no-progress ceiling applies.
    InCollective,
    /// Late: the waiter keeps waiting, up to the late-rank bound.
    Late(Lateness),
}

/// The late rank a waiter on `peer` is behind, once [`locate`] judged `peer` late: `peer`
/// itself, or, when it waits behind a late rank, the root its board names (itself if the
/// board is too old to say).
pub fn late_root(peer: Rank, lateness: Lateness, p: Presence) -> Rank {
    match lateness {
        Lateness::BehindLate => p.late_root.unwrap_or(peer),
        _ => peer,
    }
}

/// Why a running peer counts as late.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lateness {
    /// It has not entered the operation: it still runs its previous step (`last`: the newest
    /// operation it entered on the channel, if any).
    NotEntered {
        /// The newest operation it entered on that channel.
        last: Option<u32>,
    },
    /// It entered the operation but has no transport call in progress: it computes between
    /// two calls (a reduction, user code between point-to-point messages).
    BetweenCalls,
    /// It waits, inside the operation, on a rank that is itself late.
    BehindLate,
}

/// Judges what a peer's board says to waiter `me` on operation `seq` (pure).
///
/// A peer blocked behind a late rank whose chain ends at `me` is in a cycle of waits (`me`
/// is inside the collective, waiting): no late rank holds it up, so it counts as inside.
pub fn locate(p: Presence, seq: u32, me: Rank) -> Whereabouts {
    match p.entered {
        Some(e) if !seq_older(e, seq) => {
            if p.pending == 0 {
                Whereabouts::Late(Lateness::BetweenCalls)
            } else if p.late_waits > 0 && p.late_root != Some(me) {
                Whereabouts::Late(Lateness::BehindLate)
            } else {
                Whereabouts::InCollective
            }
        }
        last => Whereabouts::Late(Lateness::NotEntered { last }),
    }
}

/// How a late peer used the CPU between two looks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CpuUse {
    /// It ran for at least a tenth of the interval: computing.
    Busy,
    /// It ran less: sleeping or blocked (I/O, a lock, user code waiting on something).
    Idle,
    /// Not known (a single look, or the CPU time cannot be read).
    Unknown,
}

impl CpuUse {
    /// From the process CPU time `(at, cpu)` seen at two looks.
    pub fn between(
        earlier: Option<(std::time::Instant, Duration)>,
        later: Option<(std::time::Instant, Duration)>,
    ) -> Self {
        match (earlier, later) {
            (Some((t0, c0)), Some((t1, c1))) if t1 > t0 => {
                let wall = t1 - t0;
                if c1.saturating_sub(c0) * 10 >= wall {
                    Self::Busy
                } else {
                    Self::Idle
                }
            }
            _ => Self::Unknown,
        }
    }

    /// `computing`, `idle` or `unknown`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Busy => "computing",
            Self::Idle => "idle",
            Self::Unknown => "unknown",
        }
    }
}

/// How often a waiter says, at info level, whom it keeps waiting for.
pub const LATE_LOG_EVERY: Duration = Duration::from_secs(10);

/// The state of one wait on a late peer, kept by a link between probes: when lateness was
/// first seen, the CPU samples, when it was last said.
#[derive(Debug, Default)]
pub(crate) struct LateTrack {
    since: Option<std::time::Instant>,
    cpu: Option<(std::time::Instant, Duration)>,
    last_cpu_use: Option<CpuUse>,
    said_at: Option<std::time::Instant>,
    lateness: Option<Lateness>,
}

impl LateTrack {
    /// Records a verdict of "late" with the peer's process CPU time (if read). Returns the
    /// line to log, at most every [`LATE_LOG_EVERY`].
    pub(crate) fn late(
        &mut self,
        now: std::time::Instant,
        stalled_since: std::time::Instant,
        lateness: Lateness,
        cpu: Option<Duration>,
    ) -> Option<String> {
        self.since.get_or_insert(now);
        let sample = cpu.map(|c| (now, c));
        let use_ = CpuUse::between(self.cpu, sample);
        if use_ != CpuUse::Unknown {
            self.last_cpu_use = Some(use_);
        }
        if sample.is_some() {
            self.cpu = sample;
        }
        self.lateness = Some(lateness);
        let due = self.said_at.is_none_or(|t| now.duration_since(t) >= LATE_LOG_EVERY);
        due.then(|| {
            self.said_at = Some(now);
            format!(
                "{} for {:.1} s",
                describe(lateness, self.cpu_use()),
                now.duration_since(stalled_since).as_secs_f64()
            )
        })
    }

    /// The verdict is not "late" (any more).
    pub(crate) fn clear(&mut self) {
        *self = Self::default();
    }

    /// Whether the peer is currently judged late.
    pub(crate) fn is_late(&self) -> bool {
        self.since.is_some()
    }

    /// The peer's CPU use as last measured.
    pub(crate) fn cpu_use(&self) -> CpuUse {
        self.last_cpu_use.unwrap_or(CpuUse::Unknown)
    }
}

/// A late peer in words: `late (not in operation 42 yet; last entered 41), computing`.
pub fn describe(lateness: Lateness, cpu: CpuUse) -> String {
    let where_ = match lateness {
        Lateness::NotEntered { last: Some(l) } => {
            format!("not in this collective yet (last entered operation {})", l & crate::wire::SEQ_MASK)
        }
        Lateness::NotEntered { last: None } => "not in any collective of this channel yet".to_owned(),
        Lateness::BetweenCalls => "inside the collective but between transport calls".to_owned(),
        Lateness::BehindLate => "waiting behind a late rank".to_owned(),
    };
    format!("late: {where_}, CPU {}", cpu.name())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::seq_on;
    use std::time::Instant;

    #[test]
    fn a_rank_is_in_the_collective_only_while_it_has_entered_it_and_is_in_a_call() {
        let board = Activity::new();
        assert_eq!(board.presence(5), Some(Presence { entered: None, pending: 0, late_waits: 0, late_root: None }));
        assert_eq!(locate(board.presence(5).unwrap(), 5, 0), Whereabouts::Late(Lateness::NotEntered { last: None }));
        {
            let _call = board.enter(4);
            // Entered 4, waiting for 5: not there yet, even though it is in a call.
            assert_eq!(
                locate(board.presence(5).unwrap(), 5, 0),
                Whereabouts::Late(Lateness::NotEntered { last: Some(4) })
            );
        }
        let call = board.enter(5);
        assert_eq!(locate(board.presence(5).unwrap(), 5, 0), Whereabouts::InCollective);
        // A later operation counts as in (the waiter is behind, not the peer).
        assert_eq!(locate(board.presence(4).unwrap(), 4, 0), Whereabouts::InCollective);
        {
            let _late = board.late_wait(2);
            assert_eq!(board.presence(5).unwrap().late_root, Some(2));
            assert_eq!(locate(board.presence(5).unwrap(), 5, 0), Whereabouts::Late(Lateness::BehindLate));
            // The waiter the chain ends at is in a cycle of waits, not behind a late rank.
            assert_eq!(locate(board.presence(5).unwrap(), 5, 2), Whereabouts::InCollective);
        }
        assert_eq!(board.presence(5).unwrap().late_root, None, "gone with the wait");
        drop(call);
        assert_eq!(locate(board.presence(5).unwrap(), 5, 0), Whereabouts::Late(Lateness::BetweenCalls));
        // An older seq never moves the entry back.
        drop(board.enter(3));
        assert_eq!(board.presence(5).unwrap().entered, Some(5));
    }

    /// Two ranks inside one operation, each waiting on the other, where each once saw the
    /// other as late (it had not entered yet): the lateness each board passes on must not
    /// hold the pair up for the late-rank bound. The root each names is the other, so each
    /// finds itself at the root of the other's chain and judges it inside the collective.
    #[test]
    fn a_cycle_of_waits_is_no_late_rank() {
        let a = Activity::new();
        let _in_a = a.enter(5);
        // Rank 0 (board a) judged rank 1 late before rank 1 entered; now rank 1 waits on
        // rank 0 and reads its board.
        let wait_a = a.late_wait(1);
        let p_a = a.presence(5).unwrap();
        assert_eq!(locate(p_a, 5, 1), Whereabouts::InCollective, "rank 1 is the root of rank 0's chain: a cycle");
        assert_eq!(locate(p_a, 5, 2), Whereabouts::Late(Lateness::BehindLate), "a third rank is behind rank 1");
        // Once rank 0's own wait is gone (it saw rank 1 enter), nothing is passed on.
        drop(wait_a);
        assert_eq!(locate(a.presence(5).unwrap(), 5, 1), Whereabouts::InCollective);
        // A chain through a third rank: rank 2 behind late rank 7 passes 7 on.
        let c = Activity::new();
        let _in_c = c.enter(5);
        let _wait_c = c.late_wait(7);
        let p_c = c.presence(5).unwrap();
        assert_eq!(locate(p_c, 5, 0), Whereabouts::Late(Lateness::BehindLate));
        assert_eq!(late_root(2, Lateness::BehindLate, p_c), 7);
        assert_eq!(locate(p_c, 5, 7), Whereabouts::InCollective, "rank 7 waits inside, so nobody is late");
        assert_eq!(late_root(2, Lateness::NotEntered { last: None }, p_c), 2);
    }

    #[test]
    fn channels_are_tracked_apart_and_wrap() {
        let board = Activity::new();
        drop(board.enter(seq_on(0, 9)));
        drop(board.enter(seq_on(3, 2)));
        assert_eq!(board.presence(seq_on(0, 10)).unwrap().entered, Some(seq_on(0, 9)));
        assert_eq!(board.presence(seq_on(3, 2)).unwrap().entered, Some(seq_on(3, 2)));
        assert_eq!(board.presence(seq_on(7, 0)).unwrap().entered, None);
        // Wrapping within the sequence bits: the operation after the last number is newer.
        drop(board.enter(seq_on(4, crate::wire::SEQ_MASK)));
        drop(board.enter(seq_on(4, 0)));
        assert_eq!(board.presence(seq_on(4, 0)).unwrap().entered, Some(seq_on(4, 0)));
        drop(board.enter(seq_on(4, crate::wire::SEQ_MASK)));
        assert_eq!(
            board.presence(seq_on(4, 0)).unwrap().entered,
            Some(seq_on(4, 0)),
            "an older number never moves it back"
        );
        // More channels than slots: the extra ones read as unknown (late), never as in.
        for c in 10..10 + CHANNEL_SLOTS as u32 {
            drop(board.enter(seq_on(c, 1)));
        }
        let last = seq_on(10 + CHANNEL_SLOTS as u32 - 1, 1);
        assert_eq!(board.presence(last).unwrap().entered, None);
        assert!(matches!(locate(board.presence(last).unwrap(), last, 0), Whereabouts::Late(_)));
    }

    #[test]
    fn a_peer_reads_the_board_through_its_memory_file() {
        let board = Activity::new();
        let peer = PeerBoard::open(board.fd().expect("memfd available")).unwrap();
        let _call = board.enter(seq_on(1, 7));
        assert_eq!(
            peer.presence(seq_on(1, 7)),
            Some(Presence { entered: Some(seq_on(1, 7)), pending: 1, late_waits: 0, late_root: None })
        );
        // A board its mesh let go says nothing (the peer is no longer judged late by it).
        board.close();
        assert_eq!(peer.presence(seq_on(1, 7)), None);
    }

    #[test]
    fn boards_are_found_by_mesh() {
        let a = Activity::for_mesh("job-activity-test", 3, 1);
        let again = Activity::for_mesh("job-activity-test", 3, 1);
        assert!(Arc::ptr_eq(&a, &again), "the shm and TCP meshes of one generation share a board");
        let found = Activity::lookup(job_digest("job-activity-test"), 3, 1).unwrap();
        assert!(Arc::ptr_eq(&a, &found));
        assert_eq!(waiting_on_late("job-activity-test", 3), None);
        {
            let _w = a.late_wait(0);
            let n = waiting_on_late("job-activity-test", 3).expect("a late wait shows");
            assert_eq!(n.peer, 0);
            assert!(n.to_string().starts_with("waiting on late rank 0 for"), "{n}");
        }
        assert_eq!(waiting_on_late("job-activity-test", 3), None, "gone with the wait");
        assert!(Activity::lookup(job_digest("job-activity-test"), 3, 2).is_none());
        drop((a, again, found));
        assert!(Activity::lookup(job_digest("job-activity-test"), 3, 1).is_none(), "gone with its mesh");
    }

    #[test]
    fn cpu_use_and_the_calm_log() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        assert_eq!(CpuUse::between(Some((t0, s(1))), Some((t0 + s(10), s(10)))), CpuUse::Busy);
        assert_eq!(CpuUse::between(Some((t0, s(1))), Some((t0 + s(10), s(1)))), CpuUse::Idle);
        assert_eq!(CpuUse::between(None, Some((t0, s(1)))), CpuUse::Unknown);
        let mut track = LateTrack::default();
        let stalled = t0;
        let l = Lateness::NotEntered { last: Some(41) };
        let first = track.late(t0 + s(1), stalled, l, Some(s(5))).expect("said at once");
        assert!(first.contains("last entered operation 41") && first.contains("CPU unknown"), "{first}");
        assert!(track.late(t0 + s(2), stalled, l, Some(s(6))).is_none(), "not again within 10 s");
        let later = track.late(t0 + s(12), stalled, l, Some(s(16))).expect("said again after 10 s");
        assert!(later.contains("CPU computing") && later.contains("for 12.0 s"), "{later}");
        assert_eq!(track.cpu_use(), CpuUse::Busy);
        assert!(track.is_late());
        track.clear();
        assert!(!track.is_late());
    }
}
