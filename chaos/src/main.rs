//! `cohort-chaos`: local elastic clusters with faults injected, and the demo.

use clap::{Parser, Subcommand};
use cohort_chaos::runner::RunOptions;
use cohort_chaos::suite;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "cohort-chaos", version, about = "cohort chaos harness: local clusters, faults, invariants")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// A local elastic job on the embedded coordinator: one rank SIGKILLed mid-allreduce,
    /// the survivors re-form, a new worker joins; every step verified.
    Demo {
        /// Initial number of workers.
        #[arg(long, default_value_t = 4)]
        workers: u32,
        /// Total steps of the job.
        #[arg(long, default_value_t = 120)]
        steps: u64,
        /// Gradient size per step (bytes, K/M suffixes).
        #[arg(long, default_value = "16M")]
        size: String,
        /// Keep the logs in this directory.
        #[arg(long)]
        log_dir: Option<std::path::PathBuf>,
    },
    /// Play one scenario (a TOML file, or a name in chaos/scenarios/) and check every invariant.
    Run {
        /// Scenario file or name.
        scenario: String,
        /// Seed of every random choice (default: the scenario's).
        #[arg(long)]
        seed: Option<u64>,
        #[command(flatten)]
        common: Common,
    },
    /// Play every scenario (or, with --quick, the quick ones) and report.
    Suite {
        /// Only the scenarios marked `quick = true` (a few minutes; what CI runs).
        #[arg(long)]
        quick: bool,
        /// Override every scenario's seed.
        #[arg(long)]
        seed: Option<u64>,
        #[command(flatten)]
        common: Common,
    },
    /// Replay a scenario (default `soak`: SIGKILLs of random ranks mid-allreduce) with fresh
    /// seeds for a while; report the figures against the targets.
    Soak {
        /// How long to keep starting runs (e.g. 10m, 600s).
        #[arg(long, value_parser = cohort_chaos::scenario::parse_duration, default_value = "10m")]
        duration: std::time::Duration,
        /// Scenario file or name.
        #[arg(long, default_value = "soak")]
        scenario: String,
        /// Seed of the first run (then +1 per run).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// At most this many runs.
        #[arg(long, default_value_t = 10_000)]
        max_runs: usize,
        #[command(flatten)]
        common: Common,
    },
}

#[derive(clap::Args, Clone)]
struct Common {
    /// Directory of the scenarios.
    #[arg(long)]
    scenarios: Option<PathBuf>,
    /// Keep every run's logs here (default: a temp dir per run, removed when it passes).
    #[arg(long)]
    log_dir: Option<PathBuf>,
    /// Keep the logs of passing runs too.
    #[arg(long)]
    keep_logs: bool,
    /// Write the JSON report here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Print each run's progress.
    #[arg(long, short)]
    verbose: bool,
    /// Accept skipped scenarios (network namespaces need root): without it a skip fails the
    /// verdict. Each skip's reason is printed in the summary either way.
    #[arg(long)]
    allow_skip: bool,
}

impl Common {
    fn options(&self, seed: Option<u64>) -> RunOptions {
        RunOptions { seed, log_dir: self.log_dir.clone(), keep_logs: self.keep_logs, verbose: self.verbose }
    }
    fn dir(&self) -> PathBuf {
        self.scenarios.clone().unwrap_or_else(suite::default_dir)
    }
}

/// Runs `fut` unless SIGINT or SIGTERM comes first; then it is dropped, which kills every
/// process it started, and the exit code is 130.
async fn interruptible(fut: impl std::future::Future<Output = ExitCode>) -> ExitCode {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("cohort-chaos: installing the SIGTERM handler: {e}");
            return ExitCode::FAILURE;
        }
    };
    tokio::select! {
        code = fut => code,
        _ = tokio::signal::ctrl_c() => {
            eprintln!("cohort-chaos: interrupted; every process of the run is killed");
            ExitCode::from(130)
        }
        _ = term.recv() => {
            eprintln!("cohort-chaos: terminated; every process of the run is killed");
            ExitCode::from(143)
        }
    }
}

fn verdict(
    runs: &[cohort_chaos::report::RunReport],
    targets: &[cohort_chaos::demo::Check],
    allow_skip: bool,
) -> ExitCode {
    let skipped = runs.iter().filter(|r| r.skipped.is_some()).count();
    if suite::verdict(runs, targets, allow_skip) {
        println!(
            "PASS{}",
            if skipped > 0 { format!(" ({skipped} skipped, allowed by --allow-skip)") } else { String::new() }
        );
        ExitCode::SUCCESS
    } else {
        if skipped > 0 && !allow_skip {
            println!("{skipped} scenario(s) skipped: a skip fails the verdict (--allow-skip accepts skips)");
        }
        println!("FAIL");
        ExitCode::FAILURE
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cohort-chaos: {e}");
            return ExitCode::FAILURE;
        }
    };
    match cli.command {
        Cmd::Demo { workers, steps, size, log_dir } => {
            let config =
                cohort_chaos::demo::DemoConfig { workers: workers.max(2), steps, size, log_dir, ..Default::default() };
            runtime.block_on(interruptible(async {
                match cohort_chaos::demo::run(config).await {
                    Ok(checks) if cohort_chaos::demo::print_verdict(&checks) => ExitCode::SUCCESS,
                    Ok(_) => ExitCode::FAILURE,
                    Err(e) => {
                        eprintln!("cohort-chaos demo: {e}");
                        ExitCode::FAILURE
                    }
                }
            }))
        }
        Cmd::Run { scenario, seed, common } => {
            let sc = match suite::resolve(&scenario, &common.dir()) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("cohort-chaos run: {e}");
                    return ExitCode::from(2);
                }
            };
            let opts = common.options(seed);
            runtime.block_on(interruptible(async {
                let mut opts = opts;
                opts.verbose = true;
                let runs = suite::run_all(std::slice::from_ref(&sc), &opts).await;
                suite::publish("run", &runs, &[], common.json.as_deref());
                verdict(&runs, &[], common.allow_skip)
            }))
        }
        Cmd::Suite { quick, seed, common } => {
            let scenarios = match suite::load_dir(&common.dir(), quick) {
                Ok(s) if !s.is_empty() => s,
                Ok(_) => {
                    eprintln!("cohort-chaos suite: no scenarios in {}", common.dir().display());
                    return ExitCode::from(2);
                }
                Err(e) => {
                    eprintln!("cohort-chaos suite: {e}");
                    return ExitCode::from(2);
                }
            };
            let opts = common.options(seed);
            runtime.block_on(interruptible(async {
                let t = std::time::Instant::now();
                let runs = suite::run_all(&scenarios, &opts).await;
                suite::publish(if quick { "suite --quick" } else { "suite" }, &runs, &[], common.json.as_deref());
                println!("suite took {:.1} s", t.elapsed().as_secs_f64());
                verdict(&runs, &[], common.allow_skip)
            }))
        }
        Cmd::Soak { duration, scenario, seed, max_runs, common } => {
            let sc = match suite::resolve(&scenario, &common.dir()) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("cohort-chaos soak: {e}");
                    return ExitCode::from(2);
                }
            };
            let opts = common.options(None);
            runtime.block_on(interruptible(async {
                let runs = suite::soak(&sc, seed, duration, max_runs.max(1), &opts).await;
                let targets = cohort_chaos::report::soak_targets(&runs);
                suite::publish(
                    &format!("soak --duration {}s --seed {seed}", duration.as_secs()),
                    &runs,
                    &targets,
                    common.json.as_deref(),
                );
                verdict(&runs, &targets, common.allow_skip)
            }))
        }
    }
}
