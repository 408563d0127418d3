//! The leader's sweep of silent members on hosts' shared leases (`lease_scope = "host"`).
//!
//! A member's own lease lapses when its heartbeats stop, and the store deletes its records.
//! A host's shared lease lapses only when the whole host falls silent, so a member that stops
//! beating while its host-mates go on (a hung process, a stopped container) is found here
//! instead. Every replica that serves a member's beats rewrites its progress record at least
//! once per [`PROGRESS_PERIOD`], each time with a new `last_heartbeat_ms`: the record changes
//! while the member beats, whichever replica it talks to. A replica that records the member's
//! other calls (its commits, on another replica than its host's relay beats on) never writes
//! an older beat time back: else the record would alternate between a fresh mark and one
//! stale mark, and a leader that looked whenever the stale one stood would see it unchanged. The leader watches those records in
//! its view of the job and notes, on its own monotonic clock, when each member's last changed
//! ([`Silences`]); a member whose record has not changed for the lease TTL and one period is
//! checked once more against the store (its record still the one noted) and its records are
//! deleted by a compare-and-swap on its member record, so that a member that beat, re-joined
//! or left meanwhile is left alone. To every other rule the deletion is a lapse: the leader's
//! next look revokes the generation with "lease expired", as the store's own deletion would.
//!
//! No wall clock is compared: a replica's clock that jumps (NTP stepping it) cannot make live
//! members look silent. A member first seen by this leader (a new leader, a new member) counts
//! as heard from then, so a newly elected leader sweeps no one before a whole threshold passed.

use crate::keys::{self, Kind};
use crate::ops::{self, Context};
use crate::records::{decode, JobState, ProgressRecord};
use crate::service::PROGRESS_PERIOD;
use crate::store::StoreError;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

/// How long a member on a shared lease may stay silent before it is swept: the lease TTL (what
/// a lease of its own would allow) and one progress period (how long a live member's record
/// may go unchanged).
pub(crate) fn threshold(lease_ttl: Duration) -> Duration {
    lease_ttl + PROGRESS_PERIOD
}

/// What a member's progress record says of its last beat: its `last_heartbeat_ms`, or 0 when
/// it has none for this incarnation (then its join time stands for it).
fn beat_mark(state: &JobState, worker: &str, incarnation: u64) -> u64 {
    state.progress.get(worker).filter(|p| p.incarnation == incarnation).map_or(0, |p| p.last_heartbeat_ms)
}

/// A member to sweep: silent for longer than the threshold, with the mark its progress record
/// held all that time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Candidate {
    /// The worker id.
    pub worker: String,
    /// Its incarnation.
    pub incarnation: u64,
    /// Its progress record's `last_heartbeat_ms` (0: none), unchanged since `silent_for` ago.
    pub mark: u64,
    /// How long the leader has seen no change.
    pub silent_for: Duration,
}

/// What the leader last noted of one member: its incarnation, its progress record's mark, and
/// since when (its own clock) that mark has stood.
#[derive(Clone, Copy)]
struct Heard {
    incarnation: u64,
    mark: u64,
    since: Instant,
}

/// When the leader last saw each member's progress record change, per job, on its own clock.
#[derive(Default)]
pub(crate) struct Silences {
    jobs: Mutex<HashMap<String, HashMap<String, Heard>>>,
}

impl Silences {
    /// Notes the members of `state` on a shared lease as of `now`, and answers those whose
    /// record has not changed for longer than `threshold`. Members gone from the view are
    /// forgotten. O(members).
    pub(crate) fn observe(&self, state: &JobState, now: Instant, threshold: Duration) -> Vec<Candidate> {
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        let seen = jobs.entry(state.job.clone()).or_default();
        let mut next = HashMap::with_capacity(seen.len());
        let mut out = Vec::new();
        for m in state.members.values().filter(|m| !m.owns_lease()) {
            let mark = beat_mark(state, &m.worker_id, m.incarnation);
            let since = match seen.get(&m.worker_id) {
                Some(h) if h.incarnation == m.incarnation && h.mark == mark => h.since,
                _ => now,
            };
            let silent_for = now.saturating_duration_since(since);
            if silent_for > threshold {
                out.push(Candidate { worker: m.worker_id.clone(), incarnation: m.incarnation, mark, silent_for });
            }
            next.insert(m.worker_id.clone(), Heard { incarnation: m.incarnation, mark, since });
        }
        *seen = next;
        out
    }

    /// Forgets every job but those in `live`.
    pub(crate) fn retain(&self, live: &dyn Fn(&str) -> bool) {
        self.jobs.lock().unwrap_or_else(|e| e.into_inner()).retain(|job, _| live(job));
    }
}

/// Sweeps one job: deletes the records of each candidate whose member record and progress
/// record in the store are still the ones it was found silent with. Answers how many it
/// deleted.
///
/// # Cancel safety
/// Cancel safe: each deletion is one compare-and-swap transaction; one not sent is sent by the
/// next sweep.
pub(crate) async fn sweep_job(ctx: &Context, job: &str, candidates: Vec<Candidate>) -> Result<usize, StoreError> {
    let mut swept = 0;
    for c in candidates {
        // Checked once more against the store: the view may lag a beat, a re-join or a leave.
        let Some((member, kv)) = ops::read_member(ctx.store.as_ref(), job, &c.worker).await? else { continue };
        if member.incarnation != c.incarnation || member.owns_lease() {
            continue;
        }
        let pkey = keys::worker_key(job, Kind::Progress, &c.worker);
        let progress = ctx.store.get(&pkey).await?.and_then(|kv| decode::<ProgressRecord>(&pkey, &kv.value));
        let mark = progress.filter(|p| p.incarnation == c.incarnation).map_or(0, |p| p.last_heartbeat_ms);
        if mark != c.mark {
            continue;
        }
        if ops::remove_member(ctx, job, &c.worker, kv.mod_revision).await? {
            swept += 1;
            ctx.metrics.member_swept();
            tracing::warn!(%job, worker = %c.worker, incarnation = c.incarnation, silent_ms = c.silent_for.as_millis() as u64,
                           host = %member.host, "member silent on its host's shared lease: its records are deleted (a lapse)");
        }
    }
    Ok(swept)
}

/// One sweep of `jobs` (those whose settings put members on hosts' shared leases): each job's
/// members observed in this replica's view of it (its hub), and the silent ones deleted by
/// [`sweep_job`]. Store errors are logged; the next sweep tries again.
///
/// # Cancel safety
/// Cancel safe (see [`sweep_job`]).
pub(crate) async fn sweep(ctx: &Context, silences: &Silences, jobs: Vec<String>) {
    silences.retain(&|job| jobs.iter().any(|j| j == job));
    for job in jobs {
        let settings = ctx.settings.for_job(&job);
        let hub = match ctx.hubs.get(&job, &settings).await {
            Ok(hub) => hub,
            Err(e) => {
                tracing::debug!(%job, error = %e, "sweep: cannot follow the job");
                continue;
            }
        };
        let limit = threshold(settings.lease_ttl);
        let candidates =
            hub.read(
                |state| {
                    if state.ended.is_some() {
                        Vec::new()
                    } else {
                        silences.observe(state, Instant::now(), limit)
                    }
                },
            );
        if candidates.is_empty() {
            continue;
        }
        if let Err(e) = sweep_job(ctx, &job, candidates).await {
            tracing::warn!(%job, error = %e, "sweep of silent members failed; the next one tries again");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::MemberRecord;

    fn member(worker: &str, incarnation: u64, host_lease: i64) -> MemberRecord {
        MemberRecord {
            worker_id: worker.into(),
            incarnation,
            host: "h".into(),
            addresses: vec![],
            capabilities: vec![],
            joined_at_ms: 1_000,
            domain: String::new(),
            host_lease,
        }
    }

    fn beat(state: &mut JobState, worker: &str, incarnation: u64, at_ms: u64) {
        state
            .progress
            .insert(worker.into(), ProgressRecord { incarnation, last_heartbeat_ms: at_ms, ..Default::default() });
    }

    #[test]
    fn a_member_is_silent_when_its_record_stops_changing_on_the_leaders_clock() {
        let mut state = JobState { job: "j".into(), ..Default::default() };
        for (w, inc, lease) in [("beating", 1, 9), ("silent", 2, 9), ("own-lease", 3, 0)] {
            state.members.insert(w.into(), member(w, inc, lease));
            beat(&mut state, w, inc, 5_000);
        }
        let silences = Silences::default();
        let limit = Duration::from_secs(4);
        let t0 = Instant::now();
        assert!(silences.observe(&state, t0, limit).is_empty(), "first seen: heard from now");
        // Wall-clock stamps mean nothing: a record stamped long ago but new to the leader is
        // not silent, and a jump of the stamps (another replica's clock) is a change.
        beat(&mut state, "beating", 1, 2_000);
        assert!(silences.observe(&state, t0 + Duration::from_secs(3), limit).is_empty());
        let named = silences.observe(&state, t0 + Duration::from_secs(5), limit);
        assert_eq!(named.len(), 1, "{named:?}");
        assert_eq!((named[0].worker.as_str(), named[0].incarnation, named[0].mark), ("silent", 2, 5_000));
        assert_eq!(named[0].silent_for, Duration::from_secs(5));
        // A new incarnation of the silent worker starts afresh; a member gone is forgotten.
        state.members.insert("silent".into(), member("silent", 7, 9));
        state.members.remove("beating");
        assert!(silences.observe(&state, t0 + Duration::from_secs(6), limit).is_empty());
        let named = silences.observe(&state, t0 + Duration::from_secs(11), limit);
        assert_eq!(named.iter().map(|c| (c.worker.as_str(), c.mark)).collect::<Vec<_>>(), [("silent", 0)]);
        silences.retain(&|_| false);
        assert!(
            silences.observe(&state, t0 + Duration::from_secs(20), limit).is_empty(),
            "forgotten jobs start afresh"
        );
    }

    #[test]
    fn the_threshold_allows_a_stale_progress_record() {
        assert_eq!(threshold(Duration::from_secs(3)), Duration::from_secs(3) + PROGRESS_PERIOD);
    }
}
