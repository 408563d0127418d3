//! The leader's sweep of silent members on hosts' shared leases (`lease_scope = "host"`).
//!
//! A member's own lease lapses when its heartbeats stop, and the store deletes its records.
//! A host's shared lease lapses only when the whole host falls silent, so a member that stops
//! beating while its host-mates go on (a hung process, a stopped container) is found here
//! instead: the leader reads the members' progress records (which every replica writes at
//! least once per [`PROGRESS_PERIOD`] per member it hears from, so they speak for beats served
//! by any replica) and deletes the records of a member silent for longer than the lease TTL
//! and one period. To every other rule that deletion is a lapse: the leader's next look
//! revokes the generation with "lease expired", exactly as the store's own deletion would.
//!
//! Silence is measured on the progress record's `last_heartbeat_ms`, stamped by the serving
//! replica's wall clock: replicas' clocks are assumed to agree to well under the period (as
//! the failure report's silences assume). A newly elected leader waits one lease TTL before its
//! first sweep. Each candidate is checked once more against the store before its deletion,
//! which is a compare-and-swap on its member record: a member that beat, re-joined or left
//! meanwhile is left alone.

use crate::keys::{self, Kind};
use crate::ops::{self, Context};
use crate::records::{self, decode, JobState, ProgressRecord};
use crate::service::PROGRESS_PERIOD;
use crate::store::StoreError;
use std::time::Duration;

/// The members of `state` on a shared lease whose last heartbeat (their progress record, or
/// their join when they have none) is more than `threshold` before `now_ms`, with that
/// silence: `(worker, incarnation, silent_ms)`. O(members).
pub(crate) fn silent_members(state: &JobState, now_ms: u64, threshold: Duration) -> Vec<(String, u64, u64)> {
    let threshold = threshold.as_millis() as u64;
    state
        .members
        .values()
        .filter(|m| !m.owns_lease())
        .filter_map(|m| {
            let last = state
                .progress
                .get(&m.worker_id)
                .filter(|p| p.incarnation == m.incarnation)
                .map_or(m.joined_at_ms, |p| p.last_heartbeat_ms.max(m.joined_at_ms));
            let silent = now_ms.saturating_sub(last);
            (silent > threshold).then(|| (m.worker_id.clone(), m.incarnation, silent))
        })
        .collect()
}

/// How long a member on a shared lease may stay silent before it is swept: the lease TTL (what
/// a lease of its own would allow) and one progress period (how stale its record may be).
pub(crate) fn threshold(lease_ttl: Duration) -> Duration {
    lease_ttl + PROGRESS_PERIOD
}

/// Sweeps one job: deletes the records of each of `candidates` (from [`silent_members`] on the
/// job's view) still silent for longer than [`threshold`] in the store. Answers how many it
/// deleted.
///
/// # Cancel safety
/// Cancel safe: each deletion is one compare-and-swap transaction; one not sent is sent by the
/// next sweep.
pub(crate) async fn sweep_job(
    ctx: &Context,
    job: &str,
    candidates: Vec<(String, u64, u64)>,
) -> Result<usize, StoreError> {
    let limit = threshold(ctx.settings.for_job(job).lease_ttl);
    let mut swept = 0;
    for (worker, incarnation, _) in candidates {
        // Checked once more against the store: the view may lag a beat, a re-join or a leave.
        let Some((member, kv)) = ops::read_member(ctx.store.as_ref(), job, &worker).await? else { continue };
        if member.incarnation != incarnation || member.owns_lease() {
            continue;
        }
        let pkey = keys::worker_key(job, Kind::Progress, &worker);
        let progress = ctx.store.get(&pkey).await?.and_then(|kv| decode::<ProgressRecord>(&pkey, &kv.value));
        let last = progress
            .filter(|p| p.incarnation == incarnation)
            .map_or(member.joined_at_ms, |p| p.last_heartbeat_ms.max(member.joined_at_ms));
        let silent = records::now_ms().saturating_sub(last);
        if silent <= limit.as_millis() as u64 {
            continue;
        }
        if ops::remove_member(ctx, job, &worker, kv.mod_revision).await? {
            swept += 1;
            tracing::warn!(%job, %worker, incarnation, silent_ms = silent, host = %member.host,
                           "member silent on its host's shared lease: its records are deleted (a lapse)");
        }
    }
    Ok(swept)
}

/// One sweep of every job in `jobs` whose settings put members on hosts' leases: each job's
/// silent members found in this replica's view of it (its hub), then deleted by
/// [`sweep_job`]. Store errors are logged; the next sweep tries again.
///
/// # Cancel safety
/// Cancel safe (see [`sweep_job`]).
pub(crate) async fn sweep(ctx: &Context, jobs: Vec<String>) {
    for job in jobs {
        let settings = ctx.settings.for_job(&job);
        let hub = match ctx.hubs.get(&job, &settings).await {
            Ok(hub) => hub,
            Err(e) => {
                tracing::debug!(%job, error = %e, "sweep: cannot follow the job");
                continue;
            }
        };
        let now = records::now_ms();
        let limit = threshold(settings.lease_ttl);
        let candidates =
            hub.read(|state| if state.ended.is_some() { Vec::new() } else { silent_members(state, now, limit) });
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

    fn member(worker: &str, incarnation: u64, host_lease: i64, joined_at_ms: u64) -> MemberRecord {
        MemberRecord {
            worker_id: worker.into(),
            incarnation,
            host: "h".into(),
            addresses: vec![],
            capabilities: vec![],
            joined_at_ms,
            domain: String::new(),
            host_lease,
        }
    }

    #[test]
    fn only_silent_members_on_a_shared_lease_are_named() {
        let mut state = JobState { job: "j".into(), ..Default::default() };
        for (w, inc, lease) in [("beating", 1, 9), ("silent", 2, 9), ("own-lease", 3, 0), ("never-beat", 4, 9)] {
            state.members.insert(w.into(), member(w, inc, lease, 1_000));
        }
        let beat = |inc, at| ProgressRecord { incarnation: inc, last_heartbeat_ms: at, ..Default::default() };
        state.progress.insert("beating".into(), beat(1, 9_500));
        state.progress.insert("silent".into(), beat(2, 5_000));
        state.progress.insert("own-lease".into(), beat(3, 1_000));
        // A progress record of an older incarnation says nothing of this one.
        state.progress.insert("never-beat".into(), beat(99, 9_900));
        let named = silent_members(&state, 10_000, Duration::from_secs(4));
        let names: Vec<&str> = named.iter().map(|(w, _, _)| w.as_str()).collect();
        assert_eq!(names, ["never-beat", "silent"]);
        assert_eq!(named[1], ("silent".to_string(), 2, 5_000));
        assert!(silent_members(&state, 10_000, Duration::from_secs(10)).is_empty());
    }

    #[test]
    fn the_threshold_allows_a_stale_progress_record() {
        assert_eq!(threshold(Duration::from_secs(3)), Duration::from_secs(3) + PROGRESS_PERIOD);
    }
}
