//! Nothing accumulates in the store: many jobs run to their end on one replica, and then the
//! store holds one `ended` record per job and nothing else (no member, waiting, progress,
//! timeout or generation key), and after the configured `ended_ttl` not even those. On the
//! memory store and on a real etcd.

mod common;

use cohort_coordinator::keys;
use common::*;
use std::time::{Duration, Instant};

/// Jobs run one after the other; each has two members that form a generation, commit, and
/// leave finished.
const JOBS: usize = 25;

async fn run(backend: Backend) {
    bounded(async {
        let backing = Backing::new(backend).await;
        let mut options = Options::new(test_settings(backend));
        options.ended_ttl = Duration::from_secs(1);
        let server = replica(backing.store.clone(), &options).await;
        let addr = server.local_addr();
        let keys_under = |prefix: String| {
            let store = backing.store.clone();
            async move {
                let (kvs, _) = store.get_prefix(&prefix).await.expect("read the store");
                kvs.into_iter().map(|kv| kv.key).collect::<Vec<_>>()
            }
        };
        for i in 0..JOBS {
            let job = format!("job-{i}");
            let workers = Worker::join_many(addr, &job, 2, Duration::from_millis(100)).await;
            let g = form_all(&workers, 0).await.remove(0);
            for w in &workers {
                w.commit(g.number, 1).await.expect("commit");
            }
            for w in &workers {
                w.leave(true).await.expect("leave finished");
            }
            // The job has ended: its `ended` record is all that is left of it.
            assert_eq!(keys_under(keys::job_prefix(&job)).await, vec![keys::ended(&job)], "{job}");
        }
        // The records expire with their lease: poll the store (bounded), nothing else to wait on.
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let left = keys_under(keys::JOBS.to_string()).await;
            if left.is_empty() {
                break;
            }
            assert!(Instant::now() < deadline, "keys still there 15 s after a 1 s ended_ttl: {left:?}");
            tokio::time::sleep(Duration::from_millis(100)).await; // polling the store, not synchronisation
        }
        server.shutdown().await.expect("shutdown");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ended_jobs_leave_nothing_behind_memory() {
    run(Backend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ended_jobs_leave_nothing_behind_etcd() {
    run(Backend::Etcd).await;
}
