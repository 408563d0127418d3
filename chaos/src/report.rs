//! Reports: per-fault measurements, their statistics, a table for people and JSON.

use crate::demo::Check;
use crate::scenario::FaultKind;
use serde::Serialize;

/// One survivor's error as measured.
#[derive(Clone, Debug, Serialize)]
pub struct ErrorSeen {
    /// The worker.
    pub worker: String,
    /// Typed kind (PeerFailed, Timeout, Revoked, Transport, ...).
    pub kind: String,
    /// The root cause it named.
    pub cause: String,
    /// Milliseconds after the fault.
    pub after_ms: i64,
}

/// One member as `cohort-coordinator status` showed it.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct MemberSeen {
    /// The worker.
    pub worker: String,
    /// Its rank in the current generation, if placed.
    pub rank: Option<u32>,
    /// The generation it last reported.
    pub generation: u64,
    /// The step it last reported.
    pub step: u64,
    /// The activity it last reported.
    pub activity: String,
    /// Time since its last heartbeat, by the coordinator's clock.
    pub heartbeat_age_ms: u64,
    /// Its control stream: open, closed, unknown.
    pub control_connected: Option<bool>,
}

/// The coordinator's `status` taken while a fault lasted.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct StatusSeen {
    /// Milliseconds after the fault.
    pub after_ms: i64,
    /// Every member listed.
    pub members: Vec<MemberSeen>,
}

impl StatusSeen {
    /// Reads the members out of `cohort-coordinator status --json`.
    pub fn from_json(after_ms: i64, status: &serde_json::Value) -> Option<Self> {
        let members = status.get("members")?.as_array()?;
        let members = members
            .iter()
            .map(|m| {
                Some(MemberSeen {
                    worker: m.get("worker_id")?.as_str()?.to_string(),
                    rank: m.get("rank").and_then(serde_json::Value::as_u64).map(|r| r as u32),
                    generation: m.get("generation")?.as_u64()?,
                    step: m.get("step")?.as_u64()?,
                    activity: m.get("activity")?.as_str()?.to_string(),
                    heartbeat_age_ms: m.get("heartbeat_age_ms")?.as_u64()?,
                    control_connected: m.get("control_connected").and_then(serde_json::Value::as_bool),
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Self { after_ms, members })
    }

    /// The member silent the longest (largest heartbeat age), if any.
    pub fn stalest(&self) -> Option<&MemberSeen> {
        self.members.iter().max_by_key(|m| m.heartbeat_age_ms)
    }
}

/// What one fault did and how fast the job reacted.
#[derive(Clone, Debug, Default, Serialize)]
pub struct FaultRecord {
    /// Position in the run (1-based).
    pub index: usize,
    /// Fault kind (its name in reports).
    pub kind: FaultKind,
    /// Target workers (with their ranks at the fault).
    pub targets: Vec<String>,
    /// Link faults: the other side.
    pub peers: Vec<String>,
    /// Generation current at the fault.
    pub generation: i64,
    /// Its world size.
    pub world: i64,
    /// Highest verified step at the fault.
    pub step: i64,
    /// When it struck (ms since the epoch).
    pub at_ms: u64,
    /// How long it lasted, for faults with a duration (0 otherwise).
    pub duration_ms: u64,
    /// The first target had announced an allreduce and not finished it when struck.
    pub mid_allreduce: bool,
    /// Survivors of the fault (members expected to go on).
    pub survivors: Vec<String>,
    /// The first error of each survivor in the fault's generation.
    pub errors: Vec<ErrorSeen>,
    /// Fault to the first survivor's error.
    pub first_error_ms: Option<i64>,
    /// Fault to the last survivor's error (every survivor has its error).
    pub survivors_errors_ms: Option<i64>,
    /// First survivor's error to the last one's (revocation propagation).
    pub revocation_ms: Option<i64>,
    /// Fault to the next generation's first verified step.
    pub next_step_ms: Option<i64>,
    /// The next generation's number.
    pub next_generation: Option<i64>,
    /// Faults that must not disrupt the job (slow rank, latency, bandwidth, coordinator
    /// loss): the job's verified steps per second in a window as long as the fault just
    /// before it ...
    pub steps_per_s_before: Option<f64>,
    /// ... and while it lasted.
    pub steps_per_s_during: Option<f64>,
    /// Join storm: fault to the first verified step of a generation holding every joiner.
    pub absorbed_ms: Option<i64>,
    /// Hung rank: the coordinator's `status` taken while it was stopped, before anybody
    /// timed out (does it show which rank hung?).
    pub status: Option<StatusSeen>,
    /// Straggler: what the coordinator said and did, and the job's pace around it.
    pub straggler: Option<StragglerSeen>,
    /// Anything worth knowing.
    pub note: String,
}

/// A straggler fault as the harness saw it: the coordinator's verdict (from `status`), the
/// straggler's leave and return (from its events), and the job's verified steps per second
/// before the fault, while the straggler was a member, after it left, and after it returned.
#[derive(Clone, Debug, Default, Serialize)]
pub struct StragglerSeen {
    /// The job's straggler policy (`report` or `exclude`).
    pub policy: String,
    /// The slowed worker.
    pub target: String,
    /// The worker `status` named first, if any.
    pub named: Option<String>,
    /// Other workers `status` ever named (false positives).
    pub others_named: Vec<String>,
    /// The verdict's kind (`compute` or `link`).
    pub kind: String,
    /// The verdict's explanation.
    pub reason: String,
    /// What the coordinator did about it.
    pub action: String,
    /// When `status` first named it (ms since the epoch).
    pub named_at_ms: Option<u64>,
    /// Verified steps of the job from the fault to the naming.
    pub named_after_steps: Option<i64>,
    /// Its `event=straggler_leave` (ms since the epoch).
    pub excluded_at_ms: Option<u64>,
    /// Its first verified step after it joined again (ms since the epoch).
    pub rejoined_at_ms: Option<u64>,
    /// Duty cycles the fault played.
    pub cycles: u64,
    /// Steps per second from the straggler's leave to its return (exclude).
    pub steps_per_s_after: Option<f64>,
    /// Steps per second in the 3 s after its return.
    pub steps_per_s_rejoined: Option<f64>,
}

impl FaultRecord {
    /// The fault-specific measurement, for the table's last column.
    pub fn extra(&self) -> String {
        if let (Some(s), Some(before), Some(during)) =
            (&self.straggler, self.steps_per_s_before, self.steps_per_s_during)
        {
            let named = match (&s.named, s.named_after_steps) {
                (Some(w), Some(n)) => format!("named {w} after {n} steps"),
                _ => "never named".into(),
            };
            let mut text = format!("{named}; steps/s {before:.0} -> {during:.0}");
            if let Some(after) = s.steps_per_s_after {
                text.push_str(&format!(" -> {after:.0} excluded (x{:.2})", after / before.max(f64::MIN_POSITIVE)));
            }
            if let Some(back) = s.steps_per_s_rejoined {
                text.push_str(&format!(" -> {back:.0} rejoined"));
            }
            return text;
        }
        if let (Some(before), Some(during)) = (self.steps_per_s_before, self.steps_per_s_during) {
            let ratio = if before > 0.0 { format!(" (x{:.2})", during / before) } else { String::new() };
            return format!("steps/s {before:.0} -> {during:.0}{ratio}");
        }
        if let Some(t) = self.absorbed_ms {
            return format!("all joiners in {t} ms");
        }
        if let Some(s) = &self.status {
            if let Some(m) = s.stalest() {
                return format!(
                    "status +{} ms: stalest {} ({} ms, step {} {})",
                    s.after_ms, m.worker, m.heartbeat_age_ms, m.step, m.activity
                );
            }
        }
        String::new()
    }
}

/// Statistics of one measurement.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Stats {
    /// Samples.
    pub n: usize,
    /// Median (nearest rank).
    pub p50: Option<i64>,
    /// 99th percentile (nearest rank).
    pub p99: Option<i64>,
    /// Largest.
    pub max: Option<i64>,
}

impl Stats {
    /// Statistics of `samples` (any order).
    pub fn of(samples: impl IntoIterator<Item = i64>) -> Self {
        let mut v: Vec<i64> = samples.into_iter().collect();
        v.sort_unstable();
        Self { n: v.len(), p50: percentile(&v, 50.0), p99: percentile(&v, 99.0), max: v.last().copied() }
    }
}

/// Nearest-rank percentile of sorted samples.
pub fn percentile(sorted: &[i64], p: f64) -> Option<i64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted.get(rank.min(sorted.len()) - 1).copied()
}

/// The result of one scenario run.
#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    /// Scenario name.
    pub scenario: String,
    /// Seed used.
    pub seed: u64,
    /// Every check held and the run completed.
    pub passed: bool,
    /// Why the run could not complete (setup failure, a bounded wait ran out).
    pub error: Option<String>,
    /// Invariants and expectations.
    pub checks: Vec<Check>,
    /// The faults.
    pub faults: Vec<FaultRecord>,
    /// Wall time.
    pub wall_ms: u64,
    /// Logs (kept for failed runs).
    pub log_dir: Option<String>,
    /// Proxy counters, when the data plane went through it.
    pub proxy: Option<crate::proxy::ProxyStats>,
    /// Why the scenario was not run (network namespaces cannot be made here, ...): a skipped
    /// run has not passed; the verdict accepts it only when asked to (`--allow-skip`).
    pub skipped: Option<String>,
}

impl RunReport {
    /// The report of a scenario that was not run, and why.
    pub fn skipped(scenario: &str, seed: u64, reason: String) -> Self {
        Self {
            scenario: scenario.to_string(),
            seed,
            passed: false,
            error: None,
            checks: Vec::new(),
            faults: Vec::new(),
            wall_ms: 0,
            log_dir: None,
            proxy: None,
            skipped: Some(reason),
        }
    }
}

/// Statistics per fault kind and measurement.
#[derive(Clone, Debug, Serialize)]
pub struct KindStats {
    /// Fault kind.
    pub kind: String,
    /// Faults of this kind.
    pub count: usize,
    /// Of which struck mid-allreduce.
    pub mid_allreduce: usize,
    /// Fault → first survivor error.
    pub first_error_ms: Stats,
    /// Fault → every survivor's error.
    pub survivors_errors_ms: Stats,
    /// Revocation propagation.
    pub revocation_ms: Stats,
    /// Fault → next generation's first verified step.
    pub next_step_ms: Stats,
}

/// Per-kind statistics over `runs`.
pub fn kind_stats(runs: &[RunReport]) -> Vec<KindStats> {
    let mut kinds: Vec<String> = runs.iter().flat_map(|r| r.faults.iter().map(|f| f.kind.name().to_string())).collect();
    kinds.sort();
    kinds.dedup();
    kinds
        .into_iter()
        .map(|kind| {
            let fs: Vec<&FaultRecord> =
                runs.iter().flat_map(|r| r.faults.iter()).filter(|f| f.kind.name() == kind).collect();
            KindStats {
                count: fs.len(),
                mid_allreduce: fs.iter().filter(|f| f.mid_allreduce).count(),
                first_error_ms: Stats::of(fs.iter().filter_map(|f| f.first_error_ms)),
                survivors_errors_ms: Stats::of(fs.iter().filter_map(|f| f.survivors_errors_ms)),
                revocation_ms: Stats::of(fs.iter().filter_map(|f| f.revocation_ms)),
                next_step_ms: Stats::of(fs.iter().filter_map(|f| f.next_step_ms)),
                kind,
            }
        })
        .collect()
}

fn o(v: Option<i64>) -> String {
    v.map_or_else(|| "-".into(), |x| x.to_string())
}

/// The table for people: one line per run, one per fault, statistics, failed checks.
pub fn render(runs: &[RunReport], targets: &[Check]) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "{:<28} {:>6} {:>6} {:>7} {:>7}  {}\n",
        "SCENARIO", "SEED", "FAULTS", "SECONDS", "RESULT", "LOGS"
    ));
    for r in runs {
        out.push_str(&format!(
            "{:<28} {:>6} {:>6} {:>7.1} {:>7}  {}\n",
            r.scenario,
            r.seed,
            r.faults.len(),
            r.wall_ms as f64 / 1e3,
            if r.skipped.is_some() {
                "SKIPPED"
            } else if r.passed {
                "pass"
            } else {
                "FAIL"
            },
            r.log_dir.as_deref().unwrap_or("-")
        ));
    }
    for r in runs {
        if let Some(why) = &r.skipped {
            out.push_str(&format!("SKIPPED {}: {why}\n", r.scenario));
        }
    }
    out.push('\n');
    if runs.iter().map(|r| r.faults.len()).sum::<usize>() <= 60 {
        out.push_str(&format!(
            "{:<22} {:>3} {:<24} {:>4} {:>5} {:>4} {:>9} {:>9} {:>9} {:>9}  {}\n",
            "RUN/FAULT",
            "#",
            "TARGETS",
            "GEN",
            "WORLD",
            "MID",
            "ERR1 ms",
            "ERRS ms",
            "REVOKE ms",
            "NEXT ms",
            "MEASURED"
        ));
        for r in runs {
            for f in &r.faults {
                let line = format!(
                    "{:<22} {:>3} {:<24} {:>4} {:>5} {:>4} {:>9} {:>9} {:>9} {:>9}  {}",
                    format!("{}/{}", truncate(&r.scenario, 10), f.kind.name()),
                    f.index,
                    truncate(&f.targets.join(",").to_string(), 24),
                    f.generation,
                    f.world,
                    if f.mid_allreduce { "yes" } else { "-" },
                    o(f.first_error_ms),
                    o(f.survivors_errors_ms),
                    o(f.revocation_ms),
                    o(f.next_step_ms),
                    f.extra()
                );
                out.push_str(line.trim_end());
                out.push('\n');
            }
        }
        out.push('\n');
    }
    out.push_str(&format!(
        "{:<24} {:>5} {:>4} | {:>17} | {:>17} | {:>17} | {:>17}\n",
        "KIND", "N", "MID", "err1 p50/p99/max", "errs p50/p99/max", "revoke p50/p99/max", "next p50/p99/max"
    ));
    let s3 = |s: &Stats| format!("{}/{}/{}", o(s.p50), o(s.p99), o(s.max));
    for k in kind_stats(runs) {
        out.push_str(&format!(
            "{:<24} {:>5} {:>4} | {:>17} | {:>17} | {:>17} | {:>17}\n",
            k.kind,
            k.count,
            k.mid_allreduce,
            s3(&k.first_error_ms),
            s3(&k.survivors_errors_ms),
            s3(&k.revocation_ms),
            s3(&k.next_step_ms)
        ));
    }
    let failed: Vec<(&str, &Check)> =
        runs.iter().flat_map(|r| r.checks.iter().filter(|c| !c.ok).map(move |c| (r.scenario.as_str(), c))).collect();
    let errors: Vec<&RunReport> = runs.iter().filter(|r| r.error.is_some()).collect();
    out.push('\n');
    for r in errors {
        out.push_str(&format!("RUN ERROR {} (seed {}): {}\n", r.scenario, r.seed, r.error.as_deref().unwrap_or("")));
    }
    for (s, c) in &failed {
        out.push_str(&format!("FAILED {s}: {} ({})\n", c.what, c.detail));
    }
    if !targets.is_empty() {
        out.push_str("targets:\n");
        for c in targets {
            out.push_str(&format!("  [{}] {} ({})\n", if c.ok { " ok " } else { "MISS" }, c.what, c.detail));
        }
    }
    let checks: usize = runs.iter().map(|r| r.checks.len()).sum();
    out.push_str(&format!(
        "{} runs, {} faults, {} checks, {} failed checks, {} run errors\n",
        runs.len(),
        runs.iter().map(|r| r.faults.len()).sum::<usize>(),
        checks,
        failed.len(),
        runs.iter().filter(|r| r.error.is_some()).count()
    ));
    out
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        s.chars().take(n.saturating_sub(1)).chain(std::iter::once('~')).collect()
    }
}

/// The JSON document of a report.
pub fn to_json(command: &str, runs: &[RunReport], targets: &[Check]) -> serde_json::Value {
    serde_json::json!({
        "command": command,
        "runs": runs,
        "stats": kind_stats(runs),
        "targets": targets,
        "passed": runs.iter().all(|r| r.passed),
    })
}

/// The soak's targets over every SIGKILL of `runs` (kills struck mid-allreduce or not).
pub fn soak_targets(runs: &[RunReport]) -> Vec<Check> {
    let kills: Vec<&FaultRecord> =
        runs.iter().flat_map(|r| r.faults.iter()).filter(|f| f.kind == FaultKind::Kill).collect();
    let mid = kills.iter().filter(|f| f.mid_allreduce).count();
    let errs = Stats::of(kills.iter().filter_map(|f| f.survivors_errors_ms));
    let next = Stats::of(kills.iter().filter_map(|f| f.next_step_ms));
    let violated =
        |what: &str| runs.iter().flat_map(|r| r.checks.iter()).filter(|c| !c.ok && c.what.starts_with(what)).count();
    vec![
        Check {
            what: "at least 50 SIGKILLs mid-allreduce".into(),
            ok: mid >= 50,
            detail: format!("{mid} of {} kills", kills.len()),
        },
        Check {
            what: "zero wrong results".into(),
            ok: violated("no wrong result") == 0,
            detail: format!("{} runs with one", violated("no wrong result")),
        },
        Check {
            what: "zero hangs".into(),
            ok: violated("no hang") == 0 && runs.iter().all(|r| r.error.is_none()),
            detail: format!(
                "{} runs with one; {} run errors",
                violated("no hang"),
                runs.iter().filter(|r| r.error.is_some()).count()
            ),
        },
        Check {
            what: "survivors' errors p99 < 100 ms".into(),
            ok: errs.n == kills.len() && errs.p99.is_some_and(|p| p < 100),
            detail: format!("n {} p50 {} p99 {} max {}", errs.n, o(errs.p50), o(errs.p99), o(errs.max)),
        },
        Check {
            what: "next generation's first verified step p50 < 1 s and p99 < 2 s".into(),
            ok: next.n == kills.len() && next.p50.is_some_and(|p| p < 1000) && next.p99.is_some_and(|p| p < 2000),
            detail: format!("n {} p50 {} p99 {} max {}", next.n, o(next.p50), o(next.p99), o(next.max)),
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[5], 99.0), Some(5));
        let v: Vec<i64> = (1..=100).collect();
        assert_eq!(percentile(&v, 50.0), Some(50));
        assert_eq!(percentile(&v, 99.0), Some(99));
        assert_eq!(percentile(&v, 100.0), Some(100));
        let s = Stats::of([30, 10, 20]);
        assert_eq!((s.n, s.p50, s.p99, s.max), (3, Some(20), Some(30), Some(30)));
    }

    fn run_with(kills: &[(i64, i64)]) -> RunReport {
        RunReport {
            scenario: "s".into(),
            seed: 1,
            passed: true,
            error: None,
            checks: vec![Check { what: "no wrong result was ever accepted".into(), ok: true, detail: "ok".into() }],
            faults: kills
                .iter()
                .enumerate()
                .map(|(i, &(e, n))| FaultRecord {
                    index: i + 1,
                    kind: FaultKind::Kill,
                    mid_allreduce: true,
                    survivors_errors_ms: Some(e),
                    first_error_ms: Some(e / 2),
                    next_step_ms: Some(n),
                    ..Default::default()
                })
                .collect(),
            wall_ms: 1000,
            log_dir: None,
            proxy: None,
            skipped: None,
        }
    }

    #[test]
    fn status_json_is_read_member_by_member() {
        let json = serde_json::json!({
            "job": "j",
            "members": [
                { "worker_id": "w0", "rank": 0, "generation": 3, "step": 7, "activity": "allreduce", "heartbeat_age_ms": 80, "control_connected": true },
                { "worker_id": "w1", "rank": null, "generation": 3, "step": 6, "activity": "rendezvous", "heartbeat_age_ms": 900, "control_connected": null },
            ]
        });
        let s = StatusSeen::from_json(600, &json).expect("parses");
        assert_eq!(s.members.len(), 2);
        assert_eq!(s.members[1].rank, None);
        assert_eq!(s.members[1].control_connected, None);
        assert_eq!(s.stalest().map(|m| m.worker.as_str()), Some("w1"));
        assert!(
            StatusSeen::from_json(0, &serde_json::json!({ "members": [{ "worker_id": "w0" }] })).is_none(),
            "a member without its fields"
        );
    }

    #[test]
    fn soak_targets_judge_the_figures() {
        let good = run_with(&vec![(20, 600); 50]);
        let t = soak_targets(std::slice::from_ref(&good));
        assert!(t.iter().all(|c| c.ok), "{t:?}");
        let mut slow = vec![(20, 600); 50];
        slow[0] = (500, 600);
        slow[1] = (20, 5000);
        let t = soak_targets(&[run_with(&slow)]);
        assert!(!t[3].ok && !t[4].ok);
        let few = soak_targets(&[run_with(&[(20, 600); 3])]);
        assert!(!few[0].ok);
        let text = render(std::slice::from_ref(&good), &t);
        assert!(text.contains("kill") && text.contains("MISS"), "{text}");
        let json = to_json("soak", &[good], &t);
        assert_eq!(json["stats"][0]["count"], 50);
    }
}
