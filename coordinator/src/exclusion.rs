//! Exclusion of repeatedly failing workers (blacklisting), as pure logic.
//!
//! A failure is a revocation blamed on the worker (named by a failure report, or its lease
//! lapsed). Three failures within ten minutes exclude the worker for a cool-down that
//! starts at 30 s and doubles with every further exclusion, up to 30 min. Graceful leaves
//! never count. While excluded, a Join is refused (with the time left, in the metadata
//! [`cohort_proto::RETRY_AFTER_MS_HEADER`], so that the worker waits and joins again) and the
//! worker is never placed in a generation, so a flapping peer cannot keep the job re-forming.
//! The policy is set per replica (`serve --exclusion-*`).
//!
//! A straggler excluded by the job's straggler policy (`exclude`, see
//! [`crate::stragglers`]) is refused the same way for the job's straggler cool-down
//! ([`FailureHistory::exclude_straggler`]), but that is not a failure: it neither counts
//! towards the threshold nor lengthens a later exclusion.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// When failures turn into an exclusion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExclusionPolicy {
    /// Failures within `window` that trigger an exclusion.
    pub threshold: usize,
    /// The sliding window failures are counted in.
    pub window: Duration,
    /// The first exclusion's length.
    pub base_cooldown: Duration,
    /// The longest exclusion.
    pub max_cooldown: Duration,
}

impl Default for ExclusionPolicy {
    fn default() -> Self {
        Self {
            threshold: 3,
            window: Duration::from_secs(600),
            base_cooldown: Duration::from_secs(30),
            max_cooldown: Duration::from_secs(1800),
        }
    }
}

impl ExclusionPolicy {
    /// Checks the policy for consistency.
    pub fn validate(&self) -> Result<(), String> {
        if self.threshold < 1 {
            return Err("the exclusion threshold must be at least 1 failure".into());
        }
        if self.window.is_zero() {
            return Err("the exclusion window must be longer than 0".into());
        }
        if self.base_cooldown > self.max_cooldown {
            return Err(format!(
                "the exclusion cool-down ({:?}) must not exceed the longest cool-down ({:?})",
                self.base_cooldown, self.max_cooldown
            ));
        }
        Ok(())
    }
}

/// A worker's failure history (stored per worker under `failures/<worker>`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailureHistory {
    /// Times (ms since the epoch) of failures not yet consumed by an exclusion, oldest first.
    pub failures_ms: Vec<u64>,
    /// How many times the worker has been excluded.
    pub exclusions: u32,
    /// End of the current (or last) exclusion, ms since the epoch.
    pub excluded_until_ms: Option<u64>,
    /// Why the current (or last) exclusion began, for `status` (empty: written by an older
    /// coordinator).
    #[serde(default)]
    pub reason: String,
}

impl FailureHistory {
    /// Records a failure at `now_ms`; returns the end of the exclusion it starts, if any.
    pub fn record_failure(&mut self, policy: &ExclusionPolicy, now_ms: u64) -> Option<u64> {
        let window = policy.window.as_millis() as u64;
        self.failures_ms.retain(|&t| t + window > now_ms && t <= now_ms);
        self.failures_ms.push(now_ms);
        // Bound the record whatever the policy.
        let keep = policy.threshold.max(1);
        if self.failures_ms.len() > keep {
            let drop = self.failures_ms.len() - keep;
            self.failures_ms.drain(..drop);
        }
        if self.failures_ms.len() >= policy.threshold {
            self.exclusions = self.exclusions.saturating_add(1);
            let cooldown = cooldown(policy, self.exclusions);
            let until = now_ms.saturating_add(cooldown.as_millis() as u64);
            self.excluded_until_ms = Some(until);
            self.reason = format!(
                "{} failures within {} min (exclusion {})",
                policy.threshold,
                policy.window.as_secs() / 60,
                self.exclusions
            );
            self.failures_ms.clear();
            return Some(until);
        }
        None
    }

    /// Excludes the worker as a straggler for `cooldown` from `now_ms` (an exclusion in force
    /// that ends later is kept); returns its end. Counts no failure and no exclusion.
    pub fn exclude_straggler(&mut self, now_ms: u64, cooldown: Duration, reason: &str) -> u64 {
        let until = now_ms.saturating_add(cooldown.as_millis() as u64);
        if self.excluded_until(now_ms).is_none_or(|current| current < until) {
            self.reason = format!("straggler: {reason}");
        }
        let until = self.excluded_until(now_ms).map_or(until, |current| current.max(until));
        self.excluded_until_ms = Some(until);
        until
    }

    /// The end of the exclusion in force at `now_ms`, if one is.
    pub fn excluded_until(&self, now_ms: u64) -> Option<u64> {
        self.excluded_until_ms.filter(|&until| until > now_ms)
    }

    /// How long after `now_ms` the record still matters, the lease it is stored on: a
    /// window past its last failure (they count that long), and past the end of an exclusion
    /// in force another window (a worker that fails again that soon gets the doubled
    /// cooldown). After it the record expires with its lease, so a long job whose workers
    /// come and go under new names (a Deployment's pods) keeps a bounded number of them.
    pub fn retention(&self, policy: &ExclusionPolicy, now_ms: u64) -> Duration {
        let exclusion_left = self.excluded_until(now_ms).map_or(0, |until| until - now_ms);
        policy.window.saturating_add(Duration::from_millis(exclusion_left)).max(Duration::from_secs(1))
    }

    /// Failures counted in the window at `now_ms`.
    pub fn recent_failures(&self, policy: &ExclusionPolicy, now_ms: u64) -> usize {
        let window = policy.window.as_millis() as u64;
        self.failures_ms.iter().filter(|&&t| t + window > now_ms).count()
    }
}

/// The length of the `n`-th exclusion (1-based): base * 2^(n-1), capped.
pub fn cooldown(policy: &ExclusionPolicy, n: u32) -> Duration {
    let factor = 1u32.checked_shl(n.saturating_sub(1)).unwrap_or(u32::MAX);
    policy.base_cooldown.checked_mul(factor).unwrap_or(policy.max_cooldown).min(policy.max_cooldown)
}

/// The message a Join gets while the worker is excluded.
///
/// `who` names the excluded (`worker w3`, `failure domain node-7`), `reason` is the history's
/// [`FailureHistory::reason`] (empty: a record of an older coordinator, then the policy says
/// why).
pub fn refusal(who: &str, until_ms: u64, now_ms: u64, reason: &str, policy: &ExclusionPolicy) -> String {
    let left = Duration::from_millis(until_ms.saturating_sub(now_ms));
    let why = if reason.is_empty() {
        format!("{} failures within {} min", policy.threshold, policy.window.as_secs() / 60)
    } else {
        reason.to_string()
    };
    format!("{who} is excluded until {until_ms} ms since the epoch ({:.1} s from now): {why}", left.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: u64 = 60_000;

    #[test]
    fn three_failures_in_ten_minutes_exclude() {
        let p = ExclusionPolicy::default();
        let mut h = FailureHistory::default();
        assert_eq!(h.record_failure(&p, 0), None);
        assert_eq!(h.record_failure(&p, MIN), None);
        assert_eq!(h.record_failure(&p, 2 * MIN), Some(2 * MIN + 30_000));
        assert_eq!(h.excluded_until(2 * MIN + 1), Some(2 * MIN + 30_000));
        assert_eq!(h.excluded_until(2 * MIN + 30_000), None);
    }

    #[test]
    fn old_failures_fall_out_of_the_window() {
        let p = ExclusionPolicy::default();
        let mut h = FailureHistory::default();
        h.record_failure(&p, 0);
        h.record_failure(&p, 5 * MIN);
        assert_eq!(h.record_failure(&p, 10 * MIN), None, "the first failure is 10 min old");
        assert_eq!(h.recent_failures(&p, 10 * MIN), 2);
        // Kept a window past now, and a window past an exclusion in force.
        assert_eq!(h.retention(&p, 10 * MIN), p.window);
        h.excluded_until_ms = Some(12 * MIN);
        assert_eq!(h.retention(&p, 10 * MIN), p.window + Duration::from_millis(2 * MIN));
        assert_eq!(h.retention(&p, 13 * MIN), p.window, "an exclusion that ended adds nothing");
    }

    #[test]
    fn a_straggler_exclusion_counts_no_failure() {
        let p = ExclusionPolicy::default();
        let mut h = FailureHistory::default();
        h.record_failure(&p, 0);
        assert_eq!(h.exclude_straggler(1000, Duration::from_secs(5), "compute 3.0x"), 6000);
        assert_eq!(h.reason, "straggler: compute 3.0x");
        assert_eq!(h.excluded_until(5999), Some(6000));
        assert_eq!(h.excluded_until(6000), None);
        assert_eq!((h.recent_failures(&p, 1000), h.exclusions), (1, 0), "no failure, no exclusion counted");
        // A longer exclusion in force is kept.
        h.excluded_until_ms = Some(100_000);
        assert_eq!(h.exclude_straggler(7000, Duration::from_secs(5), "again"), 100_000);
        assert_eq!(h.reason, "straggler: compute 3.0x", "the longer exclusion in force keeps its reason");
    }

    #[test]
    fn cooldown_doubles_and_caps() {
        let p = ExclusionPolicy::default();
        assert_eq!(cooldown(&p, 1), Duration::from_secs(30));
        assert_eq!(cooldown(&p, 2), Duration::from_secs(60));
        assert_eq!(cooldown(&p, 6), Duration::from_secs(960));
        assert_eq!(cooldown(&p, 7), Duration::from_secs(1800));
        assert_eq!(cooldown(&p, 100), Duration::from_secs(1800));
        let mut h = FailureHistory::default();
        let mut t = 0;
        for round in 1..=3u32 {
            let mut until = None;
            for _ in 0..3 {
                t += 1000;
                until = h.record_failure(&p, t);
            }
            assert_eq!(until, Some(t + cooldown(&p, round).as_millis() as u64));
        }
    }
}
