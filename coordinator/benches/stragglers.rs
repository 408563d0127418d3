//! What the straggler judgement costs the coordinator per heartbeat, at 1,024 to 16,384
//! members (issue 30): every member sends its step timing with each heartbeat, and each one
//! is judged against the others' latest.
//!
//! - `per_report`: the judgement as it ran at every timed heartbeat until the round was
//!   indexed: gather the round (a copy of every member's report) and [`judge`] the member.
//! - `indexed`: [`Round::new`] once (what a large job pays once per heartbeat interval) and
//!   [`Round::judge`] per heartbeat.
//!
//! Each line gives the median of `runs` timings in microseconds and, from them, the
//! coordinator CPU one heartbeat round (every member reporting once) costs:
//!
//! ```text
//! bench=stragglers members=16384 per_report_us=.. round_new_us=.. indexed_judge_us=.. heartbeat_round_cpu_ms_before=.. heartbeat_round_cpu_ms_after=..
//! ```
//!
//! Run it with `cargo bench -p cohort-coordinator --bench stragglers`. Without `--bench`
//! (`cargo test --benches`) it runs 64 members once, as a smoke test that both paths agree.

use cohort_coordinator::stragglers::{judge, Round, StragglerRule, Timing};
use std::hint::black_box;
use std::time::Instant;

/// A ring job's reports: every member waits on its left neighbour; member 7 computes 3x.
fn reports(members: u32) -> Vec<Timing> {
    (0..members)
        .map(|rank| {
            let jitter = u64::from(rank.wrapping_mul(2_654_435_761) % 1_000);
            let compute_us = if rank == 7 { 30_000 } else { 10_000 + jitter };
            Timing {
                generation: 1,
                rank,
                steps: 20,
                compute_us,
                collective_us: 20_000 - jitter,
                peer_waits: vec![((rank + members - 1) % members, 500 + jitter), ((rank + 1) % members, 400 + jitter)],
            }
        })
        .collect()
}

fn median_us(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (sizes, runs): (&[u32], usize) = if full { (&[1_024, 4_096, 16_384], 15) } else { (&[64], 1) };
    let rule = StragglerRule::default();
    for &members in sizes {
        let all = reports(members);
        // Judge a spread of members (the straggler among them) with a fresh report.
        let suspects: Vec<Timing> = (0..members)
            .step_by((members / 32).max(1) as usize)
            .chain([7])
            .map(|r| {
                let mut fresh = all[r as usize].clone();
                fresh.steps = 21;
                fresh
            })
            .collect();
        let (mut per_report, mut round_new, mut indexed) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..runs {
            let started = Instant::now();
            let mut verdicts = Vec::new();
            for own in &suspects {
                let mut round: Vec<Timing> = all.iter().filter(|t| t.rank != own.rank).cloned().collect();
                round.push(own.clone());
                verdicts.push(judge(&rule, own.rank, black_box(&round)));
            }
            per_report.push(started.elapsed().as_secs_f64() * 1e6 / suspects.len() as f64);

            let started = Instant::now();
            let round = Round::new(1, black_box(all.clone()));
            round_new.push(started.elapsed().as_secs_f64() * 1e6);

            let started = Instant::now();
            let fast: Vec<_> = suspects.iter().map(|own| round.judge(&rule, black_box(own))).collect();
            indexed.push(started.elapsed().as_secs_f64() * 1e6 / suspects.len() as f64);
            assert_eq!(fast, verdicts, "the indexed round disagrees with judge at {members} members");
            assert!(fast.last().is_some_and(|v| v.is_some()), "the 3x member was not found slow");
        }
        let (p, n, i) = (median_us(per_report), median_us(round_new), median_us(indexed));
        let before_ms = p * f64::from(members) / 1e3;
        let after_ms = (n + i * f64::from(members)) / 1e3;
        println!(
            "bench=stragglers members={members} runs={runs} per_report_us={p:.1} round_new_us={n:.1} indexed_judge_us={i:.2} \
             heartbeat_round_cpu_ms_before={before_ms:.1} heartbeat_round_cpu_ms_after={after_ms:.2}"
        );
    }
}
