//! RDMA transport tests that need a device.
//!
//! The device is `COHORT_RDMA_DEVICE` (e.g. `mlx5_0`) or the first one with an active port.
//! Without a device every test prints `SKIPPED: no RDMA device: <why>` and returns;
//! `rdma_device_tests_skipped_without_device` checks that the reason is the clear error the
//! transport promises. Run on a machine with a NIC:
//! `COHORT_RDMA_DEVICE=mlx5_0 cargo test -p cohort-transports --features rdma --test rdma_device`.
//!
//! The late-rank tests at the end mirror `late_peers.rs` (TCP and shared memory) over RDMA:
//! the endpoint's responder answers, a late peer is waited for past the ceiling, a deadlock
//! inside the collective still fails at the ceiling, and a peer that never comes fails at the
//! late-rank bound with `Silence::Late`. The decision itself is unit-tested without a device
//! (`rdma::late`).
#![cfg(feature = "rdma")]

use cohort_transports::activity::CpuUse;
use cohort_transports::rdma::{device_names, DeviceConfig, RdmaEndpoint, RdmaMeshSpec, RdmaOptions, RdmaTransport};
use cohort_transports::{AbortReason, Deadlines, Learning, Silence, Tag, Transport, TransportError};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

const TEST_LIMIT: Duration = Duration::from_secs(60);

/// The device to use, or why there is none.
fn device() -> Result<DeviceConfig, String> {
    let names = device_names().map_err(|e| e.to_string())?;
    match std::env::var("COHORT_RDMA_DEVICE") {
        Ok(want) if !want.is_empty() => {
            if names.contains(&want) {
                Ok(DeviceConfig { name: Some(want), ..Default::default() })
            } else {
                Err(format!("COHORT_RDMA_DEVICE={want} not among the devices present ({})", names.join(", ")))
            }
        }
        _ => Ok(DeviceConfig::default()),
    }
}

macro_rules! device_or_skip {
    () => {
        match device() {
            Ok(d) => d,
            Err(why) => {
                eprintln!("SKIPPED: no RDMA device: {why}");
                return;
            }
        }
    };
}

fn options(device: &DeviceConfig) -> RdmaOptions {
    // Small slots so that multi-segment messages and credit returns are exercised.
    RdmaOptions { device: device.clone(), slot_bytes: 4096, slots: 4, ..Default::default() }
}

async fn mesh(device: &DeviceConfig, world: u32, deadlines: Deadlines) -> Vec<Arc<RdmaTransport>> {
    mesh_of("rdma-test", device, world, deadlines).await.1
}

/// A mesh of `world` for job `job` (tests that read the activity boards use a job of their
/// own: boards are per job, generation and rank in the process), with its endpoints (their
/// liveness responders answer only while they live).
async fn mesh_of(
    job: &str,
    device: &DeviceConfig,
    world: u32,
    deadlines: Deadlines,
) -> (Vec<Arc<RdmaEndpoint>>, Vec<Arc<RdmaTransport>>) {
    let mut eps = Vec::new();
    for _ in 0..world {
        eps.push(RdmaEndpoint::open(options(device)).await.expect("open endpoint"));
    }
    let peers: Vec<_> = eps.iter().map(|e| e.address().clone()).collect();
    let mut tasks = Vec::new();
    let eps: Vec<Arc<RdmaEndpoint>> = eps.into_iter().map(Arc::new).collect();
    for (rank, ep) in eps.iter().enumerate() {
        let ep = ep.clone();
        let spec = RdmaMeshSpec {
            job: job.into(),
            generation: 1,
            rank: rank as u32,
            peers: peers.clone(),
            token: b"secret".to_vec(),
            deadlines,
        };
        tasks.push(tokio::spawn(async move { ep.connect_mesh(spec).await }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(Arc::new(t.await.expect("join").expect("connect_mesh")));
    }
    (eps, out)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[test]
fn rdma_device_tests_skipped_without_device() {
    match device_names() {
        Err(e) => {
            let msg = e.to_string();
            assert!(matches!(e, TransportError::Io(_)), "{e:?}");
            assert!(msg.contains("no RDMA device found"), "the skip reason must say what is missing: {msg}");
            eprintln!("SKIPPED: no RDMA device: {msg}");
            // Opening an endpoint fails with the same clear error instead of crashing.
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let err = rt.block_on(RdmaEndpoint::open(RdmaOptions::default())).expect_err("no device");
            assert!(err.to_string().contains("no RDMA device"), "{err}");
        }
        Ok(names) => {
            assert!(!names.is_empty());
            eprintln!("RDMA devices present: {}", names.join(", "));
        }
    }
}

async fn exchange(ts: &[Arc<RdmaTransport>], sizes: &[usize]) {
    let world = ts.len() as u32;
    let mut tasks = Vec::new();
    for t in ts {
        let t = t.clone();
        let sizes = sizes.to_vec();
        tasks.push(tokio::spawn(async move {
            let me = t.rank();
            for (seq, &len) in sizes.iter().enumerate() {
                let seq = seq as u32;
                let sends = (0..world).filter(|&p| p != me).map(|p| {
                    let t = t.clone();
                    async move {
                        let data = pattern(len, (me * 16 + p) as u8);
                        t.send(p, Tag::new(seq, me, 7), &data).await
                    }
                });
                let recvs = (0..world).filter(|&p| p != me).map(|p| {
                    let t = t.clone();
                    async move {
                        let mut buf = vec![0u8; len];
                        t.recv(p, Tag::new(seq, p, 7), &mut buf).await?;
                        assert_eq!(buf, pattern(len, (p * 16 + me) as u8), "rank {me} from {p}, {len} bytes");
                        Ok::<(), TransportError>(())
                    }
                });
                let mut handles = Vec::new();
                for s in sends {
                    handles.push(tokio::spawn(s));
                }
                for r in recvs {
                    handles.push(tokio::spawn(r));
                }
                for h in handles {
                    h.await.expect("join").expect("transfer");
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("rank task");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_rank_mesh_exchanges_messages_of_several_sizes() {
    let dev = device_or_skip!();
    tokio::time::timeout(TEST_LIMIT, async {
        let ts = mesh(&dev, 2, Deadlines::default()).await;
        exchange(&ts, &[0, 1, 47, 4047, 4048, 4049, 3 * 4048 + 5, 1 << 20]).await;
        assert!(!ts[0].is_aborted() && !ts[1].is_aborted());
    })
    .await
    .expect("test bounded in time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_rank_mesh_exchanges_messages_of_several_sizes() {
    let dev = device_or_skip!();
    tokio::time::timeout(TEST_LIMIT, async {
        let ts = mesh(&dev, 3, Deadlines::default()).await;
        exchange(&ts, &[0, 8, 5000, 65536 + 3]).await;
    })
    .await
    .expect("test bounded in time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receive_times_out_when_peer_sends_nothing() {
    let dev = device_or_skip!();
    tokio::time::timeout(TEST_LIMIT, async {
        let deadlines =
            Deadlines { no_progress: Duration::from_millis(300), connect: Duration::from_secs(30), learning: None };
        let ts = mesh(&dev, 2, deadlines).await;
        let mut buf = [0u8; 16];
        let err = ts[0].recv(1, Tag::new(1, 0, 0), &mut buf).await.expect_err("nothing was sent");
        assert!(matches!(err, TransportError::Timeout { peer: 1, .. }), "{err:?}");
    })
    .await
    .expect("test bounded in time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_wakes_waiters_at_once() {
    let dev = device_or_skip!();
    tokio::time::timeout(TEST_LIMIT, async {
        let deadlines =
            Deadlines { no_progress: Duration::from_secs(30), connect: Duration::from_secs(30), learning: None };
        let ts = mesh(&dev, 2, deadlines).await;
        let t0 = ts[0].clone();
        let waiter = tokio::spawn(async move {
            let mut buf = [0u8; 16];
            t0.recv(1, Tag::new(1, 0, 0), &mut buf).await
        });
        tokio::task::yield_now().await;
        let start = std::time::Instant::now();
        ts[0].abort(AbortReason::new("test abort"));
        let err = waiter.await.expect("join").expect_err("aborted");
        assert!(matches!(&err, TransportError::Aborted(r) if r.to_string() == "test abort"), "{err:?}");
        assert!(start.elapsed() < Duration::from_secs(1), "abort must not wait on the peer");
        assert!(ts[0].is_aborted());
        let err = ts[0].send(1, Tag::new(2, 0, 0), b"x").await.expect_err("aborted");
        assert!(matches!(err, TransportError::Aborted(_)), "{err:?}");
    })
    .await
    .expect("test bounded in time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn length_mismatch_is_reported() {
    let dev = device_or_skip!();
    tokio::time::timeout(TEST_LIMIT, async {
        let ts = mesh(&dev, 2, Deadlines::default()).await;
        ts[1].send(0, Tag::new(1, 0, 9), &[1, 2, 3]).await.expect("send");
        let mut buf = [0u8; 4];
        let err = ts[0].recv(1, Tag::new(1, 0, 9), &mut buf).await.expect_err("length differs");
        assert!(matches!(err, TransportError::Mismatch { peer: 1, .. }), "{err:?}");
    })
    .await
    .expect("test bounded in time");
}

// A busy rank is not a hung rank, over RDMA (as transports/tests/late_peers.rs over TCP and
// shared memory): with learning on, a wait that moved nothing for the no-progress ceiling
// asks the peer's endpoint where it is.

const FLOOR: Duration = Duration::from_millis(100);
const CEILING: Duration = Duration::from_millis(600);

fn learned(late_rank: Duration) -> Deadlines {
    Deadlines {
        no_progress: CEILING,
        connect: Duration::from_secs(30),
        learning: Some(Learning { floor: FLOOR, late_rank }),
    }
}

/// A learned mesh of `world` for `job` whose every peer's liveness responder has answered
/// (so stalls are settled by asking it): the endpoint's bootstrap port answers probes.
async fn probed_mesh(
    job: &str,
    device: &DeviceConfig,
    world: u32,
    deadlines: Deadlines,
) -> (Vec<Arc<RdmaEndpoint>>, Vec<Arc<RdmaTransport>>) {
    let (eps, ts) = mesh_of(job, device, world, deadlines).await;
    let until = Instant::now() + Duration::from_secs(10);
    for (r, t) in ts.iter().enumerate() {
        for p in (0..world).filter(|&p| p != r as u32) {
            while !t.peer_probed(p) {
                assert!(Instant::now() < until, "rank {p}'s liveness responder never answered rank {r}");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
    (eps, ts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoint_answers_liveness_probes_and_fixed_deadlines_probe_nothing() {
    let dev = device_or_skip!();
    tokio::time::timeout(TEST_LIMIT, async {
        let (_eps, ts) = probed_mesh("rdma-late-probed", &dev, 2, learned(Duration::from_secs(60))).await;
        assert!(!ts[0].peer_probed(0), "a rank is not its own peer");
        let (_eps, fixed) =
            mesh_of("rdma-late-fixed", &dev, 2, Deadlines::fixed(CEILING, Duration::from_secs(30))).await;
        assert!(!fixed[0].peer_probed(1), "learning off: nobody is asked");
    })
    .await
    .expect("test bounded in time");
}

/// Rank 0 waits for operation 2 from rank 1, which "computes" (its task sleeps: the thing
/// under test is its lateness) for five ceilings before it enters and sends: no error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_peer_is_waited_for_past_the_ceiling() {
    let dev = device_or_skip!();
    tokio::time::timeout(TEST_LIMIT, async {
        let (_eps, ts) = probed_mesh("rdma-late-waited", &dev, 2, learned(Duration::from_secs(60))).await;
        let mut buf = [0u8; 8];
        // Operation 1 both ways: both ranks have entered something.
        let t1 = Arc::clone(&ts[1]);
        let first = tokio::spawn(async move { t1.send(0, Tag::new(1, 0, 0), &[1u8; 8]).await });
        ts[0].recv(1, Tag::new(1, 0, 0), &mut buf).await.expect("operation 1");
        first.await.expect("join").expect("send of operation 1");
        let t1 = Arc::clone(&ts[1]);
        let late = tokio::spawn(async move {
            tokio::time::sleep(CEILING * 5).await;
            t1.send(0, Tag::new(2, 0, 0), &[2u8; 8]).await
        });
        let t0 = Instant::now();
        ts[0].recv(1, Tag::new(2, 0, 0), &mut buf).await.expect("a late peer is no failure");
        assert!(t0.elapsed() >= CEILING * 5, "the message came early: {:?}", t0.elapsed());
        assert_eq!(buf, [2u8; 8]);
        late.await.expect("join").expect("the late send");
        assert!(!ts[0].is_aborted() && !ts[1].is_aborted());
    })
    .await
    .expect("test bounded in time");
}

/// Both ranks inside operation 2, each waiting on the other (a deadlock inside the
/// collective): the ceiling still applies, long before the late-rank bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_inside_the_collective_still_fails_at_the_ceiling() {
    let dev = device_or_skip!();
    tokio::time::timeout(TEST_LIMIT, async {
        let (_eps, ts) = probed_mesh("rdma-late-inside", &dev, 2, learned(Duration::from_secs(600))).await;
        let t1 = Arc::clone(&ts[1]);
        let other = tokio::spawn(async move {
            let mut b = [0u8; 8];
            t1.recv(0, Tag::new(2, 0, 0), &mut b).await
        });
        let mut buf = [0u8; 8];
        let t0 = Instant::now();
        let e0 = ts[0].recv(1, Tag::new(2, 0, 0), &mut buf).await.expect_err("a deadlock inside the collective");
        let e1 = other.await.expect("task").expect_err("a deadlock inside the collective");
        let waited = t0.elapsed();
        // Whichever rank meets the ceiling first fails its link; the other may see it close.
        let at_ceiling = |e: &TransportError| matches!(e, TransportError::Timeout { silence: Silence::Unprobed, .. });
        for (r, e) in [(0, &e0), (1, &e1)] {
            assert!(at_ceiling(e) || matches!(e, TransportError::PeerClosed { .. }), "rank {r}: {e:?}");
        }
        assert!(at_ceiling(&e0) || at_ceiling(&e1), "nobody met the ceiling: {e0:?} / {e1:?}");
        assert!(waited >= CEILING && waited < Duration::from_secs(30), "waited {waited:?}");
    })
    .await
    .expect("test bounded in time");
}

/// Rank 1 never enters operation 2 while its process computes (a thread spins): rank 0
/// fails at the late-rank bound, not the ceiling, and the error says the process runs and
/// computes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_never_comes_fails_at_the_late_rank_bound() {
    let dev = device_or_skip!();
    tokio::time::timeout(TEST_LIMIT, async {
        let bound = Duration::from_secs(3);
        let (_eps, ts) = probed_mesh("rdma-late-never", &dev, 2, learned(bound)).await;
        let stop = Arc::new(AtomicBool::new(false));
        let spin = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut x = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                }
            })
        };
        let mut buf = [0u8; 8];
        let t0 = Instant::now();
        let e = ts[0].recv(1, Tag::new(2, 0, 0), &mut buf).await.expect_err("the peer never comes");
        let waited = t0.elapsed();
        stop.store(true, Ordering::Relaxed);
        spin.join().expect("spinning thread");
        match e {
            TransportError::Timeout { peer: 1, after, silence: Silence::Late { cpu } } => {
                assert_eq!(after, bound);
                assert_eq!(cpu, CpuUse::Busy, "a spinning process counts as computing");
            }
            e => panic!("expected a late-rank timeout, got {e:?}"),
        }
        assert!(waited >= bound, "failed before the late-rank bound: {waited:?}");
    })
    .await
    .expect("test bounded in time");
}
