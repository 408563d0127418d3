//! Handshake refusals: each side's error names what differed.

mod tcp_support;

use cohort_transports::tcp::{TcpEndpoint, TcpTransport};
use cohort_transports::{Deadlines, TransportError};
use std::net::SocketAddr;
use std::time::Duration;
use tcp_support::*;
use tokio::time::{timeout, Instant};

fn d() -> Deadlines {
    deadlines(Duration::from_secs(5), Duration::from_millis(2500))
}

type Pair = (Result<TcpTransport, TransportError>, Result<TcpTransport, TransportError>);

/// Runs rank 0 and rank 1 with the given (job, generation, token, world) each.
async fn pair(a: (&str, u64, &[u8], usize), b: (&str, u64, &[u8], usize)) -> Pair {
    let eps = endpoints(2).await;
    let mut addrs: Vec<SocketAddr> = eps.iter().map(TcpEndpoint::local_addr).collect();
    // A third rank's address for the side with the bigger world; nobody listens there.
    let spare = TcpEndpoint::bind(loopback(), Default::default()).await.unwrap();
    addrs.push(spare.local_addr());
    drop(spare);
    let s0 = spec(a.0, a.1, 0, &addrs[..a.3], a.2, d());
    let s1 = spec(b.0, b.1, 1, &addrs[..b.3], b.2, d());
    tokio::join!(eps[0].connect_mesh(s0), eps[1].connect_mesh(s1))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_token_fails_both_sides() {
    timeout(TEST_LIMIT, async {
        let (r0, r1) = pair(("job", 1, TOKEN, 2), ("job", 1, b"another token", 2)).await;
        assert_handshake(&r1, "authentication failed: wrong job token");
        assert_handshake(&r0, "authentication failed: wrong job token");
    })
    .await
    .unwrap();
}

/// Per-job credentials on the data plane: a worker holding another job's credential cannot
/// compute this job's (the derivation refuses), and keying with its own credential fails the
/// handshake; a worker given the operator secret derives the same key as one given the job's
/// credential, so the two interoperate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_jobs_credential_cannot_join_a_mesh() {
    use cohort_proto::credentials::{data_plane_secret, job_token};
    timeout(TEST_LIMIT, async {
        let own = job_token(b"operator secret", "job");
        let other = job_token(b"operator secret", "other-job");
        let member = data_plane_secret(own.as_bytes(), "job").unwrap();
        assert!(data_plane_secret(other.as_bytes(), "job").is_err());
        let (r0, r1) = pair(("job", 1, &member, 2), ("job", 1, other.as_bytes(), 2)).await;
        assert_handshake(&r1, "authentication failed: wrong job token");
        assert_handshake(&r0, "authentication failed: wrong job token");
        let operator = data_plane_secret(b"operator secret", "job").unwrap();
        let (r0, r1) = pair(("job", 1, &member, 2), ("job", 1, &operator, 2)).await;
        assert!(r0.is_ok() && r1.is_ok(), "{:?} {:?}", r0.err(), r1.err());
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_job_fails_both_sides() {
    timeout(TEST_LIMIT, async {
        let (r0, r1) = pair(("job-a", 1, TOKEN, 2), ("job-b", 1, TOKEN, 2)).await;
        assert_handshake(&r1, "job mismatch");
        assert_handshake(&r0, "job mismatch");
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_generation_dialer_fails_both_sides() {
    timeout(TEST_LIMIT, async {
        let start = Instant::now();
        let (r0, r1) = pair(("job", 4, TOKEN, 2), ("job", 3, TOKEN, 2)).await;
        assert_handshake(&r1, "peer refused: generation mismatch (ours 3, theirs 4)");
        assert_handshake(&r0, "generation mismatch (ours 4, theirs 3)");
        assert!(start.elapsed() < Duration::from_secs(10));
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn newer_generation_dialer_fails_both_sides() {
    timeout(TEST_LIMIT, async {
        let (r0, r1) = pair(("job", 3, TOKEN, 2), ("job", 4, TOKEN, 2)).await;
        assert_handshake(&r1, "peer refused: generation mismatch (ours 4, theirs 3)");
        assert_handshake(&r0, "generation mismatch (ours 3, theirs 4)");
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_world_size_fails_both_sides_at_once() {
    timeout(TEST_LIMIT, async {
        let start = Instant::now();
        let (r0, r1) = pair(("job", 1, TOKEN, 2), ("job", 1, TOKEN, 3)).await;
        assert_handshake(&r1, "world size mismatch (ours 3, theirs 2)");
        assert_handshake(&r0, "world size mismatch (ours 2, theirs 3)");
        // Both sides authenticated each other, so neither waits for the connect deadline.
        assert!(start.elapsed() < d().connect, "took {:?}", start.elapsed());
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_peer_fails_at_the_connect_deadline() {
    timeout(TEST_LIMIT, async {
        let eps = endpoints(2).await;
        let addrs: Vec<SocketAddr> = eps.iter().map(TcpEndpoint::local_addr).collect();
        let d = deadlines(Duration::from_secs(1), Duration::from_millis(700));
        let start = Instant::now();
        let r = eps[0].connect_mesh(spec("job", 1, 0, &addrs, TOKEN, d)).await;
        let took = start.elapsed();
        assert_handshake(&r, "no link to ranks [1]");
        assert!(took >= d.connect && took < d.connect + Duration::from_secs(2), "took {took:?}");
    })
    .await
    .unwrap();
}
