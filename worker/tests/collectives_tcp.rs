//! The reference checks of `collectives_sim`, over the real transports: every collective on
//! world sizes 1..=8, all ranks in this process, each with its own endpoints. Every suite runs
//! four times (module per network): over TCP on loopback (a full mesh, and a mesh set up with
//! only the links the schedules plan, the others made on first use), over shared memory, and
//! over a mixed mesh where even and odd ranks play two hosts (shared memory within, TCP
//! across).

mod common;

use cohort::{Algorithm, CommConfig, CommError, Communicator, ReduceOp};
use common::meshes::{tcp_mesh, Net};
use common::{check_results, matrix, run_all, Case, TestElem};
use half::bf16;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::timeout;

const LIMIT: Duration = Duration::from_secs(240);

/// One generation of `n` ranks over `net`, even and odd ranks playing two hosts.
async fn mesh(
    net: Net,
    n: u32,
    generation: u64,
) -> (Vec<cohort_transports::tcp::TcpEndpoint>, Vec<cohort::elastic::MeshTransport>) {
    common::meshes::mesh(net, n, generation, |r| r % 2).await
}

async fn check_world<E: TestElem>(net: Net, n: u32, config: CommConfig, cases: Vec<Case>) {
    let (_endpoints, transports) = mesh(net, n, 1).await;
    let handles: Vec<_> = transports
        .into_iter()
        .map(|t| tokio::spawn(run_all::<E, _>(Communicator::new(Arc::new(t), config.clone()), cases.clone())))
        .collect();
    let mut results = Vec::new();
    let mut failures = Vec::new();
    for (rank, h) in handles.into_iter().enumerate() {
        match h.await.expect("rank task panicked") {
            Ok(r) => results.push(r),
            Err((case, e)) => failures.push(format!("rank {rank} {case:?}: {e}")),
        }
    }
    // Every rank's error: the first failure explains the others' (closed links).
    assert!(failures.is_empty(), "{net:?} {:?} n={n} failed:\n{}", E::DTYPE, failures.join("\n"));
    check_results::<E>(n, &cases, &results);
}

async fn every_collective_f32_all_ops(net: Net) {
    timeout(LIMIT, async {
        for n in 1..=8u32 {
            let cases = matrix(n, &[0, 1, 131, 1021], &ReduceOp::ALL, &Algorithm::CONCRETE);
            let config = CommConfig { segment_bytes: 1024, ..CommConfig::default() };
            check_world::<f32>(net, n, config, cases).await;
        }
    })
    .await
    .expect("suite timed out");
}

async fn every_collective_other_dtypes(net: Net) {
    timeout(LIMIT, async {
        for n in [2u32, 3, 5, 8] {
            let config = CommConfig { segment_bytes: 4096, ..CommConfig::default() };
            let sum = matrix(n, &[7, 1021], &[ReduceOp::Sum], &Algorithm::CONCRETE);
            check_world::<i64>(net, n, config.clone(), sum).await;
            let max_avg = matrix(n, &[131], &[ReduceOp::Max, ReduceOp::Avg], &Algorithm::CONCRETE);
            check_world::<bf16>(net, n, config.clone(), max_avg).await;
            check_world::<u8>(net, n, config, matrix(n, &[1021], &[ReduceOp::Prod], &Algorithm::CONCRETE)).await;
        }
    })
    .await
    .expect("suite timed out");
}

/// A 4 MiB allreduce with the default segments. Over TCP and the mixed mesh (every rank of
/// it, the ranks of one host included) the blocks are then cut into the transport's 256 KiB
/// pipeline segments; over shared memory into 1 MiB ones.
async fn large_allreduce_with_default_segments(net: Net) {
    timeout(LIMIT, async {
        {
            use cohort_transports::Transport;
            let (_endpoints, transports) = mesh(net, 4, 1).await;
            let expected = match net {
                Net::Shm => None,
                Net::Tcp | Net::TcpPlanned | Net::Mixed => Some(cohort_transports::tcp::PIPELINE_SEGMENT),
            };
            for t in &transports {
                assert_eq!(t.pipeline_segment(), expected, "{net:?}, rank {}", t.rank());
            }
        }
        for n in [2u32, 4, 7] {
            let cases = matrix(n, &[1 << 20], &[ReduceOp::Sum], &[Algorithm::Ring, Algorithm::Bcube, Algorithm::Auto]);
            let cases: Vec<Case> = cases
                .into_iter()
                .filter(|c| matches!(c.coll, common::Coll::Allreduce(_) | common::Coll::Broadcast(0)))
                .collect();
            check_world::<f32>(net, n, CommConfig::default(), cases).await;
        }
    })
    .await
    .expect("suite timed out");
}

/// Point-to-point messages of 4 MiB, several back to back, with the default segments: over
/// TCP each is cut into the transport's 256 KiB pipeline segments, every message arrives
/// whole and in order, and an allreduce after them still lines up.
async fn large_point_to_point_messages_back_to_back(net: Net) {
    timeout(LIMIT, async {
        const LEN: usize = 1 << 20;
        const MESSAGES: usize = 3;
        let (_endpoints, transports) = mesh(net, 2, 1).await;
        let mut comms: Vec<_> =
            transports.into_iter().map(|t| Communicator::new(Arc::new(t), CommConfig::default())).collect();
        let (mut receiver, mut sender) = (comms.pop().expect("rank 1"), comms.pop().expect("rank 0"));
        let send = tokio::spawn(async move {
            for m in 0..MESSAGES {
                let data: Vec<f32> = (0..LEN).map(|i| (m * LEN + i) as f32).collect();
                sender.send(&data, 1).await.expect("send");
            }
            let mut sum = vec![1.0f32; 4];
            sender.allreduce(&mut sum, ReduceOp::Sum).await.expect("allreduce on rank 0");
            sum
        });
        for m in 0..MESSAGES {
            let mut got = vec![0.0f32; LEN];
            receiver.recv(&mut got, 0).await.expect("recv");
            let wrong = (0..LEN).find(|&i| got[i] != (m * LEN + i) as f32);
            assert_eq!(wrong, None, "{net:?}: message {m} differs at element {wrong:?}");
        }
        let mut sum = vec![1.0f32; 4];
        receiver.allreduce(&mut sum, ReduceOp::Sum).await.expect("allreduce on rank 1");
        assert_eq!(sum, vec![2.0; 4]);
        assert_eq!(send.await.expect("sender"), vec![2.0; 4]);
    })
    .await
    .expect("suite timed out");
}

/// Rank 0 calls allreduce while rank 1 calls broadcast (the case, with either root):
/// a rank that receives a message of the other call fails with `CommError::Mismatch` naming
/// both calls and what differs, at once. The no-progress deadline is 20 s and this test's
/// bound 10 s, so falling back to waiting for a message that never comes fails the test; the
/// other rank either finished (a root only sends) or saw its link closed by the first.
async fn mismatched_collectives(net: Net) {
    for root in [0u32, 1] {
        let (_endpoints, transports) = mesh(net, 2, 1).await;
        let mut comms: Vec<_> =
            transports.into_iter().map(|t| Communicator::new(Arc::new(t), CommConfig::default())).collect();
        let (mut c1, mut c0) = (comms.pop().expect("rank 1"), comms.pop().expect("rank 0"));
        let a = tokio::spawn(async move {
            let mut x = vec![1f32; 1000];
            c0.allreduce(&mut x, ReduceOp::Sum).await
        });
        let b = tokio::spawn(async move {
            let mut x = vec![1u8; 1000];
            c1.broadcast(&mut x, root).await
        });
        let (ra, rb) = timeout(Duration::from_secs(10), async { (a.await.expect("rank 0"), b.await.expect("rank 1")) })
            .await
            .unwrap_or_else(|_| panic!("{net:?} root {root}: no mismatch reported within 10 s"));
        let errors: Vec<CommError> = [ra, rb].into_iter().filter_map(Result::err).collect();
        let Some(mismatch) = errors.iter().find(|e| matches!(e, CommError::Mismatch { .. })) else {
            panic!("{net:?} root {root}: no mismatch among {errors:?}")
        };
        let text = mismatch.to_string();
        assert!(
            text.contains("allreduce(") && text.contains("broadcast(") && text.contains("differ in collective, dtype"),
            "{net:?} root {root}: {text}"
        );
        assert!(errors.iter().all(|e| !matches!(e, CommError::Timeout { .. })), "{net:?} root {root}: {errors:?}");
    }
}

/// The elastic runtime's report-first mode (`abort_transport_on_error: false`): rank 1 (in a
/// broadcast) finds rank 0's allreduce message and fails with the mismatch, leaving its link
/// open, so rank 0 (waiting for rank 1's allreduce message) does not fail with "the peer closed
/// its link" naming rank 1, a report that could reach the coordinator before rank 1's and make
/// the detector the root cause. Rank 0 waits until the revocation, which carries the cause.
async fn mismatch_in_report_first_mode_leaves_the_peer_waiting_for_the_revocation(net: Net) {
    let (_endpoints, transports) = mesh(net, 2, 1).await;
    let config = CommConfig { abort_transport_on_error: false, ..CommConfig::default() };
    let mut comms: Vec<_> = transports.into_iter().map(|t| Communicator::new(Arc::new(t), config.clone())).collect();
    let (mut c1, mut c0) = (comms.pop().expect("rank 1"), comms.pop().expect("rank 0"));
    let revoker = c0.revoker();
    let mut waiting = tokio::spawn(async move {
        let mut x = vec![1f32; 1000];
        c0.allreduce(&mut x, ReduceOp::Sum).await
    });
    // Rank 1's communicator stays alive (as the elastic runtime's does until the revocation):
    // dropping it would close its links.
    let detector = tokio::spawn(async move {
        let mut x = vec![1u8; 1000];
        (c1.broadcast(&mut x, 0).await, c1)
    });
    let (found, _c1) =
        timeout(Duration::from_secs(10), detector).await.expect("no mismatch within 10 s").expect("rank 1");
    assert!(matches!(found, Err(CommError::Mismatch { rank: 0, .. })), "{net:?}: rank 1 got {found:?}");
    // Rank 0 is still waiting: nothing closed the link under it. (Before, it failed at once
    // with PeerFailed naming rank 1.)
    if let Ok(early) = timeout(Duration::from_secs(2), &mut waiting).await {
        panic!("{net:?}: rank 0 failed before the revocation: {early:?}");
    }
    let cause = cohort::RootCause {
        rank: None,
        worker_id: String::new(),
        host: String::new(),
        reason: "rank 1 found a mismatch".into(),
    };
    revoker.revoke(cause.clone());
    match timeout(Duration::from_secs(10), waiting).await.expect("revocation ignored").expect("rank 0") {
        Err(CommError::Revoked { cause: got, .. }) => assert_eq!(got, cause, "{net:?}"),
        other => panic!("{net:?}: rank 0 expected Revoked, got {other:?}"),
    }
}

/// The suites over one network, as a module of tests.
macro_rules! suites_over {
    ($module:ident, $net:expr) => {
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn every_collective_f32_all_ops() {
                super::every_collective_f32_all_ops($net).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn every_collective_other_dtypes() {
                super::every_collective_other_dtypes($net).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn large_allreduce_with_default_segments() {
                super::large_allreduce_with_default_segments($net).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn large_point_to_point_messages_back_to_back() {
                super::large_point_to_point_messages_back_to_back($net).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn mismatched_collectives_fail_with_a_mismatch_naming_both_calls() {
                super::mismatched_collectives($net).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn mismatch_in_report_first_mode_leaves_the_peer_waiting_for_the_revocation() {
                super::mismatch_in_report_first_mode_leaves_the_peer_waiting_for_the_revocation($net).await;
            }
        }
    };
}

suites_over!(over_tcp, Net::Tcp);
suites_over!(over_tcp_links_on_demand, Net::TcpPlanned);
suites_over!(over_shm, Net::Shm);
suites_over!(over_shm_and_tcp, Net::Mixed);

/// A world of 24 ranks with only the planned links at set-up: every rank holds at most
/// `2 log2(24) + 1` links after set-up (counted), every collective (alltoall and send/recv to
/// unplanned peers included) still gives the reference results, and afterwards the links made
/// on first use are counted too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_on_demand_keep_the_count_down_and_every_collective_working() {
    timeout(LIMIT, async {
        let n = 24u32;
        let (_endpoints, transports) = tcp_mesh(n, 1, true).await;
        let bound = 2.0 * f64::from(n).log2() + 1.0;
        for t in &transports {
            use cohort_transports::Transport;
            let linked = t.linked_peers();
            let planned = cohort::upfront_links(t.rank(), &cohort::HostLayout::flat(n)).len();
            assert_eq!(linked, planned, "rank {} linked {linked} peers at set-up, planned {planned}", t.rank());
            assert!((linked as f64) <= bound, "rank {}: {linked} links over {bound:.1}", t.rank());
            assert!(linked < (n - 1) as usize, "the plan must leave peers out on 24 ranks");
        }
        let cases = matrix(n, &[131], &[ReduceOp::Sum], &Algorithm::CONCRETE);
        let config = CommConfig { segment_bytes: 1024, ..CommConfig::default() };
        let handles: Vec<_> = transports
            .into_iter()
            .map(|t| {
                let t = Arc::new(t);
                let comm = Communicator::new(Arc::clone(&t), config.clone());
                let cases = cases.clone();
                tokio::spawn(async move { (run_all::<f32, _>(comm, cases).await, t) })
            })
            .collect();
        let mut results = Vec::new();
        for (rank, h) in handles.into_iter().enumerate() {
            let (r, t) = h.await.expect("rank task panicked");
            results.push(r.unwrap_or_else(|(case, e)| panic!("rank {rank} {case:?}: {e}")));
            use cohort_transports::Transport;
            // Alltoall and the point-to-point cases reach every peer: all linked by now.
            assert_eq!(t.linked_peers(), (n - 1) as usize, "rank {rank} after alltoall");
        }
        check_results::<f32>(n, &cases, &results);
    })
    .await
    .expect("suite timed out");
}
