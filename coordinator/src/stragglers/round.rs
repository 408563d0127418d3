//! One round of reports indexed once, so that judging a member against it costs
//! O(log² N) instead of [`super::judge`]'s O(N log N) (and more for the link verdict): what
//! lets a job of thousands of members send a timing with every heartbeat.
//!
//! A [`Round`] holds every member's latest report of one generation, as sorted lists (compute
//! times, collective times, every link wait) and, per member, the waits the others report on
//! its links. [`Round::judge`] answers exactly what `judge` answers for the same member on
//! the round with that member's report replaced by a fresh one: each verdict is an order
//! statistic or a count of a sorted list with a few values taken out or put in
//! ([`Adjusted`]). The heartbeat service rebuilds the round at most once per heartbeat
//! interval for a large job (the others' reports are then up to one interval old, the
//! member's own is always the fresh one) and at every report for a small one.

use super::{clear_majority, compute_slow, link_slow, outlier, Finding, StragglerRule, Timing};
use std::collections::HashMap;

/// A sorted list of values with a few of them taken out (`minus`, each present in `base`)
/// and a few others put in (`plus`): counts and order statistics without copying `base`.
#[derive(Debug)]
pub(super) struct Adjusted<'a> {
    base: &'a [u64],
    minus: Vec<u64>,
    plus: Vec<u64>,
}

impl<'a> Adjusted<'a> {
    pub(super) fn new(base: &'a [u64]) -> Self {
        Self { base, minus: Vec::new(), plus: Vec::new() }
    }

    /// Takes out one copy of `v` (which must be in the list).
    fn without(mut self, v: u64) -> Self {
        if let Some(i) = self.plus.iter().position(|&p| p == v) {
            self.plus.swap_remove(i);
        } else {
            let at = self.minus.partition_point(|&m| m < v);
            self.minus.insert(at, v);
        }
        self
    }

    /// Takes out one copy of each of `values` (each must be in `base`, and in it as often).
    fn without_all(mut self, values: impl IntoIterator<Item = u64>) -> Self {
        self.minus.extend(values);
        self.minus.sort_unstable();
        self
    }

    /// Puts in `v`.
    fn with(mut self, v: u64) -> Self {
        self.plus.push(v);
        self
    }

    fn len(&self) -> usize {
        self.base.len() + self.plus.len() - self.minus.len()
    }

    /// How many values satisfy `pred`, which must hold for a prefix of the sorted values
    /// (true up to some value, false after).
    fn count_prefix(&self, pred: impl Fn(u64) -> bool) -> usize {
        let base = self.base.partition_point(|&v| pred(v));
        let minus = self.minus.partition_point(|&v| pred(v));
        base + self.plus.iter().filter(|&&v| pred(v)).count() - minus
    }

    /// The `k`-th smallest value (0-based), if there are more than `k`.
    fn kth(&self, k: usize) -> Option<u64> {
        if k >= self.len() {
            return None;
        }
        let at_most = |v: u64| self.count_prefix(|x| x <= v);
        // The k-th value is the smallest value of base or plus with more than k values at
        // most it: the first such in base (a binary search, at_most being monotone), or one
        // of the few in plus.
        let i = self.base.partition_point(|&v| at_most(v) <= k);
        let from_base = self.base.get(i).copied();
        let from_plus = self.plus.iter().copied().filter(|&v| at_most(v) > k).min();
        match (from_base, from_plus) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The median as [`super::median`] gives it (the mean of the middle two for an even count).
    fn median(&self) -> Option<u64> {
        let n = self.len();
        if n == 0 {
            return None;
        }
        if n % 2 == 1 {
            self.kth(n / 2)
        } else {
            Some((self.kth(n / 2 - 1)? + self.kth(n / 2)?) / 2)
        }
    }
}

/// The waits the other members report on one member's links.
#[derive(Debug, Default)]
struct OnMember {
    /// The longest, and the rank that reports it (the highest such rank on a tie, as
    /// `judge` picks it).
    longest: Option<(u32, u64)>,
    /// Every one of them.
    all: Vec<u64>,
}

/// Every member's latest report of one generation, indexed once (see the module docs).
#[derive(Debug)]
pub struct Round {
    generation: u64,
    /// The reports that cover steps, by rank.
    reports: Vec<Timing>,
    computes: Vec<u64>,
    collectives: Vec<u64>,
    waits: Vec<u64>,
    on: HashMap<u32, OnMember>,
}

impl Round {
    /// Indexes the reports of `generation` in `timings` (the latest of each member; reports
    /// of other generations and reports that cover no step are left out, as `judge` does).
    /// O(N log N + W log W) for N reports holding W link waits.
    pub fn new(generation: u64, timings: impl IntoIterator<Item = Timing>) -> Self {
        let mut reports: Vec<Timing> =
            timings.into_iter().filter(|t| t.generation == generation && t.steps > 0).collect();
        reports.sort_by_key(|t| t.rank);
        reports.dedup_by_key(|t| t.rank);
        let sorted = |f: fn(&Timing) -> u64| {
            let mut v: Vec<u64> = reports.iter().map(f).collect();
            v.sort_unstable();
            v
        };
        let (computes, collectives) = (sorted(|t| t.compute_us), sorted(|t| t.collective_us));
        let mut waits: Vec<u64> = reports.iter().flat_map(|t| t.peer_waits.iter().map(|&(_, w)| w)).collect();
        waits.sort_unstable();
        let mut on: HashMap<u32, OnMember> = HashMap::new();
        for t in &reports {
            for (i, &(peer, wait)) in t.peer_waits.iter().enumerate() {
                if peer == t.rank {
                    continue;
                }
                let entry = on.entry(peer).or_default();
                entry.all.push(wait);
                // `judge` reads a reporter's first wait on the member, and of equal longest
                // waits the last reporter's (ranks ascending here).
                let first = !t.peer_waits[..i].iter().any(|&(p, _)| p == peer);
                if first && entry.longest.is_none_or(|(_, longest)| wait >= longest) {
                    entry.longest = Some((t.rank, wait));
                }
            }
        }
        for entry in on.values_mut() {
            entry.all.sort_unstable();
        }
        Self { generation, reports, computes, collectives, waits, on }
    }

    /// The generation whose reports it holds.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Members with a report in it.
    pub fn len(&self) -> usize {
        self.reports.len()
    }

    /// Whether no member has a report in it.
    pub fn is_empty(&self) -> bool {
        self.reports.is_empty()
    }

    /// The verdict [`super::judge`] gives `own.rank` on this round with its report replaced
    /// by `own` (its fresh one). `None` for a report of another generation or without steps.
    ///
    /// Exact for a rule under which no value is slow against itself (a ratio above 1 or a
    /// minimum excess above 0, as every rule cohort uses); otherwise it judges every member
    /// of the round, as `judge` does.
    pub fn judge(&self, rule: &StragglerRule, own: &Timing) -> Option<Finding> {
        if own.generation != self.generation || own.steps == 0 {
            return None;
        }
        let old = self.reports.binary_search_by_key(&own.rank, |t| t.rank).ok().map(|i| &self.reports[i]);
        let reporting = self.reports.len() - usize::from(old.is_some()) + 1;
        if reporting < 2 {
            return None;
        }
        let computes = match old {
            Some(o) => Adjusted::new(&self.computes).without(o.compute_us),
            None => Adjusted::new(&self.computes),
        }
        .with(own.compute_us);
        if let Some((ratio, med)) = compute_verdict(rule, own.compute_us, reporting, &computes) {
            let others_collective = match old {
                Some(o) => Adjusted::new(&self.collectives).without(o.collective_us),
                None => Adjusted::new(&self.collectives),
            };
            let others_collective = others_collective.median().unwrap_or(0);
            return Some(compute_slow(own, ratio, med, reporting - 1, others_collective));
        }
        // Any compute straggler explains the waits. If any member is one, the slowest is
        // (more of the others are fast against it, and their median is no higher).
        if outlier(rule, 1, 1).is_some() || outlier(rule, 0, 0).is_some() {
            return self.judge_exhaustively(rule, own);
        }
        let slowest = computes.kth(computes.len() - 1)?;
        if compute_verdict(rule, slowest, reporting, &computes).is_some() {
            return None;
        }
        // Links: the longest wait another member reports on this one, against the median of
        // every other wait (those it reports itself and those on its links left out).
        let on = self.on.get(&own.rank)?;
        let (waiter, on_suspect) = on.longest?;
        let mut elsewhere = Adjusted::new(&self.waits).without_all(on.all.iter().copied());
        if let Some(o) = old {
            elsewhere = elsewhere.without_all(o.peer_waits.iter().map(|&(_, w)| w));
        }
        let n = elsewhere.len();
        if !clear_majority(elsewhere.count_prefix(|w| outlier(rule, on_suspect, w).is_some()), n) {
            return None;
        }
        let med = elsewhere.median()?;
        let ratio = outlier(rule, on_suspect, med)?;
        Some(link_slow(waiter, on_suspect, ratio, med, n, own.compute_us))
    }

    /// `judge` itself on the round with `own` in place of its old report: O(N log N).
    fn judge_exhaustively(&self, rule: &StragglerRule, own: &Timing) -> Option<Finding> {
        let mut round: Vec<Timing> = self.reports.iter().filter(|t| t.rank != own.rank).cloned().collect();
        round.push(own.clone());
        super::judge(rule, own.rank, &round)
    }
}

/// Whether a member computing `own` is a compute straggler among `computes` (every
/// reporting member's compute time, `own` among them, `reporting` of them); if so its ratio
/// to the others' median, and that median. As `compute_ratio`, on an [`Adjusted`] list.
pub(super) fn compute_verdict(rule: &StragglerRule, own: u64, reporting: usize, computes: &Adjusted<'_>) -> Option<(f64, u64)> {
    let slow_against = computes.count_prefix(|c| outlier(rule, own, c).is_some());
    let own_at = computes.count_prefix(|c| c < own);
    let fast = slow_against - usize::from(own_at < slow_against);
    if !clear_majority(fast, reporting) {
        return None;
    }
    let others = Adjusted { base: computes.base, minus: computes.minus.clone(), plus: computes.plus.clone() }.without(own);
    let med = others.median()?;
    Some((outlier(rule, own, med)?, med))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stragglers::judge;
    use std::time::Duration;

    /// A xorshift stream: the rounds below are random but the same at every run.
    fn stream(seed: u64) -> impl FnMut(u64) -> u64 {
        let mut x = seed;
        move |m| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        }
    }

    #[test]
    fn adjusted_lists_count_and_rank_as_the_lists_they_stand_for() {
        let mut next = stream(0x9e37_79b9_7f4a_7c15);
        for case in 0..2_000 {
            let n = next(30) as usize;
            let mut base: Vec<u64> = (0..n).map(|_| next(12)).collect();
            base.sort_unstable();
            let mut list = Adjusted::new(&base);
            let mut want = base.clone();
            for _ in 0..next(4) {
                if want.is_empty() {
                    break;
                }
                let v = want[next(want.len() as u64) as usize];
                list = list.without(v);
                want.remove(want.iter().position(|&w| w == v).unwrap());
            }
            for _ in 0..next(3) {
                let v = next(14);
                list = list.with(v);
                want.push(v);
            }
            want.sort_unstable();
            assert_eq!(list.len(), want.len(), "case {case}");
            for k in 0..=want.len() {
                assert_eq!(list.kth(k), want.get(k).copied(), "case {case}: {k}-th of {want:?}");
            }
            for limit in 0..15 {
                assert_eq!(list.count_prefix(|v| v < limit), want.iter().filter(|&&v| v < limit).count());
            }
            assert_eq!(list.median(), crate::stragglers::median(&mut want.clone()), "case {case}");
        }
    }

    /// Random rounds of 1 to 48 members (ties, zeros, slow compute, slow links, members
    /// without a report), every member judged with a fresh report: the indexed round and
    /// `judge` on the round with that report in place give the same verdict, reason included.
    #[test]
    fn the_indexed_round_judges_exactly_as_judge_does() {
        let mut next = stream(0x2545_f491_4f6c_dd1d);
        let rules = [StragglerRule::default(), StragglerRule { ratio: 1.2, min_excess: Duration::from_micros(1), reports: 1 }];
        let mut found = [0usize; 2];
        for round in 0..600u64 {
            let n = 1 + (round % 48) as u32;
            let report = |rank: u32, next: &mut dyn FnMut(u64) -> u64| {
                let base = [0, 1, 2_000, 10_000, 10_500][next(5) as usize];
                let compute_us = if next(9) == 0 { base * (2 + next(4)) } else { base + next(3) * 500 };
                let waits = (0..next(4))
                    .map(|_| {
                        let peer = next(u64::from(n) + 1) as u32;
                        let w = [0, 300, 1_000, 5_000][next(4) as usize];
                        (peer, if next(11) == 0 { w * 6 + 3_000 } else { w })
                    })
                    .collect();
                Timing {
                    generation: 1 + u64::from(next(13) == 0),
                    rank,
                    steps: u32::from(next(17) != 0),
                    compute_us,
                    collective_us: next(4) * 7_000,
                    peer_waits: waits,
                }
            };
            let mut timings: Vec<Timing> = Vec::new();
            for r in 0..n {
                if next(10) != 0 {
                    timings.push(report(r, &mut next));
                }
            }
            let indexed = Round::new(1, timings.clone());
            for rank in 0..n {
                let mut fresh = report(rank, &mut next);
                fresh.generation = 1;
                fresh.steps = 1 + next(3) as u32;
                let mut plain: Vec<Timing> =
                    timings.iter().filter(|t| t.rank != rank && t.generation == 1).cloned().collect();
                plain.push(fresh.clone());
                for (i, rule) in rules.iter().enumerate() {
                    let want = judge(rule, rank, &plain);
                    found[i] += usize::from(want.is_some());
                    assert_eq!(indexed.judge(rule, &fresh), want, "round {round}, rank {rank} of {n}: {plain:?}");
                }
            }
        }
        assert!(found.iter().all(|&f| f > 100), "the rounds found too few stragglers to test: {found:?}");
    }
}
