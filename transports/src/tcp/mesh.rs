//! A TCP pair's part of the mesh set-up ([`crate::mesh_setup`]): dialing a lower rank until the
//! handshake ([`crate::handshake::dial`]) agrees, and the handshake of accepted connections
//! ([`crate::handshake::accept`]).

use super::endpoint::Incoming;
use super::options::TcpOptions;
use crate::handshake::{self, DialError, Refused, Session};
use crate::links::lock;
use crate::mesh_setup::{Arrivals, Backoff, Paired, SharedNotes};
use crate::{Rank, TransportError};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::mpsc;
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

/// A TCP pair's connection, as its set-up task hands it over ([`Paired::Linked`]).
pub(crate) struct Arrived {
    pub(crate) stream: TcpStream,
    /// A link of the previous generation re-bound ([`super::carry`]), not a fresh connection.
    pub(crate) carried: bool,
}

impl Arrived {
    /// A fresh connection.
    pub(crate) fn fresh(stream: TcpStream) -> Self {
        Self { stream, carried: false }
    }
}

fn hs(peer: Rank, detail: impl Into<String>) -> TransportError {
    TransportError::Handshake { peer, detail: detail.into() }
}

/// Dials `peer` at `addr` until its handshake succeeds, fails for good, or the deadline passes.
pub(crate) async fn dial(ctx: Arc<MeshCtx>, peer: Rank, addr: SocketAddr) -> Paired<Arrived> {
    let mut backoff = Backoff::new(DIAL_BACKOFF_MIN, DIAL_BACKOFF_MAX);
    let mut last: Option<String> = None;
    loop {
        match dial_once(&ctx, peer, addr).await {
            Ok(stream) => return Paired::Linked(peer, Arrived::fresh(stream)),
            Err(DialError::Fatal(detail)) => return Paired::Failed(hs(peer, detail)),
            Err(DialError::Retry(detail)) => {
                tracing::debug!(peer, %addr, "dial attempt failed: {detail}");
                // An attempt cut short by the deadline explains less than the one before it.
                if last.is_none() || Instant::now() < ctx.deadline {
                    let note = format!("dialing rank {peer} at {addr}: {detail}");
                    lock(&ctx.notes).record(ctx.world, Some(peer), note);
                    last = Some(detail);
                }
            }
        }
        if !backoff.pause_before(ctx.deadline).await {
            return Paired::Failed(hs(
                peer,
                format!(
                    "could not connect to rank {peer} at {addr} before the connect deadline; last attempt: {}",
                    last.as_deref().unwrap_or("none")
                ),
            ));
        }
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

/// The connections the endpoint routes to a set-up (their hellos read and screened there).
impl Arrivals for mpsc::Receiver<Incoming> {
    type Conn = Incoming;

    async fn next(&mut self) -> Result<Incoming, TransportError> {
        match self.recv().await {
            Some(inc) => Ok(inc),
            // The endpoint holds the sender while the set-up is registered.
            None => std::future::pending().await,
        }
    }
}

/// Completes the handshake of an accepted connection routed to this mesh.
pub(crate) async fn accept(ctx: Arc<MeshCtx>, inc: Incoming) -> Paired<Arrived> {
    let Incoming { mut stream, hello, addr } = inc;
    let claimed = hello.sender;
    match handshake::accept(&mut stream, &ctx.session(), hello, Some(addr), |_| true).await {
        Ok(_) => Paired::Linked(claimed, Arrived::fresh(stream)),
        Err(Refused { claimed, detail, fatal: true }) => Paired::Failed(hs(claimed, detail)),
        Err(Refused { claimed, detail, fatal: false }) => Paired::Noted { claimed: Some(claimed), detail },
    }
}

/// Records a problem that does not fail the mesh, for the final error report.
pub(crate) fn note(ctx: &MeshCtx, claimed: Option<Rank>, detail: String) {
    tracing::debug!(?claimed, "a connection failed its handshake: {detail}");
    lock(&ctx.notes).record(ctx.world, claimed, detail);
}
