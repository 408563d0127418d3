//! TCP meshes on loopback: data integrity, ordering, mismatches, concurrent generations.

mod tcp_support;

use cohort_transports::tcp::{TcpEndpoint, TcpTransport};
use cohort_transports::{Rank, Tag, Transport, TransportError};
use std::sync::Arc;
use std::time::Duration;
use tcp_support::*;
use tokio::time::timeout;

const SIZES: [usize; 5] = [0, 1, 4093, 1 << 20, 17 << 20];

fn seed(from: Rank, to: Rank, i: usize) -> u64 {
    (u64::from(from) << 32) | (u64::from(to) << 16) | i as u64
}

async fn exchange_all(ts: Vec<Arc<TcpTransport>>) {
    let mut tasks = tokio::task::JoinSet::new();
    for t in &ts {
        for peer in 0..t.world_size() {
            if peer == t.rank() {
                continue;
            }
            let tx = Arc::clone(t);
            tasks.spawn(async move {
                for (i, &len) in SIZES.iter().enumerate() {
                    let data = pattern(seed(tx.rank(), peer, i), len);
                    tx.send(peer, Tag::new(i as u32, 0, len as u32), &data).await.unwrap();
                }
            });
            let rx = Arc::clone(t);
            tasks.spawn(async move {
                for (i, &len) in SIZES.iter().enumerate() {
                    let mut buf = vec![0u8; len];
                    rx.recv(peer, Tag::new(i as u32, 0, len as u32), &mut buf).await.unwrap();
                    assert!(
                        buf == pattern(seed(peer, rx.rank(), i), len),
                        "rank {} from {peer}: size {len} corrupted",
                        rx.rank()
                    );
                }
            });
        }
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
}

async fn run_mesh(n: usize) {
    let d = deadlines(Duration::from_secs(20), Duration::from_secs(20));
    let (_eps, ts) = mesh(n, d).await;
    for (r, t) in ts.iter().enumerate() {
        assert_eq!(t.rank(), r as Rank);
        assert_eq!(t.world_size(), n as u32);
        assert_eq!(t.generation(), 1);
    }
    exchange_all(ts.clone()).await;
    assert!(ts.iter().all(|t| !t.is_aborted()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_of_1() {
    timeout(TEST_LIMIT, async {
        let (_eps, ts) = mesh(1, Default::default()).await;
        let t = &ts[0];
        assert_eq!(t.world_size(), 1);
        let e = t.send(0, Tag::new(0, 0, 0), b"x").await.unwrap_err();
        assert!(matches!(e, TransportError::InvalidArgument(_)), "{e:?}");
        let e = t.recv(1, Tag::new(0, 0, 0), &mut [0u8; 1]).await.unwrap_err();
        assert!(matches!(e, TransportError::InvalidArgument(_)), "{e:?}");
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_of_2() {
    timeout(TEST_LIMIT, run_mesh(2)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_of_3() {
    timeout(TEST_LIMIT, run_mesh(3)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_of_4() {
    timeout(TEST_LIMIT, run_mesh(4)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_of_5() {
    timeout(TEST_LIMIT, run_mesh(5)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_order_frames_are_stashed_and_delivered() {
    timeout(TEST_LIMIT, async {
        let (_eps, ts) = mesh(2, Default::default()).await;
        let (a, b) = (&ts[0], &ts[1]);
        let first = pattern(1, 3000);
        let second = pattern(2, 70_000);
        // Sent in the order seq 2, seq 1; received in the order seq 1, seq 2.
        a.send(1, Tag::new(2, 0, 9), &second).await.unwrap();
        a.send(1, Tag::new(1, 0, 9), &first).await.unwrap();
        let mut buf1 = vec![0u8; first.len()];
        b.recv(0, Tag::new(1, 0, 9), &mut buf1).await.unwrap();
        assert_eq!(buf1, first);
        let mut buf2 = vec![0u8; second.len()];
        b.recv(0, Tag::new(2, 0, 9), &mut buf2).await.unwrap();
        assert_eq!(buf2, second);

        // Two receives pending on one link at once: the one holding the reader stashes the
        // other's frame, and the other picks it up without waiting for the reader.
        let (mut x, mut y) = (vec![0u8; 10], vec![0u8; 20]);
        let rx = b.recv(0, Tag::new(3, 1, 9), &mut x);
        let ry = b.recv(0, Tag::new(3, 0, 9), &mut y);
        let sends = async {
            a.send(1, Tag::new(3, 0, 9), &pattern(3, 20)).await.unwrap();
            a.send(1, Tag::new(3, 1, 9), &pattern(4, 10)).await.unwrap();
        };
        let (r1, r2, ()) = tokio::join!(rx, ry, sends);
        r1.unwrap();
        r2.unwrap();
        assert_eq!(x, pattern(4, 10));
        assert_eq!(y, pattern(3, 20));
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signature_mismatch_is_reported() {
    timeout(TEST_LIMIT, async {
        let (_eps, ts) = mesh(3, Default::default()).await;
        ts[0].send(1, Tag::new(1, 0, 0xaaaa), &[1u8; 100]).await.unwrap();
        let e = ts[1].recv(0, Tag::new(1, 0, 0xbbbb), &mut [0u8; 100]).await.unwrap_err();
        match &e {
            TransportError::Mismatch { peer: 0, detail, .. } => {
                assert!(detail.contains("signature"), "{detail}")
            }
            e => panic!("expected a mismatch, got {e:?}"),
        }
        // The link stays broken with the same error; the other links keep working.
        let again = ts[1].recv(0, Tag::new(2, 0, 0), &mut [0u8; 1]).await.unwrap_err();
        assert!(matches!(again, TransportError::Mismatch { .. }), "{again:?}");
        ts[2].send(1, Tag::new(1, 0, 5), b"still fine").await.unwrap();
        let mut buf = [0u8; 10];
        ts[1].recv(2, Tag::new(1, 0, 5), &mut buf).await.unwrap();
        assert_eq!(&buf, b"still fine");
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn length_mismatch_is_reported() {
    timeout(TEST_LIMIT, async {
        let (_eps, ts) = mesh(2, Default::default()).await;
        ts[0].send(1, Tag::new(1, 0, 7), &[1u8; 100]).await.unwrap();
        let e = ts[1].recv(0, Tag::new(1, 0, 7), &mut [0u8; 99]).await.unwrap_err();
        match &e {
            TransportError::Mismatch { peer: 0, detail, .. } => {
                assert!(detail.contains("100 bytes received, 99 expected"), "{detail}")
            }
            e => panic!("expected a mismatch, got {e:?}"),
        }
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_generations_share_an_endpoint() {
    timeout(TEST_LIMIT, async {
        let eps = endpoints(2).await;
        let d = deadlines(Duration::from_secs(10), Duration::from_secs(10));
        let (g1, g2) = tokio::join!(mesh_on(&eps, "job", 1, d), mesh_on(&eps, "job", 2, d));
        let (m1, m2) = (pattern(11, 5000), pattern(12, 5000));
        g1[1].send(0, Tag::new(1, 0, 0), &m1).await.unwrap();
        g2[1].send(0, Tag::new(1, 0, 0), &m2).await.unwrap();
        let mut buf = vec![0u8; 5000];
        g2[0].recv(1, Tag::new(1, 0, 0), &mut buf).await.unwrap();
        assert_eq!(buf, m2);
        g1[0].recv(1, Tag::new(1, 0, 0), &mut buf).await.unwrap();
        assert_eq!(buf, m1);
        assert_eq!(g2[0].generation(), 2);
        // The same (job, generation) twice at once on one endpoint is refused.
        let addrs: Vec<_> = eps.iter().map(TcpEndpoint::local_addr).collect();
        let s = spec("job", 3, 1, &addrs, TOKEN, deadlines(Duration::from_secs(1), Duration::from_millis(300)));
        let (a, b) = tokio::join!(eps[1].connect_mesh(s.clone()), eps[1].connect_mesh(s));
        assert!(
            matches!(a, Err(TransportError::InvalidArgument(_)))
                || matches!(b, Err(TransportError::InvalidArgument(_))),
            "{a:?} {b:?}"
        );
    })
    .await
    .unwrap();
}
