//! Incremental re-formation over TCP: links whose two ends survive are carried into the next
//! generation (re-bound with the set-up's authenticated handshake, stale frames skipped);
//! links that cannot be carried on one side are replaced by fresh connections; a link left
//! half way through a frame is never carried. Real sockets on loopback.

mod tcp_support;

use cohort_transports::tcp::{CarriedLink, TcpEndpoint, TcpTransport};
use cohort_transports::{AbortReason, Deadlines, Rank, Tag, Transport};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tcp_support::*;
use tokio::time::timeout;

fn d() -> Deadlines {
    deadlines(Duration::from_secs(20), Duration::from_secs(20))
}

/// Sets up generation `generation` on `eps` (rank = index) with links that may be carried on,
/// each rank re-binding the links `carried[rank]` brings.
async fn carrying_mesh(
    eps: &[&TcpEndpoint],
    generation: u64,
    carried: Vec<Vec<(Rank, CarriedLink)>>,
) -> Vec<Arc<TcpTransport>> {
    let addrs: Vec<SocketAddr> = eps.iter().map(|e| e.local_addr()).collect();
    let futs = eps.iter().zip(carried).enumerate().map(|(r, (ep, carried))| {
        let mut s = spec("job", generation, r as Rank, &addrs, TOKEN, d());
        s.carry_links = true;
        ep.connect_mesh_carrying(s, carried)
    });
    join_all(futs).await.into_iter().map(|r| Arc::new(r.expect("set-up"))).collect()
}

/// The generation of `ts` is revoked: every rank aborts its transport (the links stay open,
/// to be carried).
fn revoke(ts: &[Arc<TcpTransport>]) {
    for t in ts {
        t.abort(AbortReason::new("generation revoked"));
    }
}

/// Every ordered pair exchanges one message of a pattern that depends on the pair and `salt`.
async fn exchange_all(ts: &[Arc<TcpTransport>], op: u32, salt: u64) {
    let mut tasks = tokio::task::JoinSet::new();
    for a in ts {
        for b in ts {
            if a.rank() == b.rank() {
                continue;
            }
            let (tx, rx) = (Arc::clone(a), Arc::clone(b));
            tasks.spawn(async move {
                let tag = Tag::new(op, tx.rank() * 16 + rx.rank(), 11);
                let data = pattern(salt + u64::from(tx.rank() * 16 + rx.rank()), 9000);
                let mut buf = vec![0u8; data.len()];
                let (sent, got) = tokio::join!(tx.send(rx.rank(), tag, &data), rx.recv(tx.rank(), tag, &mut buf));
                sent.expect("send");
                got.expect("recv");
                assert_eq!(buf, data, "{} -> {}", tx.rank(), rx.rank());
            });
        }
    }
    while let Some(r) = tasks.join_next().await {
        r.expect("exchange task");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_whose_two_ends_survive_are_carried_and_stale_frames_skipped() {
    timeout(TEST_LIMIT, async {
        let eps = endpoints(4).await;
        let all: Vec<&TcpEndpoint> = eps.iter().collect();
        let g1 = carrying_mesh(&all, 1, (0..4).map(|_| Vec::new()).collect()).await;
        exchange_all(&g1, 1, 100).await;
        // Frames nobody receives in generation 1: rank 3 to rank 2 (both survive), and a
        // large one from rank 2 to rank 0.
        g1[3].send(2, Tag::new(2, 0, 5), &pattern(7, 3000)).await.expect("a send the peer never receives");
        g1[2].send(0, Tag::new(2, 0, 5), &pattern(8, 200_000)).await.expect("a large unreceived send");
        // Generation 1 is revoked; rank 1 dies (its sockets close).
        revoke(&g1);
        let survivors: Vec<Arc<TcpTransport>> =
            g1.iter().enumerate().filter(|(r, _)| *r != 1).map(|(_, t)| Arc::clone(t)).collect();
        drop(g1);
        // Old ranks 0, 2, 3 are new ranks 0, 1, 2.
        let old_of_new = [0, 2, 3];
        let mut carried = Vec::new();
        for t in &survivors {
            let links = t.carry_over();
            assert_eq!(links.generation(), 1);
            let mine: Vec<(Rank, CarriedLink)> = (0..3)
                .filter(|&new| old_of_new[new as usize] != t.rank())
                .map(|new| (new, links.take(old_of_new[new as usize], 2).expect("a clean link is carried")))
                .collect();
            // The link to the dead rank is not asked for; dropping the handle closes it.
            carried.push(mine);
        }
        drop(survivors);
        let g2_eps: Vec<&TcpEndpoint> = old_of_new.iter().map(|&r| &eps[r as usize]).collect();
        let g2 = carrying_mesh(&g2_eps, 2, carried).await;
        for t in &g2 {
            assert_eq!(t.linked_peers(), 2, "rank {}", t.rank());
            assert_eq!(t.carried_links(), 2, "rank {}: both links carried, none dialled", t.rank());
        }
        // The carried links carry generation 2's frames, in both directions, past the stale
        // generation-1 frames that were skipped.
        exchange_all(&g2, 1, 200).await;
        // And generation 2's links are carried on again (a second re-formation, nobody lost).
        revoke(&g2);
        let mut carried = Vec::new();
        for t in &g2 {
            let links = t.carry_over();
            carried.push((0..3).filter(|&p| p != t.rank()).map(|p| (p, links.take(p, 3).expect("clean"))).collect());
        }
        drop(g2);
        let g3 = carrying_mesh(&g2_eps, 3, carried).await;
        assert!(g3.iter().all(|t| t.carried_links() == 2));
        exchange_all(&g3, 4, 300).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_one_side_cannot_carry_is_replaced_by_a_fresh_connection() {
    timeout(TEST_LIMIT, async {
        let eps = endpoints(3).await;
        let all: Vec<&TcpEndpoint> = eps.iter().collect();
        let g1 = carrying_mesh(&all, 1, (0..3).map(|_| Vec::new()).collect()).await;
        exchange_all(&g1, 1, 10).await;
        revoke(&g1);
        // Rank 1 carries nothing (as if both its links had broken): it drops the handle, which
        // shuts its ends down. Ranks 0 and 2 carry everything they can: their link to each
        // other, and their ends of the links to rank 1, whose re-binds then fail (rank 0 waits
        // for rank 1's fresh dial; rank 2 dials rank 1 afresh).
        let take_all = |t: &TcpTransport| {
            let links = t.carry_over();
            (0..3).filter(|&p| p != t.rank()).filter_map(|p| links.take(p, 2).map(|l| (p, l))).collect::<Vec<_>>()
        };
        let c0 = take_all(&g1[0]);
        let c2 = take_all(&g1[2]);
        assert_eq!((c0.len(), c2.len()), (2, 2));
        drop(g1[1].carry_over());
        drop(g1);
        let g2 = carrying_mesh(&all, 2, vec![c0, Vec::new(), c2]).await;
        let carried: Vec<usize> = g2.iter().map(|t| t.carried_links()).collect();
        assert_eq!(carried, [1, 0, 1], "only the link between ranks 0 and 2 is carried");
        assert!(g2.iter().all(|t| t.linked_peers() == 2));
        exchange_all(&g2, 1, 20).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_left_inside_a_frame_is_not_carried_one_left_between_frames_is() {
    timeout(TEST_LIMIT, async {
        let eps = endpoints(3).await;
        let all: Vec<&TcpEndpoint> = eps.iter().collect();
        let g1 = carrying_mesh(&all, 1, (0..3).map(|_| Vec::new()).collect()).await;
        // Rank 0 starts a send to rank 1 far larger than the socket buffers, which rank 1
        // never receives: cut short, it leaves the frame half sent.
        let big = pattern(1, 64 << 20);
        let cut = timeout(Duration::from_millis(300), g1[0].send(1, Tag::new(1, 0, 1), &big)).await;
        assert!(cut.is_err(), "the send cannot complete while rank 1 does not read");
        // Rank 0 waits for a frame from rank 2 that never comes, and is cut short between
        // frames.
        let mut buf = [0u8; 64];
        let waited = timeout(Duration::from_millis(100), g1[0].recv(2, Tag::new(1, 0, 1), &mut buf)).await;
        assert!(waited.is_err(), "nothing was sent");
        revoke(&g1);
        let links = g1[0].carry_over();
        assert!(links.take(1, 2).is_none(), "the link with a half-sent frame must not be carried");
        assert!(links.take(2, 2).is_some(), "the link left between frames is clean");
        assert!(links.take(2, 2).is_none(), "a link is carried once");
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_carried_link_closes_with_its_new_generation_while_the_old_one_lives() {
    timeout(TEST_LIMIT, async {
        let eps = endpoints(2).await;
        let all: Vec<&TcpEndpoint> = eps.iter().collect();
        let g1 = carrying_mesh(&all, 1, vec![Vec::new(), Vec::new()]).await;
        revoke(&g1);
        let carried = g1
            .iter()
            .map(|t| {
                let peer = 1 - t.rank();
                vec![(peer, t.carry_over().take(peer, 2).expect("a clean link"))]
            })
            .collect();
        let mut g2 = carrying_mesh(&all, 2, carried).await;
        assert!(g2.iter().all(|t| t.carried_links() == 1));
        // Rank 1's generation 2 ends while both generation-1 transports are still held: the
        // old links gave their descriptors up, so rank 0 sees the link close at once.
        drop(g2.pop());
        let mut buf = [0u8; 8];
        let err = timeout(Duration::from_secs(5), g2[0].recv(1, Tag::new(1, 0, 1), &mut buf))
            .await
            .expect("the peer's end closed; nothing to wait for")
            .expect_err("rank 1 is gone");
        assert!(matches!(err, cohort_transports::TransportError::PeerClosed { peer: 1, .. }), "{err}");
        drop(g1);
    })
    .await
    .expect("test timed out");
}
