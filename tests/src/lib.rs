//! Shared helpers of the multi-process integration tests (`tests/tests/*.rs`).
//!
//! The tests start real `cohort-coordinator` and `cohort-worker` processes through the
//! chaos crate's launcher (`cohort_chaos::cluster::Cluster`), on the memory store and on a
//! real etcd that the launcher starts on a free loopback port.

use cohort_chaos::cluster::{ClusterConfig, JobSettings, StoreKind, WorkerSpec};
use cohort_chaos::events::{EventBody, WorkerEvent};
use std::time::Duration;

/// A cluster configuration with short timers for tests.
pub fn test_cluster(job: &str, store: StoreKind, min_workers: u32) -> ClusterConfig {
    ClusterConfig {
        job: job.into(),
        store,
        coordinators: 1,
        settings: JobSettings {
            min_workers,
            max_workers: 8,
            join_window: Duration::from_millis(300),
            heartbeat_interval: Duration::from_millis(200),
            lease_ttl: Duration::from_secs(2),
            elastic_timeout: Duration::from_secs(4),
            ..Default::default()
        },
        log_dir: None,
        exclusion: None,
        metrics: false,
    }
}

/// A worker spec for tests: `steps` steps of `size` with a short pause.
pub fn test_worker(steps: u64, size: &str) -> WorkerSpec {
    WorkerSpec {
        steps,
        size: size.into(),
        step_interval: Duration::from_millis(20),
        no_progress: Duration::from_secs(3),
        fixed_deadlines: false,
        extra_args: Vec::new(),
        command: None,
    }
}

/// The events of `worker` of kind `T` (`of::<Summary>(events, "w1")`).
pub fn of<'a, T: EventBody + 'a>(events: &'a [WorkerEvent], worker: &'a str) -> impl Iterator<Item = &'a T> + 'a {
    events.iter().filter(move |e| e.worker == worker).filter_map(WorkerEvent::get::<T>)
}

/// Panics with the worker logs' tails when `ok` is false.
pub fn check(ok: bool, what: &str, events: &[WorkerEvent]) {
    if !ok {
        fail(what, events);
    }
}

/// Fails the test with `what` and the last events seen.
pub fn fail(what: &str, events: &[WorkerEvent]) -> ! {
    let tail: Vec<String> = events.iter().rev().take(40).rev().map(|e| format!("{} {}", e.worker, e.event)).collect();
    panic!("{what}\nlast events:\n{}", tail.join("\n"));
}
