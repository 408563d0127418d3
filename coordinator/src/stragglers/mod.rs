//! Straggler detection, as pure logic: which member of a synchronous generation is
//! persistently slower than the others, and whether it computes slowly or its links are slow.
//!
//! Input: every member's [`Timing`], sent with its heartbeats: per step, the mean time
//! spent outside collectives (its own compute) and inside them, and per peer the smoothed
//! gap between progress events received from that peer while an operation waited on it.
//! One slow rank slows every rank of a synchronous job, so the step time says nothing about
//! who is slow; these two measures do:
//!
//! - **compute**: a member whose compute time per step is at least [`StragglerRule::ratio`]
//!   times the median of the other members' (and at least [`StragglerRule::min_excess`]
//!   more) is slow itself. The others then wait for it inside the collectives.
//! - **link**: when no member computes slowly, a member on whose links the others wait at
//!   least `ratio` times the median wait on every other link (and `min_excess` more) has
//!   slow links. With a compute straggler in the generation no link verdict is given: the
//!   waits on its links (and, in a pipelined ring, on the links after it) are its compute,
//!   not the network.
//!
//! A member is *named* only after [`StragglerRule::reports`] consecutive reports of its own
//! found it slow (each judged against the others' latest reports), so one slow step (a page
//! fault, a checkpoint write) names nobody; one report that finds it not slow resets the
//! count. Every verdict carries its figures ([`Finding::reason`]), which `status` shows.

mod round;

pub use round::Round;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// When a member counts as slow.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StragglerRule {
    /// How many times the others' median its compute time (or the wait on its links) is, at
    /// least.
    pub ratio: f64,
    /// How much longer than the others' median, at least (so that noise on tiny steps is
    /// never a straggler).
    pub min_excess: Duration,
    /// Consecutive reports that must find it slow before it is named.
    pub reports: u32,
}

impl Default for StragglerRule {
    /// 1.5x the median and 2 ms more, for 3 consecutive reports (1.5 s at the default
    /// heartbeat interval of 500 ms).
    fn default() -> Self {
        Self { ratio: 1.5, min_excess: Duration::from_millis(2), reports: 3 }
    }
}

impl std::fmt::Display for StragglerRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            ">= {:.1}x the others' median and >= {} ms more, in {} consecutive reports",
            self.ratio,
            self.min_excess.as_millis(),
            self.reports
        )
    }
}

/// One member's recent steps, as its heartbeat reported them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timing {
    /// The generation it was measured in.
    pub generation: u64,
    /// The member's rank in that generation.
    pub rank: u32,
    /// Steps the means cover (0: no step since the previous report).
    pub steps: u32,
    /// Mean time per step outside collectives, microseconds.
    pub compute_us: u64,
    /// Mean time per step inside collectives, microseconds.
    pub collective_us: u64,
    /// `(peer rank, smoothed wait on that peer's link in microseconds)`.
    pub peer_waits: Vec<(u32, u64)>,
}

/// What makes a member a straggler.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Slowness {
    /// Its own steps (compute) take longer than the others'.
    Compute,
    /// The others wait on its links while it computes like them.
    Link,
}

impl Slowness {
    /// `compute` or `link`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Compute => "compute",
            Self::Link => "link",
        }
    }
}

/// One report's judgement that a member is slow.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Finding {
    /// Compute or link.
    pub kind: Slowness,
    /// How many times the others' median it is, in hundredths (300: 3.0x).
    pub ratio_pct: u32,
    /// The figures behind it, for `status`.
    pub reason: String,
}

/// The per-job straggler policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StragglerPolicy {
    /// Name the straggler in `status`, the metrics and the logs; nothing else.
    #[default]
    Report,
    /// Also ask it to leave at its next commit point, and refuse its join for a cool-down.
    Exclude,
}

impl StragglerPolicy {
    /// `report` or `exclude`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Report => "report",
            Self::Exclude => "exclude",
        }
    }

    /// Parses `report` or `exclude` (an empty string is the default, `report`).
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "" | "report" => Ok(Self::Report),
            "exclude" => Ok(Self::Exclude),
            other => Err(format!("straggler_policy must be \"report\" or \"exclude\", not {other:?}")),
        }
    }
}

fn median(values: &mut [u64]) -> Option<u64> {
    if values.is_empty() {
        return None;
    }
    values.sort_unstable();
    let n = values.len();
    Some(if n % 2 == 1 { values[n / 2] } else { (values[n / 2 - 1] + values[n / 2]) / 2 })
}

fn ms(us: u64) -> f64 {
    us as f64 / 1e3
}

/// Whether `value` is slow against `median` by the rule; the ratio if it is.
fn outlier(rule: &StragglerRule, value: u64, median: u64) -> Option<f64> {
    let excess = value.saturating_sub(median);
    let ratio = value as f64 / (median.max(1)) as f64;
    (ratio >= rule.ratio && excess as u128 >= rule.min_excess.as_micros()).then_some(ratio)
}

fn pct(ratio: f64) -> u32 {
    (ratio * 100.0).round().min(u32::MAX as f64) as u32
}

/// Whether `fast` of `of` is a clear (strict) majority.
fn clear_majority(fast: usize, of: usize) -> bool {
    fast * 2 > of
}

/// Every reporting member's compute time, sorted: what the compute verdicts of one round read,
/// so that judging one member costs O(log N), not a sort of the others (judging every member
/// of a round, as [`judge`] must to rule out a compute straggler elsewhere, was O(N² log N)).
struct Computes(Vec<u64>);

impl Computes {
    fn of(timings: &[&Timing]) -> Self {
        let mut all: Vec<u64> = timings.iter().map(|t| t.compute_us).collect();
        all.sort_unstable();
        Self(all)
    }
}

/// The compute outlier among `timings` at `rank`, if it is one: slow against the others'
/// median, and a clear majority of the generation's reporting members (the suspect counted
/// among them) fast against it. With three members the others' median is the mean of two, so
/// in 40/40/10 ms each 40 is 1.6x "the median" of the other two; only one member is fast,
/// so neither is named.
fn compute_finding(rule: &StragglerRule, rank: u32, timings: &[&Timing], computes: &Computes) -> Option<Finding> {
    let own = timings.iter().find(|t| t.rank == rank)?;
    let (ratio, med) = compute_ratio(rule, own.compute_us, timings.len(), computes)?;
    let others_collective =
        median(&mut timings.iter().filter(|t| t.rank != rank).map(|t| t.collective_us).collect::<Vec<_>>());
    Some(compute_slow(own, ratio, med, timings.len() - 1, others_collective.unwrap_or(0)))
}

/// The compute finding for `own`, `ratio` times the other `n` members' median compute `med`,
/// while they spend `others_collective` per step in collectives (their median).
fn compute_slow(own: &Timing, ratio: f64, med: u64, n: usize, others_collective: u64) -> Finding {
    Finding {
        kind: Slowness::Compute,
        ratio_pct: pct(ratio),
        reason: format!(
            "compute {:.1} ms per step, {ratio:.1}x the median {:.1} ms of the other {n} members \
             (they wait for it: {:.1} ms per step in collectives against its {:.1} ms)",
            ms(own.compute_us),
            ms(med),
            ms(others_collective),
            ms(own.collective_us),
        ),
    }
}

/// The link finding: rank `waiter` waits `on_suspect` on a link from the member, `ratio`
/// times the median `med` of the other `n` links, while the member computes `own_compute`.
fn link_slow(waiter: u32, on_suspect: u64, ratio: f64, med: u64, n: usize, own_compute: u64) -> Finding {
    Finding {
        kind: Slowness::Link,
        ratio_pct: pct(ratio),
        reason: format!(
            "rank {waiter} waits {:.1} ms between progress on its link from this member, {ratio:.1}x the median \
             {:.1} ms on the other {n} links, while its compute ({:.1} ms per step) is like the others'",
            ms(on_suspect),
            ms(med),
            ms(own_compute),
        ),
    }
}

/// Whether a member computing `own` of a round of `reporting` members is a compute
/// straggler; if so its ratio to the others' median, and that median. O(log N), the same
/// verdict [`Round`] gives on its indexed lists.
fn compute_ratio(rule: &StragglerRule, own: u64, reporting: usize, computes: &Computes) -> Option<(f64, u64)> {
    round::compute_verdict(rule, own, reporting, &round::Adjusted::new(&computes.0))
}

/// Judges the member at `rank` on one round of reports: `timings` holds the latest report
/// of every member of one generation (the suspect's among them). Reports that cover no step
/// are left out. `None`: not slow by this round (or too few reports to tell).
pub fn judge(rule: &StragglerRule, rank: u32, timings: &[Timing]) -> Option<Finding> {
    let live: Vec<&Timing> = timings.iter().filter(|t| t.steps > 0).collect();
    let generation = live.iter().find(|t| t.rank == rank)?.generation;
    let live: Vec<&Timing> = live.into_iter().filter(|t| t.generation == generation).collect();
    if live.len() < 2 {
        return None;
    }
    let computes = Computes::of(&live);
    if let Some(found) = compute_finding(rule, rank, &live, &computes) {
        return Some(found);
    }
    // Any compute straggler explains the waits: no link verdict beside one.
    if live.iter().any(|t| compute_ratio(rule, t.compute_us, live.len(), &computes).is_some()) {
        return None;
    }
    // Links: the longest wait any other member reports on the suspect, against the median
    // wait on every other link (reported by members other than the suspect).
    let (waiter, on_suspect) = live
        .iter()
        .filter(|t| t.rank != rank)
        .filter_map(|t| t.peer_waits.iter().find(|(p, _)| *p == rank).map(|(_, w)| (t.rank, *w)))
        .max_by_key(|(_, w)| *w)?;
    let mut elsewhere: Vec<u64> = live
        .iter()
        .filter(|t| t.rank != rank)
        .flat_map(|t| t.peer_waits.iter().filter(|(p, _)| *p != rank).map(|(_, w)| *w))
        .collect();
    let n = elsewhere.len();
    // As for compute: a clear majority of the other links must be fast against it.
    if !clear_majority(elsewhere.iter().filter(|&&w| outlier(rule, on_suspect, w).is_some()).count(), n) {
        return None;
    }
    let med = median(&mut elsewhere)?;
    let ratio = outlier(rule, on_suspect, med)?;
    let own = live.iter().find(|t| t.rank == rank).map_or(0, |t| t.compute_us);
    Some(link_slow(waiter, on_suspect, ratio, med, n, own))
}

/// A member's standing between reports: how many consecutive reports found it slow.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Standing {
    /// Consecutive reports that found it slow.
    pub streak: u32,
    /// The last finding, while the streak lasts.
    pub last: Option<Finding>,
    /// When it was named (ms since the epoch), while it is.
    pub named_since_ms: Option<u64>,
}

/// What one report changed about a member's standing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// Nothing to announce.
    None,
    /// It has just been named a straggler.
    Named,
    /// It was a straggler and is no longer.
    Cleared,
}

impl Standing {
    /// Takes one report's judgement (`None`: not slow) at `now_ms`.
    pub fn advance(&mut self, rule: &StragglerRule, finding: Option<Finding>, now_ms: u64) -> Change {
        match finding {
            Some(found) => {
                self.streak = self.streak.saturating_add(1);
                self.last = Some(found);
                if self.streak >= rule.reports && self.named_since_ms.is_none() {
                    self.named_since_ms = Some(now_ms);
                    return Change::Named;
                }
                Change::None
            }
            None => {
                let was = self.named_since_ms.is_some();
                *self = Standing::default();
                if was {
                    Change::Cleared
                } else {
                    Change::None
                }
            }
        }
    }

    /// Whether it is named a straggler now.
    pub fn named(&self) -> bool {
        self.named_since_ms.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The compute verdict as first written (sorting the others per member): the oracle of
    /// [`Computes`].
    fn compute_ratio_by_sorting(rule: &StragglerRule, rank: u32, timings: &[&Timing]) -> Option<f64> {
        let own = timings.iter().find(|t| t.rank == rank)?;
        let mut others: Vec<u64> = timings.iter().filter(|t| t.rank != rank).map(|t| t.compute_us).collect();
        let fast = others.iter().filter(|&&c| outlier(rule, own.compute_us, c).is_some()).count();
        if !clear_majority(fast, timings.len()) {
            return None;
        }
        outlier(rule, own.compute_us, median(&mut others)?)
    }

    #[test]
    fn the_sorted_index_judges_compute_exactly_as_sorting_the_others_does() {
        // Rounds of 1 to 40 members, with ties, zeros and outliers, under two rules.
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let rules = [StragglerRule::default(), StragglerRule { ratio: 1.1, min_excess: Duration::ZERO, reports: 1 }];
        for round in 0..400 {
            let n = 1 + (round % 40) as u32;
            let timings: Vec<Timing> = (0..n)
                .map(|rank| {
                    let base = [0, 1, 2_000, 10_000, 10_500][next(5) as usize];
                    let compute_us = if next(7) == 0 { base * (2 + next(4)) } else { base + next(3) * 500 };
                    Timing { generation: 1, rank, steps: 1, compute_us, ..Timing::default() }
                })
                .collect();
            let live: Vec<&Timing> = timings.iter().collect();
            let computes = Computes::of(&live);
            for rule in &rules {
                for t in &timings {
                    assert_eq!(
                        compute_ratio(rule, t.compute_us, live.len(), &computes).map(|(ratio, _)| ratio),
                        compute_ratio_by_sorting(rule, t.rank, &live),
                        "round {round}, rank {} of {n}: {:?}",
                        t.rank,
                        timings.iter().map(|t| t.compute_us).collect::<Vec<_>>()
                    );
                }
            }
        }
    }

    fn t(rank: u32, compute_ms: u64, collective_ms: u64, waits: &[(u32, u64)]) -> Timing {
        Timing {
            generation: 1,
            rank,
            steps: 20,
            compute_us: compute_ms * 1000,
            collective_us: collective_ms * 1000,
            peer_waits: waits.iter().map(|&(p, w)| (p, w * 1000)).collect(),
        }
    }

    /// A ring of 4 with rank 2 slowed to 3x compute: the others wait ~20 ms per step on it.
    fn slow_compute_round() -> Vec<Timing> {
        vec![t(0, 10, 21, &[(3, 6)]), t(1, 10, 20, &[(0, 6)]), t(2, 30, 1, &[(1, 1)]), t(3, 11, 20, &[(2, 21)])]
    }

    fn run(rule: &StragglerRule, rounds: &[Vec<Timing>], rank: u32) -> (Standing, Vec<Change>) {
        let mut standing = Standing::default();
        let changes = rounds
            .iter()
            .enumerate()
            .map(|(i, round)| standing.advance(rule, judge(rule, rank, round), i as u64))
            .collect();
        (standing, changes)
    }

    #[test]
    fn a_persistent_3x_compute_straggler_is_named_after_three_reports() {
        let rule = StragglerRule::default();
        let rounds = vec![slow_compute_round(); 5];
        let (standing, changes) = run(&rule, &rounds, 2);
        assert_eq!(changes, [Change::None, Change::None, Change::Named, Change::None, Change::None]);
        let last = standing.last.expect("a finding");
        assert_eq!(last.kind, Slowness::Compute);
        assert_eq!(last.ratio_pct, 300);
        assert!(last.reason.contains("compute 30.0 ms per step, 3.0x the median 10.0 ms"), "{}", last.reason);
        // Its neighbours are not named for the waits it causes, not even as links.
        for other in [0, 1, 3] {
            assert_eq!(judge(&rule, other, &slow_compute_round()), None, "rank {other}");
        }
    }

    #[test]
    fn a_straggler_is_named_only_when_a_clear_majority_is_fast() {
        let rule = StragglerRule::default();
        // Three members at 40/40/10 ms: each 40 is 1.6x the mean of the other two, but only
        // one member of three is fast. Naming both would exclude a majority.
        let round = vec![t(0, 40, 2, &[]), t(1, 40, 2, &[]), t(2, 10, 32, &[])];
        for rank in 0..3 {
            assert_eq!(judge(&rule, rank, &round), None, "rank {rank}");
        }
        // 30/10/10: two of three are fast, the slow one is named.
        let round = vec![t(0, 30, 2, &[]), t(1, 10, 22, &[]), t(2, 10, 22, &[])];
        assert_eq!(judge(&rule, 0, &round).map(|f| f.kind), Some(Slowness::Compute));
        // Two members: one fast of two is no majority.
        let pair = vec![t(0, 30, 2, &[]), t(1, 10, 22, &[])];
        assert_eq!(judge(&rule, 0, &pair), None);
        // Four members, two slow (40/40/10/10): half is not a clear majority.
        let half = vec![t(0, 40, 2, &[]), t(1, 40, 2, &[]), t(2, 10, 32, &[]), t(3, 10, 32, &[])];
        for rank in 0..4 {
            assert_eq!(judge(&rule, rank, &half), None, "rank {rank}");
        }
        // Links: judged against the links the suspect does not report on. Rank 0's link is
        // slow (40 ms) against two others of which one is as slow: the median (the mean of
        // 40 and 5) would name it, the majority rule does not.
        let links = vec![
            t(0, 10, 45, &[(3, 5)]),
            t(1, 10, 45, &[(0, 40)]),
            t(2, 10, 45, &[(1, 40)]),
            t(3, 10, 45, &[(2, 5)]),
        ];
        assert_eq!(judge(&rule, 0, &links), None);
    }

    #[test]
    fn a_one_off_slow_step_names_nobody() {
        let rule = StragglerRule::default();
        let even = vec![t(0, 10, 2, &[(2, 1)]), t(1, 10, 2, &[(0, 1)]), t(2, 10, 2, &[(1, 1)])];
        let mut spike = even.clone();
        spike[1].compute_us = 60_000;
        // Two slow reports, then a normal one, then two slow: never three in a row.
        let rounds = [spike.clone(), spike.clone(), even.clone(), spike.clone(), spike, even];
        let (standing, changes) = run(&rule, &rounds, 1);
        assert!(changes.iter().all(|c| *c == Change::None), "{changes:?}");
        assert!(!standing.named());
    }

    #[test]
    fn equal_ranks_name_nobody_also_with_noise() {
        let rule = StragglerRule::default();
        // Within 40% of one another: below the 1.5x ratio.
        let round = vec![t(0, 10, 5, &[(3, 2)]), t(1, 14, 3, &[(0, 3)]), t(2, 9, 6, &[(1, 2)]), t(3, 12, 4, &[(2, 3)])];
        for rank in 0..4 {
            assert_eq!(judge(&rule, rank, &round), None, "rank {rank}");
        }
        // Tiny steps: 3x of 0.3 ms is under the 2 ms excess.
        let tiny = vec![t(0, 0, 0, &[]), t(1, 0, 0, &[])];
        let mut tiny = tiny;
        tiny[0].compute_us = 300;
        tiny[1].compute_us = 900;
        assert_eq!(judge(&rule, 1, &tiny), None);
    }

    #[test]
    fn a_slow_link_is_told_from_slow_compute() {
        let rule = StragglerRule::default();
        // Everyone computes alike; rank 1's right neighbour (2) waits 40 ms on its link
        // where every other link moves every 5 ms.
        let round = vec![
            t(0, 10, 45, &[(1, 5), (2, 5), (3, 5)]),
            t(1, 10, 45, &[(0, 5), (2, 5), (3, 5)]),
            t(2, 10, 45, &[(0, 5), (1, 40), (3, 5)]),
            t(3, 10, 45, &[(0, 5), (1, 6), (2, 5)]),
        ];
        let found = judge(&rule, 1, &round).expect("rank 1's link is slow");
        assert_eq!(found.kind, Slowness::Link);
        assert_eq!(found.ratio_pct, 800);
        assert!(found.reason.starts_with("rank 2 waits 40.0 ms"), "{}", found.reason);
        for other in [0, 2, 3] {
            assert_eq!(judge(&rule, other, &round), None, "rank {other}");
        }
        let (standing, changes) = run(&rule, &vec![round; 3], 1);
        assert_eq!(changes.last(), Some(&Change::Named));
        assert_eq!(standing.last.map(|f| f.kind), Some(Slowness::Link));
    }

    #[test]
    fn a_straggler_that_recovers_is_cleared() {
        let rule = StragglerRule::default();
        let even = vec![t(0, 10, 2, &[]), t(1, 10, 2, &[]), t(2, 10, 2, &[])];
        let mut slow = even.clone();
        slow[0].compute_us = 30_000;
        let (standing, changes) = run(&rule, &[slow.clone(), slow.clone(), slow, even], 0);
        assert_eq!(changes, [Change::None, Change::None, Change::Named, Change::Cleared]);
        assert_eq!(standing, Standing::default());
    }

    #[test]
    fn reports_of_another_generation_or_without_steps_are_left_out() {
        let rule = StragglerRule::default();
        let mut round = slow_compute_round();
        // Only the suspect's report is of the current generation: nothing to compare with.
        for t in round.iter_mut().filter(|t| t.rank != 2) {
            t.generation = 0;
        }
        assert_eq!(judge(&rule, 2, &round), None);
        let mut idle = slow_compute_round();
        idle[2].steps = 0;
        assert_eq!(judge(&rule, 2, &idle), None, "a report without steps judges nothing");
    }

    #[test]
    fn the_policy_parses_and_names_itself() {
        assert_eq!(StragglerPolicy::parse(""), Ok(StragglerPolicy::Report));
        assert_eq!(StragglerPolicy::parse("report"), Ok(StragglerPolicy::Report));
        assert_eq!(StragglerPolicy::parse("exclude"), Ok(StragglerPolicy::Exclude));
        assert!(StragglerPolicy::parse("kill").is_err());
        assert_eq!(StragglerPolicy::Exclude.name(), "exclude");
        assert_eq!(
            StragglerRule::default().to_string(),
            ">= 1.5x the others' median and >= 2 ms more, in 3 consecutive reports"
        );
    }
}
