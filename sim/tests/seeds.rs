//! The control-plane simulation in the test command: a fixed set of seeds must hold every
//! invariant, and a bug fixed in the past, re-introduced, must be caught.

use cohort_sim::{run_seed, CascadeScope, FaultMix, Options};

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
    let buggy = Options { cascade_scope: CascadeScope::Replica, mix: FaultMix::SilentLinks };
    let fixed = Options { cascade_scope: CascadeScope::Store, mix: FaultMix::SilentLinks };
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
