//! The rendezvous decision, as pure logic (no store, no clock): given a job's state and
//! "now", decide whether to form the next generation, end the job, or wait until a time.
//!
//! Rules:
//! - A waiting member is *ready* for the next generation when it is live (its member key
//!   holds the same incarnation), connected (its control stream has not closed, see
//!   [`crate::records::ControlRecord`]), not excluded, and either not a member of the
//!   current generation, or done with it (it waits after the current number: a wait from
//!   before the current generation was formed is stale, also once that generation is
//!   revoked).
//! - The *expected* members are the current generation's members that are still live,
//!   connected, not excluded and have not departed (left or finished). A member whose
//!   process died is disconnected at once, long before its lease lapses: when several ranks
//!   die together (a node lost), the first report evicts one and the others are not waited
//!   for.
//! - While the current generation is active (not revoked) and has expected members, the next
//!   one forms only when every expected member is ready (cooperative re-formation: a commit
//!   point, a scale-up, a peer that left). Joiners wait meanwhile and are reported as a
//!   pending re-formation.
//! - Otherwise (no generation yet, revoked, or nobody left of it) it forms once at least
//!   `min_workers` are ready and either `max_workers` are ready, or every expected member is
//!   ready (survivors re-form at once after a failure), or the join window has passed since
//!   the last arrival.
//! - Ranks: ready survivors keep their relative order, joiners follow in arrival order;
//!   never more than `max_workers` (extra joiners keep waiting); excluded workers are never
//!   placed.
//! - Once a generation has existed, a job with fewer live (non-excluded) workers than
//!   `min_workers` for longer than the elastic timeout ends FAILED. Before the first
//!   generation, a job waits for its workers without limit.
//! - A job ends FINISHED when every member of its current generation has departed and at
//!   least one of them finished.

use crate::config::JobSettings;
use crate::records::{GenerationRecord, JobState, Outcome, Placed, WaitingRecord};
use std::collections::{BTreeSet, HashMap};

/// What to do now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// Nothing to do now.
    Nothing,
    /// Form the next generation with these members, in rank order.
    Form(Vec<Placed>),
    /// End the job.
    End(Outcome, String),
}

/// The outcome of evaluating a job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Evaluation {
    /// What to do now.
    pub(crate) action: Action,
    /// The value the generation record's `below_min_since_ms` should have.
    pub(crate) below_min_since_ms: Option<u64>,
    /// When to evaluate again if nothing changes (ms since the epoch).
    pub(crate) next_deadline_ms: Option<u64>,
    /// Joiners that could be placed while the current generation is active.
    pub(crate) pending_joiners: u32,
    /// Whether the active generation should re-form at its next commit point (joiners can
    /// be placed, or a member left gracefully).
    pub(crate) reformation_pending: bool,
    /// Members ready for the next generation.
    pub(crate) ready: u32,
}

/// Workers excluded at `now_ms`: excluded themselves, or members of an excluded failure
/// domain (see [`crate::domains`]).
pub(crate) fn excluded(state: &JobState, now_ms: u64) -> BTreeSet<String> {
    let keys: BTreeSet<&String> =
        state.failures.iter().filter(|(_, h)| h.excluded_until(now_ms).is_some()).map(|(k, _)| k).collect();
    let mut out: BTreeSet<String> =
        keys.iter().filter(|k| crate::domains::key_domain(k).is_none()).map(|k| k.to_string()).collect();
    if keys.iter().any(|k| crate::domains::key_domain(k).is_some()) {
        for m in state.members.values() {
            let key = crate::domains::domain_key(crate::records::effective_domain(&m.domain, &m.host));
            if keys.contains(&key) {
                out.insert(m.worker_id.clone());
            }
        }
    }
    out
}

/// The current generation's number and members' ranks, for lookups in O(1) (an evaluation
/// looks up every waiting worker; a linear `rank_of` each would make it quadratic).
struct Current<'a> {
    number: u64,
    ranks: HashMap<(&'a str, u64), u32>,
}

impl<'a> Current<'a> {
    fn of(g: &'a GenerationRecord) -> Self {
        let ranks =
            g.members.iter().enumerate().map(|(r, m)| ((m.worker_id.as_str(), m.incarnation), r as u32)).collect();
        Self { number: g.number, ranks }
    }
}

/// Whether `worker`, waiting as `w`, is ready for the next generation (see the module's
/// rules). Takes the waiting record in hand: one pass over the waiting workers decides
/// every one of them without looking any of them up again.
fn is_ready(
    state: &JobState,
    current: Option<&Current<'_>>,
    excluded: &BTreeSet<String>,
    worker: &str,
    w: &WaitingRecord,
) -> bool {
    if !state.is_live(worker, w.incarnation)
        || state.is_disconnected(worker, w.incarnation)
        || excluded.contains(worker)
    {
        return false;
    }
    match current {
        None => true,
        // A member of the current generation is ready only once it asks for a newer one:
        // its wait from before (which this generation answered) does not count, even after
        // a revocation, until it comes back to rendezvous.
        Some(g) => !g.ranks.contains_key(&(worker, w.incarnation)) || w.after_generation >= g.number,
    }
}

/// Evaluates a job. Pure: the same inputs always give the same decision.
pub(crate) fn evaluate(settings: &JobSettings, state: &JobState, now_ms: u64) -> Evaluation {
    let mut eval = Evaluation {
        action: Action::Nothing,
        below_min_since_ms: None,
        next_deadline_ms: None,
        pending_joiners: 0,
        reformation_pending: false,
        ready: 0,
    };
    if state.ended.is_some() {
        return eval;
    }
    let excluded = excluded(state, now_ms);
    let current = state.current();
    let departures = current.map(GenerationRecord::departures);
    let has_departed =
        |worker: &str, incarnation: u64| departures.as_ref().is_some_and(|d| d.contains(worker, incarnation));
    if let Some(g) = current {
        eval.below_min_since_ms = g.below_min_since_ms;
        if !g.members.is_empty()
            && g.members.iter().all(|m| has_departed(&m.worker_id, m.incarnation))
            && g.departed.iter().any(|d| d.finished)
        {
            eval.action = Action::End(
                Outcome::Finished,
                format!(
                    "every member of generation {} left the job, {} of them finished",
                    g.number,
                    g.departed.iter().filter(|d| d.finished).count()
                ),
            );
            return eval;
        }
    }
    // Exclusions end on their own: evaluate again then.
    for h in state.failures.values() {
        if let Some(until) = h.excluded_until(now_ms) {
            eval.next_deadline_ms = min_opt(eval.next_deadline_ms, until);
        }
    }

    let eligible = state.members.keys().filter(|w| !excluded.contains(*w)).count();
    let min = settings.min_workers as usize;
    let max = settings.max_workers as usize;
    eval.below_min_since_ms = match current {
        Some(g) if eligible < min => Some(g.below_min_since_ms.unwrap_or(now_ms)),
        _ => None,
    };
    if let Some(since) = eval.below_min_since_ms {
        let deadline = since.saturating_add(settings.elastic_timeout.as_millis() as u64);
        if now_ms >= deadline {
            eval.action = Action::End(
                Outcome::Failed,
                format!(
                    "the job had {eligible} live worker(s), fewer than min_workers = {min}, for longer than the elastic timeout ({} ms)",
                    settings.elastic_timeout.as_millis()
                ),
            );
            return eval;
        }
        eval.next_deadline_ms = min_opt(eval.next_deadline_ms, deadline);
    }

    let active = current.filter(|g| g.revoked.is_none());
    // Counted, not listed: the ready ones are found from the waiting side below.
    let expected = current.map_or(0, |g| {
        g.members
            .iter()
            .filter(|m| {
                state.is_live(&m.worker_id, m.incarnation)
                    && !state.is_disconnected(&m.worker_id, m.incarnation)
                    && !excluded.contains(&m.worker_id)
                    && !has_departed(&m.worker_id, m.incarnation)
            })
            .count()
    });
    let lookup = current.map(Current::of);
    // One pass over the waiting workers: each ready one is a survivor (an expected member,
    // placed by its current rank) or a joiner (placed by arrival).
    let mut survivors: Vec<(u32, &str)> = Vec::new();
    let mut joiners: Vec<(&str, u64)> = Vec::new();
    let mut last_arrival: Option<u64> = None;
    for (worker, w) in &state.waiting {
        if !is_ready(state, lookup.as_ref(), &excluded, worker, w) {
            continue;
        }
        last_arrival = last_arrival.max(Some(w.since_ms));
        // Ready means live, connected and not excluded, so a ready member of the current
        // generation under this incarnation is expected unless it departed.
        let rank = match (&lookup, current) {
            (Some(l), Some(_)) => {
                l.ranks.get(&(worker.as_str(), w.incarnation)).copied().filter(|_| !has_departed(worker, w.incarnation))
            }
            _ => None,
        };
        match rank {
            Some(rank) => survivors.push((rank, worker.as_str())),
            None => joiners.push((worker.as_str(), w.since_ms)),
        }
    }
    survivors.sort_unstable();
    let ready_survivors: Vec<&str> = survivors.into_iter().map(|(_, w)| w).collect();
    joiners.sort_by(|a, b| a.1.cmp(&b.1).then(a.0.cmp(b.0)));
    let mut candidates: Vec<&str> = ready_survivors.clone();
    candidates.extend(joiners.iter().map(|(w, _)| *w));
    eval.ready = candidates.len() as u32;
    candidates.truncate(max);
    let n = candidates.len();
    let all_expected_ready = expected > 0 && ready_survivors.len() == expected;
    let cooperative = active.is_some() && expected > 0;

    if cooperative {
        let room = max.saturating_sub(expected);
        eval.pending_joiners = joiners.len().min(room) as u32;
        let left_gracefully = active.is_some_and(|g| g.departed.iter().any(|d| !d.finished));
        eval.reformation_pending = eval.pending_joiners > 0 || left_gracefully;
    }

    let form = if n < min || n == 0 {
        false
    } else if cooperative {
        all_expected_ready
    } else {
        let window_passed =
            last_arrival.map(|t| now_ms >= t.saturating_add(settings.join_window.as_millis() as u64)).unwrap_or(false);
        n >= max || all_expected_ready || window_passed
    };
    if form {
        let placed = candidates
            .iter()
            .filter_map(|w| {
                let m = state.members.get(*w)?;
                Some(Placed {
                    worker_id: m.worker_id.clone(),
                    incarnation: m.incarnation,
                    host: m.host.clone(),
                    addresses: m.addresses.clone(),
                    domain: crate::records::effective_domain(&m.domain, &m.host).to_string(),
                })
            })
            .collect();
        eval.action = Action::Form(group_by_domain(placed));
    } else if n >= min && n > 0 && !cooperative {
        if let Some(t) = last_arrival {
            eval.next_deadline_ms =
                min_opt(eval.next_deadline_ms, t.saturating_add(settings.join_window.as_millis() as u64));
        }
    }
    eval
}

/// `members` with each failure domain's members next to each other, and within a domain each
/// host's: domains in the order of their first member, hosts of a domain likewise, members of
/// a host in their order. A ring then crosses between domains once per domain, and every host
/// is one run of consecutive ranks (its shared-memory links and the hierarchical allreduce
/// follow the runs: `cohort_proto::layout_runs`; a domain such as a rack holds several hosts
/// whose members may arrive interleaved). A host is a `host` name and a shared-memory
/// identity, the key of the runs. Survivors that already sat together keep their relative order.
pub(crate) fn group_by_domain(members: Vec<Placed>) -> Vec<Placed> {
    // One bucket per (domain, host), found by a hash lookup: O(members), where a scan of the
    // domains seen so far per member was O(members x domains), quadratic when every
    // member is a host of its own.
    let mut domains: HashMap<String, usize> = HashMap::new();
    let mut hosts: HashMap<(usize, String, Option<String>), usize> = HashMap::new();
    let mut order: Vec<Vec<usize>> = Vec::new();
    let mut buckets: Vec<Vec<Placed>> = Vec::new();
    for m in members {
        let domain = match domains.get(m.domain()) {
            Some(&d) => d,
            None => {
                domains.insert(m.domain().to_string(), order.len());
                order.push(Vec::new());
                order.len() - 1
            }
        };
        let identity = m
            .addresses
            .iter()
            .find(|a| a.transport == "shm")
            .and_then(|a| cohort_proto::shm_identity(&a.address))
            .map(str::to_string);
        let key = (domain, m.host.clone(), identity);
        let slot = match hosts.get(&key) {
            Some(&slot) => slot,
            None => {
                hosts.insert(key, buckets.len());
                order[domain].push(buckets.len());
                buckets.push(Vec::new());
                buckets.len() - 1
            }
        };
        buckets[slot].push(m);
    }
    let mut placed = Vec::with_capacity(buckets.iter().map(Vec::len).sum());
    for slot in order.into_iter().flatten() {
        placed.append(&mut buckets[slot]);
    }
    placed
}

fn min_opt(a: Option<u64>, b: u64) -> Option<u64> {
    Some(a.map_or(b, |a| a.min(b)))
}

/// The record of generation `number` formed from `members`, carrying the previous record's
/// revocation history forward.
pub(crate) fn next_generation(
    previous: Option<&GenerationRecord>,
    members: Vec<Placed>,
    now_ms: u64,
) -> GenerationRecord {
    let mut history = previous.map(|g| g.history.clone()).unwrap_or_default();
    let mut recoveries = previous.map(|g| g.recoveries.clone()).unwrap_or_default();
    if let Some(g) = previous {
        if let Some(cause) = &g.revoked {
            history.push((g.number, cause.clone()));
            recoveries.push(crate::records::Recovery {
                generation: g.number,
                size: g.members.len() as u32,
                formed_at_ms: g.formed_at_ms,
                revoked_at_ms: g.revoked_at_ms.unwrap_or(now_ms),
                reformed_at_ms: now_ms,
                reformed_size: members.len() as u32,
            });
        }
    }
    if history.len() > crate::records::HISTORY {
        let drop = history.len() - crate::records::HISTORY;
        history.drain(..drop);
    }
    if recoveries.len() > crate::records::HISTORY {
        let drop = recoveries.len() - crate::records::HISTORY;
        recoveries.drain(..drop);
    }
    GenerationRecord {
        number: previous.map_or(1, |g| g.number + 1),
        members,
        formed_at_ms: now_ms,
        revoked: None,
        revoked_at_ms: None,
        departed: Vec::new(),
        below_min_since_ms: None,
        history,
        recoveries,
        shards: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exclusion::FailureHistory;
    use crate::records::{Address, Cause, ControlRecord, Departure, MemberRecord, WaitingRecord};
    use std::time::Duration;

    fn settings(min: u32, max: u32) -> JobSettings {
        JobSettings {
            min_workers: min,
            max_workers: max,
            join_window: Duration::from_millis(200),
            heartbeat_interval: Duration::from_millis(100),
            lease_ttl: Duration::from_secs(1),
            elastic_timeout: Duration::from_secs(5),
            ..Default::default()
        }
    }

    fn placed(w: &str, inc: u64) -> Placed {
        Placed { worker_id: w.into(), incarnation: inc, host: "h".into(), addresses: vec![], domain: String::new() }
    }

    struct Job(JobState);

    impl Job {
        fn new() -> Self {
            Job(JobState { job: "j".into(), ..Default::default() })
        }
        fn member(mut self, w: &str, inc: u64) -> Self {
            self.0.members.insert(
                w.into(),
                MemberRecord {
                    worker_id: w.into(),
                    incarnation: inc,
                    host: "h".into(),
                    addresses: vec![],
                    capabilities: vec![],
                    joined_at_ms: 0,
                    domain: String::new(),
                    host_lease: 0,
                },
            );
            self
        }
        fn waits(mut self, w: &str, after: u64, since: u64) -> Self {
            let inc = self.0.members.get(w).map(|m| m.incarnation).unwrap_or(1);
            self.0
                .waiting
                .insert(w.into(), WaitingRecord { incarnation: inc, after_generation: after, since_ms: since });
            self
        }
        fn generation(mut self, number: u64, members: &[&str], revoked: bool) -> Self {
            let members = members.iter().map(|w| placed(w, 1)).collect();
            let mut g = next_generation(None, members, 0);
            g.number = number;
            if revoked {
                g.revoked = Some(Cause {
                    rank: Some(0),
                    worker_id: "x".into(),
                    host: String::new(),
                    reason: "r".into(),
                    reported_by: "t".into(),
                    domain: String::new(),
                    lost_ranks: Vec::new(),
                });
                g.revoked_at_ms = Some(0);
            }
            self.0.generation = Some((g, 1));
            self
        }
        fn gen_mut(&mut self) -> &mut GenerationRecord {
            &mut self.0.generation.as_mut().expect("generation").0
        }
    }

    fn formed(e: &Evaluation) -> Vec<String> {
        match &e.action {
            Action::Form(p) => p.iter().map(|p| p.worker_id.clone()).collect(),
            other => panic!("expected a formation, got {other:?}"),
        }
    }

    #[test]
    fn first_generation_waits_for_the_join_window() {
        let job = Job::new().member("a", 1).member("b", 1).waits("a", 0, 100).waits("b", 0, 150);
        let e = evaluate(&settings(1, 8), &job.0, 200);
        assert_eq!(e.action, Action::Nothing);
        assert_eq!(e.next_deadline_ms, Some(350));
        let e = evaluate(&settings(1, 8), &job.0, 350);
        assert_eq!(formed(&e), ["a", "b"]);
    }

    #[test]
    fn joiners_are_ranked_by_arrival() {
        let job = Job::new()
            .member("a", 1)
            .member("b", 1)
            .member("c", 1)
            .waits("c", 0, 10)
            .waits("a", 0, 30)
            .waits("b", 0, 20);
        assert_eq!(formed(&evaluate(&settings(1, 8), &job.0, 1000)), ["c", "b", "a"]);
    }

    #[test]
    fn max_forms_at_once_and_extra_joiners_wait() {
        let job =
            Job::new().member("a", 1).member("b", 1).member("c", 1).waits("a", 0, 1).waits("b", 0, 2).waits("c", 0, 3);
        let e = evaluate(&settings(1, 2), &job.0, 3);
        assert_eq!(formed(&e), ["a", "b"]);
    }

    #[test]
    fn below_min_does_not_form() {
        let job = Job::new().member("a", 1).waits("a", 0, 0);
        let e = evaluate(&settings(2, 4), &job.0, 10_000);
        assert_eq!(e.action, Action::Nothing);
        assert_eq!(e.next_deadline_ms, None, "no generation yet: no elastic timeout");
    }

    #[test]
    fn survivors_keep_order_and_reform_at_once_after_a_failure() {
        // Generation 1 = [a, b, c, d]; b failed (evicted); d, c, a wait; e joins.
        let job = Job::new()
            .member("a", 1)
            .member("c", 1)
            .member("d", 1)
            .member("e", 1)
            .generation(1, &["a", "b", "c", "d"], true)
            .waits("d", 1, 100)
            .waits("c", 1, 101)
            .waits("a", 1, 102)
            .waits("e", 0, 50);
        let e = evaluate(&settings(1, 8), &job.0, 102);
        assert_eq!(formed(&e), ["a", "c", "d", "e"], "no join window wait, survivors first");
    }

    #[test]
    fn survivors_keep_their_rank_order_not_their_name_order() {
        // Generation 1 = [d, a, c, b]; b departed and waits again under the same incarnation:
        // it is placed as a joiner, after the survivors, who keep their ranks' order.
        let mut job = Job::new()
            .member("a", 1)
            .member("b", 1)
            .member("c", 1)
            .member("d", 1)
            .generation(1, &["d", "a", "c", "b"], true)
            .waits("b", 1, 90)
            .waits("a", 1, 100)
            .waits("c", 1, 101)
            .waits("d", 1, 102);
        job.gen_mut().departed.push(Departure { worker_id: "b".into(), incarnation: 1, finished: false });
        let e = evaluate(&settings(1, 8), &job.0, 102);
        assert_eq!(formed(&e), ["d", "a", "c", "b"]);
        assert_eq!(e.ready, 4);
    }

    #[test]
    fn revoked_without_all_survivors_waits_for_the_window() {
        let job = Job::new().member("a", 1).member("c", 1).generation(1, &["a", "b", "c"], true).waits("a", 1, 100);
        let e = evaluate(&settings(1, 8), &job.0, 150);
        assert_eq!(e.action, Action::Nothing);
        assert_eq!(e.next_deadline_ms, Some(300));
        assert_eq!(formed(&evaluate(&settings(1, 8), &job.0, 300)), ["a"]);
    }

    #[test]
    fn a_second_dead_member_is_not_waited_for_once_its_control_stream_closed() {
        // Generation 1 = [a, b, c, d]; b and d died together (one host). b's report evicted
        // it; d's lease has not lapsed yet, but its control stream closed.
        let job = Job::new()
            .member("a", 1)
            .member("c", 1)
            .member("d", 1)
            .generation(1, &["a", "b", "c", "d"], true)
            .waits("a", 1, 100)
            .waits("c", 1, 101);
        assert_eq!(evaluate(&settings(1, 8), &job.0, 102).action, Action::Nothing, "d is expected while connected");
        let mut job = job;
        job.0.control.insert("d".into(), ControlRecord { incarnation: 1, connected: false, since_ms: 90 });
        assert_eq!(formed(&evaluate(&settings(1, 8), &job.0, 102)), ["a", "c"], "no join window wait for d");
        // A record of another incarnation says nothing about this one.
        job.0.control.insert("d".into(), ControlRecord { incarnation: 7, connected: false, since_ms: 90 });
        assert_eq!(evaluate(&settings(1, 8), &job.0, 102).action, Action::Nothing);
        // Reconnected: expected again.
        job.0.control.insert("d".into(), ControlRecord { incarnation: 1, connected: true, since_ms: 95 });
        assert_eq!(evaluate(&settings(1, 8), &job.0, 102).action, Action::Nothing);
    }

    #[test]
    fn a_disconnected_waiter_is_never_placed() {
        // b waited, then its process died before the generation formed.
        let mut job = Job::new().member("a", 1).member("b", 1).waits("a", 0, 0).waits("b", 0, 0);
        job.0.control.insert("b".into(), ControlRecord { incarnation: 1, connected: false, since_ms: 5 });
        let e = evaluate(&settings(1, 8), &job.0, 1000);
        assert_eq!(e.ready, 1);
        assert_eq!(formed(&e), ["a"]);
    }

    #[test]
    fn active_generation_reforms_only_when_every_member_is_ready() {
        let job = Job::new()
            .member("a", 1)
            .member("b", 1)
            .member("j", 1)
            .generation(3, &["a", "b"], false)
            .waits("j", 0, 10)
            .waits("a", 3, 20);
        let e = evaluate(&settings(1, 8), &job.0, 100_000);
        assert_eq!(e.action, Action::Nothing, "b is still working in generation 3");
        assert_eq!(e.pending_joiners, 1);
        assert!(e.reformation_pending);
        let job = job.waits("b", 3, 30);
        assert_eq!(formed(&evaluate(&settings(1, 8), &job.0, 31)), ["a", "b", "j"]);
    }

    #[test]
    fn a_stale_waiter_of_the_active_generation_is_not_ready() {
        // a waits after 2 but generation 3 includes it: the service hands it generation 3.
        let job = Job::new().member("a", 1).generation(3, &["a"], false).waits("a", 2, 0);
        let e = evaluate(&settings(1, 8), &job.0, 100_000);
        assert_eq!(e.action, Action::Nothing);
        assert_eq!(e.ready, 0);
    }

    #[test]
    fn a_wait_answered_by_a_revoked_generation_is_stale() {
        // a and b waited after 0 and got generation 1, which is revoked before they return.
        let job =
            Job::new().member("a", 1).member("b", 1).generation(1, &["a", "b"], true).waits("a", 0, 0).waits("b", 0, 0);
        let e = evaluate(&settings(1, 8), &job.0, 100_000);
        assert_eq!(e.action, Action::Nothing);
        assert_eq!(e.ready, 0);
        let job = job.waits("a", 1, 100_001);
        assert_eq!(evaluate(&settings(1, 8), &job.0, 100_001).ready, 1);
    }

    #[test]
    fn no_room_means_no_pending_reformation() {
        let job =
            Job::new().member("a", 1).member("b", 1).member("j", 1).generation(1, &["a", "b"], false).waits("j", 0, 0);
        let e = evaluate(&settings(1, 2), &job.0, 10);
        assert_eq!(e.pending_joiners, 0);
        assert!(!e.reformation_pending);
    }

    #[test]
    fn graceful_leave_makes_the_rest_reform() {
        let mut job = Job::new().member("a", 1).member("c", 1).generation(1, &["a", "b", "c"], false);
        job.gen_mut().departed.push(Departure { worker_id: "b".into(), incarnation: 1, finished: false });
        let e = evaluate(&settings(1, 8), &job.0, 10);
        assert!(e.reformation_pending);
        let job = job.waits("a", 1, 5).waits("c", 1, 6);
        assert_eq!(formed(&evaluate(&settings(1, 8), &job.0, 7)), ["a", "c"]);
    }

    #[test]
    fn below_min_after_a_failure_ends_after_the_elastic_timeout() {
        let job = Job::new().member("a", 1).generation(1, &["a", "b"], true).waits("a", 1, 0);
        let s = settings(2, 4);
        let e = evaluate(&s, &job.0, 1000);
        assert_eq!(e.action, Action::Nothing);
        assert_eq!(e.below_min_since_ms, Some(1000));
        assert_eq!(e.next_deadline_ms, Some(6000));
        let mut job = job;
        job.gen_mut().below_min_since_ms = Some(1000);
        assert!(matches!(evaluate(&s, &job.0, 5999).action, Action::Nothing));
        assert!(matches!(evaluate(&s, &job.0, 6000).action, Action::End(Outcome::Failed, _)));
        // Back above min: the clock stops.
        let job = job.member("z", 1);
        assert_eq!(evaluate(&s, &job.0, 7000).below_min_since_ms, None);
    }

    #[test]
    fn excluded_workers_are_never_placed() {
        let mut job = Job::new().member("a", 1).member("b", 1).waits("a", 0, 0).waits("b", 0, 0);
        job.0.failures.insert(
            "b".into(),
            FailureHistory {
                failures_ms: vec![],
                exclusions: 1,
                excluded_until_ms: Some(50_000),
                ..Default::default()
            },
        );
        let e = evaluate(&settings(1, 8), &job.0, 1000);
        assert_eq!(formed(&e), ["a"]);
        assert_eq!(formed(&evaluate(&settings(1, 8), &job.0, 50_000)), ["a", "b"], "the exclusion is over");
    }

    #[test]
    fn a_failure_domain_excluded_excludes_its_members() {
        let mut job =
            Job::new().member("a", 1).member("b", 1).member("c", 1).waits("a", 0, 0).waits("b", 0, 0).waits("c", 0, 0);
        job.0.members.get_mut("a").expect("a").domain = "node-1".into();
        job.0.members.get_mut("b").expect("b").domain = "node-1".into();
        job.0.members.get_mut("c").expect("c").domain = "node-2".into();
        job.0.failures.insert(
            crate::domains::domain_key("node-1"),
            FailureHistory {
                failures_ms: vec![],
                exclusions: 1,
                excluded_until_ms: Some(50_000),
                reason: String::new(),
            },
        );
        assert_eq!(excluded(&job.0, 1000).into_iter().collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(formed(&evaluate(&settings(1, 8), &job.0, 1000)), ["c"]);
        assert_eq!(formed(&evaluate(&settings(1, 8), &job.0, 50_000)).len(), 3, "the exclusion is over");
    }

    #[test]
    fn members_of_a_domain_get_adjacent_ranks() {
        let on = |w: &str, d: &str| Placed { domain: d.into(), ..placed(w, 1) };
        let ranks = |v: Vec<Placed>| group_by_domain(v).into_iter().map(|p| p.worker_id).collect::<Vec<_>>();
        // Arrival order interleaves the nodes; ranks group them, in order of first arrival.
        let mixed = vec![on("a", "n1"), on("b", "n2"), on("c", "n1"), on("d", "n3"), on("e", "n2"), on("f", "n1")];
        assert_eq!(ranks(mixed), ["a", "c", "f", "b", "e", "d"]);
        // Already grouped: unchanged (survivors keep their ranks).
        let grouped = vec![on("a", "n1"), on("b", "n1"), on("c", "n2"), on("d", "n2")];
        assert_eq!(ranks(grouped), ["a", "b", "c", "d"]);
        // No domain published: the host is the domain.
        let hosts = vec![
            Placed { host: "h1".into(), ..placed("a", 1) },
            Placed { host: "h2".into(), ..placed("b", 1) },
            Placed { host: "h1".into(), ..placed("c", 1) },
        ];
        assert_eq!(ranks(hosts), ["a", "c", "b"]);
        // A domain of several hosts (a rack): each host's members together inside it.
        let in_rack = |w: &str, h: &str| Placed { domain: "rack1".into(), host: h.into(), ..placed(w, 1) };
        let rack =
            vec![in_rack("a", "h1"), in_rack("b", "h2"), in_rack("c", "h1"), on("d", "rack2"), in_rack("e", "h2")];
        assert_eq!(ranks(rack), ["a", "c", "b", "e", "d"]);
        // One host name, two shared-memory identities (containers that cannot share memory):
        // two hosts, each one run.
        let shm = |w: &str, identity: &str| Placed {
            host: "node".into(),
            addresses: vec![Address {
                transport: "shm".into(),
                address: format!("shm1;host={identity};nonce=0123456789abcdef"),
            }],
            ..placed(w, 1)
        };
        assert_eq!(ranks(vec![shm("a", "c1"), shm("b", "c2"), shm("c", "c1")]), ["a", "c", "b"]);
    }

    #[test]
    fn grouping_a_large_job_keeps_the_rule_in_linear_time() {
        let on = |w: String, d: String| Placed { domain: d, ..placed(&w, 1) };
        let ids = |v: &[Placed]| v.iter().map(|p| p.worker_id.clone()).collect::<Vec<_>>();
        // 16,384 members, each a domain of its own (a host per rank): the order is kept. The
        // scan this replaced took seconds here; a hash lookup per member takes milliseconds.
        let alone: Vec<Placed> = (0..16_384).map(|i| on(format!("w{i}"), format!("h{i}"))).collect();
        let started = std::time::Instant::now();
        assert_eq!(ids(&group_by_domain(alone.clone())), ids(&alone));
        assert!(started.elapsed() < Duration::from_secs(2), "grouping took {:?}", started.elapsed());
        // 8 ranks per host, arriving round-robin over 2,048 hosts: each host's ranks end up
        // together, hosts in order of their first rank, ranks of a host in arrival order.
        let hosts = 2_048;
        let mixed: Vec<Placed> = (0..16_384).map(|i| on(format!("w{i}"), format!("h{}", i % hosts))).collect();
        let grouped = group_by_domain(mixed);
        let expected: Vec<String> =
            (0..hosts).flat_map(|h| (0..8).map(move |k| format!("w{}", h + k * hosts))).collect();
        assert_eq!(ids(&grouped), expected);
    }

    #[test]
    fn a_joiner_is_placed_beside_its_domain() {
        // Generation 1 = [a, b] on n1 and [c] on n2, revoked; d (n1) joins: it takes the rank
        // after b, and c moves up one.
        let mut job = Job::new().member("a", 1).member("b", 1).member("c", 1).member("d", 1);
        for (w, d) in [("a", "n1"), ("b", "n1"), ("c", "n2"), ("d", "n1")] {
            job.0.members.get_mut(w).expect("member").domain = d.into();
        }
        let job = job
            .generation(1, &["a", "b", "c"], true)
            .waits("a", 1, 0)
            .waits("b", 1, 0)
            .waits("c", 1, 0)
            .waits("d", 0, 10);
        let e = evaluate(&settings(1, 4), &job.0, 1000);
        assert_eq!(formed(&e), ["a", "b", "d", "c"]);
    }

    #[test]
    fn all_finished_ends_the_job() {
        let mut job = Job::new().generation(2, &["a", "b"], false);
        job.gen_mut().departed.push(Departure { worker_id: "a".into(), incarnation: 1, finished: true });
        assert_eq!(evaluate(&settings(1, 8), &job.0, 0).action, Action::Nothing);
        job.gen_mut().departed.push(Departure { worker_id: "b".into(), incarnation: 1, finished: true });
        assert!(matches!(evaluate(&settings(1, 8), &job.0, 0).action, Action::End(Outcome::Finished, _)));
    }

    #[test]
    fn next_generation_keeps_history() {
        let mut g = next_generation(None, vec![placed("a", 1)], 5);
        assert_eq!(g.number, 1);
        g.revoked = Some(Cause {
            rank: None,
            worker_id: String::new(),
            host: String::new(),
            reason: "x".into(),
            reported_by: "a".into(),
            domain: String::new(),
            lost_ranks: Vec::new(),
        });
        g.revoked_at_ms = Some(5);
        let g2 = next_generation(Some(&g), vec![placed("a", 1)], 6);
        assert_eq!(g2.number, 2);
        assert_eq!(g2.cause_of(1).map(|c| c.reason.as_str()), Some("x"));
        assert!(g2.revoked.is_none());
        let recovery = crate::records::Recovery {
            generation: 1,
            size: 1,
            formed_at_ms: 5,
            revoked_at_ms: 5,
            reformed_at_ms: 6,
            reformed_size: 1,
        };
        assert_eq!(g2.recoveries, vec![recovery], "what the failure cost is remembered");
        // Both lists stay bounded.
        let mut last = g2;
        for n in 0..20 {
            last.revoked = g.revoked.clone();
            last.revoked_at_ms = Some(10 + n);
            last = next_generation(Some(&last), vec![placed("a", 1)], 11 + n);
        }
        assert_eq!((last.history.len(), last.recoveries.len()), (crate::records::HISTORY, crate::records::HISTORY));
        assert_eq!(last.recoveries.last().map(|r| (r.generation, r.reformed_at_ms)), Some((21, 30)));
    }
}
