//! Every collective, dtype and op against a reference over the simulated network, plus the
//! failure paths (crash, stall, revocation, disagreement, whole-op deadline, cancellation)
//! under tokio's paused clock.

mod common;

use cohort::{Algorithm, CommConfig, CommError, Communicator, HostLayout, ReduceOp, RootCause};
use cohort_testkit::sim::{SimNetwork, SimTransport};
use cohort_transports::Deadlines;
use common::{check_results, matrix, run_all, Case, TestElem};
use half::{bf16, f16};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::{timeout, Instant};

const LIMIT: Duration = Duration::from_secs(120);

fn deadlines(ms: u64) -> Deadlines {
    Deadlines { no_progress: Duration::from_millis(ms), connect: Duration::from_secs(5), learning: None }
}

fn world(n: u32, config: &CommConfig, no_progress_ms: u64) -> (SimNetwork, Vec<Communicator<SimTransport>>) {
    let (net, ts) = SimNetwork::new(n, 7, deadlines(no_progress_ms));
    let comms = ts.into_iter().map(|t| Communicator::new(Arc::new(t), config.clone())).collect();
    (net, comms)
}

/// Runs `cases` on every rank of a world of `n` and checks them against the reference.
async fn check_world<E: TestElem>(n: u32, config: CommConfig, cases: Vec<Case>) {
    let (_net, comms) = world(n, &config, 10_000);
    let handles: Vec<_> = comms.into_iter().map(|c| tokio::spawn(run_all::<E, _>(c, cases.clone()))).collect();
    let mut results = Vec::new();
    for (rank, h) in handles.into_iter().enumerate() {
        match h.await.expect("rank task panicked") {
            Ok(r) => results.push(r),
            Err((case, e)) => panic!("{:?} n={n} rank={rank} {case:?} failed: {e}", E::DTYPE),
        }
    }
    check_results::<E>(n, &cases, &results);
}

const LENS: [usize; 6] = [0, 1, 7, 131, 1021, 1030];

async fn dtype_matrix<E: TestElem>() {
    for n in 1..=8u32 {
        let cases = matrix(n, &LENS, &ReduceOp::ALL, &Algorithm::CONCRETE);
        // Small segments: every schedule runs many segments per block.
        let config = CommConfig { segment_bytes: 64, bcube_base: None, ..CommConfig::default() };
        check_world::<E>(n, config, cases).await;
    }
}

#[tokio::test]
async fn f32_every_collective_every_op() {
    timeout(LIMIT, dtype_matrix::<f32>()).await.expect("suite timed out");
}

#[tokio::test]
async fn f64_every_collective_every_op() {
    timeout(LIMIT, dtype_matrix::<f64>()).await.expect("suite timed out");
}

#[tokio::test]
async fn f16_every_collective_every_op() {
    timeout(LIMIT, dtype_matrix::<f16>()).await.expect("suite timed out");
}

#[tokio::test]
async fn bf16_every_collective_every_op() {
    timeout(LIMIT, dtype_matrix::<bf16>()).await.expect("suite timed out");
}

#[tokio::test]
async fn i32_every_collective_every_op() {
    timeout(LIMIT, dtype_matrix::<i32>()).await.expect("suite timed out");
}

#[tokio::test]
async fn i64_every_collective_every_op() {
    timeout(LIMIT, dtype_matrix::<i64>()).await.expect("suite timed out");
}

#[tokio::test]
async fn u8_every_collective_every_op() {
    timeout(LIMIT, dtype_matrix::<u8>()).await.expect("suite timed out");
}

#[tokio::test]
async fn large_vectors_default_segments_and_bcube_bases() {
    timeout(LIMIT, async {
        for (n, base) in [(2, None), (4, Some(2)), (6, Some(3)), (8, Some(4)), (8, Some(3)), (7, None), (5, Some(2))] {
            let cases = matrix(n, &[300_007], &[ReduceOp::Sum, ReduceOp::Avg], &Algorithm::CONCRETE);
            let config = CommConfig { segment_bytes: 64 << 10, bcube_base: base, ..CommConfig::default() };
            check_world::<f32>(n, config, cases).await;
        }
    })
    .await
    .expect("suite timed out");
}

/// Host layouts for the hierarchical allreduce: equal hosts (two levels), hosts whose ranks
/// interleave, unequal hosts (through the leaders), one host, every rank alone.
const LAYOUTS: [&[u32]; 10] = [
    &[0, 0, 1, 1],
    &[0, 1, 0, 1],
    &[0, 0, 0, 1, 1, 1],
    &[0, 0, 1, 1, 2, 2],
    &[0, 1, 2, 0, 1, 2],
    &[0, 0, 0, 1, 1],
    &[0, 1, 1, 1, 2, 2],
    &[0, 0, 1, 1, 1, 1, 2, 3],
    &[0, 0, 0, 0],
    &[0, 1, 2],
];

/// Runs `cases` on a world laid out on hosts as `keys` says, and checks them.
async fn check_layout<E: TestElem>(keys: &[u32], config: CommConfig, cases: Vec<Case>) {
    let n = keys.len() as u32;
    let (_net, comms) = world(n, &config, 10_000);
    let handles: Vec<_> = comms
        .into_iter()
        .map(|mut c| {
            c.set_layout(HostLayout::from_keys(keys)).expect("layout of the world's size");
            tokio::spawn(run_all::<E, _>(c, cases.clone()))
        })
        .collect();
    let mut results = Vec::new();
    for (rank, h) in handles.into_iter().enumerate() {
        match h.await.expect("rank task panicked") {
            Ok(r) => results.push(r),
            Err((case, e)) => panic!("{:?} layout {keys:?} rank={rank} {case:?} failed: {e}", E::DTYPE),
        }
    }
    check_results::<E>(n, &cases, &results);
}

#[tokio::test]
async fn hierarchical_allreduce_on_every_host_layout() {
    timeout(LIMIT, async {
        for keys in LAYOUTS {
            let n = keys.len() as u32;
            let algos = [Algorithm::Hierarchical, Algorithm::Auto];
            let small = CommConfig { segment_bytes: 64, ..CommConfig::default() };
            check_layout::<f32>(keys, small.clone(), matrix(n, &LENS, &ReduceOp::ALL, &algos)).await;
            check_layout::<bf16>(keys, small, matrix(n, &[1030], &ReduceOp::ALL, &algos)).await;
            // Large enough for Auto to choose the hierarchical schedule.
            let large = CommConfig { segment_bytes: 64 << 10, ..CommConfig::default() };
            check_layout::<f32>(keys, large, matrix(n, &[300_007], &[ReduceOp::Sum, ReduceOp::Avg], &algos)).await;
        }
    })
    .await
    .expect("suite timed out");
}

#[tokio::test(start_paused = true)]
async fn ranks_that_disagree_about_the_layout_fail_instead_of_waiting() {
    let (_net, comms) = world(4, &CommConfig::default(), NO_PROGRESS.as_millis() as u64);
    let handles: Vec<_> = comms
        .into_iter()
        .map(|mut c| {
            let keys: &[u32] = if c.rank() == 1 { &[0, 1, 0, 1] } else { &[0, 0, 1, 1] };
            c.set_layout(HostLayout::from_keys(keys)).unwrap();
            tokio::spawn(async move {
                let start = Instant::now();
                let mut v = vec![1.0f32; 1000];
                (c.allreduce_with(&mut v, ReduceOp::Sum, Algorithm::Hierarchical).await, start.elapsed())
            })
        })
        .collect();
    let mut invalid = 0;
    for h in handles {
        let (r, elapsed) = timeout(LIMIT, h).await.unwrap().unwrap();
        let e = r.expect_err("ranks with different layouts cannot succeed");
        assert!(elapsed <= NO_PROGRESS, "waited {elapsed:?}");
        invalid += usize::from(matches!(e, CommError::Mismatch { .. }));
    }
    assert!(invalid >= 1, "nobody named the disagreement");
    let (_net, mut comms) = world(3, &CommConfig::default(), 1000);
    let e = comms[0].set_layout(HostLayout::flat(4)).unwrap_err();
    assert!(matches!(e, CommError::InvalidArgument(_)), "{e}");
}

#[tokio::test(start_paused = true)]
async fn crash_mid_hierarchical_allreduce_fails_every_survivor_promptly() {
    for keys in [&[0u32, 0, 1, 1][..], &[0, 0, 0, 1, 1]] {
        let (net, comms) =
            world(keys.len() as u32, &CommConfig { segment_bytes: 1024, ..CommConfig::default() }, 10_000);
        for p in (0..keys.len() as u32).filter(|&p| p != 2) {
            net.delay(2, p, Duration::from_millis(20));
        }
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                c.set_layout(HostLayout::from_keys(keys)).unwrap();
                tokio::spawn(async move {
                    let start = Instant::now();
                    let mut v = vec![1.0f32; 100_000];
                    let r = c.allreduce_with(&mut v, ReduceOp::Sum, Algorithm::Hierarchical).await;
                    (r, start.elapsed())
                })
            })
            .collect();
        // The hierarchical schedule has few rounds: rank 2 crashes while its first messages
        // (delayed 20 ms) are still on the wire, so no rank can have its contribution yet.
        tokio::time::sleep(Duration::from_millis(5)).await;
        net.crash(2);
        for (rank, h) in handles.into_iter().enumerate() {
            let (r, elapsed) = timeout(LIMIT, h).await.unwrap().unwrap();
            let e = r.expect_err("no rank may succeed after a crash");
            assert!(elapsed < NO_PROGRESS, "layout {keys:?} rank {rank} waited for the deadline: {elapsed:?}");
            if rank != 2 {
                assert!(matches!(e, CommError::PeerFailed { .. }), "layout {keys:?} rank {rank}: {e}");
            }
        }
    }
}

/// Non-associative float inputs: results must be identical bytes on every rank.
#[tokio::test]
async fn allreduce_is_bit_exact_across_ranks() {
    timeout(LIMIT, async {
        for n in [2u32, 3, 5, 6, 7, 8] {
            for algo in [Algorithm::Ring, Algorithm::Bcube, Algorithm::RecursiveDoubling, Algorithm::Auto] {
                for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Avg, ReduceOp::Min] {
                    let (_net, comms) = world(n, &CommConfig { segment_bytes: 256, ..CommConfig::default() }, 10_000);
                    let handles: Vec<_> = comms
                        .into_iter()
                        .map(|mut c| {
                            tokio::spawn(async move {
                                let r = c.rank();
                                let mut v: Vec<f32> = (0..1003u32)
                                    .map(|i| {
                                        let x =
                                            ((i.wrapping_mul(2_654_435_761) ^ r.wrapping_mul(40_503)) % 100_000) as f32;
                                        (x * 1e-3 + 0.1).powi(if i % 3 == 0 { -1 } else { 1 })
                                            * if (i + r) % 2 == 0 { 1.0 } else { -1.7 }
                                    })
                                    .collect();
                                // Signed zeros for min.
                                v[0] = if r % 2 == 0 { 0.0 } else { -0.0 };
                                c.allreduce_with(&mut v, op, algo).await.map(|_| v)
                            })
                        })
                        .collect();
                    let mut first: Option<Vec<u8>> = None;
                    for h in handles {
                        let v = h.await.unwrap().unwrap();
                        let bytes = cohort::as_bytes(&v).to_vec();
                        match &first {
                            None => first = Some(bytes),
                            Some(f) => assert!(*f == bytes, "n={n} {algo:?} {op:?}: ranks differ"),
                        }
                    }
                }
            }
        }
    })
    .await
    .expect("suite timed out");
}

#[tokio::test]
async fn untyped_entries_and_misaligned_buffers() {
    timeout(LIMIT, async {
        let (_net, comms) = world(3, &CommConfig::default(), 10_000);
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                tokio::spawn(async move {
                    let r = c.rank() as f64;
                    // 1 + 5 * 8 bytes, viewed from offset 1: never 8-aligned.
                    let mut raw = [0u8; 41];
                    for (i, chunk) in raw[1..].chunks_mut(8).enumerate() {
                        chunk.copy_from_slice(&(r * 10.0 + i as f64).to_ne_bytes());
                    }
                    c.allreduce_bytes(&mut raw[1..], cohort::DType::F64, ReduceOp::Max).await.unwrap();
                    let got: Vec<f64> = raw[1..].chunks(8).map(|b| f64::from_ne_bytes(b.try_into().unwrap())).collect();
                    let mut msg = if c.rank() == 1 { b"state!".to_vec() } else { vec![0; 6] };
                    c.broadcast_bytes(&mut msg, 1).await.unwrap();
                    let bad = c.allreduce_bytes(&mut [0u8; 7], cohort::DType::I32, ReduceOp::Sum).await;
                    (got, msg, bad)
                })
            })
            .collect();
        for h in handles {
            let (got, msg, bad) = h.await.unwrap();
            assert_eq!(got, [20.0, 21.0, 22.0, 23.0, 24.0]);
            assert_eq!(msg, b"state!");
            assert!(matches!(bad, Err(CommError::InvalidArgument(_))));
        }
    })
    .await
    .expect("suite timed out");
}

// ---------------------------------------------------------------------------------------
// Failure paths, on tokio's paused clock.

const NO_PROGRESS: Duration = Duration::from_secs(10);

fn spawn_allreduce(
    mut c: Communicator<SimTransport>,
    len: usize,
) -> tokio::task::JoinHandle<(Result<(), CommError>, Communicator<SimTransport>, Duration)> {
    tokio::spawn(async move {
        let start = Instant::now();
        let mut v = vec![1.0f32; len];
        let r = c.allreduce_with(&mut v, ReduceOp::Sum, Algorithm::Ring).await;
        (r, c, start.elapsed())
    })
}

#[tokio::test(start_paused = true)]
async fn crash_mid_allreduce_fails_every_survivor_promptly() {
    let (net, comms) = world(4, &CommConfig { segment_bytes: 1024, ..CommConfig::default() }, 10_000);
    // Every link of rank 2 is slow, so the allreduce is certainly in flight at t = 30 ms.
    for p in [0, 1, 3] {
        net.delay(2, p, Duration::from_millis(20));
    }
    let handles: Vec<_> = comms.into_iter().map(|c| spawn_allreduce(c, 100_000)).collect();
    tokio::time::sleep(Duration::from_millis(30)).await;
    net.crash(2);
    for (rank, h) in handles.into_iter().enumerate() {
        let (r, mut c, elapsed) = timeout(LIMIT, h).await.unwrap().unwrap();
        let e = r.expect_err("no rank may succeed after a crash");
        assert!(elapsed < NO_PROGRESS, "rank {rank} waited for the deadline: {elapsed:?}");
        if rank == 2 {
            assert!(matches!(e, CommError::Revoked { .. }), "crashed rank: {e}");
        } else {
            assert!(matches!(e, CommError::PeerFailed { .. }), "rank {rank}: {e}");
        }
        // Poisoned: the same class again, at once.
        let again = c.barrier().await.unwrap_err();
        assert!(again.same_class(&e), "rank {rank}: {again} after {e}");
    }
}

#[tokio::test(start_paused = true)]
async fn report_first_mode_leaves_ranks_away_from_a_crash_waiting_for_the_revocation() {
    // The elastic runtime's mode: a failed call does not close this rank's other links, so
    // ranks that are not next to the crashed one never blame a healthy survivor; they wait
    // (well within the no-progress deadline) until the revocation names the root cause.
    let config = CommConfig { segment_bytes: 1024, abort_transport_on_error: false, ..CommConfig::default() };
    let (net, comms) = world(6, &config, NO_PROGRESS.as_millis() as u64);
    for p in [0, 1, 3, 4, 5] {
        net.delay(2, p, Duration::from_millis(20));
    }
    let revokers: Vec<_> = comms.iter().map(|c| c.revoker()).collect();
    let mut handles: Vec<_> = comms.into_iter().map(|c| Some(spawn_allreduce(c, 100_000))).collect();
    tokio::time::sleep(Duration::from_millis(30)).await;
    net.crash(2);
    // The ring neighbours of rank 2 see it die and fail, naming it.
    for rank in [1usize, 3] {
        let (r, _c, elapsed) = timeout(LIMIT, handles[rank].take().unwrap()).await.unwrap().unwrap();
        assert!(elapsed < NO_PROGRESS, "rank {rank}: {elapsed:?}");
        match r {
            Err(CommError::PeerFailed { rank: 2, .. }) => {}
            other => panic!("rank {rank} must name rank 2: {other:?}"),
        }
    }
    // Well before any deadline, the others are still waiting: nobody blamed rank 1 or 3.
    tokio::time::sleep(NO_PROGRESS / 2).await;
    for rank in [0usize, 4, 5] {
        assert!(!handles[rank].as_ref().unwrap().is_finished(), "rank {rank} failed before the revocation");
    }
    let cause = RootCause { rank: Some(2), worker_id: "w2".into(), host: "h".into(), reason: "peer closed".into() };
    for r in &revokers {
        r.revoke(cause.clone());
    }
    for rank in [0usize, 4, 5] {
        let (r, _c, _) = timeout(LIMIT, handles[rank].take().unwrap()).await.unwrap().unwrap();
        match r {
            Err(CommError::Revoked { cause: got, .. }) => assert_eq!(got, cause, "rank {rank}"),
            other => panic!("rank {rank}: expected Revoked, got {other:?}"),
        }
    }
}

#[tokio::test(start_paused = true)]
async fn stalled_link_times_out_at_the_deadline() {
    let (net, comms) = world(3, &CommConfig::default(), NO_PROGRESS.as_millis() as u64);
    net.stall(0, 1);
    let handles: Vec<_> = comms.into_iter().map(|c| spawn_allreduce(c, 1 << 16)).collect();
    // The ranks waiting behind the stall time out exactly at the deadline; the failure then
    // cascades (each failed rank aborts its links) so nobody waits longer.
    let mut timeouts = 0;
    for (rank, h) in handles.into_iter().enumerate() {
        let (r, _c, elapsed) = timeout(LIMIT, h).await.unwrap().unwrap();
        let e = r.expect_err("a stalled link cannot complete");
        assert_eq!(elapsed, NO_PROGRESS, "rank {rank}");
        match e {
            CommError::Timeout { after, .. } => {
                assert_eq!(after, NO_PROGRESS);
                timeouts += 1;
            }
            e => assert!(matches!(e, CommError::PeerFailed { .. }), "rank {rank}: {e}"),
        }
    }
    assert!(timeouts >= 1);
}

/// A silent link in a lock-step ring starves every rank, and every rank times out naming the
/// rank it waits on (a cycle). The rank behind the silent link got least far in the
/// operation; the others each received more before starving. This is what lets the
/// coordinator blame the right link (see `revocation::cascade_root`).
#[tokio::test(start_paused = true)]
async fn in_a_starved_ring_the_rank_behind_the_silent_link_got_least_far() {
    let config = CommConfig { segment_bytes: 1024, abort_transport_on_error: false, ..CommConfig::default() };
    let (net, comms) = world(4, &config, NO_PROGRESS.as_millis() as u64);
    for (a, b) in [(0, 1), (1, 2), (2, 3), (3, 0)] {
        net.delay(a, b, Duration::from_millis(5));
    }
    let handles: Vec<_> = comms.into_iter().map(|c| spawn_allreduce(c, 4096)).collect();
    // Mid-operation (6 ring steps, 5 ms of latency each), the link 1 -> 2 goes silent.
    tokio::time::sleep(Duration::from_millis(12)).await;
    net.stall(1, 2);
    let mut progress = Vec::new();
    for (rank, h) in handles.into_iter().enumerate() {
        let (r, _c, _elapsed) = timeout(LIMIT, h).await.unwrap().unwrap();
        match r.expect_err("a silent link cannot complete") {
            CommError::Timeout { rank: waited_on, progress: Some(p), .. } => {
                assert_eq!(waited_on, Some(((rank + 3) % 4) as u32), "rank {rank} waits on its left neighbour");
                assert_eq!(p.seq, 0);
                progress.push(p);
            }
            e => panic!("rank {rank}: {e}"),
        }
    }
    assert!(progress[2].received > 0, "the link went silent mid-operation: {progress:?}");
    for rank in [0, 1, 3] {
        assert!(progress[2] < progress[rank], "rank 2 got least far: {progress:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn isolated_rank_times_out_its_neighbours() {
    let (net, comms) = world(4, &CommConfig::default(), NO_PROGRESS.as_millis() as u64);
    net.isolate(3);
    let handles: Vec<_> = comms.into_iter().map(|c| spawn_allreduce(c, 100)).collect();
    for (rank, h) in handles.into_iter().enumerate() {
        let (r, _c, elapsed) = timeout(LIMIT, h).await.unwrap().unwrap();
        let e = r.expect_err("an isolated rank cannot complete");
        assert!(elapsed <= NO_PROGRESS, "rank {rank}: {elapsed:?}");
        assert!(matches!(e, CommError::Timeout { .. } | CommError::PeerFailed { .. }), "rank {rank}: {e}");
    }
}

#[tokio::test(start_paused = true)]
async fn revoke_aborts_waiting_ranks_at_once_with_the_cause() {
    let (_net, mut comms) = world(3, &CommConfig::default(), NO_PROGRESS.as_millis() as u64);
    let absent = comms.pop().unwrap(); // rank 2 never joins the allreduce
    let revokers: Vec<_> = comms.iter().map(|c| c.revoker()).collect();
    let handles: Vec<_> = comms.into_iter().map(|c| spawn_allreduce(c, 1000)).collect();
    tokio::task::yield_now().await;
    let cause = RootCause { rank: Some(2), worker_id: "w2".into(), host: "host-c".into(), reason: "SIGKILL".into() };
    let start = Instant::now();
    for r in &revokers {
        r.revoke(cause.clone());
    }
    for h in handles {
        let (r, mut c, _) = timeout(LIMIT, h).await.unwrap().unwrap();
        assert_eq!(start.elapsed(), Duration::ZERO, "revocation must not wait for a deadline");
        match r {
            Err(CommError::Revoked { generation: 7, cause: got }) => assert_eq!(got, cause),
            other => panic!("expected Revoked, got {other:?}"),
        }
        assert!(matches!(c.allreduce(&mut [1i32], ReduceOp::Sum).await, Err(CommError::Revoked { .. })));
        assert!(c.revoker().is_revoked());
    }
    // A communicator revoked while idle refuses its next call.
    let mut absent = absent;
    absent.revoker().revoke(cause.clone());
    let e = absent.barrier().await.unwrap_err();
    assert!(matches!(e, CommError::Revoked { cause: ref c, .. } if *c == cause), "{e}");
    assert!(e.to_string().contains("rank 2 (worker w2 on host-c): SIGKILL"), "{e}");
}

#[tokio::test(start_paused = true)]
async fn disagreeing_lengths_are_a_mismatch_naming_the_count() {
    // Two ranks: both see the other's signature.
    let (_net, comms) = world(2, &CommConfig::default(), NO_PROGRESS.as_millis() as u64);
    let handles: Vec<_> = comms
        .into_iter()
        .map(|c| {
            let len = 10 + c.rank() as usize;
            spawn_allreduce(c, len)
        })
        .collect();
    for h in handles {
        let (r, _, elapsed) = timeout(LIMIT, h).await.unwrap().unwrap();
        assert!(matches!(&r, Err(CommError::Mismatch { detail, .. }) if detail.contains("count")), "{r:?}");
        assert!(elapsed < NO_PROGRESS);
    }
    // Five ranks, one disagrees: nobody succeeds, nobody hangs past the deadline, and the
    // rank's neighbours name the disagreement.
    for algo in Algorithm::CONCRETE {
        let (_net, comms) = world(5, &CommConfig::default(), NO_PROGRESS.as_millis() as u64);
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                tokio::spawn(async move {
                    let mut v = vec![1.0f64; if c.rank() == 3 { 50 } else { 49 }];
                    c.allreduce_with(&mut v, ReduceOp::Sum, algo).await
                })
            })
            .collect();
        let mut invalid = 0;
        for h in handles {
            let r = timeout(LIMIT, h).await.unwrap().unwrap();
            let e = r.expect_err("disagreeing ranks cannot succeed");
            invalid += usize::from(matches!(e, CommError::Mismatch { .. }));
        }
        assert!(invalid >= 1, "{algo:?}: nobody reported the disagreement");
    }
}

#[tokio::test(start_paused = true)]
async fn local_argument_errors_are_invalid_argument_on_every_rank() {
    let (_net, comms) = world(3, &CommConfig::default(), NO_PROGRESS.as_millis() as u64);
    let handles: Vec<_> = comms
        .into_iter()
        .map(|mut c| {
            tokio::spawn(async move {
                let a = c.broadcast(&mut [0u8; 4], 3).await;
                let mut fresh = c;
                (a, fresh.barrier().await)
            })
        })
        .collect();
    for h in handles {
        let (a, b) = timeout(LIMIT, h).await.unwrap().unwrap();
        assert!(matches!(a, Err(CommError::InvalidArgument(_))), "{a:?}");
        // Poisoned with the same class.
        assert!(matches!(b, Err(CommError::InvalidArgument(_))), "{b:?}");
    }
    let (_net, mut comms) = world(2, &CommConfig::default(), NO_PROGRESS.as_millis() as u64);
    let mut out = vec![0f32; 3];
    assert!(matches!(comms[0].allgather(&[1.0f32, 2.0], &mut out).await, Err(CommError::InvalidArgument(_))));
    assert!(matches!(comms[1].send(&[1u8], 1).await, Err(CommError::InvalidArgument(_))));
}

#[tokio::test(start_paused = true)]
async fn disagreeing_roots_fail_by_deadline_not_hang() {
    let (_net, comms) = world(2, &CommConfig::default(), NO_PROGRESS.as_millis() as u64);
    let handles: Vec<_> = comms
        .into_iter()
        .map(|mut c| {
            tokio::spawn(async move {
                let root = c.rank(); // both think they are the root
                let mut out = vec![0u32 as i32; 4];
                c.gather(&[1i32, 2], &mut out, root).await
            })
        })
        .collect();
    for h in handles {
        let r = timeout(LIMIT, h).await.unwrap().unwrap();
        assert!(matches!(r, Err(CommError::Timeout { .. } | CommError::PeerFailed { .. })), "{r:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn whole_op_bound_times_out_and_poisons() {
    let config = CommConfig { op_timeout: Some(Duration::from_secs(1)), ..CommConfig::default() };
    let (_net, mut comms) = world(2, &config, 60_000);
    let mut c = comms.remove(0); // rank 1 never shows up
    let start = Instant::now();
    let e = c.allreduce(&mut [1.0f32; 8], ReduceOp::Sum).await.unwrap_err();
    assert!(matches!(e, CommError::Timeout { rank: None, after, .. } if after == Duration::from_secs(1)), "{e}");
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    assert!(matches!(c.barrier().await, Err(CommError::Timeout { .. })));
    assert!(c.transport().as_ref().is_aborted_for_test());
}

trait AbortedForTest {
    fn is_aborted_for_test(&self) -> bool;
}

impl AbortedForTest for SimTransport {
    fn is_aborted_for_test(&self) -> bool {
        cohort_transports::Transport::is_aborted(self)
    }
}

#[tokio::test(start_paused = true)]
async fn cancelled_operation_poisons_the_communicator() {
    let (_net, mut comms) = world(2, &CommConfig::default(), 60_000);
    let mut c = comms.remove(0);
    let mut data = [1.0f32; 4];
    // Drop the allreduce future while it waits for rank 1.
    assert!(timeout(Duration::from_millis(5), c.allreduce(&mut data, ReduceOp::Sum)).await.is_err());
    let e = c.barrier().await.unwrap_err();
    assert!(matches!(e, CommError::Revoked { .. }), "{e}");
    assert!(e.to_string().contains("cancelled"), "{e}");
}

#[tokio::test]
async fn world_of_one_is_local() {
    let (_net, mut comms) = world(1, &CommConfig::default(), 1000);
    let c = &mut comms[0];
    let mut v = vec![3.0f32, 4.0];
    c.allreduce(&mut v, ReduceOp::Avg).await.unwrap();
    assert_eq!(v, [3.0, 4.0]);
    let mut out = vec![0.0f32; 2];
    c.allgather(&v, &mut out).await.unwrap();
    assert_eq!(out, v);
    c.barrier().await.unwrap();
    assert!(matches!(c.send(&v, 0).await, Err(CommError::InvalidArgument(_))));
}

/// Cases per property: `PROPTEST_CASES` (the knob every property test of the workspace
/// takes) when set, else 24: each case runs a whole simulated world, so fewer than
/// proptest's default of 256 (docs/testing.md).
fn proptest_cases(proptest_cases: Option<&str>) -> u32 {
    match proptest_cases {
        None => 24,
        Some(v) => v.trim().parse().unwrap_or_else(|_| panic!("PROPTEST_CASES={v:?} is not a number of cases")),
    }
}

#[test]
fn proptest_cases_sets_the_number_of_cases() {
    assert_eq!(proptest_cases(None), 24);
    assert_eq!(proptest_cases(Some("500")), 500);
    assert_eq!(proptest_cases(Some(" 1 ")), 1);
}

mod props {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: proptest_cases(std::env::var("PROPTEST_CASES").ok().as_deref()),
            ..ProptestConfig::default()
        })]

        /// Random world, size, algorithm, segment and values: integer sums are exact, so the
        /// result must equal the plain sum on every rank.
        #[test]
        fn allreduce_matches_reference(
            n in 1u32..=8,
            len in 0usize..3000,
            seg in 4usize..5000,
            algo in prop::sample::select(vec![Algorithm::Ring, Algorithm::Bcube, Algorithm::RecursiveDoubling, Algorithm::Auto]),
            seed in any::<u32>(),
        ) {
            let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
            let results = rt.block_on(async move { timeout(LIMIT, async move {
                let (_net, comms) = world(n, &CommConfig { segment_bytes: seg, ..CommConfig::default() }, 10_000);
                let hs: Vec<_> = comms.into_iter().map(|mut c| tokio::spawn(async move {
                    let r = c.rank();
                    let mut v: Vec<i64> = (0..len as u64).map(|i| ((i ^ u64::from(seed)).wrapping_mul(r as u64 + 3) % 1000) as i64 - 500).collect();
                    c.allreduce_with(&mut v, ReduceOp::Sum, algo).await.map(|_| v)
                })).collect();
                let mut out = Vec::new();
                for h in hs { out.push(h.await.unwrap().unwrap()); }
                out
            }).await }).expect("timed out");
            let want: Vec<i64> = (0..len as u64)
                .map(|i| (0..n).map(|r| ((i ^ u64::from(seed)).wrapping_mul(r as u64 + 3) % 1000) as i64 - 500).sum())
                .collect();
            for got in results {
                prop_assert_eq!(&got, &want);
            }
        }
    }
}
