//! Mesh set-up: dialing lower ranks until the handshake ([`crate::handshake::dial`]) agrees,
//! and the handshake of accepted connections ([`crate::handshake::accept`]).

use super::endpoint::{Incoming, SharedNotes};
use super::options::TcpOptions;
use crate::handshake::{self, DialError, Refused, Session};
use crate::links::lock;
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
#[derive(Clone)]
pub(crate) struct MeshCtx {
    pub job: String,
    pub generation: u64,
    pub rank: Rank,
    pub world: u32,
    pub token: Vec<u8>,
    pub options: TcpOptions,
    pub deadline: Instant,
    pub notes: SharedNotes,
    /// The pace shared by this mesh's links, made up front or on first use.
    pub pace: Arc<crate::deadline::Pace>,
}

impl MeshCtx {
    /// This side of a handshake under the set-up's deadline.
    pub(crate) fn session(&self) -> Session<'_> {
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

/// Outcome of one handshake task.
pub(crate) enum Done {
    /// A link to `rank` is authenticated and agreed.
    Linked(Rank, TcpStream),
    /// A link of the previous generation was re-bound to `rank` ([`super::carry`]), after
    /// skipping the given number of stale frames.
    Carried(Rank, TcpStream, u64),
    /// The link carried to `rank` could not be re-bound (the acceptor's side: it waits for a
    /// fresh dial instead).
    CarryFailed(Rank, String),
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
            Err(DialError::Fatal(detail)) => return Done::DialFailed(hs(peer, detail)),
            Err(DialError::Retry(detail)) => {
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

async fn connect(addr: SocketAddr, options: &TcpOptions, deadline: Instant) -> Result<TcpStream, DialError> {
    let sock = if addr.is_ipv4() { TcpSocket::new_v4() } else { TcpSocket::new_v6() }
        .map_err(|e| DialError::Fatal(format!("creating a socket: {e}")))?;
    options.apply_buffers(&socket2::SockRef::from(&sock)).map_err(|e| DialError::Fatal(e.to_string()))?;
    let stream = match tokio::time::timeout_at(deadline, sock.connect(addr)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return Err(DialError::Retry(format!("connect: {e}"))),
        Err(_) => return Err(DialError::Retry("connect timed out".into())),
    };
    options.apply(&socket2::SockRef::from(&stream)).map_err(|e| DialError::Fatal(e.to_string()))?;
    Ok(stream)
}

async fn dial_once(ctx: &MeshCtx, peer: Rank, addr: SocketAddr) -> Result<TcpStream, DialError> {
    let mut stream = connect(addr, &ctx.options, ctx.deadline).await?;
    handshake::dial(&mut stream, &ctx.session(), peer).await?;
    Ok(stream)
}

/// Completes the handshake of an accepted connection routed to this mesh.
pub(crate) async fn accept(ctx: Arc<MeshCtx>, inc: Incoming) -> Done {
    let Incoming { mut stream, hello, addr } = inc;
    let claimed = hello.sender;
    match handshake::accept(&mut stream, &ctx.session(), hello, Some(addr), |_| true).await {
        Ok(_) => Done::Linked(claimed, stream),
        Err(Refused { claimed, detail, fatal }) => Done::AcceptFailed { claimed, detail, fatal },
    }
}

/// Records a non-fatal failure of an accepted connection for the final error report.
pub(crate) fn note(ctx: &MeshCtx, claimed: Rank, detail: String) {
    tracing::debug!(claimed, "accepted connection failed its handshake: {detail}");
    lock(&ctx.notes).record(ctx.world, claimed, detail);
}
