//! Mesh set-up: dialing lower ranks, completing handshakes of accepted connections.

use super::endpoint::{Incoming, SharedNotes};
use super::options::TcpOptions;
use crate::handshake::{self, check_fields, Hello, HsIoError, Message, Verdict};
use crate::link_guards::lock;
use crate::{Rank, TransportError};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpSocket, TcpStream};
use tokio::time::Instant;

/// First pause between dial attempts; doubles up to [`DIAL_BACKOFF_MAX`].
const DIAL_BACKOFF_MIN: Duration = Duration::from_millis(10);
/// Longest pause between dial attempts.
const DIAL_BACKOFF_MAX: Duration = Duration::from_millis(250);

/// What one generation's mesh set-up needs in its handshake tasks.
pub(crate) struct MeshCtx {
    pub job: String,
    pub generation: u64,
    pub rank: Rank,
    pub world: u32,
    pub token: Vec<u8>,
    pub options: TcpOptions,
    pub deadline: Instant,
    pub notes: SharedNotes,
}

/// Outcome of one handshake task.
pub(crate) enum Done {
    /// A link to `rank` is authenticated and agreed.
    Linked(Rank, TcpStream),
    /// Dialing `rank` failed for good; the mesh fails with this error.
    DialFailed(TransportError),
    /// An accepted connection claiming `claimed` failed its handshake.
    AcceptFailed {
        claimed: Rank,
        detail: String,
        /// Both sides authenticated each other, so this is a genuine disagreement that fails
        /// the mesh; otherwise it is only noted (an unauthenticated stranger cannot fail it).
        fatal: bool,
    },
}

fn hs(peer: Rank, detail: impl Into<String>) -> TransportError {
    TransportError::Handshake { peer, detail: detail.into() }
}

/// Dials `peer` at `addr` until its handshake succeeds, fails for good, or the deadline passes.
pub(crate) async fn dial(ctx: Arc<MeshCtx>, peer: Rank, addr: SocketAddr) -> Done {
    let mut backoff = DIAL_BACKOFF_MIN;
    let mut last: Option<String> = None;
    loop {
        match dial_once(&ctx, peer, addr).await {
            Ok(stream) => return Done::Linked(peer, stream),
            Err(Attempt::Fatal(detail)) => return Done::DialFailed(hs(peer, detail)),
            Err(Attempt::Retry(detail)) => {
                tracing::debug!(peer, %addr, "dial attempt failed: {detail}");
                // An attempt cut short by the deadline explains less than the one before it.
                if last.is_none() || Instant::now() < ctx.deadline {
                    let note = format!("dialing rank {peer} at {addr}: {detail}");
                    lock(&ctx.notes).record(ctx.world, peer, note);
                    last = Some(detail);
                }
            }
        }
        if Instant::now() + backoff >= ctx.deadline {
            return Done::DialFailed(hs(
                peer,
                format!(
                    "could not connect to rank {peer} at {addr} before the connect deadline; last attempt: {}",
                    last.as_deref().unwrap_or("none")
                ),
            ));
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(DIAL_BACKOFF_MAX);
    }
}

enum Attempt {
    Retry(String),
    Fatal(String),
}

fn retry_io(e: HsIoError) -> Attempt {
    match e {
        HsIoError::Malformed(m) => Attempt::Fatal(format!("peer sent an invalid handshake message: {m}")),
        e => Attempt::Retry(e.to_string()),
    }
}

async fn connect(addr: SocketAddr, options: &TcpOptions, deadline: Instant) -> Result<TcpStream, Attempt> {
    let sock = if addr.is_ipv4() { TcpSocket::new_v4() } else { TcpSocket::new_v6() }
        .map_err(|e| Attempt::Fatal(format!("creating a socket: {e}")))?;
    options.apply_buffers(&socket2::SockRef::from(&sock)).map_err(|e| Attempt::Fatal(e.to_string()))?;
    let stream = match tokio::time::timeout_at(deadline, sock.connect(addr)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return Err(Attempt::Retry(format!("connect: {e}"))),
        Err(_) => return Err(Attempt::Retry("connect timed out".into())),
    };
    options.apply(&socket2::SockRef::from(&stream)).map_err(|e| Attempt::Fatal(e.to_string()))?;
    Ok(stream)
}

async fn dial_once(ctx: &MeshCtx, peer: Rank, addr: SocketAddr) -> Result<TcpStream, Attempt> {
    let deadline = ctx.deadline;
    let mut stream = connect(addr, &ctx.options, deadline).await?;
    let ours = Hello::new(&ctx.job, ctx.generation, ctx.rank, peer, ctx.world).map_err(Attempt::Fatal)?;
    let our_bytes = ours.encode();
    handshake::write_all(&mut stream, &our_bytes, deadline).await.map_err(retry_io)?;
    let theirs = match handshake::read_message(&mut stream, deadline).await.map_err(retry_io)? {
        Message::Hello(h) => h,
        Message::Refuse(r) if r.retriable => return Err(Attempt::Retry(r.describe_for_dialer())),
        Message::Refuse(r) => return Err(Attempt::Fatal(r.describe_for_dialer())),
        m => return Err(Attempt::Fatal(format!("expected a hello, got {m:?}"))),
    };
    let their_bytes = theirs.encode();
    let their_mac = match handshake::read_message(&mut stream, deadline).await.map_err(retry_io)? {
        Message::Proof { mac, .. } => mac,
        m => return Err(Attempt::Fatal(format!("expected a proof, got {m:?}"))),
    };
    let authentic = handshake::verify(&ctx.token, false, &our_bytes, &their_bytes, &their_mac);
    let verdict = if authentic { check_fields(&ours, &theirs) } else { Verdict::AuthFailed };
    let mac = handshake::proof(&ctx.token, true, &our_bytes, &their_bytes)
        .ok_or_else(|| Attempt::Fatal("HMAC rejected the job token".into()))?;
    handshake::write_all(&mut stream, &handshake::encode_proof(verdict, &mac), deadline).await.map_err(retry_io)?;
    let their_verdict = match handshake::read_message(&mut stream, deadline).await {
        Ok(Message::Verdict(v)) => v,
        Ok(m) => return Err(Attempt::Fatal(format!("expected a verdict, got {m:?}"))),
        // Our own verdict explains a failure better than the acceptor closing on us.
        Err(_) if verdict != Verdict::Ok => return Err(Attempt::Fatal(verdict.describe(&ours, &theirs))),
        Err(e) => return Err(retry_io(e)),
    };
    if verdict != Verdict::Ok {
        return Err(Attempt::Fatal(verdict.describe(&ours, &theirs)));
    }
    if their_verdict != Verdict::Ok {
        return Err(Attempt::Fatal(format!("peer refused: {}", their_verdict.describe(&ours, &theirs))));
    }
    Ok(stream)
}

/// Completes the handshake of an accepted connection routed to this mesh.
pub(crate) async fn accept(ctx: Arc<MeshCtx>, inc: Incoming) -> Done {
    let claimed = inc.hello.sender;
    match accept_inner(&ctx, inc).await {
        Ok(done) => done,
        Err(detail) => Done::AcceptFailed { claimed, detail, fatal: false },
    }
}

async fn accept_inner(ctx: &MeshCtx, inc: Incoming) -> Result<Done, String> {
    let Incoming { mut stream, hello: theirs, addr } = inc;
    let deadline = ctx.deadline;
    let claimed = theirs.sender;
    let ours = Hello::new(&ctx.job, ctx.generation, ctx.rank, claimed, ctx.world)?;
    let our_bytes = ours.encode();
    let their_bytes = theirs.encode();
    let mac = handshake::proof(&ctx.token, false, &their_bytes, &our_bytes).ok_or("HMAC rejected the job token")?;
    let mut reply = our_bytes.clone();
    reply.extend_from_slice(&handshake::encode_proof(Verdict::Ok, &mac));
    let ctx_err = |e: HsIoError| format!("connection from {addr} claiming rank {claimed}: {e}");
    handshake::write_all(&mut stream, &reply, deadline).await.map_err(ctx_err)?;
    let (their_verdict, their_mac) = match handshake::read_message(&mut stream, deadline).await.map_err(ctx_err)? {
        Message::Proof { verdict, mac } => (verdict, mac),
        m => return Err(format!("connection from {addr} claiming rank {claimed}: expected a proof, got {m:?}")),
    };
    let authentic = handshake::verify(&ctx.token, true, &their_bytes, &our_bytes, &their_mac);
    let verdict = if !authentic {
        Verdict::AuthFailed
    } else {
        match check_fields(&ours, &theirs) {
            Verdict::Ok if claimed <= ctx.rank || claimed >= ctx.world => Verdict::RankUnexpected,
            v => v,
        }
    };
    // Best effort: a failure to deliver the verdict shows up on the dialer's side.
    let _ = handshake::write_all(&mut stream, &handshake::encode_verdict(verdict), deadline).await;
    if verdict != Verdict::Ok {
        let detail = match verdict {
            Verdict::RankUnexpected => format!(
                "rank {claimed} at {addr} dialed rank {}, but rank {} accepts only from ranks {}..{}",
                theirs.receiver,
                ctx.rank,
                ctx.rank + 1,
                ctx.world
            ),
            v => format!("rank {claimed} at {addr}: {}", v.describe(&ours, &theirs)),
        };
        return Ok(Done::AcceptFailed { claimed, detail, fatal: authentic });
    }
    if their_verdict != Verdict::Ok {
        let detail = format!("rank {claimed} at {addr}: peer refused: {}", their_verdict.describe(&ours, &theirs));
        return Ok(Done::AcceptFailed { claimed, detail, fatal: true });
    }
    Ok(Done::Linked(claimed, stream))
}

/// Records a non-fatal failure of an accepted connection for the final error report.
pub(crate) fn note(ctx: &MeshCtx, claimed: Rank, detail: String) {
    tracing::debug!(claimed, "accepted connection failed its handshake: {detail}");
    lock(&ctx.notes).record(ctx.world, claimed, detail);
}
