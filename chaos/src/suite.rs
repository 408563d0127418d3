//! `suite` (every scenario, or the quick ones) and `soak` (one scenario, fresh seeds, for a
//! while), with their reports.

use crate::netns::NetLab;
use crate::report::{self, RunReport};
use crate::runner::{self, RunOptions};
use crate::scenario::{NetworkChoice, Scenario, ScenarioError};
use cohort_proto::progress::{Mode, Progress, Total};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The shipped scenarios' directory (`chaos/scenarios`).
pub fn default_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios")
}

/// Finds a scenario: a path to a TOML file, else a name in `dir` (`kills` → `dir/kills.toml`).
pub fn resolve(name_or_path: &str, dir: &Path) -> Result<Scenario, ScenarioError> {
    let p = Path::new(name_or_path);
    if p.is_file() {
        return Scenario::load(p);
    }
    let file = dir.join(format!("{}.toml", name_or_path.trim_end_matches(".toml")));
    Scenario::load(&file)
}

/// Every scenario in `dir` (sorted by file name); with `quick`, only those marked quick.
/// Scenarios whose name starts with `soak` are left to `soak`.
pub fn load_dir(dir: &Path, quick: bool) -> Result<Vec<Scenario>, ScenarioError> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|source| ScenarioError::Read { path: dir.display().to_string(), source })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let s = Scenario::load(&f)?;
        if s.name.starts_with("soak") || (quick && !s.quick) {
            continue;
        }
        out.push(s);
    }
    Ok(out)
}

/// Runs `scenarios` one after the other, printing a line per run. A scenario on network
/// namespaces is skipped where they cannot be made (not root, no iproute2): its report says
/// why ([`RunReport::skipped`]), and it fails the [`verdict`] unless skips are allowed.
///
/// # Cancel safety
/// Cancel safe: dropping it kills the current run's processes.
pub async fn run_all(scenarios: &[Scenario], opts: &RunOptions) -> Vec<RunReport> {
    let progress = Progress::with_mode("chaos", Total::Items(scenarios.len() as u64), progress_mode(opts));
    let mut reports = Vec::new();
    for s in scenarios {
        let t = Instant::now();
        let seed = opts.seed.unwrap_or(s.seed);
        progress.suspend(|| println!("== {} (seed {seed}): {}", s.name, s.description));
        progress.start(format!("{} (seed {seed})", s.name));
        if s.network == NetworkChoice::Netns {
            if let Err(why) = NetLab::probe() {
                let why = format!("network namespaces are unavailable here: {why}");
                progress.suspend(|| println!("   SKIPPED: {why}"));
                progress.done("skipped");
                reports.push(RunReport::skipped(&s.name, seed, why));
                continue;
            }
        }
        let mut o = opts.clone();
        o.log_dir = opts.log_dir.as_ref().map(|d| d.join(&s.name));
        let r = runner::run(s, &o).await;
        let outcome = if r.passed { "pass" } else { "FAIL" };
        progress.suspend(|| {
            println!(
                "   {outcome} in {:.1} s{}",
                t.elapsed().as_secs_f64(),
                r.log_dir.as_ref().map(|d| format!(" (logs: {d})")).unwrap_or_default()
            );
            print_failures(&r);
        });
        progress.done(outcome);
        reports.push(r);
    }
    reports
}

/// How a suite or soak shows its progress on stderr: a bar on a terminal, plain lines
/// elsewhere, and plain lines under `--verbose` too (its own lines would break a bar).
fn progress_mode(opts: &RunOptions) -> Mode {
    match Mode::detect() {
        Mode::Bar if opts.verbose => Mode::Lines,
        mode => mode,
    }
}

/// Whether `runs` and `targets` make a PASS: at least one run, every run passed (a skipped
/// one only when `allow_skip`), every target met. A skipped scenario fails by default: a
/// suite that could not run part of itself has not shown that part holds.
pub fn verdict(runs: &[RunReport], targets: &[crate::demo::Check], allow_skip: bool) -> bool {
    !runs.is_empty()
        && runs.iter().all(|r| r.passed || (allow_skip && r.skipped.is_some()))
        && targets.iter().all(|c| c.ok)
}

/// Prints a failed run's failed checks and error (nothing for a passing or skipped run).
fn print_failures(r: &RunReport) {
    if r.passed || r.skipped.is_some() {
        return;
    }
    for c in r.checks.iter().filter(|c| !c.ok) {
        println!("   FAILED: {} ({})", c.what, c.detail);
    }
    if let Some(e) = &r.error {
        println!("   ERROR: {e}");
    }
}

/// Runs `scenario` with seeds `seed`, `seed + 1`, ... until `duration` has passed (a run
/// is never started after that) or `max_runs` runs.
///
/// # Cancel safety
/// Cancel safe, as [`run_all`].
pub async fn soak(
    scenario: &Scenario,
    seed: u64,
    duration: Duration,
    max_runs: usize,
    opts: &RunOptions,
) -> Vec<RunReport> {
    let start = Instant::now();
    let progress = Progress::with_mode(format!("soak {}", scenario.name), Total::Time(duration), progress_mode(opts));
    let mut reports = Vec::new();
    let mut kills = 0;
    while start.elapsed() < duration && reports.len() < max_runs {
        let mut o = opts.clone();
        o.seed = Some(seed + reports.len() as u64);
        o.log_dir = opts.log_dir.as_ref().map(|d| d.join(format!("{}-{}", scenario.name, seed + reports.len() as u64)));
        progress.start(format!("run {} (seed {})", reports.len() + 1, seed + reports.len() as u64));
        let r = runner::run(scenario, &o).await;
        kills += r.faults.iter().filter(|f| f.kind == crate::scenario::FaultKind::Kill).count();
        let outcome = if r.passed { "pass" } else { "FAIL" };
        progress.suspend(|| {
            println!(
                "soak run {} (seed {}): {outcome} in {:.1} s, {} faults, {kills} kills so far, {:.0} s elapsed{}",
                reports.len() + 1,
                r.seed,
                r.wall_ms as f64 / 1e3,
                r.faults.len(),
                start.elapsed().as_secs_f64(),
                r.log_dir.as_ref().map(|d| format!(" (logs: {d})")).unwrap_or_default()
            );
            print_failures(&r);
        });
        progress.done(outcome);
        reports.push(r);
    }
    reports
}

/// Prints the table and writes the JSON report to `json` (if given); returns the table.
pub fn publish(command: &str, runs: &[RunReport], targets: &[crate::demo::Check], json: Option<&Path>) -> String {
    let table = report::render(runs, targets);
    println!("\n{table}");
    if let Some(path) = json {
        let doc = report::to_json(command, runs, targets);
        match serde_json::to_string_pretty(&doc) {
            Ok(text) => match std::fs::write(path, text) {
                Ok(()) => println!("JSON report: {}", path.display()),
                Err(e) => eprintln!("cohort-chaos: writing {}: {e}", path.display()),
            },
            Err(e) => eprintln!("cohort-chaos: encoding the report: {e}"),
        }
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::demo::Check;

    fn passed(name: &str) -> RunReport {
        let mut r = RunReport::skipped(name, 1, String::new());
        r.skipped = None;
        r.passed = true;
        r
    }

    #[test]
    fn a_skipped_scenario_fails_the_verdict_unless_skips_are_allowed() {
        let skipped = RunReport::skipped("netns", 3, "network namespaces are unavailable here: not root".into());
        let runs = vec![passed("kills"), skipped];
        assert!(!verdict(&runs, &[], false), "a skip is a failure by default");
        assert!(verdict(&runs, &[], true), "--allow-skip accepts it");
        assert!(verdict(&runs[..1], &[], false));
        assert!(!verdict(&[], &[], true), "no run is no pass");
        let missed = Check { what: "a target".into(), ok: false, detail: String::new() };
        assert!(!verdict(&runs, &[missed], true));
        // A failed run is a failure whatever the flag.
        let mut failed = passed("hang");
        failed.passed = false;
        assert!(!verdict(&[failed], &[], true));
        // The summary names the skipped scenario and why.
        let table = crate::report::render(&runs, &[]);
        assert!(table.contains("SKIPPED netns: network namespaces are unavailable here: not root"), "{table}");
    }
}
