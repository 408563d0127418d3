//! Per-generation queue-pair set-up over the authenticated TCP bootstrap.
//!
//! Rank `i` dials the bootstrap listener of every rank `j < i` and accepts from every rank
//! `j > i`. On each connection:
//!
//! 1. the TCP transport's handshake runs unchanged ([`crate::handshake`]): hellos
//!    carrying job, generation, ranks, world size and nonces, then HMAC-SHA256 proofs over
//!    both hellos keyed by the job token, then the acceptor's verdict;
//! 2. each side sends a `QPINFO` message: magic `"CHRQ"`, text length (u16 LE), its encoded
//!    [`RdmaAddress`] for this pair, and `HMAC-SHA256(token, label ‖ hello_dialer ‖
//!    hello_acceptor ‖ text)` with a per-role label, so the QP description is bound to this
//!    authenticated session and cannot be replayed into another;
//! 3. each side moves its QP `INIT -> RTR -> RTS` towards the other's address and sends
//!    `READY` (`"CHRR"`); a side uses the QP only after reading the other's `READY`, so no
//!    write ever reaches a QP that is not yet ready to receive.
//!
//! A connection that fails before authentication (wrong token, another job or generation,
//! garbage) is refused and noted without failing the set-up, so a stranger cannot break it;
//! a dialer whose peer is not ready yet, or refuses as retriable, tries again until the
//! connect deadline.

use super::address::{RdmaAddress, MAX_ADDRESS_LEN};
use super::qp::{QpTiming, QueuePair};
use crate::handshake::{self as hs, DialError, Hello, Message, Refusal, Refused, Session, Verdict};
use crate::mesh_setup::{Backoff, Paired};
use crate::{Rank, TransportError};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

const QPINFO_MAGIC: [u8; 4] = *b"CHRQ";
const READY: [u8; 4] = *b"CHRR";
const LABEL_QP_DIALER: &[u8] = b"cohort/rdma/v1/qp/dialer";
const LABEL_QP_ACCEPTOR: &[u8] = b"cohort/rdma/v1/qp/acceptor";
/// Longest a single accepted connection may take to say hello.
const HELLO_WAIT: Duration = Duration::from_secs(5);
/// Pause between a dialer's attempts.
const RETRY_PAUSE: Duration = Duration::from_millis(50);

/// Our side of one pair, ready to be connected.
pub(crate) struct PairSetup {
    pub qp: Arc<QueuePair>,
    pub local: RdmaAddress,
}

/// Everything the set-up tasks share.
pub(crate) struct MeshCtx {
    pub job: String,
    pub generation: u64,
    pub rank: Rank,
    pub world: u32,
    pub token: Vec<u8>,
    pub deadline: Instant,
    pub timing: QpTiming,
    /// Most slots a peer's ring may have: this rank's work queues are sized for its own
    /// ring size, so every rank must use the same one (or smaller).
    pub max_slots: u32,
    /// Indexed by rank; `None` for ourselves.
    pub pairs: Vec<Option<PairSetup>>,
    /// Ranks whose accepted connection has authenticated (a second one is refused).
    pub claimed: Mutex<Vec<bool>>,
}

impl MeshCtx {
    fn session(&self) -> Session<'_> {
        Session {
            job: &self.job,
            generation: self.generation,
            rank: self.rank,
            world: self.world,
            token: &self.token,
            deadline: self.deadline,
        }
    }
}

fn qp_mac(token: &[u8], dialer: bool, hello_d: &[u8], hello_a: &[u8], text: &[u8]) -> Option<Hmac<Sha256>> {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(token).ok()?;
    m.update(if dialer { LABEL_QP_DIALER } else { LABEL_QP_ACCEPTOR });
    for part in [hello_d, hello_a, text] {
        m.update(&(part.len() as u64).to_le_bytes());
        m.update(part);
    }
    Some(m)
}

/// Encodes a `QPINFO` message (pure).
pub(crate) fn encode_qpinfo(token: &[u8], dialer: bool, hello_d: &[u8], hello_a: &[u8], addr: &RdmaAddress) -> Vec<u8> {
    let text = addr.encode();
    let mac: [u8; 32] = qp_mac(token, dialer, hello_d, hello_a, text.as_bytes())
        .map(|m| m.finalize().into_bytes().into())
        .unwrap_or([0; 32]);
    let mut b = Vec::with_capacity(6 + text.len() + 32);
    b.extend_from_slice(&QPINFO_MAGIC);
    // Encoded addresses are far shorter than u16::MAX.
    b.extend_from_slice(&(text.len() as u16).to_le_bytes());
    b.extend_from_slice(text.as_bytes());
    b.extend_from_slice(&mac);
    b
}

/// Checks and decodes the text and MAC of a `QPINFO` message sent by the side `dialer`.
pub(crate) fn decode_qpinfo(
    token: &[u8],
    dialer: bool,
    hello_d: &[u8],
    hello_a: &[u8],
    text: &[u8],
    mac: &[u8; 32],
) -> Result<RdmaAddress, String> {
    let ok = qp_mac(token, dialer, hello_d, hello_a, text).is_some_and(|m| m.verify_slice(mac).is_ok());
    if !ok {
        return Err("queue pair description failed authentication".into());
    }
    let text = std::str::from_utf8(text).map_err(|_| "queue pair description is not UTF-8".to_owned())?;
    RdmaAddress::decode(text).map_err(|e| e.to_string())
}

async fn timed<T>(deadline: Instant, f: impl std::future::Future<Output = std::io::Result<T>>) -> Result<T, String> {
    match tokio::time::timeout_at(deadline, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err("connection closed during set-up".into()),
        Ok(Err(e)) => Err(format!("i/o error during set-up: {e}")),
        Err(_) => Err("set-up timed out".into()),
    }
}

async fn read_qpinfo(s: &mut TcpStream, deadline: Instant) -> Result<(Vec<u8>, [u8; 32]), String> {
    let mut head = [0u8; 6];
    timed(deadline, s.read_exact(&mut head)).await?;
    if head[..4] != QPINFO_MAGIC {
        return Err("expected a queue pair description".into());
    }
    let len = usize::from(u16::from_le_bytes([head[4], head[5]]));
    if len == 0 || len > MAX_ADDRESS_LEN {
        return Err(format!("queue pair description of {len} bytes (allowed 1..={MAX_ADDRESS_LEN})"));
    }
    let mut text = vec![0u8; len];
    timed(deadline, s.read_exact(&mut text)).await?;
    let mut mac = [0u8; 32];
    timed(deadline, s.read_exact(&mut mac)).await?;
    Ok((text, mac))
}

/// Exchanges QP descriptions, brings the QP up and exchanges `READY`.
async fn finish_pair(
    ctx: &MeshCtx,
    s: &mut TcpStream,
    peer: Rank,
    dialer: bool,
    hello_d: &[u8],
    hello_a: &[u8],
) -> Result<RdmaAddress, TransportError> {
    let hs_err = |detail: String| TransportError::Handshake { peer, detail };
    let pair = ctx
        .pairs
        .get(peer as usize)
        .and_then(Option::as_ref)
        .ok_or_else(|| hs_err("no queue pair for this rank".into()))?;
    let ours = encode_qpinfo(&ctx.token, dialer, hello_d, hello_a, &pair.local);
    timed(ctx.deadline, s.write_all(&ours)).await.map_err(hs_err)?;
    let (text, mac) = read_qpinfo(s, ctx.deadline).await.map_err(hs_err)?;
    let remote = decode_qpinfo(&ctx.token, !dialer, hello_d, hello_a, &text, &mac).map_err(hs_err)?;
    if remote.slots() > ctx.max_slots {
        return Err(hs_err(format!(
            "peer's receive ring has {} slots, more than the {} this rank's queues are sized for (use the same RdmaOptions::slots on every rank)",
            remote.slots(),
            ctx.max_slots
        )));
    }
    pair.qp.to_rtr(&remote, ctx.timing)?;
    pair.qp.to_rts(pair.local.psn, ctx.timing)?;
    timed(ctx.deadline, s.write_all(&READY)).await.map_err(hs_err)?;
    let mut r = [0u8; 4];
    timed(ctx.deadline, s.read_exact(&mut r)).await.map_err(hs_err)?;
    if r != READY {
        return Err(hs_err("peer did not confirm its queue pair is ready".into()));
    }
    Ok(remote)
}

fn io_note(e: hs::HsIoError) -> String {
    e.to_string()
}

/// Dials `peer` (a lower rank) at `addr` until connected, refused for good, or the deadline.
pub(crate) async fn dial(ctx: Arc<MeshCtx>, peer: Rank, addr: SocketAddr) -> Paired<RdmaAddress> {
    let hs_err = |detail: String| TransportError::Handshake { peer, detail };
    let mut backoff = Backoff::new(RETRY_PAUSE, RETRY_PAUSE);
    loop {
        let attempt = async {
            let mut s = timed(ctx.deadline, TcpStream::connect(addr)).await.map_err(DialError::Retry)?;
            let _ = s.set_nodelay(true);
            let transcript = hs::dial(&mut s, &ctx.session(), peer).await?;
            Ok::<_, DialError>((s, transcript))
        };
        let last = match attempt.await {
            Ok((mut s, t)) => {
                return match finish_pair(&ctx, &mut s, peer, true, &t.dialer, &t.acceptor).await {
                    Ok(remote) => Paired::Linked(peer, remote),
                    Err(e) => Paired::Failed(e),
                };
            }
            Err(DialError::Retry(why)) => why,
            Err(DialError::Fatal(why)) => return Paired::Failed(hs_err(why)),
        };
        if !backoff.pause_before(ctx.deadline).await {
            return Paired::Failed(hs_err(format!("connect deadline passed (last attempt: {last})")));
        }
    }
}

/// Serves one accepted connection from a higher rank: linked, noted (a connection that did
/// not authenticate), or failed (a peer that authenticated and then disagreed).
pub(crate) async fn accept_one(ctx: Arc<MeshCtx>, s: TcpStream, from: SocketAddr) -> Paired<RdmaAddress> {
    match serve_accepted(ctx, s, from).await {
        Ok(Ok((sender, remote))) => Paired::Linked(sender, remote),
        Ok(Err(detail)) => Paired::Noted { claimed: None, detail },
        Err(e) => Paired::Failed(e),
    }
}

/// [`accept_one`]: `Ok(Err(note))` for a refused stranger.
async fn serve_accepted(
    ctx: Arc<MeshCtx>,
    mut s: TcpStream,
    from: SocketAddr,
) -> Result<Result<(Rank, RdmaAddress), String>, TransportError> {
    let _ = s.set_nodelay(true);
    let refuse_note = |why: String| Err(format!("connection from {from}: {why}"));
    let hello_deadline = (Instant::now() + HELLO_WAIT).min(ctx.deadline);
    let theirs = match hs::read_message(&mut s, hello_deadline).await {
        Ok(Message::Hello(h)) => h,
        Ok(m) => return Ok(refuse_note(format!("expected a hello, got {m:?}"))),
        Err(e) => return Ok(refuse_note(io_note(e))),
    };
    // Screened before anything is proven, so a dialer of another generation hears why (and
    // one that is ahead retries until this endpoint forms its generation).
    let sender = theirs.sender;
    let ours = Hello::new(&ctx.job, ctx.generation, ctx.rank, sender, ctx.world).map_err(TransportError::Io)?;
    let verdict = hs::check_dialer(&ours, &theirs);
    if verdict != Verdict::Ok {
        let retriable = verdict == Verdict::GenerationMismatch && theirs.generation > ctx.generation;
        let r = Refusal {
            code: verdict,
            retriable,
            ours: ctx.generation,
            theirs: theirs.generation,
            text: verdict.describe(&ours, &theirs),
        };
        let _ = hs::write_all(&mut s, &r.encode(), hello_deadline).await;
        return Ok(refuse_note(r.text));
    }
    // A second authenticated connection of a rank already linked is refused as busy.
    let admit = |rank: Rank| {
        let mut claimed = ctx.claimed.lock().unwrap_or_else(|e| e.into_inner());
        claimed.get_mut(rank as usize).is_some_and(|c| !std::mem::replace(c, true))
    };
    let t = match hs::accept(&mut s, &ctx.session(), theirs, Some(from), admit).await {
        Ok(t) => t,
        Err(Refused { claimed, detail, fatal: true }) => {
            return Err(TransportError::Handshake { peer: claimed, detail });
        }
        Err(Refused { detail, .. }) => return Ok(Err(detail)),
    };
    let remote = finish_pair(&ctx, &mut s, sender, false, &t.dialer, &t.acceptor).await?;
    Ok(Ok((sender, remote)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::address::{Mtu, RecvRegion};

    fn addr() -> RdmaAddress {
        RdmaAddress {
            lid: 3,
            gid: [1; 16],
            qpn: 77,
            psn: 99,
            mtu: Mtu::M2048,
            slot_bytes: 4096,
            ring: RecvRegion { addr: 0x1000, rkey: 5, len: 4096 * 8 },
        }
    }

    #[test]
    fn qpinfo_is_bound_to_token_role_and_session() {
        let (hd, ha) = (b"hello-d".to_vec(), b"hello-a".to_vec());
        let msg = encode_qpinfo(b"tok", true, &hd, &ha, &addr());
        assert_eq!(&msg[..4], b"CHRQ");
        let len = usize::from(u16::from_le_bytes([msg[4], msg[5]]));
        let text = &msg[6..6 + len];
        let mac: [u8; 32] = msg[6 + len..].try_into().unwrap();
        assert_eq!(decode_qpinfo(b"tok", true, &hd, &ha, text, &mac), Ok(addr()));
        assert!(decode_qpinfo(b"other", true, &hd, &ha, text, &mac).unwrap_err().contains("authentication"));
        assert!(decode_qpinfo(b"tok", false, &hd, &ha, text, &mac).is_err(), "role is bound");
        assert!(decode_qpinfo(b"tok", true, &ha, &hd, text, &mac).is_err(), "session is bound");
        let mut tampered = text.to_vec();
        let i = tampered.len() - 1;
        tampered[i] ^= 1;
        assert!(decode_qpinfo(b"tok", true, &hd, &ha, &tampered, &mac).is_err());
    }

    fn ctx(rank: Rank, generation: u64, token: &[u8]) -> Arc<MeshCtx> {
        Arc::new(MeshCtx {
            job: "job-1".into(),
            generation,
            rank,
            world: 2,
            token: token.to_vec(),
            deadline: Instant::now() + Duration::from_secs(10),
            timing: QpTiming::default(),
            max_slots: 16,
            pairs: vec![None, None],
            claimed: Mutex::new(vec![false; 2]),
        })
    }

    fn describe(p: &Paired<RdmaAddress>) -> String {
        match p {
            Paired::Linked(r, _) => format!("linked to rank {r}"),
            Paired::Noted { detail, .. } => format!("noted: {detail}"),
            Paired::Failed(e) => format!("failed: {e}"),
        }
    }

    /// Runs one dial against one accepted connection on loopback.
    async fn pair_up(dialer: Arc<MeshCtx>, acceptor: Arc<MeshCtx>) -> (Paired<RdmaAddress>, Paired<RdmaAddress>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let acc = tokio::spawn(async move {
            let (s, from) = l.accept().await.unwrap();
            accept_one(acceptor, s, from).await
        });
        let d = dial(dialer, 0, addr).await;
        (d, acc.await.unwrap())
    }

    #[tokio::test]
    async fn wrong_token_is_refused_on_both_sides() {
        let run = pair_up(ctx(1, 4, b"good"), ctx(0, 4, b"evil"));
        let (d, a) = tokio::time::timeout(Duration::from_secs(10), run).await.unwrap();
        match d {
            Paired::Failed(TransportError::Handshake { peer: 0, detail }) => {
                assert!(detail.contains("authentication failed"), "{detail}")
            }
            other => panic!("dialer: {}", describe(&other)),
        }
        match a {
            Paired::Noted { detail, .. } => assert!(detail.contains("authentication failed"), "{detail}"),
            other => panic!("acceptor: {}", describe(&other)),
        }
    }

    #[tokio::test]
    async fn stale_generation_is_refused_with_both_numbers() {
        let run = pair_up(ctx(1, 3, b"tok"), ctx(0, 4, b"tok"));
        let (d, a) = tokio::time::timeout(Duration::from_secs(10), run).await.unwrap();
        match d {
            Paired::Failed(TransportError::Handshake { detail, .. }) => {
                assert!(detail.contains("generation mismatch (ours 3, theirs 4)"), "{detail}")
            }
            other => panic!("dialer: {}", describe(&other)),
        }
        assert!(matches!(a, Paired::Noted { .. }), "{}", describe(&a));
    }

    #[tokio::test]
    async fn authenticated_peer_without_queue_pair_fails_cleanly() {
        // Both sides authenticate, then the QP exchange finds no queue pair for the peer
        // (this machine has no device): a typed error, no panic, no hang.
        let run = pair_up(ctx(1, 4, b"tok"), ctx(0, 4, b"tok"));
        let (d, a) = tokio::time::timeout(Duration::from_secs(10), run).await.unwrap();
        assert!(
            matches!(d, Paired::Failed(TransportError::Handshake { peer: 0, ref detail }) if detail.contains("no queue pair")),
            "{}",
            describe(&d)
        );
        assert!(matches!(a, Paired::Failed(TransportError::Handshake { peer: 1, .. })), "{}", describe(&a));
    }
}
