//! The control-plane simulation in the test command: a fixed set of seeds must hold every
//! invariant, and a bug fixed in the past, re-introduced, must be caught.

use cohort_sim::{run_seed, CascadeScope, FaultMix, Options};
use std::collections::{BTreeMap, BTreeSet};

/// Seeds run by the test command (about 1.5 s each on a debug build).
const SEEDS: u64 = 24;

#[test]
fn fixed_seeds_hold_every_invariant() {
    let mut faults = 0;
    for seed in 0..SEEDS {
        let report = run_seed(seed, &Options::default());
        assert!(
            report.violations.is_empty(),
            "seed {seed} broke invariants: {:#?}\nreplay it: cargo run -p cohort-sim --release -- replay --seed {seed}",
            report.violations
        );
        assert!(report.lines.len() > 20, "seed {seed} traced almost nothing: {:?}", report.lines);
        faults += report.faults;
    }
    assert!(faults >= SEEDS as usize * 3, "only {faults} faults over {SEEDS} seeds");
}

/// Before commit d99aa8c each replica judged the timeout reports it received alone, so a
/// cascade split between replicas could blame (and evict) a healthy rank. With that
/// behaviour restored, silent data links must make some seed evict a healthy worker; the
/// same seeds pass with the fix.
#[test]
fn judging_a_timeout_cascade_per_replica_is_caught() {
    let seeds = 0..8u64;
    let buggy = Options {
        cascade_scope: CascadeScope::Replica,
        mix: FaultMix::SilentLinks,
        workers: None,
        tick_ms: None,
        workers_per_host: None,
        lease_scope: Default::default(),
        ..Options::default()
    };
    let fixed = Options {
        cascade_scope: CascadeScope::Store,
        mix: FaultMix::SilentLinks,
        workers: None,
        tick_ms: None,
        workers_per_host: None,
        lease_scope: Default::default(),
        ..Options::default()
    };
    let caught: Vec<u64> = seeds
        .clone()
        .filter(|&seed| run_seed(seed, &buggy).violations.iter().any(|v| v.contains("healthy worker is never evicted")))
        .collect();
    assert!(!caught.is_empty(), "no seed in {seeds:?} caught cascades judged per replica");
    for seed in caught {
        let report = run_seed(seed, &fixed);
        assert!(report.violations.is_empty(), "seed {seed} fails with the fix too: {:#?}", report.violations);
    }
}

/// One seed, run twice, gives the same trace and hash (the replay command's promise). This
/// needs `--cfg tokio_unstable` (set in .cargo/config.toml): without it tokio's `select!`
/// draws from an unseeded random number, and the interleaving of same-millisecond events can
/// differ between runs.
#[test]
fn a_seed_replays_to_the_same_trace() {
    for seed in [4, 17] {
        let first = run_seed(seed, &Options::default());
        let second = run_seed(seed, &Options::default());
        if first.hash != second.hash {
            let at = first.lines.iter().zip(&second.lines).position(|(a, b)| a != b).unwrap_or(0);
            panic!(
                "seed {seed} ran twice gave hashes {:016x} and {:016x}; first difference at line {at}:\n{:?}\n{:?}\n\
                 (is the build missing --cfg tokio_unstable, e.g. because RUSTFLAGS replaced .cargo/config.toml?)",
                first.hash,
                second.hash,
                first.lines.get(at),
                second.lines.get(at)
            );
        }
        assert_eq!(first.lines, second.lines, "seed {seed}: equal hashes, different traces");
    }
}

/// Under `lease_scope = "host"`, with two workers to a host: each host's workers share one
/// store lease (a host's crash, pause or isolation lapses it whole), incarnations are no lease
/// ids, leaves and evictions delete records instead of revoking, and the failure reports'
/// silences come from the progress records alone. Every invariant still holds.
#[test]
fn seeds_hold_every_invariant_on_hosts_shared_leases() {
    let options = Options {
        workers: Some(6),
        workers_per_host: Some(2),
        lease_scope: cohort_coordinator::config::LeaseScope::Host,
        ..Options::default()
    };
    let mut faults = 0;
    for seed in 0..8 {
        let report = run_seed(seed, &options);
        assert!(
            report.violations.is_empty(),
            "seed {seed} on shared leases broke invariants: {:#?}\nreplay it: cargo run -p cohort-sim --release -- replay --seed {seed} --workers 6 --workers-per-host 2 --lease-scope host",
            report.violations
        );
        faults += report.faults;
    }
    assert!(faults >= 8 * 3, "only {faults} faults over 8 seeds");
}

/// Seed 5160 with 24 workers, 4 to a host, on sparse views and shared leases (found by
/// `cohort-sim explore`, 2026-11-30): a whole host stops (SIGSTOP) while the ring runs, every
/// other rank times out within a millisecond, and one healthy rank's report reaches the
/// coordinator after the cascade's holds. It and the stopped ranks were then all chain ends
/// (waited on, no report), and the first one named was blamed: the healthy rank was evicted.
/// Among several ends the one silent longest is now the root, and every invariant holds.
#[test]
fn a_healthy_rank_late_with_its_report_is_not_blamed_for_a_stopped_host() {
    let options = Options {
        workers: Some(24),
        workers_per_host: Some(4),
        whole_answer_up_to: Some(8),
        lease_scope: cohort_coordinator::config::LeaseScope::Host,
        ..Options::default()
    };
    let report = run_seed(5160, &options);
    assert!(
        report.violations.is_empty(),
        "seed 5160 broke invariants: {:#?}\nreplay it: cargo run -p cohort-sim --release -- replay --seed 5160 --workers 24 --workers-per-host 4 --whole-answer-up-to 8 --lease-scope host",
        report.violations
    );
    assert!(
        report.lines.iter().any(|l| l.contains("domain host-3 lost")),
        "the stopped host is blamed as a whole at least once"
    );
}

/// Under `lease_scope = "host"`, single workers hang (as under SIGSTOP) while their host-mates
/// run on and keep the host's shared lease alive. The hung rank is still found: its peers'
/// timeouts are re-attributed to it, and a rank hung longer than its lease's time to live is
/// swept by the leader (its records deleted under the live lease) and evicted. Every
/// invariant holds, some seed shows a hung worker evicted, and some host's relays (the
/// shipped ones, on the simulation's sockets) pass to a host-mate when their server goes.
#[test]
fn a_rank_hung_on_a_live_host_is_found_and_swept() {
    let options = hung_ranks_on_shared_leases();
    let (mut faults, mut evictions, mut relays_moved) = (0, 0, 0);
    for seed in 0..8 {
        let report = run_seed(seed, &options);
        assert!(
            report.violations.is_empty(),
            "seed {seed} with hung ranks on shared leases broke invariants: {:#?}\nreplay it: cargo run -p cohort-sim --release -- replay --seed {seed} --workers 6 --workers-per-host 2 --lease-scope host --hung-ranks-only",
            report.violations
        );
        faults += report.faults;
        // Nothing else deletes a member's records here: its host's lease never lapses.
        evictions += report.lines.iter().filter(|l| l.contains(" evicted (")).count();
        // The host relays run too: a host-mate serves a relay whose server was swept.
        relays_moved += relay_servers(&report.lines, 2).values().filter(|s| s.len() > 1).count();
    }
    assert!(faults >= 8 * 3, "only {faults} faults over 8 seeds");
    assert!(evictions > 0, "no hung worker was swept in 8 seeds");
    assert!(relays_moved > 0, "no host's relay was ever served by a second worker in 8 seeds");
}

/// A bug planted in the shipped heartbeat relay (a worker whose relay hangs waits for it for
/// an hour instead of beating itself within the next flush and a quarter of an interval) is
/// caught: in seed 3 of the hung-rank runs worker-2 serves its host's relay and hangs, and
/// its healthy host-mate loses its lease. The same seed passes without the bug.
#[test]
fn a_relay_that_is_never_bypassed_is_caught() {
    let options = Options { relay_never_bypassed: true, ..hung_ranks_on_shared_leases() };
    let report = run_seed(3, &options);
    assert!(
        report
            .violations
            .iter()
            .any(|v| v.contains("a healthy worker is never evicted") || v.contains("did not return")),
        "the planted relay bug went unnoticed: {:#?}",
        report.violations
    );
}

/// Hung ranks only, 6 workers 2 to a host, on hosts' shared leases (`replay --workers 6
/// --workers-per-host 2 --lease-scope host --hung-ranks-only`).
fn hung_ranks_on_shared_leases() -> Options {
    Options {
        mix: FaultMix::HungRanks,
        workers: Some(6),
        workers_per_host: Some(2),
        lease_scope: cohort_coordinator::config::LeaseScope::Host,
        ..Options::default()
    }
}

/// The workers of each host (hosts of `per_host` workers) that served its heartbeat relay in
/// a trace, host by host (trace lines read `SECONDS PARTY EVENT...`).
fn relay_servers(lines: &[String], per_host: usize) -> BTreeMap<usize, BTreeSet<usize>> {
    let mut servers: BTreeMap<usize, BTreeSet<usize>> = BTreeMap::new();
    for line in lines.iter().filter(|l| l.ends_with(" serves cohort-heartbeat-relay")) {
        let Some(worker) = line.split_whitespace().nth(1).and_then(|p| p.strip_prefix("worker-")) else { continue };
        let Ok(worker) = worker.parse::<usize>() else { continue };
        servers.entry(worker / per_host).or_default().insert(worker);
    }
    servers
}

/// The bug the host relays found, planted again: before 2026-11-29 each replica wrote a
/// member's progress record as it held it. With a host's relay beating on one replica and the
/// member's commits reaching another, the second wrote its old beat time back once per
/// period, and the leader, looking when that stale mark stood, swept beating members as
/// silent. Seed 3 (hosts of 2, hung ranks, shared leases) evicts a healthy worker with the
/// bug and passes without it (`a_rank_hung_on_a_live_host_is_found_and_swept`).
#[test]
fn a_replica_writing_an_old_beat_time_back_is_caught() {
    let options = Options { stale_beat_writes: true, ..hung_ranks_on_shared_leases() };
    let report = run_seed(3, &options);
    assert!(
        report.violations.iter().any(|v| v.contains("a healthy worker is never evicted")),
        "the planted stale beat writes went unnoticed: {:#?}",
        report.violations
    );
}

/// With several workers to a host (the scale runs' `--workers-per-host`), a host is one
/// failure domain: a crash drawn for one worker restarts every worker of its host and no
/// other, and every invariant still holds.
#[test]
fn a_crash_takes_the_whole_host_of_several_workers() {
    let options = Options { workers: Some(12), workers_per_host: Some(4), ..Options::default() };
    let report = run_seed(3, &options);
    assert!(report.violations.is_empty(), "seed 3 with 4 workers per host: {:#?}", report.violations);
    // Trace lines read `SECONDS PARTY EVENT...`.
    let parsed: Vec<(&str, &str, String)> = report
        .lines
        .iter()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            Some((words.next()?, words.next()?, words.collect::<Vec<_>>().join(" ")))
        })
        .collect();
    let mut restarts = 0;
    for (at, _, event) in parsed.iter().filter(|(_, party, _)| *party == "FAULT") {
        let Some(w) = event.strip_prefix("ends: crash worker-").and_then(|w| w.parse::<usize>().ok()) else { continue };
        let host = w / 4 * 4..w / 4 * 4 + 4;
        let started: Vec<usize> = parsed
            .iter()
            .filter(|(t, _, e)| t == at && e == "process starts")
            .filter_map(|(_, party, _)| party.strip_prefix("worker-")?.parse().ok())
            .collect();
        let mut want: Vec<usize> = host.collect();
        let mut got = started.clone();
        want.sort_unstable();
        got.sort_unstable();
        assert_eq!(got, want, "at {at} s the end of worker-{w}'s crash restarted {started:?}");
        restarts += 1;
    }
    assert!(restarts >= 1, "seed 3 drew no worker crash to check: {:#?}", report.lines);
}

/// Generations above the job's `whole_answer_up_to` (4 here, with 16 workers on hosts of
/// their own) are answered as sparse views, which the shipped worker completes (its ring
/// predecessor resolved on first use when its view lacks it). Every view agrees with every
/// other and with where the ranks run, links carried into the next generation (the shipped
/// decision, `PreviousView`) reach the process the new view names, and every invariant holds
/// through the seed's faults.
#[test]
fn sparse_views_hold_every_invariant() {
    let options = Options { workers: Some(16), whole_answer_up_to: Some(4), ..Options::default() };
    let (mut faults, mut sparse, mut carried) = (0, 0, 0);
    for seed in 0..6 {
        let report = run_seed(seed, &options);
        assert!(
            report.violations.is_empty(),
            "seed {seed} on sparse views broke invariants: {:#?}\nreplay it: cargo run -p cohort-sim -- replay --seed {seed} --workers 16 --whole-answer-up-to 4",
            report.violations
        );
        faults += report.faults;
        sparse += report.lines.iter().filter(|l| knows_fewer_than_all(l)).count();
        carried +=
            report.lines.iter().filter(|l| knows_fewer_than_all(l) && l.contains("its link carried from")).count();
    }
    assert!(faults >= 6 * 3, "only {faults} faults over 6 seeds");
    assert!(sparse > 0, "no worker was given a sparse view");
    assert!(carried > 0, "no link was carried into a sparse generation");
}

/// A bug planted in the shipped decision which links are carried into the next generation
/// (the old link at the same rank number, as if ranks never moved after a failure) is caught:
/// a carried link reaches another process than the one the new view names at that rank. The
/// same seed passes without it (`sparse_views_hold_every_invariant`).
#[test]
fn a_link_carried_to_the_wrong_rank_is_caught() {
    let options =
        Options { workers: Some(16), whole_answer_up_to: Some(4), carry_same_ranks: true, ..Options::default() };
    let report = run_seed(1, &options);
    assert!(
        report.violations.iter().any(|v| v.contains("link carried into generation")),
        "the planted carry bug went unnoticed: {:#?}",
        report.violations
    );
}

/// Whether a trace line says a worker connected a generation knowing only part of it:
/// `generation G: rank R of N (knows K), ...` with K < N.
fn knows_fewer_than_all(line: &str) -> bool {
    let Some((_, rest)) = line.split_once(" of ") else { return false };
    let Some((size, rest)) = rest.split_once(" (knows ") else { return false };
    let Some((known, _)) = rest.split_once(')') else { return false };
    matches!((size.parse::<u32>(), known.parse::<u32>()), (Ok(n), Ok(k)) if k < n)
}

/// A bug planted in the replicas' sparse answers (each partner's entry is the next rank's
/// member, relabelled) is caught: views disagree on who runs a rank, and a rank's ring
/// predecessor is another process than its view names. The same seed passes without it
/// (`sparse_views_hold_every_invariant`).
#[test]
fn a_wrong_partner_in_sparse_answers_is_caught() {
    let options = Options { workers: Some(16), whole_answer_up_to: Some(4), wrong_partner: true, ..Options::default() };
    let report = run_seed(0, &options);
    assert!(
        report.violations.iter().any(|v| v.contains("two members at rank")
            || v.contains("'s view of generation")
            || v.contains("link carried into generation")),
        "the planted wrong partner went unnoticed: {:#?}",
        report.violations
    );
}

/// The shipped worker at scale: 1,024 workers (hosts of 8, the simulated clock in 5 ms
/// steps) at the default `whole_answer_up_to` (256), so every generation of the job is
/// answered as sparse views; the seed's faults (pauses, isolations, partitions, crashes,
/// replica crashes, store outages) are drawn among them, links are carried into each next
/// generation (5,084 of the seed's 6,137 connections), and every invariant holds. A longer
/// run: `cohort-sim explore --workers 1024 --workers-per-host 8 --tick-ms 5 --duration 1h`
/// (docs/testing.md).
#[test]
fn a_thousand_workers_on_sparse_views_hold_every_invariant() {
    let options = Options { workers: Some(1024), workers_per_host: Some(8), tick_ms: Some(5), ..Options::default() };
    let report = run_seed(1, &options);
    assert!(
        report.violations.is_empty(),
        "seed 1 with 1,024 workers broke invariants: {:#?}\nreplay it: cargo run -p cohort-sim --release -- replay --seed 1 --workers 1024 --workers-per-host 8 --tick-ms 5",
        report.violations
    );
    assert!(report.faults >= 10, "only {} faults", report.faults);
    let sparse = report.lines.iter().filter(|l| knows_fewer_than_all(l)).count();
    assert!(sparse >= 1024, "only {sparse} connections on sparse views");
    let carried =
        report.lines.iter().filter(|l| knows_fewer_than_all(l) && l.contains("its link carried from")).count();
    assert!(carried >= 1024, "only {carried} connections carried their link over");
}
