//! A status that stays readable at thousands of members: counts and spreads over every
//! member, and the outliers by name (`cohort-coordinator status` prints it instead of the
//! member table above `--rows` members).
//!
//! Pure: it reads a [`pb::StatusResponse`]'s members and the caller's clock, so it is tested
//! without a coordinator. O(N log N) in the members.

use cohort_proto::v1 as pb;
use std::collections::BTreeMap;
use std::fmt;

/// Why a member was picked out, in one word.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OutlierKind {
    /// Its control stream closed and did not reopen (its process is most likely gone).
    ControlClosed,
    /// It is not in the current generation (and not waiting to join).
    NotInGeneration,
    /// Its heartbeat is much older than the others'.
    StaleHeartbeat,
    /// It reported fewer steps than the furthest member.
    Behind,
}

/// One member picked out by name, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outlier {
    /// What sets it apart, in one word.
    pub kind: OutlierKind,
    /// Its rank in the current generation, if it has one.
    pub rank: Option<u32>,
    /// Its worker id.
    pub worker_id: String,
    /// Its host.
    pub host: String,
    /// What sets it apart (`heartbeat 4.1 s ago (median 0.2 s)`).
    pub why: String,
}

/// Spread of one figure over the members.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Spread {
    /// Smallest.
    pub min: u64,
    /// Median.
    pub median: u64,
    /// 99th percentile (nearest rank).
    pub p99: u64,
    /// Largest.
    pub max: u64,
}

impl Spread {
    fn of(mut values: Vec<u64>) -> Self {
        if values.is_empty() {
            return Self::default();
        }
        values.sort_unstable();
        let at = |q: f64| values[((values.len() as f64 * q).ceil() as usize).clamp(1, values.len()) - 1];
        Self { min: values[0], median: at(0.5), p99: at(0.99), max: values[values.len() - 1] }
    }
}

/// The summary of every member of a job's status.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StatusSummary {
    /// Members listed.
    pub members: usize,
    /// Members with a rank in the current generation.
    pub ranked: usize,
    /// Members per activity (`allreduce`, `sync`, ...).
    pub activities: BTreeMap<String, usize>,
    /// Members per generation they last reported.
    pub generations: BTreeMap<u64, usize>,
    /// Members waiting in the rendezvous.
    pub waiting: usize,
    /// Members whose control stream closed and did not reopen.
    pub control_closed: usize,
    /// Distinct hosts.
    pub hosts: usize,
    /// Heartbeat age, ms.
    pub heartbeat_age_ms: Spread,
    /// Step reported.
    pub step: Spread,
    /// Members picked out by name (at most the limit given to [`summarize`]).
    pub outliers: Vec<Outlier>,
}

/// Summarizes `members` as of `now_ms`, naming at most `limit` outliers: closed control
/// streams first, then members not in the current generation, the stalest heartbeats (over
/// twice the median and a second), and the members furthest behind in steps.
pub fn summarize(members: &[pb::MemberStatus], now_ms: u64, limit: usize) -> StatusSummary {
    let age = |m: &pb::MemberStatus| now_ms.saturating_sub(m.last_heartbeat_ms);
    let mut s = StatusSummary {
        members: members.len(),
        ranked: members.iter().filter(|m| m.rank.is_some()).count(),
        waiting: members.iter().filter(|m| m.waiting).count(),
        control_closed: members.iter().filter(|m| m.control_connected == Some(false)).count(),
        heartbeat_age_ms: Spread::of(members.iter().map(age).collect()),
        step: Spread::of(members.iter().filter(|m| m.rank.is_some()).map(|m| m.step).collect()),
        ..StatusSummary::default()
    };
    let mut hosts = std::collections::BTreeSet::new();
    for m in members {
        let activity = if m.activity.is_empty() { "-" } else { &m.activity };
        *s.activities.entry(activity.to_string()).or_default() += 1;
        *s.generations.entry(m.generation).or_default() += 1;
        hosts.insert(m.host.as_str());
    }
    s.hosts = hosts.len();

    let mut picked: Vec<(usize, OutlierKind, String)> = Vec::new();
    let pick = |i: usize, kind: OutlierKind, why: String, picked: &mut Vec<(usize, OutlierKind, String)>| {
        if picked.len() < limit && !picked.iter().any(|(j, _, _)| *j == i) {
            picked.push((i, kind, why));
        }
    };
    for (i, m) in members.iter().enumerate() {
        if m.control_connected == Some(false) {
            pick(
                i,
                OutlierKind::ControlClosed,
                "control stream CLOSED (its process is most likely gone)".into(),
                &mut picked,
            );
        }
    }
    for (i, m) in members.iter().enumerate() {
        if m.rank.is_none() && !m.waiting {
            let why = format!("not in the current generation (last in {})", m.generation);
            pick(i, OutlierKind::NotInGeneration, why, &mut picked);
        }
    }
    let median_age = s.heartbeat_age_ms.median;
    let mut stale: Vec<usize> =
        (0..members.len()).filter(|&i| age(&members[i]) > (2 * median_age).max(median_age + 1000)).collect();
    stale.sort_by_key(|&i| std::cmp::Reverse(age(&members[i])));
    for i in stale {
        let why = format!("heartbeat {} ago (median {})", secs(age(&members[i])), secs(median_age));
        pick(i, OutlierKind::StaleHeartbeat, why, &mut picked);
    }
    let top = s.step.max;
    let mut behind: Vec<usize> =
        (0..members.len()).filter(|&i| members[i].rank.is_some() && members[i].step < top).collect();
    behind.sort_by_key(|&i| (members[i].step, members[i].rank));
    for i in behind {
        let m = &members[i];
        let why = format!("at step {}, {} behind the furthest ({top})", m.step, top - m.step);
        pick(i, OutlierKind::Behind, why, &mut picked);
    }
    s.outliers = picked
        .into_iter()
        .map(|(i, kind, why)| {
            let m = &members[i];
            Outlier { kind, rank: m.rank, worker_id: m.worker_id.clone(), host: m.host.clone(), why }
        })
        .collect();
    s
}

fn secs(ms: u64) -> String {
    if ms < 1000 {
        format!("{ms} ms")
    } else {
        format!("{:.1} s", ms as f64 / 1000.0)
    }
}

fn counts<K: fmt::Display>(map: &BTreeMap<K, usize>) -> String {
    map.iter().map(|(k, n)| format!("{k} {n}")).collect::<Vec<_>>().join(", ")
}

impl fmt::Display for StatusSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "members: {} on {} hosts ({} ranked, {} waiting, {} control streams closed)",
            self.members, self.hosts, self.ranked, self.waiting, self.control_closed
        )?;
        writeln!(f, "activity: {}", counts(&self.activities))?;
        writeln!(f, "generation reported: {}", counts(&self.generations))?;
        let h = self.heartbeat_age_ms;
        writeln!(f, "heartbeat age: median {}, p99 {}, max {}", secs(h.median), secs(h.p99), secs(h.max))?;
        let st = self.step;
        writeln!(f, "step (ranked members): min {}, median {}, max {}", st.min, st.median, st.max)?;
        if self.outliers.is_empty() {
            writeln!(f, "outliers: none")?;
        } else {
            writeln!(f, "outliers ({}):", self.outliers.len())?;
            for o in &self.outliers {
                let rank = o.rank.map_or_else(|| "-".to_string(), |r| r.to_string());
                writeln!(f, "  rank {rank} worker {} host {}: {}", o.worker_id, o.host, o.why)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(i: u32, heartbeat_ms: u64, step: u64) -> pb::MemberStatus {
        pb::MemberStatus {
            worker_id: format!("w{i}"),
            host: format!("h{}", i / 8),
            rank: Some(i),
            last_heartbeat_ms: heartbeat_ms,
            generation: 3,
            step,
            activity: "allreduce".into(),
            control_connected: Some(true),
            ..Default::default()
        }
    }

    #[test]
    fn sixteen_thousand_members_summarize_to_a_few_lines_naming_the_outliers() {
        let now = 1_000_000;
        let mut members: Vec<pb::MemberStatus> = (0..16_384).map(|i| member(i, now - 200, 500)).collect();
        members[77].last_heartbeat_ms = now - 9_000;
        members[901].control_connected = Some(false);
        members[12_000].step = 480;
        members[5].rank = None;
        members[5].generation = 2;
        let s = summarize(&members, now, 10);
        assert_eq!((s.members, s.ranked, s.hosts, s.control_closed), (16_384, 16_383, 2048, 1));
        assert_eq!(s.heartbeat_age_ms.median, 200);
        assert_eq!(s.heartbeat_age_ms.max, 9_000);
        assert_eq!((s.step.min, s.step.max), (480, 500));
        let named: Vec<&str> = s.outliers.iter().map(|o| o.worker_id.as_str()).collect();
        assert_eq!(named, ["w901", "w5", "w77", "w12000"], "{s}");
        let text = s.to_string();
        assert!(text.lines().count() < 15, "{text}");
        assert!(text.contains("heartbeat 9.0 s ago (median 200 ms)"), "{text}");
        assert!(text.contains("at step 480, 20 behind the furthest (500)"), "{text}");
        assert!(text.contains("generation reported: 2 1, 3 16383"), "{text}");
    }

    #[test]
    fn the_outlier_list_is_bounded_and_a_quiet_job_has_none() {
        let now = 50_000;
        let members: Vec<pb::MemberStatus> = (0..100).map(|i| member(i, now - 100, u64::from(i))).collect();
        assert_eq!(summarize(&members, now, 3).outliers.len(), 3, "99 members are behind the furthest");
        let even: Vec<pb::MemberStatus> = (0..100).map(|i| member(i, now - 100, 7)).collect();
        let s = summarize(&even, now, 10);
        assert!(s.outliers.is_empty(), "{s}");
        assert!(s.to_string().contains("outliers: none"));
        assert_eq!(summarize(&[], now, 10).members, 0);
    }
}
