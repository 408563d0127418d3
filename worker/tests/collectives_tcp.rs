//! The reference checks of `collectives_sim`, over real TCP on loopback: every collective on
//! world sizes 1..=8, all ranks in this process, each with its own endpoint.

mod common;

use cohort::{Algorithm, CommConfig, Communicator, ReduceOp};
use cohort_transports::tcp::{MeshSpec, TcpEndpoint, TcpOptions, TcpTransport};
use cohort_transports::Deadlines;
use common::{check_results, matrix, run_all, Case, TestElem};
use half::bf16;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::timeout;

const LIMIT: Duration = Duration::from_secs(240);

/// Binds `n` endpoints on loopback and connects them into one generation.
async fn mesh(n: u32, generation: u64) -> (Vec<TcpEndpoint>, Vec<TcpTransport>) {
    let mut endpoints = Vec::new();
    for _ in 0..n {
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        endpoints.push(TcpEndpoint::bind(addr, TcpOptions::default()).await.expect("bind"));
    }
    let peers: Vec<SocketAddr> = endpoints.iter().map(|e| e.local_addr()).collect();
    let deadlines = Deadlines { no_progress: Duration::from_secs(20), connect: Duration::from_secs(20) };
    let setups = endpoints.iter().enumerate().map(|(rank, e)| {
        e.connect_mesh(MeshSpec {
            job: "collectives-tcp".into(),
            generation,
            rank: rank as u32,
            peers: peers.clone(),
            token: b"test-token".to_vec(),
            deadlines,
        })
    });
    let transports = futures::future::try_join_all(setups).await.expect("mesh set-up");
    (endpoints, transports)
}

async fn check_world<E: TestElem>(n: u32, config: CommConfig, cases: Vec<Case>) {
    let (_endpoints, transports) = mesh(n, 1).await;
    let handles: Vec<_> = transports
        .into_iter()
        .map(|t| tokio::spawn(run_all::<E, _>(Communicator::new(Arc::new(t), config.clone()), cases.clone())))
        .collect();
    let mut results = Vec::new();
    for (rank, h) in handles.into_iter().enumerate() {
        match h.await.expect("rank task panicked") {
            Ok(r) => results.push(r),
            Err((case, e)) => panic!("{:?} n={n} rank={rank} {case:?} failed: {e}", E::DTYPE),
        }
    }
    check_results::<E>(n, &cases, &results);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_collective_over_tcp_f32_all_ops() {
    timeout(LIMIT, async {
        for n in 1..=8u32 {
            let cases = matrix(n, &[0, 1, 131, 1021], &ReduceOp::ALL, &Algorithm::CONCRETE);
            let config = CommConfig { segment_bytes: 1024, ..CommConfig::default() };
            check_world::<f32>(n, config, cases).await;
        }
    })
    .await
    .expect("suite timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_collective_over_tcp_other_dtypes() {
    timeout(LIMIT, async {
        for n in [2u32, 3, 5, 8] {
            let config = CommConfig { segment_bytes: 4096, ..CommConfig::default() };
            check_world::<i64>(n, config.clone(), matrix(n, &[7, 1021], &[ReduceOp::Sum], &Algorithm::CONCRETE)).await;
            check_world::<bf16>(
                n,
                config.clone(),
                matrix(n, &[131], &[ReduceOp::Max, ReduceOp::Avg], &Algorithm::CONCRETE),
            )
            .await;
            check_world::<u8>(n, config, matrix(n, &[1021], &[ReduceOp::Prod], &Algorithm::CONCRETE)).await;
        }
    })
    .await
    .expect("suite timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_allreduce_over_tcp_with_default_segments() {
    timeout(LIMIT, async {
        for n in [2u32, 4, 7] {
            let cases = matrix(n, &[1 << 20], &[ReduceOp::Sum], &[Algorithm::Ring, Algorithm::Bcube, Algorithm::Auto]);
            let cases: Vec<Case> = cases
                .into_iter()
                .filter(|c| matches!(c.coll, common::Coll::Allreduce(_) | common::Coll::Broadcast(0)))
                .collect();
            check_world::<f32>(n, CommConfig::default(), cases).await;
        }
    })
    .await
    .expect("suite timed out");
}
