//! `cohort-chaos`: local elastic clusters with faults injected, and the demo.

use clap::{Parser, Subcommand};
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
            let config = cohort_chaos::demo::DemoConfig { workers: workers.max(2), steps, size, log_dir, ..Default::default() };
            match runtime.block_on(cohort_chaos::demo::run(config)) {
                Ok(checks) => {
                    if cohort_chaos::demo::print_verdict(&checks) {
                        ExitCode::SUCCESS
                    } else {
                        ExitCode::FAILURE
                    }
                }
                Err(e) => {
                    eprintln!("cohort-chaos demo: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
