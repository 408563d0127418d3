//! Nothing accumulates in the store: many jobs run to their end on one replica, and then the
//! store holds one `ended` record per job and nothing else (no member, waiting, progress,
//! timeout or generation key), and after the configured `ended_ttl` not even those. Nor in
//! the replica's metrics: an ended job's series are gone. On the memory store and on a real
//! etcd.

mod common;

use cohort_coordinator::exclusion::ExclusionPolicy;
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
            // Different digests: the replica counts a mismatch, a metric series of the job.
            for (i, w) in workers.iter().enumerate() {
                w.commit_digest(g.number, 1, vec![i as u8; 32]).await.expect("commit");
            }
            assert!(scrape(&server).await.contains(&format!("cohort_digest_mismatches_total{{job=\"{job}\"}} 1")));
            for w in &workers {
                w.leave(true).await.expect("leave finished");
            }
            // The job has ended: its `ended` record is all that is left of it, and no metric
            // series of it is left on the replica.
            assert_eq!(keys_under(keys::job_prefix(&job)).await, vec![keys::ended(&job)], "{job}");
            // The leader may have been evaluating the job as it ended: poll, bounded.
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let text = scrape(&server).await;
                if !text.contains(&format!("job=\"{job}\"")) {
                    break;
                }
                assert!(Instant::now() < deadline, "{job} ended 10 s ago, its series are still there:\n{text}");
                tokio::time::sleep(Duration::from_millis(50)).await; // polling the metrics, not synchronisation
            }
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

/// The replica's `/metrics` text.
async fn scrape(server: &cohort_coordinator::server::ServerHandle) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(server.metrics_addr().expect("metrics")).await.expect("connect");
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await.expect("write");
    let mut body = String::new();
    conn.read_to_string(&mut body).await.expect("read");
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ended_jobs_leave_nothing_behind_memory() {
    run(Backend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ended_jobs_leave_nothing_behind_etcd() {
    run(Backend::Etcd).await;
}

/// Workers that fail under names never seen again (a Deployment's replacement pods) leave
/// failure histories; they expire a window after the failure (on a lease), while the job
/// goes on, instead of accumulating for the life of the job.
async fn failure_histories_expire(backend: Backend) {
    bounded(async {
        let backing = Backing::new(backend).await;
        let mut settings = test_settings(backend);
        settings.min_workers = 2;
        let mut options = Options::new(settings);
        options.exclusion = ExclusionPolicy { window: Duration::from_secs(1), ..ExclusionPolicy::default() };
        let server = replica(backing.store.clone(), &options).await;
        let addr = server.local_addr();
        let failures_prefix = format!("{}failures/", keys::job_prefix("long"));
        let failure_keys = || {
            let store = backing.store.clone();
            let prefix = failures_prefix.clone();
            async move { store.get_prefix(&prefix).await.expect("read the store").0.len() }
        };
        let stay = Worker::join(addr, "long", "stay", Duration::from_millis(100)).await;
        let mut after = 0;
        const CHURNED: usize = 4;
        for i in 0..CHURNED {
            let name = format!("pod-{i}");
            let churned = Worker::join(addr, "long", &name, Duration::from_millis(100)).await;
            let gs = futures::future::join_all([stay.next_generation(after), churned.next_generation(0)]).await;
            let g = gs[0].clone();
            let rank = g.members.iter().position(|m| m.worker_id == name).expect("placed") as u32;
            assert!(stay.report(g.number, Some(rank), "pod died").await.expect("report").accepted);
            after = g.number;
        }
        assert!(failure_keys().await >= 1, "the failures were recorded");
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let left = failure_keys().await;
            if left == 0 {
                break;
            }
            assert!(Instant::now() < deadline, "{left} failure histories still there 15 s after a 1 s window");
            tokio::time::sleep(Duration::from_millis(100)).await; // polling the store, not synchronisation
        }
        // The job itself is untouched: `stay` is still a member.
        let s = status(addr, "long").await;
        assert!(s.members.iter().any(|m| m.worker_id == "stay"), "{s:?}");
        server.shutdown().await.expect("shutdown");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_histories_of_departed_workers_expire_memory() {
    failure_histories_expire(Backend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_histories_of_departed_workers_expire_etcd() {
    failure_histories_expire(Backend::Etcd).await;
}
