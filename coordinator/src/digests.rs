//! Comparison of the state digests members report with their commits.
//!
//! Members of one generation commit a step after the same collective on the same state, so
//! their digests for that step must be equal; a difference means their states diverged (a
//! wrong restore, a wrong sync, a rank-local value in the state). Commits of one step in
//! different generations are not compared: a step redone after its first committer died may
//! legitimately differ (a different world shards the data differently), and the members'
//! sync compares those itself.
//!
//! Two views, both pure: [`CommitLedger`] keeps the recent commits a replica received, per
//! job, and reports a mismatch the moment a commit disagrees (the service counts it and logs
//! a warning); [`among_last_commits`] compares the members' last commits as the store and
//! the cache hold them (what `status` shows, whichever replica received them).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Duration;
use tokio::time::Instant;

/// One member's commit of a step.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Commit {
    /// The member.
    pub(crate) worker_id: String,
    /// Hex digest of its committed state.
    pub(crate) digest: String,
}

/// Members of one generation that committed one step with different digests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Mismatch {
    /// The generation.
    pub(crate) generation: u64,
    /// The step.
    pub(crate) step: u64,
    /// Every commit of that step known, ordered by worker.
    pub(crate) commits: Vec<Commit>,
}

impl Mismatch {
    /// The mismatch as the status RPC returns it.
    pub(crate) fn to_proto(&self) -> cohort_proto::v1::DigestMismatch {
        cohort_proto::v1::DigestMismatch {
            generation: self.generation,
            step: self.step,
            commits: self
                .commits
                .iter()
                .map(|c| cohort_proto::v1::CommitDigest { worker_id: c.worker_id.clone(), digest: c.digest.clone() })
                .collect(),
        }
    }
}

/// Steps kept per job (the newest): the commits of one step arrive within about a step of
/// each other, so a few steps suffice to compare them.
const STEPS_KEPT: usize = 16;
/// Mismatches kept per job (the newest).
const MISMATCHES_KEPT: usize = 16;
/// Jobs kept at most (those idle longer than [`IDLE`] go first, then the least recently
/// committed).
const JOBS_KEPT: usize = 1024;
/// How long an idle job's commits are kept once there are many jobs.
const IDLE: Duration = Duration::from_secs(600);

#[derive(Debug)]
struct JobCommits {
    /// (generation, step) -> worker -> digest.
    steps: BTreeMap<(u64, u64), BTreeMap<String, String>>,
    mismatches: VecDeque<Mismatch>,
    touched: Instant,
}

/// The recent commits a replica received, per job, in bounded memory.
#[derive(Debug, Default)]
pub(crate) struct CommitLedger {
    jobs: HashMap<String, JobCommits>,
}

impl CommitLedger {
    /// Records `worker`'s commit of `step` in `generation` with `digest`. Returns the mismatch
    /// (every known commit of that step) when the digest differs from another member's.
    pub(crate) fn record(
        &mut self,
        job: &str,
        generation: u64,
        step: u64,
        worker: &str,
        digest: &str,
        now: Instant,
    ) -> Option<Mismatch> {
        if !self.jobs.contains_key(job) {
            crate::bounded::make_room(&mut self.jobs, JOBS_KEPT, IDLE, now, |j| j.touched);
        }
        let entry = self.jobs.entry(job.to_string()).or_insert_with(|| JobCommits {
            steps: BTreeMap::new(),
            mismatches: VecDeque::new(),
            touched: now,
        });
        entry.touched = now;
        let commits = entry.steps.entry((generation, step)).or_default();
        commits.insert(worker.to_string(), digest.to_string());
        let disagree = commits.iter().any(|(w, d)| w != worker && d != digest);
        let mismatch = disagree.then(|| Mismatch {
            generation,
            step,
            commits: commits.iter().map(|(w, d)| Commit { worker_id: w.clone(), digest: d.clone() }).collect(),
        });
        while entry.steps.len() > STEPS_KEPT {
            entry.steps.pop_first();
        }
        if let Some(m) = &mismatch {
            entry.mismatches.retain(|old| (old.generation, old.step) != (generation, step));
            entry.mismatches.push_back(m.clone());
            while entry.mismatches.len() > MISMATCHES_KEPT {
                entry.mismatches.pop_front();
            }
        }
        mismatch
    }

    /// Forgets `job` (it ended).
    pub(crate) fn forget(&mut self, job: &str) {
        self.jobs.remove(job);
    }

    /// The mismatches seen for `job` (the newest [`MISMATCHES_KEPT`]), oldest first.
    pub(crate) fn mismatches(&self, job: &str) -> Vec<Mismatch> {
        self.jobs.get(job).map(|j| j.mismatches.iter().cloned().collect()).unwrap_or_default()
    }
}

/// Mismatches among members' last commits, given as `(generation, step, commit)` per member:
/// the (generation, step) pairs at which two members' digests differ.
pub(crate) fn among_last_commits(last: impl IntoIterator<Item = (u64, u64, Commit)>) -> Vec<Mismatch> {
    let mut by_step: BTreeMap<(u64, u64), Vec<Commit>> = BTreeMap::new();
    for (generation, step, commit) in last {
        by_step.entry((generation, step)).or_default().push(commit);
    }
    by_step
        .into_iter()
        .filter(|(_, commits)| commits.iter().any(|c| c.digest != commits[0].digest))
        .map(|((generation, step), mut commits)| {
            commits.sort();
            Mismatch { generation, step, commits }
        })
        .collect()
}

/// `a` and `b` as one list, ordered by (generation, step): mismatches of the same step are
/// merged (a member's commit from `b` wins over `a`'s).
pub(crate) fn merge(a: Vec<Mismatch>, b: Vec<Mismatch>) -> Vec<Mismatch> {
    let mut merged: BTreeMap<(u64, u64), BTreeMap<String, String>> = BTreeMap::new();
    for m in a.into_iter().chain(b) {
        let commits = merged.entry((m.generation, m.step)).or_default();
        for c in m.commits {
            commits.insert(c.worker_id, c.digest);
        }
    }
    merged
        .into_iter()
        .map(|((generation, step), commits)| Mismatch {
            generation,
            step,
            commits: commits.into_iter().map(|(worker_id, digest)| Commit { worker_id, digest }).collect(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(w: &str, d: &str) -> Commit {
        Commit { worker_id: w.into(), digest: d.into() }
    }

    #[test]
    fn the_ledger_flags_a_different_digest_for_one_step_of_one_generation() {
        let mut l = CommitLedger::default();
        let now = Instant::now();
        assert_eq!(l.record("j", 1, 5, "w0", "aa", now), None);
        assert_eq!(l.record("j", 1, 5, "w1", "aa", now), None);
        // The same step in another generation is not compared.
        assert_eq!(l.record("j", 2, 5, "w2", "bb", now), None);
        let m = l.record("j", 1, 5, "w2", "bb", now).expect("mismatch");
        assert_eq!((m.generation, m.step), (1, 5));
        assert_eq!(m.commits, vec![c("w0", "aa"), c("w1", "aa"), c("w2", "bb")]);
        assert_eq!(l.mismatches("j"), vec![m]);
        assert!(l.mismatches("other").is_empty());
        // A member recommitting its own step (after a restore) is no mismatch by itself.
        let mut l = CommitLedger::default();
        assert_eq!(l.record("j", 1, 5, "w0", "aa", now), None);
        assert_eq!(l.record("j", 1, 5, "w0", "bb", now), None);
    }

    #[test]
    fn the_ledger_stays_bounded() {
        let mut l = CommitLedger::default();
        let now = Instant::now();
        for step in 0..1000 {
            l.record("j", 1, step, "w0", "aa", now);
            l.record("j", 1, step, "w1", "bb", now);
        }
        assert_eq!(l.jobs["j"].steps.len(), STEPS_KEPT);
        let kept = l.mismatches("j");
        assert_eq!(kept.len(), MISMATCHES_KEPT);
        assert_eq!(kept.last().map(|m| m.step), Some(999));
    }

    #[test]
    fn the_ledger_keeps_a_bounded_number_of_jobs_however_fast_they_come() {
        let mut l = CommitLedger::default();
        let now = Instant::now();
        for j in 0..3 * JOBS_KEPT {
            l.record(&format!("job-{j}"), 1, 1, "w0", "aa", now + Duration::from_millis(j as u64));
        }
        assert!(l.jobs.len() <= JOBS_KEPT, "{}", l.jobs.len());
        assert!(l.jobs.contains_key(&format!("job-{}", 3 * JOBS_KEPT - 1)), "the newest is kept");
        l.forget(&format!("job-{}", 3 * JOBS_KEPT - 1));
        assert!(!l.jobs.contains_key(&format!("job-{}", 3 * JOBS_KEPT - 1)));
    }

    #[test]
    fn last_commits_are_compared_per_generation_and_step_and_merged() {
        let found = among_last_commits([
            (3, 10, c("w1", "bb")),
            (3, 10, c("w0", "aa")),
            (3, 9, c("w2", "cc")),
            (2, 10, c("w3", "dd")),
            (3, 11, c("w4", "ee")),
            (3, 11, c("w5", "ee")),
        ]);
        assert_eq!(found, vec![Mismatch { generation: 3, step: 10, commits: vec![c("w0", "aa"), c("w1", "bb")] }]);
        let seen = vec![Mismatch { generation: 3, step: 10, commits: vec![c("w0", "aa"), c("w2", "aa")] }];
        let merged = merge(seen, found);
        assert_eq!(merged.len(), 1);
        assert_eq!(merged[0].commits, vec![c("w0", "aa"), c("w1", "bb"), c("w2", "aa")]);
    }
}
