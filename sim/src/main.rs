//! `cohort-sim`: replay one seed of the control-plane simulation, or explore many.

use clap::{Parser, Subcommand};
use cohort_coordinator::config::LeaseScope;
use cohort_sim::{run_seed, CascadeScope, FaultMix, Options};
use std::process::ExitCode;
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(about = "Deterministic simulation of cohort's control plane (see docs/testing.md)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Runs one seed; prints its trace, its hash and the invariants it broke.
    Replay {
        /// The seed.
        #[arg(long)]
        seed: u64,
        /// Judge timeout cascades per replica (the bug fixed in d99aa8c), to see it caught.
        #[arg(long)]
        per_replica_cascades: bool,
        /// Draw only silent data links (timeout cascades).
        #[arg(long)]
        silent_links_only: bool,
        /// Draw only single workers hanging while their host-mates run on (with
        /// --workers-per-host 2 or more and --lease-scope host: the sweep of shared leases).
        #[arg(long, conflicts_with = "silent_links_only")]
        hung_ranks_only: bool,
        /// Run this many workers instead of the seed's 3 to 5 (the scale runs).
        #[arg(long)]
        workers: Option<usize>,
        /// The simulated clock's step in ms (default 1; the scale runs take 5).
        #[arg(long)]
        tick_ms: Option<u64>,
        /// Workers per simulated host, their failure domain (default 1; the scale runs take 8).
        #[arg(long)]
        workers_per_host: Option<usize>,
        /// Whose store lease a member's records are on: member (default) or host.
        #[arg(long, value_parser = LeaseScope::parse, default_value = "member")]
        lease_scope: LeaseScope,
        /// The job's whole_answer_up_to (default 256): larger generations are sparse views.
        #[arg(long)]
        whole_answer_up_to: Option<u32>,
        /// Plant the wrong-partner bug in the replicas' sparse answers, to see it caught.
        #[arg(long)]
        wrong_partner: bool,
        /// Plant the stale-beat-writes bug in the replicas' progress writes, to see it caught.
        #[arg(long)]
        stale_beat_writes: bool,
        /// Plant the never-bypassed bug in the heartbeat relay, to see it caught.
        #[arg(long)]
        relay_never_bypassed: bool,
        /// Plant the same-ranks bug in the decision which links are carried over, to see it
        /// caught.
        #[arg(long)]
        carry_same_ranks: bool,
    },
    /// Runs seeds from --first on until the duration is spent; reports the failing seeds.
    Explore {
        /// How long to run, e.g. 90s, 10m, 1h.
        #[arg(long, value_parser = parse_duration)]
        duration: Duration,
        /// The first seed.
        #[arg(long, default_value_t = 0)]
        first: u64,
        /// Run this many workers instead of each seed's 3 to 5.
        #[arg(long)]
        workers: Option<usize>,
        /// The simulated clock's step in ms (default 1).
        #[arg(long)]
        tick_ms: Option<u64>,
        /// Workers per simulated host (default 1).
        #[arg(long)]
        workers_per_host: Option<usize>,
        /// Whose store lease a member's records are on: member (default) or host.
        #[arg(long, value_parser = LeaseScope::parse, default_value = "member")]
        lease_scope: LeaseScope,
        /// The job's whole_answer_up_to (default 256): larger generations are sparse views.
        #[arg(long)]
        whole_answer_up_to: Option<u32>,
    },
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let (number, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = number.parse().map_err(|_| format!("{s:?} is not a duration like 90s, 10m, 1h"))?;
    match unit {
        "" | "s" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        "h" => Ok(Duration::from_secs(n * 3600)),
        _ => Err(format!("{s:?}: the unit is s, m or h")),
    }
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Replay {
            seed,
            per_replica_cascades,
            silent_links_only,
            hung_ranks_only,
            workers,
            tick_ms,
            workers_per_host,
            lease_scope,
            whole_answer_up_to,
            wrong_partner,
            stale_beat_writes,
            relay_never_bypassed,
            carry_same_ranks,
        } => {
            let options = Options {
                cascade_scope: if per_replica_cascades { CascadeScope::Replica } else { CascadeScope::Store },
                mix: match (silent_links_only, hung_ranks_only) {
                    (true, _) => FaultMix::SilentLinks,
                    (_, true) => FaultMix::HungRanks,
                    _ => FaultMix::All,
                },
                workers,
                tick_ms,
                workers_per_host,
                lease_scope,
                whole_answer_up_to,
                wrong_partner,
                stale_beat_writes,
                relay_never_bypassed,
                carry_same_ranks,
            };
            let report = run_seed(seed, &options);
            for line in &report.lines {
                println!("{line}");
            }
            println!("seed {seed}: {} faults, trace hash {:016x}", report.faults, report.hash);
            if report.violations.is_empty() {
                println!("every invariant held");
                ExitCode::SUCCESS
            } else {
                for v in &report.violations {
                    println!("VIOLATION {v}");
                }
                ExitCode::FAILURE
            }
        }
        Command::Explore { duration, first, workers, tick_ms, workers_per_host, lease_scope, whole_answer_up_to } => {
            let options =
                Options { workers, tick_ms, workers_per_host, lease_scope, whole_answer_up_to, ..Options::default() };
            let started = Instant::now();
            let (mut seeds, mut faults, mut failing) = (0u64, 0usize, Vec::new());
            let mut seed = first;
            while started.elapsed() < duration {
                let report = run_seed(seed, &options);
                seeds += 1;
                faults += report.faults;
                if !report.violations.is_empty() {
                    println!("seed {seed} FAILED ({} violations): {}", report.violations.len(), report.violations[0]);
                    failing.push(seed);
                }
                seed += 1;
            }
            println!(
                "explored seeds {first}..{seed} ({seeds} seeds) in {:.0?}: {faults} faults injected, {} failing seeds {failing:?}",
                started.elapsed(),
                failing.len()
            );
            if failing.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
    }
}
