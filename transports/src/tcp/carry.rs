//! Incremental re-formation: carrying a generation's links into the next one.
//!
//! When one rank of a large job fails, the survivors' next generation mostly links the same
//! pairs again (with ranks compacted past the failed one, about 84% of a 64-rank job's
//! planned links and 93% of a 16,384-rank job's join two survivors that were linked
//! before). Rather than dial those again, each side takes the clean socket out of the old
//! generation's link ([`CarriedLinks::take`]) and re-binds it to the new generation
//! ([`rebind`]):
//!
//! 1. Each side writes a re-bind marker ([`super::frame::rebind_marker`]): a header of kind
//!    2 carrying the new generation. Whatever it sent before belongs to older generations.
//! 2. Each side reads what the peer sent until that peer's marker, skipping whole data frames
//!    of older generations (sent before the peer stopped, never received here). Anything
//!    else (a malformed header, a frame of the new generation, end of stream) fails it.
//! 3. The two run the set-up's handshake ([`crate::handshake`]) over the socket, with the new
//!    generation's ranks: the higher new rank dials, the lower one accepts, each proving the
//!    job token with fresh nonces, exactly as on a fresh connection.
//!
//! A link can only be carried when it is clean on both sides: no operation holds it, and no
//! frame was left half sent or half read (see [`super::link::TcpLink::carry_over`]). A side
//! that cannot carry a link shuts its socket down, so the other side's re-bind fails at once
//! with end of stream. Then the higher rank dials a fresh connection, and the lower one takes
//! it from its endpoint as at any set-up. Every step is bounded by the set-up's connect
//! deadline.

use super::frame::{self, Skimmed, HEADER_LEN};
use super::link::{TakenSocket, TcpLink};
use super::mesh::MeshCtx;
use crate::handshake::{self, Message};
use crate::links::Links;
use crate::{AbortReason, Rank};
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// The links of a generation that ended, from which the next generation's set-up takes the
/// clean ones ([`super::TcpTransport::carry_over`]). Dropping it shuts down every link not
/// taken, so that their peers' re-binds fail at once and they dial fresh connections.
pub struct CarriedLinks {
    links: Arc<Links<TcpLink>>,
}

impl std::fmt::Debug for CarriedLinks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CarriedLinks")
            .field("generation", &self.links.generation)
            .field("rank", &self.links.rank)
            .finish_non_exhaustive()
    }
}

impl CarriedLinks {
    /// The links of a transport, which is aborted first if it was not (no operation may start
    /// on a link being carried).
    pub(crate) fn of(links: &Arc<Links<TcpLink>>) -> Self {
        if !links.aborted() {
            links.abort(AbortReason::new("its links are carried into the next generation"));
        }
        Self { links: Arc::clone(links) }
    }

    /// The generation these links were made for.
    pub fn generation(&self) -> u64 {
        self.links.generation
    }

    /// Takes the socket of the link to `old_peer` (its rank in the generation that ended) for
    /// generation `to`, if that link is clean. `None` when there is no such link, or it broke,
    /// or an operation still holds it; the link then closes when this handle drops.
    pub fn take(&self, old_peer: Rank, to: u64) -> Option<CarriedLink> {
        let link = self.links.get(old_peer)?;
        let TakenSocket { stream, read_ahead } = link.carry_over(to)?;
        Some(CarriedLink { stream: Rewound { read_ahead, pos: 0, stream: Some(stream) }, from: self.links.generation })
    }
}

impl Drop for CarriedLinks {
    fn drop(&mut self) {
        self.links.close_all();
    }
}

/// One link's socket taken out of a generation that ended, to be re-bound to the next one by
/// that generation's set-up ([`super::TcpEndpoint::connect_mesh_carrying`]). Dropped unused,
/// it shuts the socket down (the peer then dials a fresh connection).
pub struct CarriedLink {
    stream: Rewound,
    from: u64,
}

impl std::fmt::Debug for CarriedLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CarriedLink").field("from_generation", &self.from).finish_non_exhaustive()
    }
}

impl CarriedLink {
    /// The generation the link was made for (or last carried into).
    pub fn from_generation(&self) -> u64 {
        self.from
    }
}

/// Re-binds `link` to the peer that has rank `peer` in the generation `ctx` forms: markers
/// both ways, the peer's older frames skipped, then the set-up's handshake (this side dials
/// when its rank is the higher). Returns the stream, ready for that generation's frames, and
/// how many stale frames were skipped; or why it could not be carried, with the socket shut
/// down.
///
/// # Cancel safety
/// Cancel safe in effect: dropping it drops the link, which shuts the socket down.
pub(crate) async fn rebind(ctx: &MeshCtx, peer: Rank, mut link: CarriedLink) -> Result<(TcpStream, u64), String> {
    let skipped = exchange(ctx, peer, &mut link.stream).await.map_err(|e| {
        format!("the link to rank {peer} carried from generation {} could not be re-bound: {e}", link.from)
    })?;
    match link.stream.into_stream() {
        Some(stream) => Ok((stream, skipped)),
        // The peer sent more than its handshake before this side finished its own: it breaks
        // the protocol, and the link is not used.
        None => Err(format!("rank {peer} sent bytes past its handshake on the carried link")),
    }
}

async fn exchange(ctx: &MeshCtx, peer: Rank, s: &mut Rewound) -> Result<u64, String> {
    handshake::write_all(s, &frame::rebind_marker(ctx.generation), ctx.deadline)
        .await
        .map_err(|e| format!("sending the re-bind marker: {e}"))?;
    let skipped = tokio::time::timeout_at(ctx.deadline, skim_to_marker(s, ctx.generation, ctx.options.max_frame))
        .await
        .map_err(|_| "no re-bind marker from the peer within the connect deadline".to_owned())??;
    let session = ctx.session();
    if peer < ctx.rank {
        handshake::dial(s, &session, peer).await.map_err(|e| e.into_detail())?;
    } else {
        let hello = match handshake::read_message(s, ctx.deadline).await {
            Ok(Message::Hello(h)) => h,
            Ok(m) => return Err(format!("expected a hello, got {m:?}")),
            Err(e) => return Err(format!("reading the peer's hello: {e}")),
        };
        if hello.sender != peer {
            return Err(format!("the hello claims rank {}, not rank {peer}", hello.sender));
        }
        handshake::accept(s, &session, hello, None, |_| true).await.map_err(|r| r.detail)?;
    }
    Ok(skipped)
}

/// Reads the peer's frames up to its re-bind marker for generation `forming`, skipping whole
/// data frames of older generations; returns how many were skipped.
async fn skim_to_marker(s: &mut Rewound, forming: u64, max_frame: u64) -> Result<u64, String> {
    let mut skipped = 0;
    let mut scratch = Vec::new();
    loop {
        let mut h = [0u8; HEADER_LEN];
        s.read_exact(&mut h).await.map_err(|e| format!("reading the peer's frames before its marker: {e}"))?;
        match frame::skim(&h, forming, max_frame).map_err(|e| format!("before the peer's marker: {e}"))? {
            Skimmed::Marker => return Ok(skipped),
            Skimmed::Stale(len) => {
                scratch.resize(scratch.len().max((len as usize).min(64 * 1024)), 0);
                let mut left = len;
                while left > 0 {
                    let n = left.min(scratch.len() as u64) as usize;
                    s.read_exact(&mut scratch[..n])
                        .await
                        .map_err(|e| format!("skipping a frame of an older generation: {e}"))?;
                    left -= n as u64;
                }
                skipped += 1;
            }
        }
    }
}

/// A carried socket with the bytes its old link had read ahead put back in front of it.
/// Dropped while it still holds the socket, it shuts the socket down at once (the peer's
/// re-bind then fails with end of stream and it dials afresh).
struct Rewound {
    read_ahead: Vec<u8>,
    pos: usize,
    stream: Option<TcpStream>,
}

impl Rewound {
    /// The socket, once every byte read ahead was consumed; `None` (the socket shut down)
    /// otherwise.
    fn into_stream(mut self) -> Option<TcpStream> {
        if self.pos < self.read_ahead.len() {
            return None;
        }
        self.stream.take()
    }

    fn stream(&mut self) -> io::Result<&mut TcpStream> {
        self.stream.as_mut().ok_or_else(|| io::Error::other("the carried socket was given up"))
    }
}

impl Drop for Rewound {
    fn drop(&mut self) {
        if let Some(s) = &self.stream {
            // Nothing to do if it is already disconnected.
            let _ = socket2::SockRef::from(s).shutdown(std::net::Shutdown::Both);
        }
    }
}

impl AsyncRead for Rewound {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.pos < this.read_ahead.len() {
            let n = (this.read_ahead.len() - this.pos).min(buf.remaining());
            buf.put_slice(&this.read_ahead[this.pos..this.pos + n]);
            this.pos += n;
            return Poll::Ready(Ok(()));
        }
        match this.stream() {
            Ok(s) => Pin::new(s).poll_read(cx, buf),
            Err(e) => Poll::Ready(Err(e)),
        }
    }
}

impl AsyncWrite for Rewound {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut().stream() {
            Ok(s) => Pin::new(s).poll_write(cx, data),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut().stream() {
            Ok(s) => Pin::new(s).poll_flush(cx),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut().stream() {
            Ok(s) => Pin::new(s).poll_shutdown(cx),
            Err(e) => Poll::Ready(Err(e)),
        }
    }
}

/// Shuts a stream down that must not be used (a carried socket that lost to a fresh link),
/// so that the peer sees end of stream at once.
pub(crate) fn close(stream: TcpStream) {
    let _ = socket2::SockRef::from(&stream).shutdown(std::net::Shutdown::Both);
}
