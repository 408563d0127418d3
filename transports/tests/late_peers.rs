//! A busy rank is not a hung rank, over real loopback sockets and shared memory: a peer whose
//! process runs but has not entered the operation (it computes its step, writes a
//! checkpoint) is waited for past the no-progress ceiling, and so is a rank waiting behind
//! it; a peer inside the operation that moves nothing still fails at the ceiling; and a
//! peer that never comes fails at the late-rank bound, named as running and late.

mod tcp_support;

use cohort_transports::activity::CpuUse;
use cohort_transports::shm::{ShmEndpoint, ShmMeshSpec, ShmOptions, ShmTransport};
use cohort_transports::tcp::TcpTransport;
use cohort_transports::{Deadlines, Learning, Silence, Tag, Transport, TransportError};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tcp_support::{endpoints, join_all, spec, TEST_LIMIT, TOKEN};
use tokio::time::{timeout, Instant};

const FLOOR: Duration = Duration::from_millis(100);
const CEILING: Duration = Duration::from_millis(600);

fn learned(late_rank: Duration) -> Deadlines {
    Deadlines {
        no_progress: CEILING,
        connect: Duration::from_secs(10),
        learning: Some(Learning { floor: FLOOR, late_rank }),
    }
}

/// A TCP mesh of `n` for job `job`, every link's responder heard (so stalls are probed).
async fn tcp(job: &str, n: usize, d: Deadlines) -> (Vec<cohort_transports::tcp::TcpEndpoint>, Vec<Arc<TcpTransport>>) {
    tcp_each(job, &vec![d; n]).await
}

/// As [`tcp`], rank `r` with deadlines `ds[r]`.
async fn tcp_each(job: &str, ds: &[Deadlines]) -> (Vec<cohort_transports::tcp::TcpEndpoint>, Vec<Arc<TcpTransport>>) {
    let n = ds.len();
    let eps = endpoints(n).await;
    let addrs: Vec<_> = eps.iter().map(|e| e.local_addr()).collect();
    let futs = eps.iter().enumerate().map(|(r, ep)| ep.connect_mesh(spec(job, 1, r as u32, &addrs, TOKEN, ds[r])));
    let ts: Vec<_> = join_all(futs).await.into_iter().map(|t| Arc::new(t.expect("mesh"))).collect();
    let until = Instant::now() + Duration::from_secs(10);
    for (r, t) in ts.iter().enumerate() {
        for p in (0..n as u32).filter(|&p| p != r as u32) {
            while !t.peer_probed(p) {
                assert!(Instant::now() < until, "rank {p}'s liveness responder never answered rank {r}");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
    (eps, ts)
}

async fn shm(job: &str, n: u32, d: Deadlines) -> Vec<Arc<ShmTransport>> {
    shm_each(job, &vec![d; n as usize]).await
}

/// As [`shm`], rank `r` with deadlines `ds[r]`.
async fn shm_each(job: &str, ds: &[Deadlines]) -> Vec<Arc<ShmTransport>> {
    let n = ds.len() as u32;
    let options = ShmOptions { slots: 4, slot_bytes: 4096, ..ShmOptions::default() };
    let eps: Vec<ShmEndpoint> = (0..n).map(|_| ShmEndpoint::new(options.clone()).expect("endpoint")).collect();
    let peers: Vec<_> = eps.iter().map(|e| Some(e.address().clone())).collect();
    let tasks: Vec<_> = eps
        .into_iter()
        .enumerate()
        .map(|(r, e)| {
            let spec = ShmMeshSpec {
                job: job.into(),
                generation: 1,
                rank: r as u32,
                peers: peers.clone(),
                token: b"tok".to_vec(),
                deadlines: ds[r],
            };
            tokio::spawn(async move { e.connect_mesh(spec).await })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(Arc::new(t.await.expect("set-up task").expect("mesh")));
    }
    out
}

/// Rank 0 waits for operation 2 from rank 1, which "computes" (its task sleeps: the thing
/// under test is its lateness) for five ceilings before it enters and sends: no error.
async fn late_peer_is_waited_for<T: Transport>(ts: Vec<Arc<T>>) {
    let mut buf = [0u8; 8];
    // Operation 1 both ways: both ranks have entered something.
    let t1 = Arc::clone(&ts[1]);
    let first = tokio::spawn(async move { t1.send(0, Tag::new(1, 0, 0), &[1u8; 8]).await });
    ts[0].recv(1, Tag::new(1, 0, 0), &mut buf).await.unwrap();
    first.await.unwrap().unwrap();
    let t1 = Arc::clone(&ts[1]);
    let late = tokio::spawn(async move {
        tokio::time::sleep(CEILING * 5).await;
        t1.send(0, Tag::new(2, 0, 0), &[2u8; 8]).await
    });
    let t0 = Instant::now();
    ts[0].recv(1, Tag::new(2, 0, 0), &mut buf).await.expect("a late peer is no failure");
    assert!(t0.elapsed() >= CEILING * 5, "the message came early: {:?}", t0.elapsed());
    assert_eq!(buf, [2u8; 8]);
    late.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_a_late_peer_is_waited_for_past_the_ceiling() {
    timeout(TEST_LIMIT, async {
        let (_eps, ts) = tcp("late-tcp-waited", 2, learned(Duration::from_secs(60))).await;
        late_peer_is_waited_for(ts).await;
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_a_late_peer_is_waited_for_past_the_ceiling() {
    timeout(TEST_LIMIT, async {
        late_peer_is_waited_for(shm("late-shm-waited", 2, learned(Duration::from_secs(60))).await).await;
    })
    .await
    .expect("bounded");
}

/// Three ranks in a chain: rank 2 is late to operation 2; rank 1 has entered it and waits on
/// rank 2; rank 0 waits on rank 1, which is inside the operation but blocked behind a late
/// rank: nobody is cut, and all complete when rank 2 comes.
async fn a_rank_behind_a_late_one_is_waited_for<T: Transport>(ts: Vec<Arc<T>>) {
    let (t1, t2) = (Arc::clone(&ts[1]), Arc::clone(&ts[2]));
    let late = tokio::spawn(async move {
        tokio::time::sleep(CEILING * 5).await;
        t2.send(1, Tag::new(2, 0, 0), &[2u8; 8]).await
    });
    let middle = tokio::spawn(async move {
        let mut b = [0u8; 8];
        t1.recv(2, Tag::new(2, 0, 0), &mut b).await?;
        t1.send(0, Tag::new(2, 1, 0), &b).await
    });
    let mut buf = [0u8; 8];
    ts[0].recv(1, Tag::new(2, 1, 0), &mut buf).await.expect("a rank behind a late rank is no failure");
    assert_eq!(buf, [2u8; 8]);
    middle.await.unwrap().unwrap();
    late.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_a_rank_behind_a_late_rank_is_waited_for() {
    timeout(TEST_LIMIT, async {
        let (_eps, ts) = tcp("late-tcp-chain", 3, learned(Duration::from_secs(60))).await;
        a_rank_behind_a_late_one_is_waited_for(ts).await;
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_a_rank_behind_a_late_rank_is_waited_for() {
    timeout(TEST_LIMIT, async {
        a_rank_behind_a_late_one_is_waited_for(shm("late-shm-chain", 3, learned(Duration::from_secs(60))).await).await;
    })
    .await
    .expect("bounded");
}

/// Both ranks inside operation 2, each waiting on the other (a deadlock inside the
/// collective): the ceiling still applies, long before the late-rank bound. Whichever rank
/// meets it first fails the link, so the other may see the link close instead.
async fn inside_the_collective_the_ceiling_holds<T: Transport + 'static>(ts: Vec<Arc<T>>) {
    let t1 = Arc::clone(&ts[1]);
    let t0 = Instant::now();
    let other = tokio::spawn(async move {
        let mut b = [0u8; 8];
        t1.recv(0, Tag::new(2, 0, 0), &mut b).await
    });
    let mut buf = [0u8; 8];
    let e0 = ts[0].recv(1, Tag::new(2, 0, 0), &mut buf).await.unwrap_err();
    let e1 = other.await.unwrap().unwrap_err();
    let waited = t0.elapsed();
    let at_ceiling = |e: &TransportError| matches!(e, TransportError::Timeout { silence: Silence::Unprobed, .. });
    for (r, e) in [(0, &e0), (1, &e1)] {
        assert!(at_ceiling(e) || matches!(e, TransportError::PeerClosed { .. }), "rank {r}: {e:?}");
    }
    assert!(at_ceiling(&e0) || at_ceiling(&e1), "nobody met the ceiling: {e0:?} / {e1:?}");
    assert!(waited >= CEILING && waited < Duration::from_secs(30), "waited {waited:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_a_peer_inside_the_collective_still_fails_at_the_ceiling() {
    timeout(TEST_LIMIT, async {
        let (_eps, ts) = tcp("late-tcp-inside", 2, learned(Duration::from_secs(600))).await;
        inside_the_collective_the_ceiling_holds(ts).await;
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_a_peer_inside_the_collective_still_fails_at_the_ceiling() {
    timeout(TEST_LIMIT, async {
        inside_the_collective_the_ceiling_holds(shm("late-shm-inside", 2, learned(Duration::from_secs(600))).await)
            .await;
    })
    .await
    .expect("bounded");
}

/// Rank 1 is late to operation 2 (it has not entered), so rank 0 waits behind it; then rank
/// 1 enters and itself waits on rank 0: a deadlock inside the collective. Rank 0's board
/// still says it waits behind late rank 1 when rank 1 first looks (rank 1 looks often, rank
/// 0 seldom), but rank 1 is that root, so it must not take rank 0 for "behind a late rank":
/// otherwise each holds the other up as late until the late-rank bound (ten minutes here).
/// Both fail at the ceiling instead (the one that fails second may see the link close).
async fn a_cycle_of_waits_meets_the_ceiling<T: Transport + 'static>(job: &str, ts: Vec<Arc<T>>) {
    let t0 = Arc::clone(&ts[0]);
    let started = Instant::now();
    let first = tokio::spawn(async move {
        let mut b = [0u8; 8];
        t0.recv(1, Tag::new(2, 0, 0), &mut b).await
    });
    let until = Instant::now() + Duration::from_secs(30);
    while cohort_transports::activity::waiting_on_late(job, 1).is_none() {
        assert!(Instant::now() < until, "rank 0 never judged rank 1 late");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut buf = [0u8; 8];
    let e1 = ts[1].recv(0, Tag::new(2, 0, 0), &mut buf).await.unwrap_err();
    let e0 = first.await.unwrap().unwrap_err();
    let waited = started.elapsed();
    let at_ceiling = |e: &TransportError| matches!(e, TransportError::Timeout { silence: Silence::Unprobed, .. });
    for (r, e) in [(0, &e0), (1, &e1)] {
        assert!(at_ceiling(e) || matches!(e, TransportError::PeerClosed { .. }), "rank {r}: {e:?}");
    }
    assert!(at_ceiling(&e0) || at_ceiling(&e1), "nobody met the ceiling: {e0:?} / {e1:?}");
    assert!(waited < Duration::from_secs(60), "a cycle of waits held itself up as late: {waited:?}");
}

/// Rank 0 looks at rank 1 every second, rank 1 at rank 0 every tenth of one (learned
/// deadlines at their floors); both with a 3 s ceiling and a 10 min late-rank bound.
fn cycle_deadlines() -> Vec<Deadlines> {
    let with_floor = |floor| Deadlines {
        no_progress: Duration::from_secs(3),
        connect: Duration::from_secs(10),
        learning: Some(Learning { floor, late_rank: Duration::from_secs(600) }),
    };
    vec![with_floor(Duration::from_secs(1)), with_floor(FLOOR)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_a_cycle_of_waits_is_no_late_rank() {
    timeout(TEST_LIMIT, async {
        let (_eps, ts) = tcp_each("late-tcp-cycle", &cycle_deadlines()).await;
        a_cycle_of_waits_meets_the_ceiling("late-tcp-cycle", ts).await;
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_a_cycle_of_waits_is_no_late_rank() {
    timeout(TEST_LIMIT, async {
        a_cycle_of_waits_meets_the_ceiling("late-shm-cycle", shm_each("late-shm-cycle", &cycle_deadlines()).await)
            .await;
    })
    .await
    .expect("bounded");
}

/// Rank 1 never enters operation 2 while its process computes (a thread spins): rank 0
/// fails at the late-rank bound, not the ceiling, and the error says the process runs and
/// computes.
async fn a_peer_that_never_comes_fails_at_the_late_bound<T: Transport>(ts: Vec<Arc<T>>, bound: Duration) {
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
    let e = ts[0].recv(1, Tag::new(2, 0, 0), &mut buf).await.unwrap_err();
    let waited = t0.elapsed();
    stop.store(true, Ordering::Relaxed);
    spin.join().unwrap();
    match e {
        TransportError::Timeout { peer: 1, after, silence: Silence::Late { cpu } } => {
            assert_eq!(after, bound);
            assert_eq!(cpu, CpuUse::Busy, "a spinning process counts as computing");
        }
        e => panic!("expected a late-rank timeout, got {e:?}"),
    }
    assert!(waited >= bound, "failed before the late-rank bound: {waited:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_a_peer_that_never_comes_fails_at_the_late_rank_bound() {
    timeout(TEST_LIMIT, async {
        let bound = Duration::from_secs(3);
        let (_eps, ts) = tcp("late-tcp-never", 2, learned(bound)).await;
        a_peer_that_never_comes_fails_at_the_late_bound(ts, bound).await;
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_a_peer_that_never_comes_fails_at_the_late_rank_bound() {
    timeout(TEST_LIMIT, async {
        let bound = Duration::from_secs(3);
        a_peer_that_never_comes_fails_at_the_late_bound(shm("late-shm-never", 2, learned(bound)).await, bound).await;
    })
    .await
    .expect("bounded");
}
