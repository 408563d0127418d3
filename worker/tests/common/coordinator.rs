//! A real coordinator in this process (memory store, loopback gRPC) and members joining it,
//! for the tests of the host relays.

use cohort::control::ControlClient;
use cohort_coordinator::store::memory::MemoryStore;
use cohort_coordinator::{JobSettings, ServeConfig, ServerHandle, Settings};
use cohort_proto::v1 as pb;
use std::sync::Arc;

/// A coordinator on a free loopback port, every job with `settings`.
pub(crate) async fn start(settings: JobSettings) -> ServerHandle {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let config = ServeConfig::new(Arc::new(MemoryStore::new()), Settings::uniform(settings).expect("settings"));
    cohort_coordinator::start(config, listener).await.expect("coordinator")
}

/// `id` joins `job` from `host` through `client` (a TCP address that is never dialled).
pub(crate) async fn join(client: &ControlClient, job: &str, host: &str, id: &str) -> pb::JoinResponse {
    client
        .join(pb::JoinRequest {
            job: job.into(),
            worker_id: id.into(),
            host: host.into(),
            addresses: vec![pb::TransportAddress { transport: "tcp".into(), address: "127.0.0.1:9".into() }],
            capabilities: vec!["transport:tcp".into()],
            protocol_version: cohort_proto::PROTOCOL_VERSION,
            ..Default::default()
        })
        .await
        .expect("join")
}
