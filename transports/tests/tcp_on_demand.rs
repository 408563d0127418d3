//! TCP meshes set up with only some links (`Upfront::Only`): the others are made on first use,
//! in either direction, authenticated as at set-up, counted, raced against the abort, and
//! bounded by the connect deadline.

mod tcp_support;

use cohort_transports::tcp::{TcpEndpoint, TcpTransport, Upfront};
use cohort_transports::{AbortReason, Deadlines, Rank, Tag, Transport, TransportError};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tcp_support::*;
use tokio::time::{timeout, Instant};

/// A ring: each rank links only its two neighbours at set-up.
fn ring(rank: Rank, n: Rank) -> Upfront {
    let mut peers = vec![(rank + 1) % n, (rank + n - 1) % n];
    peers.sort_unstable();
    peers.dedup();
    peers.retain(|&p| p != rank);
    Upfront::Only(peers)
}

/// Sets up `n` ranks on `eps`, each linking only its ring neighbours.
async fn ring_mesh(eps: &[TcpEndpoint], generation: u64, d: Deadlines) -> Vec<Arc<TcpTransport>> {
    let n = eps.len() as Rank;
    let addrs: Vec<SocketAddr> = eps.iter().map(TcpEndpoint::local_addr).collect();
    let futs = eps.iter().enumerate().map(|(r, ep)| {
        let mut s = spec("job", generation, r as Rank, &addrs, TOKEN, d);
        s.upfront = ring(r as Rank, n);
        ep.connect_mesh(s)
    });
    join_all(futs).await.into_iter().map(|r| Arc::new(r.expect("ring set-up"))).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unplanned_peers_link_on_first_use_in_either_direction() {
    timeout(TEST_LIMIT, async {
        let eps = endpoints(6).await;
        let ts = ring_mesh(&eps, 1, deadlines(Duration::from_secs(20), Duration::from_secs(20))).await;
        for t in &ts {
            assert_eq!(t.linked_peers(), 2, "rank {} after set-up: its two ring neighbours", t.rank());
        }
        // Every ordered pair exchanges one message, the lower rank sending first for half of
        // them: whichever side gets there first, the higher rank dials.
        let mut tasks = tokio::task::JoinSet::new();
        for a in &ts {
            for b in 0..6 {
                if b == a.rank() {
                    continue;
                }
                let (tx, rx) = (Arc::clone(a), Arc::clone(&ts[b as usize]));
                let data = pattern(u64::from(a.rank() * 10 + b), 4093);
                tasks.spawn(async move {
                    let tag = Tag::new(a_to_b(tx.rank(), b), 0, 7);
                    let mut buf = vec![0u8; data.len()];
                    let (sent, got) = tokio::join!(tx.send(b, tag, &data), rx.recv(tx.rank(), tag, &mut buf));
                    sent.expect("send");
                    got.expect("recv");
                    assert_eq!(buf, data);
                });
            }
        }
        while let Some(r) = tasks.join_next().await {
            r.expect("exchange task");
        }
        for t in &ts {
            assert_eq!(t.linked_peers(), 5, "rank {}: every peer linked once, no duplicates", t.rank());
        }
    })
    .await
    .expect("test timed out");
}

/// A distinct operation number for each ordered pair, so that the messages never meet.
fn a_to_b(a: Rank, b: Rank) -> u32 {
    a * 16 + b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_never_dials_times_out_at_the_connect_deadline() {
    timeout(TEST_LIMIT, async {
        let connect = Duration::from_millis(400);
        let eps = endpoints(4).await;
        let ts = ring_mesh(&eps, 1, deadlines(Duration::from_secs(20), connect)).await;
        // Rank 0 waits for rank 2 (the higher one dials), which never asks for the link.
        let started = Instant::now();
        let e = ts[0].recv(2, Tag::new(1, 0, 0), &mut [0u8; 4]).await.unwrap_err();
        assert!(matches!(e, TransportError::Timeout { peer: 2, after, .. } if after == connect), "{e}");
        assert!(started.elapsed() >= connect, "gave up before the deadline: {:?}", started.elapsed());
        assert_eq!(ts[0].linked_peers(), 2);
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dialling_a_peer_that_is_gone_fails_within_the_connect_deadline() {
    timeout(TEST_LIMIT, async {
        let connect = Duration::from_millis(600);
        let mut eps = endpoints(4).await;
        let mut ts = ring_mesh(&eps, 1, deadlines(Duration::from_secs(20), connect)).await;
        // Rank 0 goes away (transport and endpoint); rank 2 then needs its link to it.
        drop(ts.remove(0));
        drop(eps.remove(0));
        let e = ts[1].send(0, Tag::new(1, 0, 0), b"late").await.unwrap_err();
        assert!(matches!(e, TransportError::Handshake { peer: 0, .. }), "{e}");
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_ends_a_wait_for_a_link_at_once() {
    timeout(TEST_LIMIT, async {
        let eps = endpoints(4).await;
        let ts = ring_mesh(&eps, 1, deadlines(Duration::from_secs(20), Duration::from_secs(20))).await;
        let t0 = Arc::clone(&ts[0]);
        let waiting = tokio::spawn(async move { t0.recv(2, Tag::new(1, 0, 0), &mut [0u8; 4]).await });
        ts[0].abort(AbortReason::new("test revokes the generation"));
        let e = timeout(Duration::from_secs(5), waiting)
            .await
            .expect("the abort did not end the wait")
            .expect("task")
            .unwrap_err();
        assert!(matches!(e, TransportError::Aborted(ref r) if r.to_string().contains("test revokes")), "{e}");
        // A link made now, after the abort, is refused the same way.
        let e = ts[0].send(2, Tag::new(2, 0, 0), b"x").await.unwrap_err();
        assert!(matches!(e, TransportError::Aborted(_)), "{e}");
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dial_with_the_wrong_token_links_nothing() {
    timeout(TEST_LIMIT, async {
        let connect = Duration::from_millis(500);
        let eps = endpoints(4).await;
        let ts = ring_mesh(&eps, 1, deadlines(Duration::from_secs(20), connect)).await;
        // A stranger (the right job and generation, not the job's token) dials rank 0 as rank 2.
        let stranger = TcpEndpoint::bind(loopback(), Default::default()).await.expect("bind");
        let addrs: Vec<SocketAddr> = eps.iter().map(TcpEndpoint::local_addr).collect();
        let mut s = spec("job", 1, 2, &addrs, b"not-the-token", deadlines(Duration::from_secs(20), connect));
        s.upfront = Upfront::Only(vec![0]);
        let forged = stranger.connect_mesh(s).await;
        assert!(forged.is_err(), "a wrong token must not link");
        // Rank 0 still has no link to rank 2, and waiting for it times out as with no dial.
        assert_eq!(ts[0].linked_peers(), 2);
        let e = ts[0].recv(2, Tag::new(1, 0, 0), &mut [0u8; 4]).await.unwrap_err();
        assert!(matches!(e, TransportError::Timeout { peer: 2, .. }), "{e}");
    })
    .await
    .expect("test timed out");
}

/// Finds addresses from a table, counting the questions per rank; a rank not in the table is
/// refused.
#[derive(Debug)]
struct Table {
    addresses: std::collections::HashMap<Rank, SocketAddr>,
    asked: std::sync::Mutex<Vec<Rank>>,
}

impl cohort_transports::tcp::ResolvePeer for Table {
    fn resolve(
        &self,
        peer: Rank,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<SocketAddr, TransportError>> + Send + '_>> {
        self.asked.lock().unwrap().push(peer);
        let found = self
            .addresses
            .get(&peer)
            .copied()
            .ok_or_else(|| TransportError::InvalidArgument(format!("no address for rank {peer}")));
        Box::pin(async move { found })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn addresses_not_given_are_resolved_once_on_first_use() {
    use cohort_transports::tcp::UNKNOWN_PEER;
    timeout(TEST_LIMIT, async {
        // Six ranks on a ring; each is given only its neighbours' addresses. Rank 5 may
        // resolve every rank but 1; the others resolve nothing.
        let eps = endpoints(6).await;
        let addrs: Vec<SocketAddr> = eps.iter().map(TcpEndpoint::local_addr).collect();
        let d = deadlines(Duration::from_secs(20), Duration::from_secs(20));
        let table = Arc::new(Table {
            addresses: [0, 2, 3].into_iter().map(|r| (r, addrs[r as usize])).collect(),
            asked: std::sync::Mutex::new(Vec::new()),
        });
        let futs = eps.iter().enumerate().map(|(r, ep)| {
            let Upfront::Only(near) = ring(r as Rank, 6) else { unreachable!() };
            let given: Vec<SocketAddr> = (0..6u32)
                .map(|p| if near.contains(&p) || p == r as Rank { addrs[p as usize] } else { UNKNOWN_PEER })
                .collect();
            let mut s = spec("job", 1, r as Rank, &given, TOKEN, d);
            s.upfront = Upfront::Only(near);
            if r == 5 {
                s.resolver = Some(Arc::clone(&table) as Arc<dyn cohort_transports::tcp::ResolvePeer>);
            }
            ep.connect_mesh(s)
        });
        let ts: Vec<Arc<TcpTransport>> =
            join_all(futs).await.into_iter().map(|r| Arc::new(r.expect("set-up"))).collect();
        // 5 sends to 2 twice (one resolution), and to 3: it dials, having resolved them.
        for (to, seq) in [(2u32, 0u32), (2, 1), (3, 0)] {
            let tag = Tag::new(a_to_b(5, to), seq, 7);
            let data = pattern(u64::from(to + seq), 1000);
            let mut buf = vec![0u8; data.len()];
            let (sent, got) = tokio::join!(ts[5].send(to, tag, &data), ts[to as usize].recv(5, tag, &mut buf));
            sent.expect("send");
            got.expect("recv");
            assert_eq!(buf, data);
        }
        assert_eq!(*table.asked.lock().unwrap(), vec![2, 3], "each address asked for once");
        // Rank 1's address cannot be found: the operation fails with the resolver's error and
        // nothing is linked.
        let err = ts[5].send(1, Tag::new(a_to_b(5, 1), 0, 7), &[1, 2, 3]).await.expect_err("no address");
        assert!(err.to_string().contains("no address for rank 1"), "{err}");
        // Rank 2 has no resolver: it cannot dial rank 0 (not given), and says so.
        let err = ts[2].send(0, Tag::new(a_to_b(2, 0), 0, 7), &[1]).await.expect_err("no resolver");
        assert!(err.to_string().contains("rank 0 has no address"), "{err}");
        assert_eq!(ts[5].linked_peers(), 4, "neighbours 0 and 4, then 2 and 3");
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_up_refuses_a_planned_peer_whose_address_is_not_given() {
    use cohort_transports::tcp::UNKNOWN_PEER;
    let eps = endpoints(2).await;
    let mut s = spec(
        "job",
        1,
        1,
        &[UNKNOWN_PEER, eps[1].local_addr()],
        TOKEN,
        deadlines(Duration::from_secs(5), Duration::from_secs(5)),
    );
    s.upfront = Upfront::Only(vec![0]);
    let Err(err) = timeout(TEST_LIMIT, eps[1].connect_mesh(s)).await.expect("bounded") else {
        panic!("the set-up was not refused");
    };
    assert!(matches!(err, TransportError::InvalidArgument(_)), "{err}");
}
