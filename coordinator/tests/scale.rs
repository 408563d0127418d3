//! Rendezvous of 256 workers into one generation: every worker gets the same generation of
//! all 256 members. How long it takes is measured by the control-plane benchmark
//! (`cargo bench -p cohort-coordinator --bench control_plane`), not asserted here.

mod common;

use common::*;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rendezvous_of_256_workers() {
    bounded(async {
        const N: usize = 256;
        let backing = Backing::new(Backend::Memory).await;
        let mut settings = test_settings(Backend::Memory);
        settings.max_workers = N as u32;
        settings.join_window = Duration::from_secs(10); // forms when all N wait, not by the window
        settings.lease_ttl = Duration::from_secs(60); // no heartbeats needed during the test
        settings.elastic_timeout = Duration::from_secs(60);
        let server = replica(backing.store.clone(), &Options::new(settings)).await;
        let addr = server.local_addr();
        let mut workers = Vec::with_capacity(N);
        for i in 0..N {
            let mut w = Worker::join(addr, "big", &format!("w{i:03}"), Duration::from_secs(3600)).await;
            w.stop_heartbeats();
            workers.push(w);
        }
        let generations = form_all(&workers, 0).await;
        let g = &generations[0];
        assert_eq!(g.members.len(), N);
        assert!(generations.iter().all(|x| x == g));
        server.shutdown().await.expect("shutdown");
    })
    .await;
}
