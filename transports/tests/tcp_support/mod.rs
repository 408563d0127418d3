//! Helpers shared by the TCP transport tests.
#![allow(dead_code)]

use cohort_transports::handshake::{self, Hello, Message, Verdict};
use cohort_transports::tcp::{MeshSpec, TcpEndpoint, TcpOptions, TcpTransport, Upfront};
use cohort_transports::{Deadlines, Rank, TransportError};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

/// The job token every honest test rank uses.
pub(crate) const TOKEN: &[u8] = b"test-token-0123456789";
/// Bound on every test.
pub(crate) const TEST_LIMIT: Duration = Duration::from_secs(90);

pub(crate) fn deadlines(no_progress: Duration, connect: Duration) -> Deadlines {
    Deadlines { no_progress, connect, learning: None }
}

pub(crate) fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

pub(crate) async fn endpoints(n: usize) -> Vec<TcpEndpoint> {
    let mut v = Vec::new();
    for _ in 0..n {
        v.push(TcpEndpoint::bind(loopback(), TcpOptions::default()).await.unwrap());
    }
    v
}

pub(crate) fn spec(
    job: &str,
    generation: u64,
    rank: Rank,
    peers: &[SocketAddr],
    token: &[u8],
    d: Deadlines,
) -> MeshSpec {
    MeshSpec {
        job: job.into(),
        generation,
        rank,
        peers: peers.to_vec(),
        token: token.to_vec(),
        deadlines: d,
        upfront: Upfront::Every,
        carry_links: false,
        resolver: None,
    }
}

/// Forms a mesh of `n` ranks, one endpoint each, all set-ups running concurrently.
pub(crate) async fn mesh_on(eps: &[TcpEndpoint], job: &str, generation: u64, d: Deadlines) -> Vec<Arc<TcpTransport>> {
    let addrs: Vec<SocketAddr> = eps.iter().map(TcpEndpoint::local_addr).collect();
    let futs =
        eps.iter().enumerate().map(|(r, ep)| ep.connect_mesh(spec(job, generation, r as Rank, &addrs, TOKEN, d)));
    let mut out = Vec::new();
    for r in join_all(futs).await {
        out.push(Arc::new(r.unwrap()));
    }
    out
}

pub(crate) async fn mesh(n: usize, d: Deadlines) -> (Vec<TcpEndpoint>, Vec<Arc<TcpTransport>>) {
    let eps = endpoints(n).await;
    let ts = mesh_on(&eps, "job", 1, d).await;
    (eps, ts)
}

/// Polls all futures concurrently on the current task and collects their outputs in order.
pub(crate) async fn join_all<F: Future>(futs: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let mut futs: Vec<Pin<Box<F>>> = futs.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in futs.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                match f.as_mut().poll(cx) {
                    Poll::Ready(v) => *o = Some(v),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    out.into_iter().map(|o| o.unwrap()).collect()
}

/// Polls `fut` once; `Some` if it completed.
pub(crate) async fn poll_once<F: Future + Unpin>(fut: &mut F) -> Option<F::Output> {
    std::future::poll_fn(|cx| {
        Poll::Ready(match Pin::new(&mut *fut).poll(cx) {
            Poll::Ready(v) => Some(v),
            Poll::Pending => None,
        })
    })
    .await
}

/// Deterministic message contents.
pub(crate) fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Performs a correct dialer handshake by hand (the tests know the token) and returns the
/// raw socket, ready for hand-made frames.
pub(crate) async fn raw_handshake(
    addr: SocketAddr,
    job: &str,
    generation: u64,
    me: Rank,
    to: Rank,
    world: u32,
) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let ours = Hello::new(job, generation, me, to, world).unwrap();
    let ob = ours.encode();
    s.write_all(&ob).await.unwrap();
    let theirs = match handshake::read_message(&mut s, deadline).await.unwrap() {
        Message::Hello(h) => h,
        m => panic!("expected a hello, got {m:?}"),
    };
    let tb = theirs.encode();
    let Message::Proof { verdict: Verdict::Ok, mac } = handshake::read_message(&mut s, deadline).await.unwrap() else {
        panic!("expected a proof");
    };
    assert!(handshake::verify(TOKEN, false, &ob, &tb, &mac));
    let ours_mac = handshake::proof(TOKEN, true, &ob, &tb).unwrap();
    s.write_all(&handshake::encode_proof(Verdict::Ok, &ours_mac)).await.unwrap();
    match handshake::read_message(&mut s, deadline).await.unwrap() {
        Message::Verdict(Verdict::Ok) => s,
        m => panic!("expected an OK verdict, got {m:?}"),
    }
}

pub(crate) fn assert_handshake(r: &Result<TcpTransport, TransportError>, needle: &str) {
    match r {
        Err(TransportError::Handshake { detail, .. }) => {
            assert!(detail.contains(needle), "expected {needle:?} in {detail:?}")
        }
        Err(e) => panic!("expected a handshake error naming {needle:?}, got {e:?}"),
        Ok(_) => panic!("expected a handshake error naming {needle:?}, got a transport"),
    }
}
