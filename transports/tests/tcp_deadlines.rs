//! Learned no-progress deadlines over real loopback sockets: a peer that is late but alive
//! is waited for (its process answers the liveness probe), a peer whose process does not
//! answer is failed soon after the learned deadline, long before the ceiling, and so is one
//! on a link that has learned nothing itself (it takes its transport's pace), and so is one
//! on a link made on first use, from the end that accepted it without the peer's address.

mod tcp_support;

use cohort_transports::liveness::PROBE_WITHIN;
use cohort_transports::tcp::TcpTransport;
use cohort_transports::{DeadlineBasis, Deadlines, Learning, Tag, Transport, TransportError};
use std::sync::Arc;
use std::time::Duration;
use tcp_support::{endpoints, join_all, mesh, spec, TEST_LIMIT, TOKEN};
use tokio::time::{timeout, Instant};

const FLOOR: Duration = Duration::from_millis(150);
const CEILING: Duration = Duration::from_secs(8);

fn learned() -> Deadlines {
    Deadlines { no_progress: CEILING, connect: Duration::from_secs(10), learning: Some(Learning::with_floor(FLOOR)) }
}

/// Waits (bounded) until rank 0's link to rank 1 has heard rank 1's liveness responder.
async fn until_probed(t: &TcpTransport) {
    until_peer_probed(t, 1).await;
}

/// Waits (bounded) until the link to `peer` has heard the peer's liveness responder.
async fn until_peer_probed(t: &TcpTransport, peer: u32) {
    let until = Instant::now() + Duration::from_secs(5);
    while !t.peer_probed(peer) {
        assert!(Instant::now() < until, "the peer's liveness responder never answered");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Takes `eps[rank]`'s endpoint down and holds its port with a UDP socket that never
/// answers, as a stopped process's responder would stay silent.
async fn freeze(eps: &mut Vec<cohort_transports::tcp::TcpEndpoint>, rank: usize) -> std::net::UdpSocket {
    let port = eps[rank].local_addr();
    drop(eps.remove(rank));
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        match std::net::UdpSocket::bind(port) {
            Ok(s) => return s,
            Err(_) if Instant::now() < until => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(e) => panic!("the responder's port was never released: {e}"),
        }
    }
}

/// Rank 1 sends two 64 KiB messages per operation, rank 0 receives them: `ops` operations
/// from `first`, so that rank 0's link learns its (fast) pace.
async fn warm_up(ts: &[Arc<TcpTransport>], first: u32, ops: u32) {
    let data = vec![7u8; 64 << 10];
    let sender = Arc::clone(&ts[1]);
    let send = tokio::spawn(async move {
        for seq in first..first + ops {
            for step in 0..2 {
                sender.send(0, Tag::new(seq, step, 0), &data).await.unwrap();
            }
        }
    });
    let mut buf = vec![0u8; 64 << 10];
    for seq in first..first + ops {
        for step in 0..2 {
            ts[0].recv(1, Tag::new(seq, step, 0), &mut buf).await.unwrap();
        }
    }
    send.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_but_alive_peer_is_waited_for() {
    timeout(TEST_LIMIT, async {
        let (_eps, ts) = mesh(2, learned()).await;
        until_probed(&ts[0]).await;
        let before = ts[0].deadlines_in_force();
        assert_eq!(before[0].1.basis, DeadlineBasis::Unlearned, "{}", before[0].1);
        warm_up(&ts, 1, 40).await;
        let in_force = ts[0].deadlines_in_force()[0].1;
        assert_eq!((in_force.value, in_force.basis), (FLOOR, DeadlineBasis::Floor), "{in_force}");

        // Inside an operation: one message, then 1 s of silence (the peer computes), then the next.
        let late = Duration::from_secs(1);
        let sender = Arc::clone(&ts[1]);
        let send = tokio::spawn(async move {
            sender.send(0, Tag::new(41, 0, 0), b"first").await.unwrap();
            tokio::time::sleep(late).await;
            sender.send(0, Tag::new(41, 1, 0), b"second").await.unwrap();
            // Late to the next operation altogether.
            tokio::time::sleep(late).await;
            sender.send(0, Tag::new(42, 0, 0), b"third").await.unwrap();
        });
        let mut buf = [0u8; 5];
        ts[0].recv(1, Tag::new(41, 0, 0), &mut buf).await.unwrap();
        let start = Instant::now();
        let mut buf = [0u8; 6];
        ts[0].recv(1, Tag::new(41, 1, 0), &mut buf).await.expect("a late but live peer is not cut");
        assert!(start.elapsed() >= late - Duration::from_millis(50));
        let mut buf = [0u8; 5];
        ts[0].recv(1, Tag::new(42, 0, 0), &mut buf).await.expect("a peer late to an operation is not cut");
        assert_eq!(&buf, b"third");
        send.await.unwrap();
        assert!(!ts[0].is_aborted());
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_whose_process_does_not_answer_is_failed_after_the_learned_deadline() {
    timeout(TEST_LIMIT, async {
        let (mut eps, ts) = mesh(2, learned()).await;
        until_probed(&ts[0]).await;
        warm_up(&ts, 1, 40).await;
        assert_eq!(ts[0].deadlines_in_force()[0].1.value, FLOOR);
        // Rank 1's process "freezes": its endpoint (and liveness responder) goes.
        let _mute = freeze(&mut eps, 1).await;
        let start = Instant::now();
        let e = ts[0].recv(1, Tag::new(41, 0, 0), &mut [0u8; 16]).await.unwrap_err();
        let took = start.elapsed();
        assert!(matches!(e, TransportError::Timeout { peer: 1, .. }), "{e:?}");
        assert!(took >= FLOOR, "took {took:?}");
        assert!(took < FLOOR + PROBE_WITHIN + Duration::from_millis(700), "took {took:?}, the ceiling is {CEILING:?}");
    })
    .await
    .unwrap();
}

/// A link that never learned (here rank 0's link to rank 2, which carried nothing; in a job,
/// a ring's send-only link, or one carrying a small allreduce by recursive doubling) waits
/// its transport's pace, not the ceiling, before it asks a silent peer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_on_a_link_that_learned_nothing_is_failed_at_the_transports_pace() {
    timeout(TEST_LIMIT, async {
        let (mut eps, ts) = mesh(3, learned()).await;
        until_peer_probed(&ts[0], 1).await;
        until_peer_probed(&ts[0], 2).await;
        warm_up(&ts, 1, 40).await;
        let in_force = ts[0].deadlines_in_force();
        let to = |peer: u32| in_force.iter().find(|(p, _)| *p == peer).map(|(_, d)| *d).expect("a link");
        assert_eq!((to(1).value, to(1).basis), (FLOOR, DeadlineBasis::Floor), "{}", to(1));
        assert_eq!((to(2).value, to(2).basis, to(2).samples), (FLOOR, DeadlineBasis::Unlearned, 0), "{}", to(2));
        let _mute = freeze(&mut eps, 2).await;
        let start = Instant::now();
        let e = ts[0].recv(2, Tag::new(41, 0, 0), &mut [0u8; 16]).await.unwrap_err();
        let took = start.elapsed();
        assert!(matches!(e, TransportError::Timeout { peer: 2, .. }), "{e:?}");
        assert!(e.to_string().contains("liveness"), "the error says the peer was asked: {e}");
        assert!(took >= FLOOR, "took {took:?}");
        assert!(took < FLOOR + PROBE_WITHIN + Duration::from_millis(700), "took {took:?}, the ceiling is {CEILING:?}");
    })
    .await
    .unwrap();
}

/// Finds one rank's address, counting the questions (as the elastic runtime asks the
/// coordinator).
#[derive(Debug)]
struct OneAddress {
    rank: u32,
    addr: std::net::SocketAddr,
    asked: std::sync::atomic::AtomicUsize,
}

impl cohort_transports::tcp::ResolvePeer for OneAddress {
    fn resolve(
        &self,
        peer: u32,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<std::net::SocketAddr, TransportError>> + Send + '_>>
    {
        self.asked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let found = if peer == self.rank {
            Ok(self.addr)
        } else {
            Err(TransportError::InvalidArgument(format!("no address for rank {peer}")))
        };
        Box::pin(async move { found })
    }
}

/// Rank 0 is not given rank 2's address and does not link it at set-up (a sparse view's
/// peer outside the plan); rank 2 links rank 0 on first use (the higher rank dials). Rank 0
/// accepts the link, finds rank 2's address through its resolver and probes it: when rank 2
/// stops, rank 0 fails it after the learned deadline, not at the ceiling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_linked_on_first_use_is_probed_from_the_accepting_end() {
    use cohort_transports::tcp::{Upfront, UNKNOWN_PEER};
    timeout(TEST_LIMIT, async {
        let mut eps = endpoints(3).await;
        let addrs: Vec<std::net::SocketAddr> = eps.iter().map(|e| e.local_addr()).collect();
        let resolver = Arc::new(OneAddress { rank: 2, addr: addrs[2], asked: Default::default() });
        let futs = (0..3u32).map(|r| {
            let mut given = addrs.clone();
            if r == 0 {
                given[2] = UNKNOWN_PEER;
            }
            let mut s = spec("job", 1, r, &given, TOKEN, learned());
            s.upfront = Upfront::Only(if r == 1 { vec![0, 2] } else { vec![1] });
            if r == 0 {
                s.resolver = Some(Arc::clone(&resolver) as Arc<dyn cohort_transports::tcp::ResolvePeer>);
            }
            eps[r as usize].connect_mesh(s)
        });
        let ts: Vec<Arc<TcpTransport>> =
            join_all(futs).await.into_iter().map(|r| Arc::new(r.expect("set-up"))).collect();
        assert_eq!(ts[0].linked_peers(), 1, "rank 0 linked only rank 1 at set-up");
        // Rank 2 sends to rank 0 (it dials); rank 0's link learns its pace.
        let data = vec![7u8; 64 << 10];
        let sender = Arc::clone(&ts[2]);
        let send = tokio::spawn(async move {
            for seq in 1..=40u32 {
                sender.send(0, Tag::new(seq, 0, 0), &data).await.unwrap();
            }
        });
        let mut buf = vec![0u8; 64 << 10];
        for seq in 1..=40u32 {
            ts[0].recv(2, Tag::new(seq, 0, 0), &mut buf).await.unwrap();
        }
        send.await.unwrap();
        assert_eq!(ts[0].linked_peers(), 2, "rank 2 linked on first use");
        until_peer_probed(&ts[0], 2).await;
        assert_eq!(resolver.asked.load(std::sync::atomic::Ordering::Relaxed), 1, "rank 2's address asked once");
        let _mute = freeze(&mut eps, 2).await;
        let start = Instant::now();
        let e = ts[0].recv(2, Tag::new(41, 0, 0), &mut [0u8; 16]).await.unwrap_err();
        let took = start.elapsed();
        assert!(matches!(e, TransportError::Timeout { peer: 2, .. }), "{e:?}");
        assert!(e.to_string().contains("liveness"), "the error says the peer was asked: {e}");
        assert!(took < FLOOR + PROBE_WITHIN + Duration::from_millis(700), "took {took:?}, the ceiling is {CEILING:?}");
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_learning_off_the_fixed_deadline_holds() {
    timeout(TEST_LIMIT, async {
        let np = Duration::from_millis(600);
        let (_eps, ts) = mesh(2, Deadlines::fixed(np, Duration::from_secs(10))).await;
        warm_up(&ts, 1, 20).await;
        let in_force = ts[0].deadlines_in_force()[0].1;
        assert_eq!((in_force.value, in_force.basis), (np, DeadlineBasis::Fixed));
        let start = Instant::now();
        let e = ts[0].recv(1, Tag::new(21, 0, 0), &mut [0u8; 16]).await.unwrap_err();
        assert!(matches!(e, TransportError::Timeout { peer: 1, after, .. } if after == np), "{e:?}");
        assert!(start.elapsed() >= np);
    })
    .await
    .unwrap();
}
