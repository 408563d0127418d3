//! What every party of one simulation shares: the trace (readable lines: time, party,
//! event), the data plane's state (see [`crate::worker`]), and the observations the
//! invariants are checked against.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};

/// Simulated milliseconds now, as the calling host sees them (0 outside a host).
pub(crate) fn now_ms() -> u64 {
    turmoil::sim_elapsed().map_or(0, |d| d.as_millis() as u64)
}

/// One generation as a worker was told it.
/// What a worker incarnation did, as far as the invariants care.
#[derive(Clone, Debug, Default)]
pub(crate) struct WorkerView {
    /// The live incarnation (0: none yet, or the process is down).
    pub(crate) incarnation: u64,
    /// Whether the process runs.
    pub(crate) up: bool,
    /// The generation it works in, if any.
    pub(crate) in_generation: Option<u64>,
    /// The newest generation this incarnation was given.
    pub(crate) last_formed: u64,
    /// The job's end as this worker heard it (time, outcome).
    pub(crate) ended: Option<(u64, String)>,
    /// It left the job after finishing its work.
    pub(crate) finished: bool,
    /// The coordinator refused its join until then (the exclusion policy): it was told why
    /// it is in no generation.
    pub(crate) excluded_until: u64,
}

/// What the workers were told of one generation (whole or sparse views), and where its ranks
/// run: the model's network, which knows every rank's process as sockets would.
#[derive(Default)]
pub(crate) struct GenerationRecord {
    /// Its size and host layout, as the first member to connect derived them (every member
    /// must derive the same).
    pub(crate) shape: Option<(u32, cohort::HostLayout)>,
    /// The member at each rank (worker id, incarnation), as first told in any view.
    pub(crate) told: BTreeMap<u32, (String, u64)>,
    /// Where each rank runs: the worker index and incarnation that connected as it.
    pub(crate) placed: BTreeMap<u32, (usize, u64)>,
    /// The step the generation resumes after, agreed at its first collective (the
    /// checkpoint's sync: the newest commit of any member).
    pub(crate) resume: Option<u64>,
}

/// A fault as it touched a party, for judging whether what happened to that party was
/// excused by a fault.
#[derive(Clone, Debug)]
pub(crate) struct Touch {
    pub(crate) worker: usize,
    pub(crate) from_ms: u64,
    pub(crate) to_ms: u64,
}

/// The shared state of one simulation.
#[derive(Default)]
pub(crate) struct Ledger {
    lines: Vec<String>,
    /// Invariant violations found while running.
    pub(crate) violations: Vec<String>,
    /// What the workers were told of each generation, and where its ranks run.
    pub(crate) generations: BTreeMap<u64, GenerationRecord>,
    /// Revoked generations, with when a worker first heard it.
    pub(crate) revoked: BTreeMap<u64, u64>,
    /// Per worker index.
    pub(crate) workers: BTreeMap<usize, WorkerView>,
    /// Faults by the workers they touch.
    pub(crate) touches: Vec<Touch>,
    /// Data plane: workers paused now.
    pub(crate) paused: BTreeSet<usize>,
    /// Data plane: silent directed links (from, to) between worker indices.
    pub(crate) silent: BTreeSet<(usize, usize)>,
    /// Data plane: (generation, step) -> ranks that arrived.
    pub(crate) arrivals: BTreeMap<(u64, u64), BTreeSet<u32>>,
    /// Data plane: (generation, step) pairs that completed (every member arrived with no
    /// fault on the ring): every member's step then completes, as in a ring whose last
    /// messages were already on their way.
    pub(crate) completed: BTreeSet<(u64, u64)>,
    /// Data plane: (generation, step) pairs a member arrived at with a re-formation pending:
    /// every member leaves the generation after that step (the flag the ranks agree on at a
    /// commit point).
    pub(crate) reform: BTreeSet<(u64, u64)>,
    /// Data plane: the newest step each worker index committed (its state survives crashes
    /// as a checkpoint would).
    pub(crate) committed: BTreeMap<usize, u64>,
    /// The driver asked the workers to finish.
    pub(crate) finish: bool,
    /// Faults injected.
    pub(crate) faults: usize,
}

/// The ledger, shared by the hosts and the driver.
#[derive(Clone, Default)]
pub(crate) struct Shared(Arc<Mutex<Ledger>>);

impl Shared {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Ledger> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends a trace line at the calling host's time.
    pub(crate) fn log(&self, party: &str, event: impl AsRef<str>) {
        self.log_at(now_ms(), party, event);
    }

    /// Appends a trace line at `at_ms`.
    pub(crate) fn log_at(&self, at_ms: u64, party: &str, event: impl AsRef<str>) {
        let line = format!("{:>6}.{:03} {party:<10} {}", at_ms / 1000, at_ms % 1000, event.as_ref());
        self.lock().lines.push(line);
    }

    /// Records a violation (and traces it).
    pub(crate) fn violation(&self, at_ms: u64, what: impl Into<String>) {
        let what = what.into();
        self.log_at(at_ms, "CHECK", format!("VIOLATION {what}"));
        self.lock().violations.push(format!("at {}.{:03} s: {what}", at_ms / 1000, at_ms % 1000));
    }

    /// The trace so far.
    pub(crate) fn lines(&self) -> Vec<String> {
        self.lock().lines.clone()
    }
}

impl Ledger {
    /// Whether a fault touched `worker` within `[from_ms, to_ms]`.
    pub(crate) fn touched(&self, worker: usize, from_ms: u64, to_ms: u64) -> bool {
        self.touches.iter().any(|t| t.worker == worker && t.from_ms <= to_ms && t.to_ms >= from_ms)
    }
}

/// FNV-1a over the trace lines (with their line breaks): the seed's fingerprint.
pub(crate) fn hash(lines: &[String]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for line in lines {
        for b in line.bytes().chain(std::iter::once(b'\n')) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}
