//! What one seed draws: the cluster's shape, the network's latency, and the fault schedule.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::fmt;

/// One fault, applied at `at_ms` and undone (where it can be) after `for_ms`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// A replica's process dies; it restarts after the fault's time.
    ReplicaCrash(usize),
    /// A replica cannot reach the store (its requests fail as unavailable).
    StoreOutage(usize),
    /// The network between a worker and a replica drops everything, both ways.
    PartitionWorkerReplica(usize, usize),
    /// A worker cannot reach any replica.
    IsolateWorker(usize),
    /// The data-plane link from the first worker to the second goes silent (as a stuck TCP
    /// connection does; control traffic still flows).
    SilentLink(usize, usize),
    /// A worker's process dies; it restarts (a new incarnation) after the fault's time.
    WorkerCrash(usize),
    /// A worker stops, as under SIGSTOP, and resumes after the fault's time.
    WorkerPause(usize),
    /// One worker hangs (stops, as under SIGSTOP) while the other workers of its host run on
    /// and beat, so that a host's shared lease stays alive; it resumes after the fault's time.
    /// Its connections stay open: what it is sent waits for it.
    WorkerHang(usize),
    /// Every replica's wall clock jumps by this many milliseconds (and back afterwards).
    ClockJump(i64),
    /// Messages take up to this many milliseconds (instead of the seed's usual).
    LatencySpike(u64),
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::ReplicaCrash(r) => write!(f, "crash replica-{r}"),
            Fault::StoreOutage(r) => write!(f, "store outage for replica-{r}"),
            Fault::PartitionWorkerReplica(w, r) => write!(f, "partition worker-{w} | replica-{r}"),
            Fault::IsolateWorker(w) => write!(f, "isolate worker-{w} from every replica"),
            Fault::SilentLink(a, b) => write!(f, "data link worker-{a} -> worker-{b} goes silent"),
            Fault::WorkerCrash(w) => write!(f, "crash worker-{w}"),
            Fault::WorkerPause(w) => write!(f, "pause worker-{w} (SIGSTOP)"),
            Fault::WorkerHang(w) => write!(f, "hang worker-{w} alone (its host-mates run on)"),
            Fault::ClockJump(ms) => write!(f, "replicas' wall clocks jump {ms:+} ms"),
            Fault::LatencySpike(ms) => write!(f, "message latency up to {ms} ms"),
        }
    }
}

/// A scheduled fault.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scheduled {
    /// When it starts (simulated milliseconds).
    pub at_ms: u64,
    /// How long it lasts.
    pub for_ms: u64,
    /// What it is.
    pub fault: Fault,
}

/// Which faults a run draws from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FaultMix {
    /// Every kind.
    #[default]
    All,
    /// Only silent data-plane links (timeout cascades), with workers spread over three
    /// replicas: what the cascade regression needs.
    SilentLinks,
    /// Only single workers hanging on hosts whose other workers run on
    /// ([`Fault::WorkerHang`]): what the leader's sweep of members silent under a host's
    /// shared lease needs.
    HungRanks,
}

/// Everything a seed decides before the run.
#[derive(Clone, Debug)]
pub struct Scenario {
    /// Coordinator replicas.
    pub replicas: usize,
    /// Workers.
    pub workers: usize,
    /// The job's `min_workers`.
    pub min_workers: u32,
    /// Largest message latency (the smallest is 0).
    pub max_latency_ms: u64,
    /// Largest store latency.
    pub store_latency_ms: u64,
    /// The faults, in time order.
    pub faults: Vec<Scheduled>,
    /// When the surviving workers are asked to finish.
    pub finish_at_ms: u64,
    /// If set: at this time workers are crashed for good until fewer than `min_workers`
    /// remain, and the job must then fail on every survivor.
    pub shrink_at_ms: Option<u64>,
}

/// When the first fault may start: the job has formed by then.
const FIRST_FAULT_MS: u64 = 6_000;
/// Faults start before this.
const LAST_FAULT_MS: u64 = 45_000;
/// The quiet time after the last fault ends before workers finish.
const SETTLE_MS: u64 = 25_000;

impl Scenario {
    /// The scenario of `seed`, with `workers` workers if given (at least 2) instead of the
    /// seed's own draw; the rest of the draw is the same either way.
    pub fn draw(seed: u64, mix: FaultMix, workers: Option<usize>) -> Scenario {
        let mut rng = StdRng::seed_from_u64(seed);
        let (replicas, drawn) = match mix {
            FaultMix::All => (rng.random_range(2..=3), rng.random_range(3..=5)),
            FaultMix::SilentLinks => (3, rng.random_range(4..=5)),
            FaultMix::HungRanks => (2, rng.random_range(4..=6)),
        };
        let workers = workers.map_or(drawn, |n| n.max(2));
        let max_latency_ms = *[1u64, 5, 20].get(rng.random_range(0..3)).unwrap_or(&1);
        let store_latency_ms = *[0u64, 4, 30].get(rng.random_range(0..3)).unwrap_or(&0);
        let mut faults = Vec::new();
        let mut t = FIRST_FAULT_MS;
        loop {
            t += rng.random_range(500..6_000);
            if t >= LAST_FAULT_MS {
                break;
            }
            let for_ms = rng.random_range(300..6_000);
            let fault = match mix {
                FaultMix::SilentLinks => {
                    let a = rng.random_range(0..workers);
                    let b = (a + rng.random_range(1..workers)) % workers;
                    Fault::SilentLink(a, b)
                }
                FaultMix::HungRanks => Fault::WorkerHang(rng.random_range(0..workers)),
                FaultMix::All => match rng.random_range(0..9) {
                    0 => Fault::ReplicaCrash(rng.random_range(0..replicas)),
                    1 => Fault::StoreOutage(rng.random_range(0..replicas)),
                    2 => Fault::PartitionWorkerReplica(rng.random_range(0..workers), rng.random_range(0..replicas)),
                    3 => Fault::IsolateWorker(rng.random_range(0..workers)),
                    4 => {
                        let a = rng.random_range(0..workers);
                        Fault::SilentLink(a, (a + rng.random_range(1..workers)) % workers)
                    }
                    5 => Fault::WorkerCrash(rng.random_range(0..workers)),
                    6 => Fault::WorkerPause(rng.random_range(0..workers)),
                    7 => Fault::ClockJump(rng.random_range(-500..=500)),
                    _ => Fault::LatencySpike(rng.random_range(50..=400)),
                },
            };
            faults.push(Scheduled { at_ms: t, for_ms, fault });
            t += for_ms;
        }
        let quiet_from = faults.last().map_or(FIRST_FAULT_MS, |f| f.at_ms + f.for_ms);
        let finish_at_ms = quiet_from.max(LAST_FAULT_MS) + SETTLE_MS;
        let shrink_at_ms = (mix == FaultMix::All && rng.random_range(0..4) == 0).then(|| finish_at_ms - 20_000);
        Scenario {
            replicas,
            workers,
            min_workers: 2,
            max_latency_ms,
            store_latency_ms,
            faults,
            finish_at_ms,
            shrink_at_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workers_named(fault: &Fault) -> Vec<usize> {
        match *fault {
            Fault::PartitionWorkerReplica(w, _)
            | Fault::IsolateWorker(w)
            | Fault::WorkerCrash(w)
            | Fault::WorkerPause(w)
            | Fault::WorkerHang(w) => {
                vec![w]
            }
            Fault::SilentLink(a, b) => vec![a, b],
            Fault::ReplicaCrash(_) | Fault::StoreOutage(_) | Fault::ClockJump(_) | Fault::LatencySpike(_) => vec![],
        }
    }

    #[test]
    fn a_worker_count_override_keeps_the_rest_of_the_draw_and_spreads_the_faults() {
        let mut spread = std::collections::BTreeSet::new();
        for seed in 0..40 {
            let own = Scenario::draw(seed, FaultMix::All, None);
            let wide = Scenario::draw(seed, FaultMix::All, Some(512));
            assert!((3..=5).contains(&own.workers), "seed {seed}: {} workers", own.workers);
            assert_eq!(wide.workers, 512);
            assert_eq!(
                (wide.replicas, wide.max_latency_ms, wide.store_latency_ms),
                (own.replicas, own.max_latency_ms, own.store_latency_ms)
            );
            assert_eq!(wide.faults.len(), own.faults.len(), "seed {seed}: the fault schedule's length is the seed's");
            for f in &wide.faults {
                for w in workers_named(&f.fault) {
                    assert!(w < 512, "seed {seed}: {} names a worker out of range", f.fault);
                    spread.insert(w);
                }
            }
        }
        assert!(spread.iter().any(|&w| w >= 5), "faults only ever hit the first five workers: {spread:?}");
        assert_eq!(Scenario::draw(7, FaultMix::All, Some(1)).workers, 2, "a job needs two workers");
    }
}
