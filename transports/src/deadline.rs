//! Self-tuning no-progress deadlines: how long a link may sit without moving a byte before
//! its peer is suspected, learned from how long progress normally takes on that link.
//!
//! [`ProgressEstimator`] is pure (no clock, no I/O): it is fed the gaps between progress
//! events observed on one link while an operation waited on it, and answers the deadline in
//! force, the way TCP's retransmission timer does (RFC 6298: a smoothed gap plus four times
//! its smoothed variation), with two safeguards of its own:
//! - a *peak* term: the deadline is at least twice the largest recent gap (the peak decays
//!   by 1/64 per sample), so one burst of slow progress is remembered for a while instead of
//!   being averaged away;
//! - bounds: never below [`Learning::floor`] (clear of scheduler hiccups on a loaded machine),
//!   never above the configured ceiling ([`Deadlines::no_progress`]); until
//!   [`MIN_SAMPLES`] gaps have been seen, the ceiling itself.
//!
//! A link that has not seen [`MIN_SAMPLES`] gaps (one that only sends, or only carries
//! single-message exchanges such as a small allreduce by recursive doubling) cannot judge its
//! own pace; with learning on it takes its transport's (`Pace`: the deadline the transport's
//! learned links last had, at least the floor), so a stopped peer is asked about on such a link
//! as soon as on any other instead of at the ceiling.
//!
//! What a learned deadline *does* is up to the transport: the TCP transport, when it passes,
//! asks the peer's process whether it is alive ([`crate::liveness`]); a peer that does
//! not answer is failed at once, one that answers (it is merely late, or waits on somebody
//! else) is waited for up to the ceiling.

use crate::wire::seq_older;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

/// Deadlines applied by a transport to every wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deadlines {
    /// A link that moves no bytes for this long while an operation waits on it fails the
    /// operation with [`crate::TransportError::Timeout`]. With [`Deadlines::learning`] on, this is
    /// the ceiling: the deadline in force is learned per link and never exceeds it.
    pub no_progress: Duration,
    /// Bound on connection set-up (connect, accept and handshake of the whole mesh).
    pub connect: Duration,
    /// Self-tuning no-progress deadlines (this module); `None`: `no_progress` as it is.
    /// Transports that cannot learn (RDMA, the simulated network) use the ceiling either
    /// way; RDMA links still ask a peer that moved nothing for the ceiling where it is, and
    /// wait for a late one up to [`Learning::late_rank`], when this is `Some`.
    pub learning: Option<Learning>,
}

impl Deadlines {
    /// Fixed deadlines: `no_progress` on every link, nothing learned.
    pub fn fixed(no_progress: Duration, connect: Duration) -> Self {
        Self { no_progress, connect, learning: None }
    }
}

impl Default for Deadlines {
    /// A 10 s no-progress ceiling with learning on (floor [`DEFAULT_FLOOR`]), 30 s
    /// to connect.
    fn default() -> Self {
        Self {
            no_progress: Duration::from_secs(10),
            connect: Duration::from_secs(30),
            learning: Some(Learning::default()),
        }
    }
}

/// Gaps needed before the learned value replaces the ceiling.
pub const MIN_SAMPLES: u32 = 8;

/// The default floor of learned deadlines.
pub const DEFAULT_FLOOR: Duration = Duration::from_millis(250);

/// How deadlines are learned, when they are ([`Deadlines::learning`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Learning {
    /// The learned deadline is never shorter than this.
    pub floor: Duration,
    /// How long a link waits on a peer whose process runs but is *late* to the operation
    /// (it has not entered it, computes between two calls of it, or waits behind a rank that
    /// is late; see [`crate::activity`]) before it fails with
    /// [`crate::Silence::Late`]. The no-progress ceiling does not apply to such a wait: a
    /// rank that writes a checkpoint for a minute is not cut. This bound catches a process
    /// that never comes (an endless loop, a deadlock in user code). Never shorter than the
    /// no-progress ceiling: a shorter value counts as the ceiling.
    pub late_rank: Duration,
}

/// The default late-rank bound: 30 minutes, gloo's default timeout (NCCL's watchdog waits
/// 10 minutes, torchft 60 s). A late rank is never a false failure before it.
pub const DEFAULT_LATE_RANK: Duration = Duration::from_secs(30 * 60);

impl Learning {
    /// Learning with `floor` and the default late-rank bound.
    pub fn with_floor(floor: Duration) -> Self {
        Self { floor, ..Self::default() }
    }
}

impl Default for Learning {
    /// A floor of [`DEFAULT_FLOOR`], a late-rank bound of [`DEFAULT_LATE_RANK`].
    fn default() -> Self {
        Self { floor: DEFAULT_FLOOR, late_rank: DEFAULT_LATE_RANK }
    }
}

/// Why the deadline in force has the value it has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeadlineBasis {
    /// Learning is off: the configured deadline.
    Fixed,
    /// Too few gaps seen yet on this link ([`MIN_SAMPLES`]; a link that only sends, or only
    /// carries single-message exchanges, never sees any): the transport's pace (`Pace`), at
    /// least the floor; the ceiling for [`ProgressEstimator::deadline`] alone.
    Unlearned,
    /// The learned value was below the floor: the floor.
    Floor,
    /// Learned from the gaps seen (smoothed gap + 4 x variation, or twice the recent peak).
    Learned,
    /// The learned value was above the ceiling: the ceiling.
    Ceiling,
}

impl DeadlineBasis {
    /// A short lower-case name (`fixed`, `unlearned`, `floor`, `learned`, `ceiling`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Fixed => "fixed",
            Self::Unlearned => "unlearned",
            Self::Floor => "floor",
            Self::Learned => "learned",
            Self::Ceiling => "ceiling",
        }
    }
}

impl std::fmt::Display for DeadlineBasis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The deadline in force on one link, and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeadlineInForce {
    /// How long the link may move no bytes before its peer is suspected.
    pub value: Duration,
    /// Why it has this value.
    pub basis: DeadlineBasis,
    /// Smoothed gap between progress events (zero before the first sample).
    pub smoothed: Duration,
    /// Smoothed variation of the gap.
    pub variation: Duration,
    /// Largest recent gap (decaying).
    pub peak: Duration,
    /// Gaps seen so far.
    pub samples: u32,
}

impl std::fmt::Display for DeadlineInForce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ms ({}; {} gaps, smoothed {:.1} ms, variation {:.1} ms, peak {:.1} ms)",
            self.value.as_millis(),
            self.basis,
            self.samples,
            self.smoothed.as_secs_f64() * 1e3,
            self.variation.as_secs_f64() * 1e3,
            self.peak.as_secs_f64() * 1e3
        )
    }
}

/// Learns how long progress normally takes on one link (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProgressEstimator {
    smoothed: Duration,
    variation: Duration,
    peak: Duration,
    samples: u32,
}

impl ProgressEstimator {
    /// An estimator that has seen nothing (its deadline is the ceiling).
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds one gap between progress events.
    pub fn observe(&mut self, gap: Duration) {
        if self.samples == 0 {
            self.smoothed = gap;
            self.variation = gap / 2;
        } else {
            let diff = gap.abs_diff(self.smoothed);
            self.variation = self.variation * 3 / 4 + diff / 4;
            self.smoothed = self.smoothed * 7 / 8 + gap / 8;
        }
        self.peak = gap.max(self.peak - self.peak / 64);
        self.samples = self.samples.saturating_add(1);
    }

    /// The deadline in force, between `floor` and `ceiling` (the ceiling wins if they cross).
    pub fn deadline(&self, floor: Duration, ceiling: Duration) -> DeadlineInForce {
        let (value, basis) = if self.samples < MIN_SAMPLES {
            (ceiling, DeadlineBasis::Unlearned)
        } else {
            let learned = (self.smoothed + self.variation * 4).max(self.peak * 2);
            if learned >= ceiling {
                (ceiling, DeadlineBasis::Ceiling)
            } else if learned <= floor {
                (floor.min(ceiling), if floor >= ceiling { DeadlineBasis::Ceiling } else { DeadlineBasis::Floor })
            } else {
                (learned, DeadlineBasis::Learned)
            }
        };
        DeadlineInForce {
            value,
            basis,
            smoothed: self.smoothed,
            variation: self.variation,
            peak: self.peak,
            samples: self.samples,
        }
    }
}

/// The pace of one transport's links: the deadline in force its learned links last had (the
/// newest published wins), for its links that have learned nothing themselves (see the module
/// docs). Zero until a link has learned.
#[derive(Debug)]
pub(crate) struct Pace {
    nanos: AtomicU64,
    /// This rank's board of the mesh ([`crate::activity`]), which its links' waits update
    /// and consult.
    activity: Arc<crate::activity::Activity>,
}

impl Pace {
    /// A pace shared by the links of one transport (one generation's mesh), with this rank's
    /// board of that mesh.
    pub(crate) fn shared(activity: Arc<crate::activity::Activity>) -> Arc<Self> {
        Arc::new(Self { nanos: AtomicU64::new(0), activity })
    }

    /// This rank's board of the mesh.
    pub(crate) fn board(&self) -> &Arc<crate::activity::Activity> {
        &self.activity
    }

    /// A pace with a board of its own (tests).
    #[cfg(test)]
    pub(crate) fn detached() -> Arc<Self> {
        Self::shared(Arc::new(crate::activity::Activity::new()))
    }

    fn publish(&self, learned: Duration) {
        let nanos = u64::try_from(learned.as_nanos()).unwrap_or(u64::MAX);
        // Relaxed: a hint read by other links' timers; no other memory depends on it.
        if self.nanos.load(Ordering::Relaxed) != nanos {
            self.nanos.store(nanos, Ordering::Relaxed);
        }
    }

    /// The newest learned deadline of a link of this transport, if any has learned.
    fn get(&self) -> Option<Duration> {
        match self.nanos.load(Ordering::Relaxed) {
            0 => None,
            n => Some(Duration::from_nanos(n)),
        }
    }
}

/// One link's deadline state, shared by the operations on it: the estimator, and the newest
/// operation the peer has been seen in (gaps are learned only inside an operation the peer
/// has already entered, so that waiting for a peer that is late to an operation, as it
/// computes a longer step or saves a checkpoint, never teaches the link a long gap).
#[derive(Debug)]
pub(crate) struct LinkProgress {
    ceiling: Duration,
    learning: Option<Learning>,
    estimator: std::sync::Mutex<ProgressEstimator>,
    /// Newest `seq` of a frame from the peer, plus one (0: none yet).
    newest_seq: AtomicU64,
    /// The transport's pace: published to while this link has learned, read while it has not.
    pace: Arc<Pace>,
}

impl LinkProgress {
    /// A link with nothing learned yet, of the transport whose links share `pace`.
    pub(crate) fn new(deadlines: Deadlines, pace: Arc<Pace>) -> Self {
        Self {
            ceiling: deadlines.no_progress,
            learning: deadlines.learning,
            estimator: std::sync::Mutex::new(ProgressEstimator::new()),
            newest_seq: AtomicU64::new(0),
            pace,
        }
    }

    /// The configured ceiling (the fixed deadline when learning is off).
    pub(crate) fn ceiling(&self) -> Duration {
        self.ceiling
    }

    /// Whether deadlines are learned on this link.
    pub(crate) fn learning(&self) -> bool {
        self.learning.is_some()
    }

    /// How long a wait on a late peer may last ([`Learning::late_rank`]; the ceiling when
    /// learning is off, where nobody is asked where it is).
    pub(crate) fn late_bound(&self) -> Duration {
        self.learning.map_or(self.ceiling, |l| l.late_rank.max(self.ceiling))
    }

    /// This rank's board of the mesh the link belongs to.
    pub(crate) fn activity(&self) -> &crate::activity::Activity {
        &self.pace.activity
    }

    /// The deadline in force and why.
    pub(crate) fn in_force(&self) -> DeadlineInForce {
        let e = *self.estimator.lock().unwrap_or_else(PoisonError::into_inner);
        match self.learning {
            Some(l) => {
                let d = e.deadline(l.floor, self.ceiling);
                if d.basis == DeadlineBasis::Unlearned {
                    let borrowed = self.pace.get().unwrap_or(l.floor).max(l.floor).min(self.ceiling);
                    DeadlineInForce { value: borrowed, ..d }
                } else {
                    d
                }
            }
            None => DeadlineInForce { basis: DeadlineBasis::Fixed, ..e.deadline(self.ceiling, self.ceiling) },
        }
    }

    /// Records that a frame of operation `seq` came from the peer.
    pub(crate) fn saw(&self, seq: u32) {
        let _ = self.newest_seq.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |cur| {
            let newer = cur == 0 || seq_older((cur - 1) as u32, seq);
            newer.then_some(u64::from(seq) + 1)
        });
    }

    /// Whether the peer has been seen in operation `seq` (or a later one).
    pub(crate) fn peer_in(&self, seq: u32) -> bool {
        match self.newest_seq.load(Ordering::Relaxed) {
            0 => false,
            n => !seq_older((n - 1) as u32, seq),
        }
    }

    /// Feeds a gap between progress events of an operation on `seq`, if the peer had been
    /// seen in it (else the gap may be the peer's lateness, not the link's pace).
    pub(crate) fn observe(&self, seq: u32, gap: Duration) {
        let Some(l) = self.learning else { return };
        if self.peer_in(seq) {
            let mut e = self.estimator.lock().unwrap_or_else(PoisonError::into_inner);
            e.observe(gap);
            let d = e.deadline(l.floor, self.ceiling);
            drop(e);
            if d.basis != DeadlineBasis::Unlearned {
                self.pace.publish(d.value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLOOR: Duration = Duration::from_millis(250);
    const CEILING: Duration = Duration::from_secs(10);

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    fn us(v: u64) -> Duration {
        Duration::from_micros(v)
    }

    fn fed(gaps: impl IntoIterator<Item = Duration>) -> ProgressEstimator {
        let mut e = ProgressEstimator::new();
        for g in gaps {
            e.observe(g);
        }
        e
    }

    #[test]
    fn warm_up_with_no_or_few_samples_is_the_ceiling() {
        let d = ProgressEstimator::new().deadline(FLOOR, CEILING);
        assert_eq!((d.value, d.basis, d.samples), (CEILING, DeadlineBasis::Unlearned, 0));
        let d = fed([us(100); MIN_SAMPLES as usize - 1]).deadline(FLOOR, CEILING);
        assert_eq!((d.value, d.basis), (CEILING, DeadlineBasis::Unlearned));
        let d = fed([us(100); MIN_SAMPLES as usize]).deadline(FLOOR, CEILING);
        assert_eq!((d.value, d.basis), (FLOOR, DeadlineBasis::Floor));
    }

    /// Fast steps (a 256 KiB allreduce on loopback: gaps of 50-400 us), then the peer stops:
    /// the deadline stays at the floor, so the stall is suspected after 250 ms, not 10 s.
    #[test]
    fn fast_link_then_a_stall_is_suspected_at_the_floor() {
        let trace: Vec<Duration> = (0..2000).map(|i| us(50 + (i * 37 % 350))).collect();
        let e = fed(trace);
        let d = e.deadline(FLOOR, CEILING);
        assert_eq!((d.value, d.basis), (FLOOR, DeadlineBasis::Floor), "{d}");
        assert!(d.smoothed < ms(1) && d.peak < ms(1), "{d}");
    }

    /// A slow but moving link (a congested WAN link or a CPU-starved peer: gaps of 0.6-1.4 s)
    /// gets a deadline well above its largest gap (at least 1.5 x), so it is never suspected
    /// while it moves.
    #[test]
    fn slow_link_is_given_room_above_its_largest_gap() {
        let trace: Vec<Duration> = (0..500).map(|i| ms(600 + (i * 131 % 800))).collect();
        let largest = *trace.iter().max().unwrap();
        let d = fed(trace).deadline(FLOOR, CEILING);
        assert_eq!(d.basis, DeadlineBasis::Learned, "{d}");
        assert!(d.value >= largest * 3 / 2, "{d} against a largest gap of {largest:?}");
        assert!(d.value < CEILING, "{d}");
    }

    /// Mostly fast, with bursts of 80 ms gaps (a neighbour's GC pause, a page-cache flush):
    /// right after a burst the deadline covers twice the burst; long after, the peak has
    /// decayed and the deadline is back at the floor.
    #[test]
    fn a_burst_raises_the_deadline_and_then_decays() {
        let mut e = fed((0..500).map(|_| us(200)));
        assert_eq!(e.deadline(FLOOR, CEILING).value, FLOOR);
        for _ in 0..5 {
            e.observe(ms(200));
        }
        let after_burst = e.deadline(FLOOR, CEILING);
        assert!(after_burst.value >= ms(400), "{after_burst}");
        for _ in 0..2000 {
            e.observe(us(200));
        }
        let later = e.deadline(FLOOR, CEILING);
        assert_eq!((later.value, later.basis), (FLOOR, DeadlineBasis::Floor), "{later}");
    }

    /// A link slower than the ceiling allows is held at the ceiling (the configured bound
    /// always wins), and a floor above the ceiling yields the ceiling.
    #[test]
    fn the_ceiling_bounds_everything() {
        let d = fed((0..50).map(|_| ms(8000))).deadline(FLOOR, CEILING);
        assert_eq!((d.value, d.basis), (CEILING, DeadlineBasis::Ceiling));
        let d = fed((0..50).map(|_| us(10))).deadline(ms(500), ms(300));
        assert_eq!((d.value, d.basis), (ms(300), DeadlineBasis::Ceiling));
    }

    /// A recorded trace with a regime change: fast steps, then the link slows down tenfold
    /// for good. Right at the change the peak term makes room; the smoothed estimate follows.
    #[test]
    fn a_link_that_slows_down_for_good_is_followed() {
        let mut e = fed((0..300).map(|_| ms(20)));
        assert_eq!(e.deadline(FLOOR, CEILING).value, FLOOR);
        e.observe(ms(200));
        assert!(e.deadline(FLOOR, CEILING).value >= ms(400));
        for _ in 0..300 {
            e.observe(ms(200));
        }
        let d = e.deadline(FLOOR, CEILING);
        assert!(d.value >= ms(400) && d.smoothed > ms(190), "{d}");
    }

    #[test]
    fn a_link_learns_only_inside_operations_the_peer_entered() {
        let d = Deadlines::default();
        let link = LinkProgress::new(d, Pace::detached());
        for _ in 0..20 {
            link.observe(7, ms(5000)); // waiting for a late peer: not learned
        }
        assert_eq!(link.in_force().basis, DeadlineBasis::Unlearned);
        link.saw(7);
        assert!(link.peer_in(7) && link.peer_in(6) && !link.peer_in(8));
        for _ in 0..20 {
            link.observe(7, us(300));
        }
        assert_eq!(link.in_force().value, DEFAULT_FLOOR);
        link.saw(3); // an older frame does not move it back
        assert!(link.peer_in(7));
        let fixed = LinkProgress::new(Deadlines::fixed(ms(1500), ms(100)), Pace::detached());
        fixed.saw(1);
        fixed.observe(1, us(10));
        assert_eq!((fixed.in_force().value, fixed.in_force().basis), (ms(1500), DeadlineBasis::Fixed));
    }

    /// A link that has learned nothing (it only sends, or carries one message per operation)
    /// waits the floor while no link of its transport has learned, then the pace its learned
    /// siblings last had; never beyond the ceiling, and with learning off, the fixed deadline.
    #[test]
    fn an_unlearned_link_takes_its_transports_pace() {
        let pace = Pace::detached();
        let (learner, quiet) = (
            LinkProgress::new(Deadlines::default(), Arc::clone(&pace)),
            LinkProgress::new(Deadlines::default(), Arc::clone(&pace)),
        );
        assert_eq!((quiet.in_force().value, quiet.in_force().basis), (DEFAULT_FLOOR, DeadlineBasis::Unlearned));
        learner.saw(1);
        for _ in 0..MIN_SAMPLES {
            learner.observe(1, ms(400));
        }
        let learned = learner.in_force();
        assert_eq!(learned.basis, DeadlineBasis::Learned, "{learned}");
        let borrowed = quiet.in_force();
        assert_eq!((borrowed.value, borrowed.basis, borrowed.samples), (learned.value, DeadlineBasis::Unlearned, 0));
        // A slow transport's pace is held to the ceiling; a fast one's to the floor.
        let slow = Pace::detached();
        slow.publish(Duration::from_secs(60));
        assert_eq!(LinkProgress::new(Deadlines::default(), slow).in_force().value, CEILING);
        let fast = Pace::detached();
        fast.publish(us(1));
        assert_eq!(LinkProgress::new(Deadlines::default(), fast).in_force().value, DEFAULT_FLOOR);
        let fixed = LinkProgress::new(Deadlines::fixed(ms(1500), ms(100)), pace);
        assert_eq!((fixed.in_force().value, fixed.in_force().basis), (ms(1500), DeadlineBasis::Fixed));
    }

    #[test]
    fn display_says_why() {
        let d = fed((0..10).map(|_| us(300))).deadline(FLOOR, CEILING);
        let s = d.to_string();
        assert!(s.starts_with("250 ms (floor; 10 gaps"), "{s}");
    }
}
