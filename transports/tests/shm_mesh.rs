//! The shared-memory transport in one process: set-up, message matching, large pipelined
//! messages, mismatches, abort, deadlines, refused handshakes.

use cohort_transports::shm::{ShmAddress, ShmEndpoint, ShmMeshSpec, ShmOptions, ShmTransport};
use cohort_transports::{AbortReason, Deadlines, Tag, Transport, TransportError};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::{timeout, Instant};

const LIMIT: Duration = Duration::from_secs(60);

fn deadlines(no_progress: Duration) -> Deadlines {
    Deadlines { no_progress, connect: Duration::from_secs(10), learning: None }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// Small slots so that multi-slot messages and ring wrap-around are exercised.
fn small() -> ShmOptions {
    ShmOptions { slots: 4, slot_bytes: 4096, ..ShmOptions::default() }
}

fn spec(job: &str, generation: u64, rank: u32, peers: &[ShmAddress], token: &[u8], d: Deadlines) -> ShmMeshSpec {
    ShmMeshSpec {
        job: job.into(),
        generation,
        rank,
        peers: peers.iter().cloned().map(Some).collect(),
        token: token.to_vec(),
        deadlines: d,
    }
}

async fn mesh(n: u32, options: ShmOptions, d: Deadlines) -> Vec<Arc<ShmTransport>> {
    let eps: Vec<ShmEndpoint> = (0..n).map(|_| ShmEndpoint::new(options.clone()).expect("endpoint")).collect();
    let peers: Vec<ShmAddress> = eps.iter().map(|e| e.address().clone()).collect();
    let tasks: Vec<_> = eps
        .into_iter()
        .enumerate()
        .map(|(r, e)| {
            let s = spec("shm-test", 3, r as u32, &peers, b"tok", d);
            tokio::spawn(async move { e.connect_mesh(s).await })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(Arc::new(t.await.expect("set-up task").expect("mesh")));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_of_every_size_arrive_intact_both_ways() {
    timeout(LIMIT, async {
        let t = mesh(2, small(), deadlines(Duration::from_secs(10))).await;
        for (i, len) in [0usize, 1, 4031, 4032, 4033, 100_000, 1 << 20].into_iter().enumerate() {
            let a = pattern(i as u8, len);
            let b = pattern(i as u8 + 100, len);
            let (mut ra, mut rb) = (vec![0u8; len], vec![0u8; len]);
            let tag = Tag::new(i as u32, 0, 9);
            let (x, y, z, w) = tokio::join!(
                t[0].send(1, tag, &a),
                t[1].recv(0, tag, &mut ra),
                t[1].send(0, tag, &b),
                t[0].recv(1, tag, &mut rb)
            );
            x.unwrap();
            y.unwrap();
            z.unwrap();
            w.unwrap();
            assert_eq!(ra, a, "len {len}");
            assert_eq!(rb, b, "len {len}");
        }
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_order_messages_are_matched_by_tag() {
    timeout(LIMIT, async {
        let t = mesh(3, small(), deadlines(Duration::from_secs(10))).await;
        let (t0, t2) = (t[0].clone(), t[2].clone());
        let sender = tokio::spawn(async move {
            for step in 0..5u32 {
                t2.send(0, Tag::new(1, step, 7), &pattern(step as u8, 10_000 + step as usize)).await.unwrap();
            }
        });
        // Receive in reverse order: the earlier messages are stashed.
        for step in (0..5u32).rev() {
            let mut buf = vec![0u8; 10_000 + step as usize];
            t0.recv(2, Tag::new(1, step, 7), &mut buf).await.unwrap();
            assert_eq!(buf, pattern(step as u8, buf.len()));
        }
        sender.await.unwrap();
    })
    .await
    .unwrap();
}

/// `recv_with` lends the ring's slots in order: the pieces are at most a slot's payload,
/// concatenate to the message, and the scratch buffer is never written. A message stashed
/// because it came early is handed over whole; a disagreement is a mismatch, as for `recv`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recv_with_lends_the_slots_in_order_without_touching_the_scratch() {
    timeout(LIMIT, async {
        let t = mesh(2, small(), deadlines(Duration::from_secs(10))).await;
        let slot_payload = 4096 - 64;
        for (i, len) in [0usize, 1, 4032, 4033, 100_000].into_iter().enumerate() {
            let sent = pattern(i as u8, len);
            let mut scratch = vec![0xeeu8; len];
            let mut pieces: Vec<Vec<u8>> = Vec::new();
            let tag = Tag::new(i as u32, 0, 5);
            let (s, r) = tokio::join!(
                t[0].send(1, tag, &sent),
                t[1].recv_with(0, tag, &mut scratch, |piece| pieces.push(piece.to_vec()))
            );
            s.unwrap();
            r.unwrap();
            assert!(pieces.iter().all(|p| p.len() <= slot_payload), "len {len}: a piece larger than a slot");
            assert_eq!(pieces.len(), len.div_ceil(slot_payload).max(1), "len {len}: one piece per slot");
            assert_eq!(pieces.concat(), sent, "len {len}");
            assert!(scratch.iter().all(|&b| b == 0xee), "len {len}: the scratch was written");
        }

        // Step 1 is sent first and stashed while step 0 is awaited; it is then handed over
        // whole, in one piece.
        let (first, second) = (pattern(1, 5_000), pattern(2, 5_000)); // two slots each: both fit the ring
        t[0].send(1, Tag::new(50, 1, 5), &second).await.unwrap();
        t[0].send(1, Tag::new(50, 0, 5), &first).await.unwrap();
        let mut scratch = vec![0u8; 5_000];
        let mut got = Vec::new();
        t[1].recv_with(0, Tag::new(50, 0, 5), &mut scratch, |p| got.extend_from_slice(p)).await.unwrap();
        assert_eq!(got, first);
        let mut pieces = 0;
        got.clear();
        t[1].recv_with(0, Tag::new(50, 1, 5), &mut scratch, |p| {
            pieces += 1;
            got.extend_from_slice(p)
        })
        .await
        .unwrap();
        assert_eq!((pieces, got), (1, second));

        let mut scratch = vec![0u8; 65];
        let mut consumed = 0;
        let (s, r) = tokio::join!(
            t[0].send(1, Tag::new(51, 0, 5), &[1u8; 64]),
            t[1].recv_with(0, Tag::new(51, 0, 5), &mut scratch, |p| consumed += p.len())
        );
        s.unwrap();
        let e = r.unwrap_err();
        assert!(matches!(&e, TransportError::Mismatch { peer: 0, detail, .. } if detail.contains("64 bytes received, 65 expected")), "{e:?}");
        assert_eq!(consumed, 0, "a mismatched message was handed over");
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn length_and_signature_disagreements_are_mismatches() {
    timeout(LIMIT, async {
        let t = mesh(2, small(), deadlines(Duration::from_secs(10))).await;
        let mut buf = [0u8; 64];
        let (s, r) = tokio::join!(t[0].send(1, Tag::new(0, 0, 1), &[1u8; 64]), t[1].recv(0, Tag::new(0, 0, 2), &mut buf));
        s.unwrap();
        let e = r.unwrap_err();
        assert!(matches!(&e, TransportError::Mismatch { peer: 0, detail, .. } if detail.contains("signature")), "{e:?}");
        let t = mesh(2, small(), deadlines(Duration::from_secs(10))).await;
        let mut buf = [0u8; 65];
        let (s, r) = tokio::join!(t[0].send(1, Tag::new(0, 0, 1), &[1u8; 64]), t[1].recv(0, Tag::new(0, 0, 1), &mut buf));
        s.unwrap();
        let e = r.unwrap_err();
        assert!(matches!(&e, TransportError::Mismatch { peer: 0, detail, .. } if detail.contains("64 bytes received, 65 expected")), "{e:?}");
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_is_a_timeout_after_the_no_progress_deadline() {
    timeout(LIMIT, async {
        let t = mesh(2, small(), deadlines(Duration::from_millis(300))).await;
        let started = Instant::now();
        let e = t[0].recv(1, Tag::new(0, 0, 1), &mut [0u8; 8]).await.unwrap_err();
        assert!(matches!(e, TransportError::Timeout { peer: 1, .. }), "{e:?}");
        assert!(started.elapsed() >= Duration::from_millis(300), "{:?}", started.elapsed());
        // A sender facing a full ring that nobody drains times out too.
        let big = vec![0u8; 1 << 20];
        let e = t[1].send(0, Tag::new(0, 0, 1), &big).await.unwrap_err();
        assert!(
            matches!(e, TransportError::Timeout { peer: 0, .. } | TransportError::PeerClosed { peer: 0, .. }),
            "{e:?}"
        );
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_is_local_and_immediate_and_the_peer_sees_the_link_close() {
    timeout(LIMIT, async {
        let t = mesh(2, small(), deadlines(Duration::from_secs(30))).await;
        let t0 = t[0].clone();
        let waiting = tokio::spawn(async move { t0.recv(1, Tag::new(0, 0, 1), &mut [0u8; 8]).await });
        let peer_waiting = {
            let t1 = t[1].clone();
            tokio::spawn(async move { t1.recv(0, Tag::new(0, 0, 1), &mut [0u8; 8]).await })
        };
        // Not synchronisation: the asserts hold whether the receives are already parked or
        // not (an abort before a receive starts fails it the same way); the pause only makes
        // the parked case, the one worth exercising, the usual one.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let started = Instant::now();
        t[0].abort(AbortReason::new("test abort"));
        let e = waiting.await.unwrap().unwrap_err();
        assert!(matches!(&e, TransportError::Aborted(r) if r.0.contains("test abort")), "{e:?}");
        let e = peer_waiting.await.unwrap().unwrap_err();
        assert!(matches!(e, TransportError::PeerClosed { peer: 0, .. }), "{e:?}");
        assert!(started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());
        assert!(t[0].is_aborted() && t[1].is_aborted());
        let e = t[0].send(1, Tag::new(1, 0, 1), &[0u8; 8]).await.unwrap_err();
        assert!(matches!(e, TransportError::Aborted(_)), "{e:?}");
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_token_or_generation_fails_the_set_up_with_a_clear_error() {
    timeout(LIMIT, async {
        let d = Deadlines { no_progress: Duration::from_secs(5), connect: Duration::from_millis(800), learning: None };
        let eps: Vec<ShmEndpoint> = (0..2).map(|_| ShmEndpoint::new(small()).unwrap()).collect();
        let peers: Vec<ShmAddress> = eps.iter().map(|e| e.address().clone()).collect();
        let (a, b) = tokio::join!(
            eps[0].connect_mesh(spec("job", 1, 0, &peers, b"right", d)),
            eps[1].connect_mesh(spec("job", 1, 1, &peers, b"wrong", d))
        );
        let e = b.unwrap_err();
        assert!(
            matches!(&e, TransportError::Handshake { peer: 0, detail } if detail.contains("wrong job token")),
            "{e:?}"
        );
        let e = a.unwrap_err();
        assert!(matches!(&e, TransportError::Handshake { detail, .. } if detail.contains("connect deadline")), "{e:?}");
        // Another generation never meets this one's listener: the dialer times out.
        let (a, b) = tokio::join!(
            eps[0].connect_mesh(spec("job", 2, 0, &peers, b"t", d)),
            eps[1].connect_mesh(spec("job", 3, 1, &peers, b"t", d))
        );
        assert!(matches!(a.unwrap_err(), TransportError::Handshake { .. }));
        // The dial's own retry deadline ("could not reach") or, on a loaded machine, the mesh's
        // connect deadline a moment earlier ("not complete within the connect deadline"): either
        // way the dialer gave up on rank 0 in time.
        let e = b.unwrap_err();
        assert!(
            matches!(&e, TransportError::Handshake { peer: 0, detail }
                if detail.contains("could not reach") || detail.contains("not complete within the connect deadline")),
            "{e:?}"
        );
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_listed_peers_are_linked() {
    timeout(LIMIT, async {
        let d = deadlines(Duration::from_secs(10));
        let eps: Vec<ShmEndpoint> = (0..3).map(|_| ShmEndpoint::new(small()).unwrap()).collect();
        let peers: Vec<ShmAddress> = eps.iter().map(|e| e.address().clone()).collect();
        // Rank 1 is "on another host": only 0 and 2 share memory.
        let mk = |rank: u32| {
            let mut s = spec("job", 1, rank, &peers, b"t", d);
            s.peers[1] = None;
            s
        };
        let (a, c) = tokio::join!(eps[0].connect_mesh(mk(0)), eps[2].connect_mesh(mk(2)));
        let (a, c) = (a.unwrap(), c.unwrap());
        assert!(a.links_to(2) && c.links_to(0) && !a.links_to(1));
        let e = a.send(1, Tag::new(0, 0, 0), &[1]).await.unwrap_err();
        assert!(matches!(&e, TransportError::InvalidArgument(m) if m.contains("not linked")), "{e:?}");
        let mut buf = [0u8; 3];
        let (s, r) = tokio::join!(a.send(2, Tag::new(0, 0, 0), &[1, 2, 3]), c.recv(0, Tag::new(0, 0, 0), &mut buf));
        s.unwrap();
        r.unwrap();
        assert_eq!(buf, [1, 2, 3]);
    })
    .await
    .unwrap();
}

#[test]
fn addresses_round_trip_and_garbage_is_refused() {
    let a = ShmAddress::new_local().expect("address");
    assert_eq!(ShmAddress::decode(&a.encode()).unwrap(), a);
    assert!(a.host.starts_with("boot=") && a.host.contains(":net=") && a.host.contains(":ipc="), "{}", a.host);
    for bad in [
        "",
        "shm1;",
        "shm1;host=;nonce=00112233",
        "shm1;host=x;nonce=xyz",
        "tcp;host=a;nonce=0011223344",
        "shm1;host=a b;nonce=0011223344",
    ] {
        assert!(ShmAddress::decode(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn out_of_range_options_are_refused() {
    for o in [
        ShmOptions { slots: 1, ..ShmOptions::default() },
        ShmOptions { slot_bytes: 100, ..ShmOptions::default() },
        ShmOptions { slots: 1024, slot_bytes: 16 << 20, ..ShmOptions::default() },
    ] {
        let e = ShmEndpoint::new(o).unwrap_err();
        assert!(matches!(e, TransportError::InvalidArgument(_)), "{e:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_peer_sent_before_it_went_is_delivered_then_the_close_is_reported() {
    timeout(LIMIT, async {
        let mut t = mesh(2, small(), deadlines(Duration::from_secs(10))).await;
        let t1 = t.pop().unwrap();
        let t0 = t.pop().unwrap();
        t1.send(0, Tag::new(0, 0, 1), &[5u8; 100]).await.unwrap();
        drop(t1);
        let mut buf = [0u8; 100];
        t0.recv(1, Tag::new(0, 0, 1), &mut buf).await.unwrap();
        assert_eq!(buf, [5u8; 100]);
        let e = t0.recv(1, Tag::new(1, 0, 1), &mut buf).await.unwrap_err();
        assert!(matches!(e, TransportError::PeerClosed { peer: 1, .. }), "{e:?}");
    })
    .await
    .unwrap();
}
